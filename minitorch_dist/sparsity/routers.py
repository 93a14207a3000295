"""Chapter 10 — routers of a mixture of experts: which expert(s) each token goes to, with what weight.

Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
Layer", §2.1 (noisy top-k gating, eq. 3-5). Lepikhin et al. 2021, "GShard", §2.2 and Algorithm 1
(top-2 gating with expert capacity, first choices before second choices). Fedus et al. 2021,
"Switch Transformers", §2.1-2.2 (top-1 routing; capacity, eq. 3; load-balancing loss, eq. 4-6;
router initialisation, §2.4). Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing",
§3.1 (each expert picks its top-k tokens, k = n·c/e).

A router scores T tokens x [T, h] against E experts with one matrix, ``logits = x @ w_gate``
(``w_gate`` [h, E], Shazeer's W_g), and returns a :class:`Routing`: the kept (token, expert)
*assignments* and their combine weights. Two families:

    token choice   each token picks its top-k experts; an expert takes at most
                   C = ceil(cf · T · k / E) assignments (Switch eq. 3) and drops the rest
    expert choice  each expert picks its top-C tokens, C = T · cf / E (Zhou et al. eq. 1):
                   perfectly balanced by construction, but a token may get 0 or several experts

Which assignments a full expert drops is the *priority order*: assignments are considered
choice-major, then token-major — every token's first choice (tokens 0, 1, ..., T-1), then every
token's second choice, ... — and an expert keeps the first C that reach it. For top-1 (Switch) that
is token order; for top-2 it is GShard's rule that first choices are served before second choices.
A dropped assignment contributes nothing: the token passes through the layer's residual.

The load-balancing loss (Switch eq. 4-6) pushes the router towards an even load:

    loss = α · E · Σ_i f_i · P_i,    f_i = share of assignments routed to expert i (before capacity),
                                     P_i = mean over tokens of the router probability p_i(x)

f is a count (no gradient); P carries the gradient. Under a perfectly even load f_i = P_i = 1/E
and the loss is α, its minimum over f for a uniform P. Token-choice routers here compute it from
each token's *first* choice, as Switch does for top-1 and GShard (Algorithm 1) for top-2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..costmodel import expert_choice_capacity, moe_capacity


@dataclass
class Routing:
    """What a router decided for x [T, h] with E experts.

    ``tokens``, ``experts``, ``weights`` [A]: the kept assignments, sorted by expert (stable: inside
    an expert in priority order). ``weights`` are the differentiable combine weights.
    ``probs``, ``logits`` [T, E]: the router's softmax and scores (``probs`` feeds the aux loss).
    ``capacity``: assignments an expert may take (None: unlimited). ``dropped``: assignments lost to
    capacity (expert choice: tokens no expert picked). ``counts`` [E]: kept assignments per expert.
    ``aux_loss``: the load-balancing loss (a zero scalar for routers without one).
    """

    tokens: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor
    probs: torch.Tensor
    logits: torch.Tensor
    capacity: int | None
    dropped: int
    counts: torch.Tensor
    aux_loss: torch.Tensor

    @property
    def n_tokens(self) -> int:
        return self.probs.size(0)

    @property
    def n_experts(self) -> int:
        return self.probs.size(1)

    def combine_weights(self) -> torch.Tensor:
        """The dense [T, E] matrix W with W[t, e] = weight of assignment (t, e), 0 where not routed:
        the MoE output is ``Σ_e W[:, e] · expert_e(x)`` (Shazeer eq. 1). Differentiable in ``weights``."""
        W = self.weights.new_zeros(self.n_tokens, self.n_experts)
        return W.index_put((self.tokens, self.experts), self.weights)


# --- the formulas ------------------------------------------------------------------------------


def capacity(n_tokens: int, n_experts: int, k: int = 1, capacity_factor: float = 1.0) -> int:
    """Expert capacity ``C = ceil(cf · T · k / E)`` (Switch Transformers eq. 3, GShard's 2N/E for k = 2):
    the one formula in :func:`minitorch_dist.costmodel.moe_capacity`, so theory and code agree."""
    return moe_capacity(n_tokens, n_experts, k, capacity_factor)


def load_balancing_loss(probs: torch.Tensor, assignment: torch.Tensor, n_experts: int,
                        alpha: float = 0.01) -> torch.Tensor:
    """Switch Transformers eq. (4)-(6): ``α · N · Σ_i f_i · P_i``.

    ``probs`` [T, N]: router probabilities (P_i = their mean over tokens; the gradient flows here).
    ``assignment``: either a LongTensor [T] of each token's (top-1) expert, or a [T, N] 0/1 mask of
    assignments (several per token allowed); f_i = mask[:, i].sum() / mask.sum(), the share of
    assignments routed to expert i (= fraction of tokens for top-1, as in eq. 5).
    """
    if probs.dim() != 2 or probs.size(1) != n_experts:
        raise ValueError(f"probs must be [tokens, n_experts={n_experts}], got shape {tuple(probs.shape)}")
    T = probs.size(0)
    if assignment.dim() == 1:
        if assignment.size(0) != T:
            raise ValueError(f"assignment has {assignment.size(0)} entries but probs has {T} tokens")
        if (assignment.dtype.is_floating_point
                or (T and (assignment.min() < 0 or assignment.max() >= n_experts))):
            raise ValueError(f"a 1-D assignment must hold expert ids in [0, {n_experts}), got "
                             f"{assignment.tolist()}")
        mask = F.one_hot(assignment, n_experts)
    elif assignment.shape == probs.shape:
        mask = assignment
    else:
        raise ValueError(f"assignment must be expert ids [T={T}] or a mask [T, {n_experts}], "
                         f"got shape {tuple(assignment.shape)}")
    mask = mask.to(probs.dtype).detach()
    if mask.sum() <= 0:
        raise ValueError("assignment routes no token to any expert; f_i = share of assignments is undefined")
    f = mask.sum(0) / mask.sum()  # eq. (5): fraction dispatched to each expert (a count: no gradient)
    P = probs.mean(0)  # eq. (6): mean router probability (differentiable)
    return alpha * n_experts * (f * P).sum()


# --- routing as functions of the router's scores ------------------------------------------------


def _check_logits(logits):
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [tokens, n_experts], got shape {tuple(logits.shape)}")
    return logits.shape


def top_k_routing(logits: torch.Tensor, k: int = 1, capacity: int | None = None, normalize: bool = True,
                  aux_alpha: float = 0.0, attempt: torch.Tensor | None = None) -> Routing:
    """Token choice: each token picks its top-k experts by ``softmax(logits)``; capacity drops the overflow.

    ``normalize``: weights are the top-k probabilities renormalised to sum to 1 — Shazeer's
    ``softmax(KeepTopK(H, k))`` and GShard's ``g_i / (g_1 + g_2)`` are this same number. Switch
    (k = 1) keeps the raw probability p_i(x), so that the router still gets a gradient.
    ``attempt`` [T, k] bool: which choices are dispatched at all (GShard's random second expert);
    not attempted is not "dropped". Priority: choice-major, then token order (module docstring).
    """
    T, E = _check_logits(logits)
    if not 1 <= k <= E:
        raise ValueError(f"k = {k} experts per token must be in [1, n_experts = {E}]")
    probs = logits.softmax(-1)
    gates, experts = probs.topk(k, dim=-1)  # [T, k], best first
    if normalize:
        gates = gates / gates.sum(-1, keepdim=True)
    aux = (load_balancing_loss(probs, experts[:, 0], E, aux_alpha) if aux_alpha and T
           else logits.new_zeros(()))
    return assign_by_priority(experts, gates, probs, logits, capacity, aux, attempt)


def assign_by_priority(experts: torch.Tensor, gates: torch.Tensor, probs: torch.Tensor, logits: torch.Tensor,
                       capacity: int | None, aux_loss: torch.Tensor,
                       attempt: torch.Tensor | None = None) -> Routing:
    """The :class:`Routing` of token-choice decisions already made: ``experts`` / ``gates`` [T, k], each
    token's choices best first and their combine weights. Capacity keeps the first ``capacity``
    assignments that reach an expert in priority order (choice-major, then token order: module doc),
    the rest are dropped. Every token-choice router ends here, however it chose."""
    T, k = experts.shape
    E = probs.size(1)
    # Priority order: flatten choice-major, so all first choices come before any second choice.
    flat_e, flat_g = experts.t().reshape(-1), gates.t().reshape(-1)
    flat_t = torch.arange(T, device=experts.device).repeat(k)
    if attempt is not None and tuple(attempt.shape) != (T, k):
        raise ValueError(f"attempt must be a bool mask [T={T}, k={k}] of the choices to dispatch, "
                         f"got shape {tuple(attempt.shape)}")
    tried = torch.ones_like(flat_e, dtype=torch.bool) if attempt is None else attempt.t().reshape(-1)
    onehot = F.one_hot(flat_e, E) * tried[:, None]
    position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # 0-based slot in its expert's queue
    keep = tried if capacity is None else tried & (position < capacity)
    dropped = int(tried.sum() - keep.sum())
    order = torch.sort(flat_e[keep], stable=True).indices  # by expert, priority order inside
    tokens, exps, weights = flat_t[keep][order], flat_e[keep][order], flat_g[keep][order]
    return Routing(tokens, exps, weights, probs, logits, capacity, dropped,
                   torch.bincount(exps, minlength=E), aux_loss)


def expert_choice_routing(logits: torch.Tensor, capacity: int) -> Routing:
    """Expert choice (Zhou et al. 2022 eq. 1): S = softmax(logits) over experts; each expert e takes
    the ``capacity`` tokens with the largest S[:, e], weighted by S[t, e]. Every expert gets exactly
    its capacity; ``dropped`` counts the tokens no expert picked. Inside an expert: by score, best first."""
    T, E = _check_logits(logits)
    if not 1 <= capacity <= T:
        raise ValueError(f"expert-choice capacity {capacity} must be in [1, tokens = {T}]: "
                         f"an expert picks that many distinct tokens")
    probs = logits.softmax(-1)
    G, I = probs.t().topk(capacity, dim=-1)  # [E, C]: each expert's best tokens
    tokens = I.reshape(-1)
    experts = torch.arange(E, device=logits.device).repeat_interleave(capacity)
    picked = torch.zeros(T, dtype=torch.bool, device=logits.device)
    picked[tokens] = True
    return Routing(tokens, experts, G.reshape(-1), probs, logits, capacity, int(T - picked.sum()),
                   torch.full((E,), capacity, dtype=torch.long, device=logits.device), logits.new_zeros(()))


# --- the routers: modules that hold w_gate ------------------------------------------------------


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


def _check_cf(cf, allow_none):
    if cf is None and allow_none:
        return
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not 0 < cf < math.inf:
        raise ValueError(f"capacity_factor must be a number > 0 (1.0 = an even share)"
                         f"{' or None (no capacity limit)' if allow_none else ''}, got {cf!r}")


class Router(nn.Module):
    """Holds ``w_gate`` [h, E] and scores tokens: ``logits = x @ w_gate``. Subclasses route.

    Initialisation: truncated normal with σ = sqrt(0.1 / h), Switch Transformers §2.4 ("reduce the
    default Transformer initialization scale s = 1.0 by a factor of 10"); see ``reset_parameters``.
    ``experts_per_token``: how many experts a token uses on average (k; expert choice: cf).
    """

    experts_per_token: float = 1

    def __init__(self, h: int, n_experts: int, aux_alpha: float = 0.0):
        super().__init__()
        _positive_int("h", h)
        _positive_int("n_experts", n_experts)
        if not (isinstance(aux_alpha, (int, float)) and aux_alpha >= 0):
            raise ValueError(f"aux_alpha must be a number >= 0 (Switch uses 0.01), got {aux_alpha!r}")
        self.h, self.n_experts, self.aux_alpha = h, n_experts, float(aux_alpha)
        self.w_gate = nn.Parameter(torch.empty(h, n_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = math.sqrt(0.1 / self.h)
        nn.init.trunc_normal_(self.w_gate, std=std, a=-2 * std, b=2 * std)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.size(1) != self.h:
            raise ValueError(f"router input must be tokens [T, h={self.h}], got shape {tuple(x.shape)}")
        return x @ self.w_gate

    def extra_repr(self) -> str:
        return f"h={self.h}, n_experts={self.n_experts}"


class NoisyTopKRouter(Router):
    """Shazeer et al. 2017 §2.1: ``H(x) = x·W_g + StandardNormal() · Softplus(x·W_noise)`` (eq. 4),
    ``G(x) = Softmax(KeepTopK(H(x), k))`` (eq. 3, 5). The noise is drawn only in training (from
    ``generator`` if given, else the global RNG); in eval H = x·W_g. ``w_noise`` starts at zero
    (Shazeer: "initialize W_g and W_noise to all zeros"; W_g here gets the Switch init instead so
    that eval routing is not a tie). No capacity by default, as in the paper;
    ``capacity_factor`` adds one. Aux loss: the Switch loss on each token's first choice (module doc).
    """

    def __init__(self, h: int, n_experts: int, k: int = 2, noisy: bool = True,
                 capacity_factor: float | None = None, aux_alpha: float = 0.01,
                 generator: torch.Generator | None = None):
        _positive_int("k", k)
        if k > n_experts:
            raise ValueError(f"k = {k} experts per token exceeds n_experts = {n_experts}; use k <= n_experts")
        _check_cf(capacity_factor, allow_none=True)
        super().__init__(h, n_experts, aux_alpha)
        self.k, self.noisy, self.capacity_factor, self.generator = k, noisy, capacity_factor, generator
        self.experts_per_token = k
        self.w_noise = nn.Parameter(torch.zeros(h, n_experts))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if hasattr(self, "w_noise"):
            nn.init.zeros_(self.w_noise)

    def forward(self, x: torch.Tensor) -> Routing:
        H = self.scores(x)
        if self.noisy and self.training:
            noise = torch.randn(H.shape, generator=self.generator, dtype=H.dtype, device=H.device)
            H = H + noise * F.softplus(x @ self.w_noise)
        C = None if self.capacity_factor is None else capacity(x.size(0), self.n_experts, self.k,
                                                               self.capacity_factor)
        return top_k_routing(H, self.k, C, normalize=True, aux_alpha=self.aux_alpha)


class SwitchRouter(Router):
    """Switch Transformers §2.1: top-1, the weight is the router probability p_i(x) (not renormalised),
    capacity ``ceil(cf · T / E)`` (eq. 3), overflow dropped in token order. ``capacity_factor=None``:
    no limit. Aux loss: eq. (4), α = ``aux_alpha`` (the paper's 10⁻²)."""

    def __init__(self, h: int, n_experts: int, capacity_factor: float | None = 1.25, aux_alpha: float = 0.01):
        _check_cf(capacity_factor, allow_none=True)
        super().__init__(h, n_experts, aux_alpha)
        self.capacity_factor = capacity_factor

    def forward(self, x: torch.Tensor) -> Routing:
        C = None if self.capacity_factor is None else capacity(x.size(0), self.n_experts, 1,
                                                               self.capacity_factor)
        return top_k_routing(self.scores(x), 1, C, normalize=False, aux_alpha=self.aux_alpha)


class Top2Router(Router):
    """GShard Algorithm 1: top-2 of softmax(x·W_g), gates renormalised ``g_i / (g_1 + g_2)``;
    capacity ``ceil(cf · 2T / E)``, first choices served before second choices. With
    ``random_second`` the second expert is dispatched only with probability ``min(1, 2·g_2)``
    (GShard's random routing; off by default so that routing is deterministic)."""

    experts_per_token = 2

    def __init__(self, h: int, n_experts: int, capacity_factor: float | None = 1.25, aux_alpha: float = 0.01,
                 random_second: bool = False, generator: torch.Generator | None = None):
        if n_experts < 2:
            raise ValueError(f"top-2 routing needs n_experts >= 2, got {n_experts}")
        _check_cf(capacity_factor, allow_none=True)
        super().__init__(h, n_experts, aux_alpha)
        self.capacity_factor, self.random_second, self.generator = capacity_factor, random_second, generator

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.scores(x)
        attempt = None
        if self.random_second and self.training:
            g = logits.softmax(-1).topk(2, dim=-1).values.detach()
            g2 = g[:, 1] / g.sum(-1)
            u = torch.rand(g2.shape, generator=self.generator, dtype=g2.dtype, device=g2.device)
            attempt = torch.stack([torch.ones_like(u, dtype=torch.bool), u < 2 * g2], dim=1)
        C = None if self.capacity_factor is None else capacity(x.size(0), self.n_experts, 2,
                                                               self.capacity_factor)
        return top_k_routing(logits, 2, C, normalize=True, aux_alpha=self.aux_alpha, attempt=attempt)


class ExpertChoiceRouter(Router):
    """Zhou et al. 2022 §3.1: each expert picks its top-C tokens, ``C = min(T, ceil(T · cf / E))``
    (eq. 1, "k = n × c / e"; c = cf is the average number of experts per token). No aux loss: the
    load is even by construction."""

    def __init__(self, h: int, n_experts: int, capacity_factor: float = 1.0):
        _check_cf(capacity_factor, allow_none=False)
        super().__init__(h, n_experts, 0.0)
        self.capacity_factor = self.experts_per_token = capacity_factor

    def forward(self, x: torch.Tensor) -> Routing:
        C = expert_choice_capacity(x.size(0), self.n_experts, self.capacity_factor)
        return expert_choice_routing(self.scores(x), C)


ROUTERS = {"topk": NoisyTopKRouter, "switch": SwitchRouter, "top2": Top2Router,
           "expert_choice": ExpertChoiceRouter}


def register_router(name: str, cls: type) -> None:
    """Add a router class to ``ROUTERS`` under ``name`` (so ``make_router`` and ``MoEGPTConfig.router``
    know it). :mod:`.aux_free` registers "aux_free" this way, when the package is imported."""
    if not (isinstance(cls, type) and issubclass(cls, Router)):
        raise ValueError(f"a router must be a subclass of Router, got {cls!r}")
    if ROUTERS.get(name, cls) is not cls:
        raise ValueError(f"router name {name!r} is taken by {ROUTERS[name].__name__}; choose another name")
    ROUTERS[name] = cls


def make_router(name: str, h: int, n_experts: int, **kwargs) -> Router:
    """``make_router("switch", h, E, capacity_factor=1.0)`` -> a router; names: ``ROUTERS``."""
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; choose one of {sorted(ROUTERS)}")
    return ROUTERS[name](h, n_experts, **kwargs)
