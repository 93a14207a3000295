"""Chapter 10 — the tour's rows: expert parallel == one process; drops and all-to-all bytes == formulas."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...analysis import costmodel
from ...analysis.predict import tour_row
from ...runtime import comm
from ...runtime.env import single_thread
from ...runtime.launch import launch
from ...sparsity import ExpertParallelMoE, MoELayer, SwitchRouter, capacity, top_k_routing

_H, _E, _TOK, _SEED = 16, 4, 64, 0  # the headline's layer: width, experts, tokens per rank


def _headline_layer() -> MoELayer:
    torch.manual_seed(_SEED)
    return MoELayer(_H, 2 * _H, _E, SwitchRouter(_H, _E, capacity_factor=1.0))


def _headline_tokens(n: int) -> torch.Tensor:
    return torch.randn(n, _TOK, _H, generator=torch.Generator().manual_seed(_SEED + 1))


def _headline_rank():
    n, r = dist.get_world_size(), dist.get_rank()
    ep = ExpertParallelMoE(_headline_layer())
    x = _headline_tokens(n)[r].requires_grad_(True)
    with comm.meter() as m:
        y = ep(x)
        y.square().sum().backward()
    return {"y": y.detach(), "bytes": m.bytes["all_to_all"]}


def _reference(n: int, batches: int):
    """One process: each rank's tokens routed alone (outputs, loads before capacity, what was kept),
    and the tokens dropped by uniform random top-1 routing in each of ``batches`` batches."""
    with single_thread():
        layer, xs = _headline_layer(), _headline_tokens(n)
        ref, loads, kept = [], [], []
        for r in range(n):
            with torch.no_grad():
                ref.append(layer(xs[r]))
            routing = layer.last_routing
            loads.append(torch.bincount(routing.probs.argmax(-1), minlength=_E).tolist())  # before capacity
            kept.append((routing.counts.tolist(), routing.dropped, routing.capacity))
        gen = torch.Generator().manual_seed(1)
        C = capacity(_TOK, _E, 1, 1.0)
        drops = torch.tensor([float(top_k_routing(torch.randn(_TOK, _E, generator=gen), 1, C).dropped)
                              for _ in range(batches)])
    return ref, loads, kept, drops


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 10's rows: expert parallel == one process; dropped tokens and all-to-all bytes == formulas."""
    n = 2
    per_rank = launch(_headline_rank, n, timeout_s=120)
    batches = 100 if smoke else 400  # uniform random routing: mean drops over many batches vs the expectation
    ref, loads, kept, drops = _reference(n, batches)
    C = capacity(_TOK, _E, 1, 1.0)
    diff = max((p["y"] - want).abs().max().item() for p, want in zip(per_rank, ref))
    dropped = sum(d for _, d, _ in kept)
    predicted = sum(costmodel.dropped_tokens(load, cap) for load, (_, _, cap) in zip(loads, kept))
    expected = costmodel.expected_dropped_tokens(_TOK, _E, 1, 1.0)
    stderr = drops.std().item() / batches ** 0.5
    S = costmodel.expert_parallel_send_matrix([c for c, _, _ in kept], n)
    want_bytes = sum(costmodel.all_to_all_bytes_moe(S, _H, include_self=True, backward=True)) \
        + n * costmodel.moe_counts_exchange_bytes(_E, n, include_self=True)
    got_bytes = sum(p["bytes"] for p in per_rank)
    return [
        {"chapter": "ch10",
         "experiment": f"expert parallel (E={_E} on {n} ranks) == one process, max |Δ output|",
         "theory": 1e-6, "measured": diff, "ok": diff < 1e-6},
        {"chapter": "ch10",
         "experiment": f"Switch, cf=1, T={_TOK}/rank: dropped = Σ max(0, load - C), C={C}",
         "theory": predicted, "measured": dropped, "ok": dropped == predicted},
        {"chapter": "ch10",
         "experiment": f"random top-1 routing, {batches} batches: mean dropped vs expectation",
         "theory": round(expected, 3), "measured": round(drops.mean().item(), 3),
         "ok": abs(drops.mean().item() - expected) < 4 * stderr},
        {"chapter": "ch10", "experiment": "all-to-all bytes (fwd+bwd, both ranks): meter = formula + counts",
         "theory": want_bytes, "measured": got_bytes, "ok": got_bytes == want_bytes},
        tour_row("ch10", "ep", smoke),
    ]
