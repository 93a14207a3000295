"""Chapter 10: expert parallelism equals the single-process MoE layer with the same routing.

Each rank routes its own TOK tokens, so the reference is the same :class:`MoELayer` (same seed) run
in one process on each rank's chunk separately, with the chunks' losses summed: rank r's outputs
and input gradients must equal chunk r's, rank r's experts' gradients the reference's gradients of
experts [r·E/n, (r+1)·E/n), and the router's gradient after ``sync_replicated_grads`` the
reference's. World sizes 2 and 4, E = 8 experts (4 and 2 per rank), four routings: Switch with
drops, GShard top-2 with drops, expert choice, and a skewed one where every token of a rank goes to
one expert (all-to-all splits of zero rows).

The mechanism is checked too: three all-to-alls forward (counts, dispatch, combine) and two backward,
their byte counts equal ``costmodel.all_to_all_bytes_moe`` on the send matrix that the *reference*
routing implies (``costmodel.expert_parallel_send_matrix``) plus the counts exchange.

Tolerances (derived in tests/_support.py). Every case runs in float64: the experts see the same rows
in a different grouping (all ranks' rows for an expert in one matmul), and the router gradient is n
partial sums added by an all-reduce: the same sums in another order, at most N = 4·TOK rows in an
expert's or the router's weight gradient (D_FF = 16 hidden), chained 10 deep (logits, softmax, two
expert layers and the combine forward, as many back): ``model_bound(n=48, depth=10)`` scaled by the
values, ~1e-11. A row sent to the wrong expert or returned to the wrong token moves outputs by
O(0.1); a missing all-reduce leaves ~1/n of the router gradient. Bytes are counted for float64 rows
(8 bytes an element; the counts are int64 either way); the bare all-to-all moves small integers:
exact.

Built under a different seed on each rank, the layer (and a whole model through ``expert_parallel``)
still holds rank 0's router, experts and replicated weights, bitwise: broadcast when it is built.
"""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.launch import launch
from minitorch_dist.sparsity.expert_parallel import (
    ExpertParallelMoE,
    all_to_all,
    expert_parallel,
    replicated_parameters,
    sync_replicated_grads,
)
from minitorch_dist.sparsity.moe import ExpertChoiceRouter, MoELayer, SwitchRouter, Top2Router

from _support import case, close, float64, model_bound, refusal, run_cases

pytestmark = pytest.mark.ch10

H, D_FF, E, TOK, SEED = 8, 16, 8, 12, 7
N, DEPTH = 4 * TOK, 10  # the longest reduction (every rank's rows) and the chain: module docstring
ELEM = 8  # bytes of a float64 element: every case runs in float64
CASES = {
    "switch": lambda: SwitchRouter(H, E, capacity_factor=1.0),
    "top2": lambda: Top2Router(H, E, capacity_factor=0.75),
    "expert_choice": lambda: ExpertChoiceRouter(H, E, capacity_factor=1.0),
    "skewed": lambda: SwitchRouter(H, E, capacity_factor=None),
}


def _layer(case, n_experts=E, seed=SEED):
    torch.manual_seed(seed)
    router = CASES[case]() if n_experts == E else SwitchRouter(H, n_experts)
    return MoELayer(H, D_FF, n_experts, router)


def _data(case, n):
    g = torch.Generator().manual_seed(SEED + 1)
    x, G = torch.randn(n * TOK, H, generator=g), torch.randn(n * TOK, H, generator=g)
    if case == "skewed":  # all of a rank's tokens are one token: they all pick the same expert
        x = x[::TOK].repeat_interleave(TOK, 0)
    return x.view(n, TOK, H), G.view(n, TOK, H)


def _model(seed):
    """A replicated linear layer, then an MoE layer."""
    torch.manual_seed(seed)
    lin = nn.Linear(H, H)
    return nn.Sequential(lin, MoELayer(H, D_FF, E, SwitchRouter(H, E, capacity_factor=1.0)))


def _seeded():
    """Each rank builds its layer and model under its own seed (rank 0's is SEED)."""
    n, r = dist.get_world_size(), dist.get_rank()
    layer = _layer("switch", seed=SEED + 1000 * r)
    built = layer.router.w_gate.detach().clone()
    ep = ExpertParallelMoE(layer)
    with torch.no_grad():
        y = ep(_data("switch", n)[0][r])
    model = expert_parallel(_model(SEED + 1000 * r))
    return {"built": built, "y": y, "layer": {k: p.detach().clone() for k, p in ep.named_parameters()},
            "model": {k: p.detach().clone() for k, p in model.named_parameters()}}


def _events(m):
    return [(e.op, e.nbytes) for e in m.events]


def _routing_case(name):
    n, r = dist.get_world_size(), dist.get_rank()
    ep = ExpertParallelMoE(_layer(name))
    xs, Gs = _data(name, n)
    x = xs[r].clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = ep(x)
    with comm.meter() as bwd:
        ((y * Gs[r]).sum() + ep.aux_loss).backward()
    with comm.meter() as sync:
        sync_replicated_grads(ep)
    return {"y": y.detach(), "dx": x.grad,
            "experts": [[p.grad for p in e.parameters()] for e in ep.experts],
            "router": ep.router.w_gate.grad, "send": ep.send_counts, "recv": ep.recv_counts,
            "fwd": _events(fwd), "bwd": _events(bwd), "sync": _events(sync),
            "replicated": [tuple(p.shape) for p in replicated_parameters(ep)]}


def _bare_all_to_all():
    """The bare differentiable all-to-all, uneven: rank r sends j+1 rows of value r to rank j."""
    n, r = dist.get_world_size(), dist.get_rank()
    rows = torch.full((sum(j + 1 for j in range(n)), 2), float(r), requires_grad=True)
    got = all_to_all(rows, [r + 1] * n, [j + 1 for j in range(n)])
    (got * (torch.arange(got.size(0), dtype=got.dtype)[:, None] + 1)).sum().backward()
    return got.detach(), rows.grad


def _bare_layer():
    """``expert_parallel`` on the MoE layer itself (nothing to replace it inside): its sharded layer."""
    ep = expert_parallel(_layer("switch"))
    return {"type": type(ep).__name__, "local": len(ep.experts), "first": ep.first_expert}


def _rank_run():
    n = dist.get_world_size()
    cases = {name: (lambda name=name: _routing_case(name)) for name in CASES}
    bad = 3 if n == 2 else 6
    cases |= {"error": lambda: refusal(lambda: ExpertParallelMoE(_layer("switch", n_experts=bad))),
              "a2a": _bare_all_to_all, "seeded": _seeded, "bare": _bare_layer,
              "bare_error": lambda: refusal(lambda: expert_parallel(_layer("switch", n_experts=bad)))}
    with float64():
        return run_cases(cases)


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    n = request.param
    return n, launch(_rank_run, n, timeout_s=120)


def _close(got, want, where):
    close(got, want, model_bound(n=N, depth=DEPTH, scale=max(1.0, want.abs().max().item())), where)


@float64()
def _reference(case, n):
    """The layer on each chunk separately (as each rank routes), chunk losses summed (float64)."""
    layer = _layer(case)
    xs, Gs = _data(case, n)
    out, total = [], 0.0
    for r in range(n):
        x = xs[r].clone().requires_grad_(True)
        y = layer(x)
        total = total + (y * Gs[r]).sum() + layer.aux_loss
        out.append({"x": x, "y": y.detach(), "counts": layer.last_routing.counts.tolist()})
    total.backward()
    return layer, out


@pytest.mark.parametrize("name", sorted(CASES))
def test_expert_parallel_outputs_and_gradients_equal_single_process(ranks, name):
    n, results = ranks
    layer, ref = _reference(name, n)
    per = E // n
    for r in range(n):
        got = case(results[r], name, r)
        assert got["y"].dtype == torch.float64
        _close(got["y"], ref[r]["y"], f"y r={r}")
        _close(got["dx"], ref[r]["x"].grad, f"dx r={r}")
        for i, grads in enumerate(got["experts"]):
            want = [p.grad for p in layer.experts[r * per + i].parameters()]
            for a, b in zip(grads, want):
                _close(a, b, f"expert {r * per + i} gradient r={r}")
        _close(got["router"], layer.router.w_gate.grad, f"router gradient r={r}")
        assert got["replicated"] == [(H, E)]  # only the router is replicated; experts are sharded
    if name == "skewed":  # every rank sent all its rows to one rank and none to the others
        assert all(sorted(case(results[r], name, r)["send"]) == [0] * (n - 1) + [TOK] for r in range(n))


@pytest.mark.parametrize("name", sorted(CASES))
def test_all_to_all_bytes_match_the_meter_and_the_formula(ranks, name):
    n, results = ranks
    _, ref = _reference(name, n)
    S = costmodel.expert_parallel_send_matrix([c["counts"] for c in ref], n)  # from the reference routing
    want = costmodel.all_to_all_bytes_moe(S, H, bytes_per_element=ELEM, include_self=True, backward=True)
    counts_bytes = costmodel.moe_counts_exchange_bytes(E, n, include_self=True)
    for r in range(n):
        got = case(results[r], name, r)
        assert got["send"] == S[r] and got["recv"] == [S[i][r] for i in range(n)]
        A, R = sum(S[r]) * H * ELEM, sum(S[i][r] for i in range(n)) * H * ELEM
        assert got["fwd"] == [("all_to_all", E * 8), ("all_to_all", A), ("all_to_all", R)]  # int64 counts
        assert got["bwd"] == [("all_to_all", A), ("all_to_all", R)]  # reverse order, splits swapped
        assert sum(b for _, b in got["fwd"] + got["bwd"]) == want[r] + counts_bytes
        assert got["sync"] == [("all_reduce", H * E * ELEM)]  # the router's gradient, once


def test_uneven_all_to_all_and_its_backward(ranks):
    n, results = ranks
    for r in range(n):
        got, grad = case(results[r], "a2a", r)
        # rank r receives r+1 rows from every rank i, holding value i (small integers: exact)
        want = torch.tensor([float(i) for i in range(n) for _ in range(r + 1)], dtype=got.dtype)
        assert torch.equal(got, want[:, None].expand(-1, 2))
        # backward sends each row's gradient (its 1-based position at the receiver) back to its origin
        want_grad = []
        for j in range(n):  # rank r's block for rank j: rows at positions r·(j+1) + 1 ... on rank j
            want_grad += [float(r * (j + 1) + m + 1) for m in range(j + 1)]
        assert torch.equal(grad, torch.tensor(want_grad, dtype=grad.dtype)[:, None].expand(-1, 2))


def _local(params, r, per, prefix):
    """Rank r's part of a dense layer's parameters: router whole, experts [r·per, (r+1)·per) renumbered."""
    out = {}
    for k, p in params.items():
        rest = k[len(prefix):]
        if rest.startswith("experts."):
            i, tail = rest[len("experts."):].split(".", 1)
            if r * per <= int(i) < (r + 1) * per:
                out[f"{prefix}experts.{int(i) - r * per}.{tail}"] = p
        else:
            out[k] = p
    return out


def test_per_rank_seeds_give_the_first_ranks_layer_and_model(ranks):
    n, results = ranks
    per = E // n
    with float64():
        layer = {k: p.detach() for k, p in _layer("switch").named_parameters()}
        model = {k: p.detach() for k, p in _model(SEED).named_parameters()}
    _, ref = _reference("switch", n)
    built = case(results[1], "seeded", 1)["built"]
    assert not torch.equal(built, layer["router.w_gate"])  # rank 1's own differed
    for r in range(n):
        got = case(results[r], "seeded", r)
        for name, want in (("layer", _local(layer, r, per, "")), ("model", _local(model, r, per, "1."))):
            assert got[name].keys() == want.keys(), name
            for k in want:
                assert torch.equal(got[name][k], want[k]), f"{name} {k} r={r}"
        _close(got["y"], ref[r]["y"], f"seeded y r={r}")


def test_experts_not_divisible_by_ranks_is_a_clear_error(ranks):
    n, results = ranks
    bad = 3 if n == 2 else 6
    errors = [case(res, "error", r) for r, res in enumerate(results)]
    assert errors[0].startswith(f"n_experts {bad} is not divisible by {n} ranks (expert parallel degree)")
    assert all(e == errors[0] for e in errors)


def test_expert_parallel_on_the_layer_itself_shards_it_or_refuses(ranks):
    """``expert_parallel(moe_layer)`` returned the layer unchanged (every expert on every rank, no check)."""
    n, results = ranks
    bad = 3 if n == 2 else 6
    for r, res in enumerate(results):
        assert case(res, "bare", r) == {"type": "ExpertParallelMoE", "local": E // n, "first": r * E // n}
        assert case(res, "bare_error", r).startswith(f"n_experts {bad} is not divisible by {n} ranks")


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        ExpertParallelMoE(_layer("switch"))
