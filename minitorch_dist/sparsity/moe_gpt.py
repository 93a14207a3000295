"""Chapter 10 — the tiny GPT with mixture-of-experts feed-forward layers.

Lepikhin et al. 2021, "GShard", §2.1 ("replacing every other feed-forward layer with an MoE layer")
and Fedus et al. 2021, "Switch Transformers", §2 and §2.4 (the same, top-1; the training loss is the
language-model loss plus α times the load-balancing loss of every MoE layer).

Block i of :class:`~minitorch_dist.models.gpt.GPT` gets an :class:`~.moe.MoELayer` in place of its
MLP when ``(i + 1) % moe_every == 0`` (moe_every=2: blocks 1, 3, ...; 1: all). Each expert has the
dense MLP's shape (h -> mlp_ratio·h -> h), so with k experts per token a token does k MLPs' worth of
FLOPs while the layer holds E MLPs' worth of parameters:

    total params     N_dense + n_moe · ((E - 1) · P_mlp + h·E)
    active / token   N_dense + n_moe · ((k - 1) · P_mlp + h·E)     (P_mlp = one MLP's parameters)

``loss = lm_loss + Σ_layers aux_loss``; ``model.lm_loss`` keeps the language-model part alone (the
number to compare with the corpus's entropy floor). The experts have no dropout.

Two modern variants, by configuration: ``router="aux_free"`` balances by a per-expert selection bias
instead of a loss (Wang et al. 2024; DeepSeek-V3 §2.1.2; call :meth:`MoEGPT.update_expert_biases`
after each optimizer step), and ``dropless=True`` processes every token with grouped GEMMs
(MegaBlocks; :class:`~.dropless.DroplessMoELayer`, ``capacity_factor=None``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..models.gpt import GPT, GPTConfig, init_gpt2_
from .aux_free import update_expert_biases
from .dropless import DroplessMoELayer
from .moe import ROUTERS, MoELayer, make_router


@dataclass
class MoEGPTConfig(GPTConfig):
    """``GPTConfig`` plus the MoE knobs. ``router``: one of ``ROUTERS``; ``top_k`` is used by "topk"
    and "aux_free" only; ``capacity_factor=None`` means no capacity limit (token-choice routers);
    ``aux_alpha`` is the load-balancing loss weight α (Switch: 0.01; ignored by "expert_choice" and
    "aux_free", which have none); ``bias_update_rate`` is aux_free's γ (DeepSeek-V3: 0.001);
    ``dropless``: every token processed, experts as grouped GEMMs (needs ``capacity_factor=None``)."""

    moe_every: int = 2
    n_experts: int = 4
    router: str = "switch"
    capacity_factor: float | None = 1.25
    aux_alpha: float = 0.01
    top_k: int = 2
    bias_update_rate: float = 0.001
    dropless: bool = False

    def __post_init__(self):
        super().__post_init__()
        for name in ("moe_every", "n_experts", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEGPTConfig.{name} must be a positive int, got {v!r}")
        if self.moe_every > self.n_layer:
            raise ValueError(f"moe_every {self.moe_every} > n_layer {self.n_layer} leaves no MoE block; "
                             f"use moe_every <= {self.n_layer}")
        if self.router not in ROUTERS:
            raise ValueError(f"MoEGPTConfig.router {self.router!r} is unknown; choose one of "
                             f"{sorted(ROUTERS)}")
        if self.dropless and (self.capacity_factor is not None or self.router == "expert_choice"):
            raise ValueError("MoEGPTConfig(dropless=True) processes every token: set capacity_factor=None "
                             f"and a token-choice router (got router={self.router!r}, "
                             f"capacity_factor={self.capacity_factor})")

    @property
    def moe_blocks(self) -> list[int]:
        return [i for i in range(self.n_layer) if (i + 1) % self.moe_every == 0]

    def router_kwargs(self) -> dict:
        if self.router == "expert_choice":
            return {"capacity_factor": self.capacity_factor}
        if self.router == "aux_free":
            return {"capacity_factor": self.capacity_factor, "k": self.top_k,
                    "bias_update_rate": self.bias_update_rate}
        kw = {"capacity_factor": self.capacity_factor, "aux_alpha": self.aux_alpha}
        return {**kw, "k": self.top_k} if self.router == "topk" else kw


class MoEGPT(GPT):
    """``GPT`` whose blocks ``cfg.moe_blocks`` have an MoE feed-forward. ``model(idx, targets)`` ->
    ``(logits, lm_loss + Σ aux)``; after a forward, ``lm_loss`` and ``aux_loss`` hold the two parts."""

    def __init__(self, cfg: MoEGPTConfig):
        if not isinstance(cfg, MoEGPTConfig):
            raise ValueError(f"MoEGPT needs an MoEGPTConfig, got {type(cfg).__name__}")
        super().__init__(cfg)
        h = cfg.n_embd
        for i in cfg.moe_blocks:
            cls = DroplessMoELayer if cfg.dropless else MoELayer
            layer = cls(h, cfg.mlp_ratio * h, cfg.n_experts,
                        make_router(cfg.router, h, cfg.n_experts, **cfg.router_kwargs()), bias=cfg.bias)
            init_gpt2_(layer, cfg.n_layer)  # experts initialised like the MLPs they replace ...
            layer.router.reset_parameters()  # ... the router as Switch §2.4 says
            self.blocks[i].mlp = layer
        self.lm_loss: torch.Tensor | None = None
        self.aux_loss: torch.Tensor | None = None

    def moe_layers(self) -> list:
        """The MoE feed-forwards, in block order (MoELayer, or ExpertParallelMoE once sharded)."""
        return [self.blocks[i].mlp for i in self.cfg.moe_blocks]

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits, lm_loss = super().forward(idx, targets)
        self.lm_loss = lm_loss
        self.aux_loss = sum(layer.aux_loss for layer in self.moe_layers())
        return logits, (None if lm_loss is None else lm_loss + self.aux_loss)

    def update_expert_biases(self, group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """After an optimizer step: the aux-free routers' bias update from the step's loads (summed over
        ``group`` when parallel); returns those loads. A no-op (``[]``) for other routers."""
        return update_expert_biases(self, group)

    def _routings(self):
        routings = [layer.last_routing for layer in self.moe_layers()]
        if any(r is None for r in routings):
            raise RuntimeError("no routing yet: run a forward pass first")
        return routings

    def expert_load(self) -> list[torch.Tensor]:
        """Per MoE layer, the assignments each expert kept in the last forward: LongTensor[E] each."""
        return [r.counts.clone() for r in self._routings()]

    def dropped(self) -> list[int]:
        """Per MoE layer, the assignments dropped for capacity in the last forward."""
        return [r.dropped for r in self._routings()]

    def active_params_per_token(self, exclude_embeddings: bool = False) -> float:
        """Parameters one token uses: all of them except, in each MoE layer, the E - k experts it
        skips (k = ``router.experts_per_token``; for expert choice the average, cf)."""
        total = self.num_params(exclude_embeddings)
        for layer in self.moe_layers():
            if not isinstance(layer, MoELayer):
                raise RuntimeError("active_params_per_token counts a whole model: call it before "
                                   "expert_parallel()")
            per_expert = sum(p.numel() for p in layer.experts[0].parameters())
            total -= (layer.n_experts - layer.router.experts_per_token) * per_expert
        return total
