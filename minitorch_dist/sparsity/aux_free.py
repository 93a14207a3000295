"""Chapter 10 — auxiliary-loss-free load balancing: a per-expert bias steers which experts are chosen.

Wang, Gao, Zhu, Zhang & Li 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts"
(arXiv:2408.15664), §3 (Loss-Free Balancing, Algorithm 1); DeepSeek-AI 2024, "DeepSeek-V3 Technical
Report" (arXiv:2412.19437), §2.1.2 ("Auxiliary-Loss-Free Load Balancing", eq. 16).

The auxiliary loss of Switch (eq. 4-6, :func:`.routers.load_balancing_loss`) balances the load by
adding a gradient to the router that has nothing to do with the language model; too small an α and
the experts collapse, too large and the interference costs quality. Loss-free balancing keeps the
gradient clean and steers with a bias instead. With s_{i,t} token t's affinity for expert i
(``score``: the softmax of the router's logits, or their sigmoid as in DeepSeek-V3) and b_i a
per-expert bias,

    selection   expert i is chosen by token t  iff  s_{i,t} + b_i ∈ TopK({s_{j,t} + b_j}, k)
    gate        g_{i,t} = s_{i,t} for the chosen experts (normalised over them when ``normalize``)

the bias decides *which* experts a token uses, never *how much* their outputs weigh: it is not a
parameter, gets no gradient, and adds no term to the loss. After each training step (every
micro-batch's forward counted, and in data / expert parallelism every rank's tokens),

    b_i ← b_i + γ · sign(c̄ − c_i),      c_i = assignments expert i received in the step, c̄ = mean_i c_i

an overloaded expert's bias falls by γ, an underloaded one's rises by γ (γ = ``bias_update_rate``,
DeepSeek-V3's "bias update speed", 0.001 for most of its pre-training). The loads c_i are counted
before any capacity (DeepSeek-V3 drops no token in training). Ranks that route their own tokens
must apply the *same* update, or their replicated routers drift apart: :func:`update_expert_biases`
all-reduces the step's loads first, one flat buffer for every router of a model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm
from .routers import Router, Routing, assign_by_priority, capacity, register_router

__all__ = ["SCORES", "affinity_scores", "biased_choice", "biased_top_k_routing", "bias_update",
           "AuxFreeRouter", "aux_free_routers", "update_expert_biases"]

SCORES = ("softmax", "sigmoid")


def _check_rate(rate) -> float:
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"bias_update_rate must be > 0 (DeepSeek-V3 uses 0.001), got {rate!r}")
    return float(rate)


def affinity_scores(logits: torch.Tensor, score: str = "softmax") -> torch.Tensor:
    """s [T, E]: ``softmax(logits)`` over experts (Switch, GShard, Wang et al.) or ``sigmoid(logits)``,
    each expert scored on its own (DeepSeek-V3 eq. 15)."""
    if score == "softmax":
        return logits.softmax(-1)
    if score == "sigmoid":
        return logits.sigmoid()
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")


def biased_choice(logits: torch.Tensor, bias: torch.Tensor, k: int = 1, score: str = "softmax",
                  normalize: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(s, experts, gates)``: the scores [T, E], each token's k experts by ``s + bias`` [T, k] (best
    first, no gradient) and their gates, the *unbiased* s renormalised over the k when ``normalize``
    (default: k > 1; with k = 1 the raw score keeps the router's gradient, as in Switch)."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, n_experts], got shape {tuple(logits.shape)}")
    E = logits.size(1)
    if not 1 <= k <= E:
        raise ValueError(f"k = {k} experts per token must be in [1, n_experts = {E}]")
    if tuple(bias.shape) != (E,):
        raise ValueError(f"bias must hold one value per expert, shape ({E},), got {tuple(bias.shape)}")
    s = affinity_scores(logits, score)
    sel = torch.promote_types(torch.promote_types(s.dtype, bias.dtype), torch.float32)  # never below fp32
    experts = (s.detach().to(sel) + bias.to(sel)).topk(k, dim=-1).indices  # selection: biased
    gates = s.gather(1, experts)  # weighting: unbiased, differentiable
    if k > 1 if normalize is None else normalize:
        gates = gates / gates.sum(-1, keepdim=True)
    return s, experts, gates


def biased_top_k_routing(logits: torch.Tensor, bias: torch.Tensor, k: int = 1, capacity: int | None = None,
                         score: str = "softmax", normalize: bool | None = None) -> Routing:
    """Token choice with a selection bias (DeepSeek-V3 eq. 16) as a :class:`Routing`: the choices of
    :func:`biased_choice`, then capacity in priority order. ``probs`` are the scores s; ``aux_loss``
    is zero: there is no auxiliary loss."""
    s, experts, gates = biased_choice(logits, bias, k, score, normalize)
    return assign_by_priority(experts, gates, s, logits, capacity, logits.new_zeros(()))


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """``b + γ · sign(mean(c) − c)`` (Wang et al. Algorithm 1; DeepSeek-V3 §2.1.2), a new tensor.
    An expert exactly at the mean load keeps its bias (sign 0)."""
    rate = _check_rate(rate)
    if load.shape != bias.shape:
        raise ValueError(f"load {tuple(load.shape)} and bias {tuple(bias.shape)} must both be [n_experts]")
    c = load.to(torch.float64)
    return bias + rate * torch.sign(c.mean() - c).to(bias.dtype)


class AuxFreeRouter(Router):
    """Token choice (top-``k``) balanced by a bias, not by a loss (module docstring).

    Buffers (not parameters, no gradient; saved in the state dict): ``expert_bias`` [E], the b_i (kept in
    fp32 or wider when the model is cast to fp16 / bf16; the selection is computed in it), and
    ``step_load`` [E], the assignments each expert was chosen for by the training forwards since the
    last :meth:`update_bias` (before capacity). ``capacity_factor=None`` (the default): dropless, as
    DeepSeek-V3 trains. ``score``: "softmax" or "sigmoid". ``aux_alpha`` is 0: there is no aux loss.
    """

    def __init__(self, h: int, n_experts: int, k: int = 1, capacity_factor: float | None = None,
                 bias_update_rate: float = 0.001, score: str = "softmax", normalize: bool | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_experts:
            raise ValueError(f"k must be an int in [1, n_experts = {n_experts}], got {k!r}")
        if capacity_factor is not None:
            try:
                capacity(1, 1, 1, capacity_factor)  # the cost model's check: a finite number > 0
            except ValueError as e:
                raise ValueError(f"{e}; or None for no capacity (dropless, as DeepSeek-V3)") from None
        if score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {score!r}")
        super().__init__(h, n_experts, 0.0)
        self.k = self.experts_per_token = k
        self.capacity_factor, self.score, self.normalize = capacity_factor, score, normalize
        self.bias_update_rate = _check_rate(bias_update_rate)
        dev = self.w_gate.device
        bias_dtype = torch.promote_types(self.w_gate.dtype, torch.float32)  # at least fp32 (see _apply)
        self.register_buffer("expert_bias", torch.zeros(n_experts, dtype=bias_dtype, device=dev))
        self.register_buffer("step_load", torch.zeros(n_experts, dtype=torch.long, device=dev))

    def forward(self, x: torch.Tensor) -> Routing:
        C = None if self.capacity_factor is None else capacity(x.size(0), self.n_experts, self.k,
                                                               self.capacity_factor)
        logits = self.scores(x)
        s, experts, gates = biased_choice(logits, self.expert_bias, self.k, self.score, self.normalize)
        if self.training:  # what the update balances: every choice made, kept by capacity or not
            self.step_load += torch.bincount(experts.reshape(-1), minlength=self.n_experts)
        return assign_by_priority(experts, gates, s, logits, C, logits.new_zeros(()))

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``, ``.bfloat16()``... move the bias but keep it at least fp32: in bf16 a
        bias of 0.5 cannot move by γ = 0.001 (the spacing there is 2⁻⁸), so the updates would vanish."""
        super()._apply(fn, recurse)
        if self.expert_bias.dtype in (torch.float16, torch.bfloat16):
            self.expert_bias = self.expert_bias.float()
        return self

    def update_bias(self, load: torch.Tensor | None = None) -> torch.Tensor:
        """Apply ``b ← b + γ·sign(mean(c) − c)`` with c = ``load`` (default: this router's ``step_load``)
        and reset ``step_load``; returns the load used. In parallel training pass the all-reduced load
        (:func:`update_expert_biases` does)."""
        c = self.step_load if load is None else load
        with torch.no_grad():
            c = c.to(self.step_load.device)
            self.expert_bias.copy_(bias_update(self.expert_bias, c, self.bias_update_rate))
        used = c.clone()
        self.step_load.zero_()
        return used

    def extra_repr(self) -> str:
        return (f"h={self.h}, n_experts={self.n_experts}, k={self.k}, score={self.score}, "
                f"bias_update_rate={self.bias_update_rate}")


register_router("aux_free", AuxFreeRouter)


def aux_free_routers(model: nn.Module) -> list[AuxFreeRouter]:
    """Every :class:`AuxFreeRouter` inside ``model``, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, AuxFreeRouter)]


def update_expert_biases(model: nn.Module, group: dist.ProcessGroup | None = None,
                         sync: bool | None = None) -> list[torch.Tensor]:
    """End of a training step: update the bias of every :class:`AuxFreeRouter` in ``model`` from the
    step's load, and return those loads (one [E] tensor per router).

    ``sync`` (default: when a process group of more than one rank is initialised): first sum the
    loads over ``group`` — one all-reduce of one flat int64 buffer for all routers — so that every
    rank, having routed only its own tokens, applies the update of the global batch and the
    replicated routers stay identical."""
    routers = aux_free_routers(model)
    if not routers:
        return []
    if sync is None:
        sync = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    flat = torch.cat([r.step_load for r in routers])
    if sync:
        comm.all_reduce(flat, group=group)
    return [r.update_bias(c) for r, c in zip(routers, flat.split([r.n_experts for r in routers]))]
