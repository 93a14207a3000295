"""Chapter 10 — the mixture-of-experts layer: route, dispatch, run the experts, combine.

Shazeer et al. 2017, "Outrageously Large Neural Networks", §2 (eq. 1: ``y = Σ_i G(x)_i E_i(x)``,
computed only for the experts with G(x)_i ≠ 0). Lepikhin et al. 2021, "GShard", §2.2 and
Algorithm 1 (dispatch and combine). Fedus et al. 2021, "Switch Transformers", §2 (an MoE layer
replaces the transformer's feed-forward MLP; a dropped token passes on through the residual).

Each expert is the transformer MLP (c_fc, GELU, c_proj) of :mod:`minitorch_dist.models.gpt`.
For x [T, h] and a :class:`~.routers.Routing` with A kept assignments (t_a, e_a, w_a), sorted by
expert, the layer computes

    dispatch   X = x[t_1 .. t_A]                        [A, h]   rows of expert 0, then 1, ...
    experts    Y = cat_e expert_e(X_e)                  [A, h]   X_e = the counts[e] rows of expert e
    combine    y[t] = Σ_{a: t_a = t} w_a · Y_a           [T, h]   (index_add; 0 for a dropped token)

and, as the reference, the *dense* path that runs every expert on every token and mixes with the
[T, E] combine-weight matrix W: ``y = Σ_e W[:, e] · expert_e(x)``. The two agree to fp32 rounding on
the same routing (the tests check it). Dispatch is what makes MoE cheap: expert e does counts[e]
rows of work, not T. Expert parallelism (:mod:`.expert_parallel`) puts an all-to-all between
dispatch and the experts and another between the experts and combine, and reuses these functions.
"""
from __future__ import annotations

import torch
from torch import nn

from .routers import (  # noqa: F401  (re-exported: the chapter's whole API is importable from here)
    ROUTERS,
    ExpertChoiceRouter,
    NoisyTopKRouter,
    Router,
    Routing,
    SwitchRouter,
    Top2Router,
    capacity,
    expert_choice_routing,
    load_balancing_loss,
    make_router,
    top_k_routing,
)


class Expert(nn.Module):
    """One expert: the GPT MLP, c_fc (h -> d_ff), GELU (tanh approximation, as ``models.gpt.MLP``), c_proj."""

    def __init__(self, h: int, d_ff: int, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(h, d_ff, bias=bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(d_ff, h, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


def dispatch(x: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, list[int]]:
    """x [T, h] -> (the packed expert inputs [A, h], rows per expert): row a is ``x[routing.tokens[a]]``,
    expert e's rows are the e-th block of ``counts[e]`` rows (the routing is sorted by expert)."""
    return x[routing.tokens], routing.counts.tolist()


def run_experts(experts, packed: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert i on its block of ``counts[i]`` rows of ``packed``; outputs in the same layout. An expert
    with no rows still runs (on an empty block), so its parameters get a zero gradient, not None."""
    if len(counts) != len(experts) or sum(counts) != packed.size(0):
        raise ValueError(f"counts {counts} must give one block per expert ({len(experts)}) "
                         f"and add up to the {packed.size(0)} packed rows")
    return torch.cat([expert(block) for expert, block in zip(experts, packed.split(counts))])


def combine(expert_outputs: torch.Tensor, routing: Routing, n_tokens: int) -> torch.Tensor:
    """y[t] = Σ over t's kept assignments a of ``weights[a] · expert_outputs[a]``; [n_tokens, h]."""
    weighted = expert_outputs * routing.weights.to(expert_outputs.dtype)[:, None]
    return expert_outputs.new_zeros(n_tokens, expert_outputs.size(1)).index_add(0, routing.tokens, weighted)


class MoELayer(nn.Module):
    """A router and ``n_experts`` :class:`Expert` MLPs. ``forward(x, path="dispatch" | "dense")``.

    ``router``: a :class:`~.routers.Router` (its ``w_gate`` must be [h, n_experts]) or a name from
    ``ROUTERS`` ("topk", "switch", "top2", "expert_choice") built with its defaults. x may be
    [..., h]; tokens are flattened to [T, h] and routed together (capacity is per forward call).
    After a forward, ``last_routing`` holds its :class:`Routing` and ``aux_loss`` its
    load-balancing loss (add it to the training loss).
    """

    def __init__(self, h: int, d_ff: int, n_experts: int, router: Router | str = "switch", bias: bool = True):
        super().__init__()
        for name, v in (("h", h), ("d_ff", d_ff), ("n_experts", n_experts)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"MoELayer {name} must be a positive int, got {v!r}")
        if isinstance(router, str):
            router = make_router(router, h, n_experts)
        if not isinstance(router, Router):
            raise ValueError(f"router must be a Router or one of {sorted(ROUTERS)}, got "
                             f"{type(router).__name__}")
        if tuple(router.w_gate.shape) != (h, n_experts):
            raise ValueError(f"router scores {router.n_experts} experts from width {router.h}, but the layer "
                             f"has n_experts={n_experts}, h={h}; build the router with ({h}, {n_experts})")
        self.h, self.d_ff, self.n_experts = h, d_ff, n_experts
        self.router = router
        self.experts = nn.ModuleList(Expert(h, d_ff, bias) for _ in range(n_experts))
        self.last_routing: Routing | None = None

    @property
    def aux_loss(self) -> torch.Tensor:
        """The last forward's load-balancing loss (0 before any forward, or for a router without one)."""
        if self.last_routing is None:
            return self.router.w_gate.new_zeros(())
        return self.last_routing.aux_loss

    def forward(self, x: torch.Tensor, path: str = "dispatch") -> torch.Tensor:
        if x.size(-1) != self.h:
            raise ValueError(f"MoELayer expects [..., h={self.h}] inputs, got shape {tuple(x.shape)}")
        if path not in ("dispatch", "dense"):
            raise ValueError("path must be 'dispatch' (the sparse computation) or 'dense' "
                             f"(the reference), got {path!r}")
        tokens = x.reshape(-1, self.h)
        routing = self.last_routing = self.router(tokens)
        if path == "dense":  # every expert on every token, mixed by the [T, E] weight matrix
            W = routing.combine_weights().to(x.dtype)
            y = sum(W[:, e, None] * expert(tokens) for e, expert in enumerate(self.experts))
        else:
            packed, counts = dispatch(tokens, routing)
            y = combine(run_experts(self.experts, packed, counts), routing, tokens.size(0))
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"h={self.h}, d_ff={self.d_ff}, n_experts={self.n_experts}"
