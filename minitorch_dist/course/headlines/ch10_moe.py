"""Chapter 10 — the tour's rows: expert parallel == one process; drops and all-to-all bytes == formulas;
aux-free balancing (Wang et al. 2024; DeepSeek-V3 §2.1.2), the dropless MoE (MegaBlocks) and chunked
expert parallelism (Tutel) against their references and formulas."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from ... import costmodel
from ...analysis.predict import tour_row
from ...costmodel import moe as moe_cost
from ...runtime import comm
from ...runtime.env import single_thread
from ...runtime.launch import launch
from ...sparsity import (
    AuxFreeRouter,
    DroplessMoELayer,
    ExpertParallelMoE,
    MoELayer,
    SwitchRouter,
    Top2Router,
    capacity,
    top_k_routing,
)

_H, _E, _TOK, _SEED = 16, 4, 64, 0  # the headline's layer: width, experts, tokens per rank
_CHUNKS = 4  # chunked expert parallelism: pieces of the dispatch / combine


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
    chunked = ExpertParallelMoE(_headline_layer(), chunks=_CHUNKS)  # the same layer, pipelined
    with comm.meter() as mc:
        yc = chunked(x.detach().requires_grad_(True))
        yc.square().sum().backward()
    return {"y": y.detach(), "bytes": m.bytes["all_to_all"], "chunked_diff": (yc - y).abs().max().item(),
            "chunked_calls": mc.calls["all_to_all"], "chunked_bytes": mc.bytes["all_to_all"]}


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
        *_modern_rows(per_rank, n),
        tour_row("ch10", "ep", smoke),
    ]


def _aux_free_collapse(rate: float = 0.003, steps: int = 250):
    """A router whose every token picks expert 0, balanced by the bias update alone: (first step a token
    left expert 0, the steps ceil(gap / 2γ) predict, mean max/mean load over the last 50 steps)."""
    torch.manual_seed(_SEED)
    router = AuxFreeRouter(8, 4, k=1, bias_update_rate=rate)
    x = torch.randn(256, 8)
    x[:, 0] = 1.0
    with torch.no_grad():
        router.w_gate[0] = torch.tensor([1.5, 0.0, 0.0, 0.0])
        s = (x @ router.w_gate).softmax(-1)
    gap = (s[:, 0] - s[:, 1:].max(-1).values).min().item()
    first, late = None, []
    for step in range(steps):
        counts = router(x).counts
        first = step if first is None and counts[0] < len(x) else first
        late.append(moe_cost.load_imbalance(counts))
        router.update_bias()
    return first, moe_cost.aux_free_steps_to_shift(gap, rate), sum(late[-50:]) / 50


def _dropless_checks():
    """(max |dropless - token-by-token| in fp64, matmul FLOPs counted, FLOPs the formula gives)."""
    torch.manual_seed(_SEED)
    layer = DroplessMoELayer(_H, 2 * _H, _E, Top2Router(_H, _E, capacity_factor=None), impl="loop").double()
    x = torch.randn(_TOK, _H, dtype=torch.float64)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        y = layer(x)
    r = layer.last_routing
    with torch.no_grad():
        ref = torch.zeros_like(x)
        for t, e, w in zip(r.tokens.tolist(), r.experts.tolist(), r.weights.tolist()):
            ref[t] += w * layer.experts[e](x[t])
    want = moe_cost.dropless_expert_flops(r.counts, _H, 2 * _H) + 2 * _TOK * _H * _E  # + the router's matmul
    return (y - ref).abs().max().item(), fc.get_total_flops(), want


def _modern_rows(per_rank, n) -> list[dict]:
    with single_thread():
        first, predicted, late = _aux_free_collapse()
        err, flops, want_flops = _dropless_checks()
    diff = max(p["chunked_diff"] for p in per_rank)
    calls = [p["chunked_calls"] for p in per_rank]
    ch = "ch10"
    return [
        {"chapter": ch, "experiment": "aux-free bias, collapsed router: first step a token leaves "
                                      "expert 0 = ceil(gap / 2γ) (+1 for float32)",
         "theory": predicted, "measured": first, "ok": first - predicted in (0, 1)},
        {"chapter": ch, "experiment": "aux-free bias alone, 250 steps: max/mean load, last 50 steps (< 1.15)",
         "theory": 1.0, "measured": round(late, 3), "ok": late < 1.15},
        {"chapter": ch, "experiment": "dropless MoE == every token through its experts (fp64), max |Δ|",
         "theory": 1e-12, "measured": err, "ok": err < 1e-12},
        {"chapter": ch, "experiment": "dropless expert FLOPs: FlopCounterMode = 4·h·d_ff·Σ routed + router",
         "theory": want_flops, "measured": flops, "ok": flops == want_flops},
        {"chapter": ch, "experiment": f"chunked EP ({_CHUNKS} chunks, {n} ranks) == unchunked, max |Δ|",
         "theory": 1e-6, "measured": diff, "ok": diff < 1e-6},
        {"chapter": ch, "experiment": f"chunked EP: all-to-alls fwd+bwd = 1 + 4·{_CHUNKS}, unchunked bytes",
         "theory": 1 + 4 * _CHUNKS, "measured": max(calls),
         "ok": all(c == 1 + 4 * _CHUNKS for c in calls)
         and all(p["chunked_bytes"] == p["bytes"] for p in per_rank)},
    ]
