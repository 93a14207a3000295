"""Chapter 12, held-out: the rank grid on uneven shapes the visible tests do not draw (30 to 42 ranks, odd
axis sizes), microbatch counts at exact binary boundaries with ``dp``, ``micro_batch_size`` and
interleaving all in play, the 2-D grid step on the other two grids of 2 ranks (2 x 1 with rows 3 and 2;
1 x 2, every rank reading all 3 rows) with another model and learning rate, and the traffic of a pipeline
without data parallelism (4 microbatches) and of ZeRO-1 on 2 replicas, metered on 2 ranks.

Expected values as in the visible tests: the library's ``RankGrid`` and torch's row-major mesh layout;
the bubble worked out by hand (targets are binary fractions, so a bubble equal to one is equal in any
arithmetic); the single-process run (``reference_run``) cut to each rank's slice, in float64, held to the
visible tests' bounds (``model_bound`` of the gradients' size over N = max(B·T, 4h) terms and a depth of
6 per layer + 2, carried over the steps by ``sgd_bound``; the replicas bitwise); the library's 3D step
metered here, compared exactly with what the exercise measures, and ``costmodel`` for the prediction
(within 1 %: ZeRO's one-byte flags, as the visible tests say).
"""
import functools
import itertools
import sys

import cloudpickle
import pytest
import torch

from minitorch_dist import costmodel
from minitorch_dist.course.exercises import load, resolve_impl
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.mesh import RankGrid

from _support import close, dense_run, float64, model_bound, run_cases, sgd_bound

pytestmark = pytest.mark.ch12

if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

UNEVEN_SHAPES = [(3, 5, 2), (5, 2, 3), (2, 3, 5), (7, 2, 2), (1, 6, 5), (4, 1, 7), (3, 3, 3), (2, 7, 3)]


def test_rank_to_coords_held_out_uneven_grids(ex):
    for dp, tp, pp in UNEVEN_SHAPES:
        n, grid = dp * tp * pp, RankGrid(dp * tp * pp, dp, tp, pp)
        mesh = torch.arange(n).reshape(pp, dp, tp)  # torch's DeviceMesh layout, slowest axis first
        for rank in range(n):
            coords = tuple(ex.rank_to_coords(rank, dp, tp, pp))
            assert coords == tuple(grid.coords(rank)), f"rank {rank} of dp={dp} tp={tp} pp={pp}"
            assert ex.coords_to_rank(coords, dp, tp, pp) == rank
        for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
            assert ex.coords_to_rank((d, t, p), dp, tp, pp) == mesh[p, d, t].item(), (dp, tp, pp, d, t, p)
        for axis, dim in (("pp", 0), ("dp", 1), ("tp", 2)):
            size = mesh.shape[dim]
            want = sorted(mesh.movedim(dim, -1).reshape(-1, size).tolist())
            assert ex.group_ranks(axis, dp, tp, pp) == grid.groups(axis) == want, \
                f"{axis} groups of dp={dp} tp={tp} pp={pp}"


def test_microbatches_for_bubble_held_out_boundaries(ex):
    # 3/m <= 3/8: m = 8 meets it exactly (units 64/2 = 32)
    assert ex.microbatches_for_bubble(4, 0.375, 64, 2) == 8
    # 5/m <= 1/16 needs m >= 80; 160/2 = 80 units: the whole per-replica batch, one sequence each
    assert ex.microbatches_for_bubble(6, 0.0625, 160, 2) == 80
    # 4/m <= 1/4 needs m >= 16; 72/3 = 24 units: 24 (16 does not divide 24)
    assert ex.microbatches_for_bubble(5, 0.25, 72, 3) == 24
    # ...in units of 2 sequences there are 12, and no divisor of 12 reaches 16
    with pytest.raises(ValueError):
        ex.microbatches_for_bubble(5, 0.25, 72, 3, micro_batch_size=2)
    # interleaved, v = 2: 2/(2m) <= 1/8 needs m >= 8, a multiple of p = 3 dividing 48: 12
    assert ex.microbatches_for_bubble(3, 0.125, 48, 1, v=2) == 12
    # v = 4 divides the bubble by 4: 2/(4m) <= 1/8 needs m >= 4; multiples of 3 dividing 48: 6
    assert ex.microbatches_for_bubble(3, 0.125, 48, 1, v=4) == 6
    with pytest.raises(ValueError):  # a pipeline always has a bubble: a target of 0 cannot be met
        ex.microbatches_for_bubble(2, 0.0, 64, 1)


# --- on 2 ranks: the 2-D grid step on its other two shapes, and the metered 3D step ------------------

HCFG = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
HSTEPS, HSEQ, HLR = 3, 8, 0.2
#: (dp, tp, batch): rows 3 and 2 on two replicas; one replica of two TP ranks that read all 3 rows
GRIDS = ((2, 1, 5), (1, 2, 3))
#: (dp, tp, pp, zero, microbatches), batch 8: a pipeline alone (4 microbatches), ZeRO-1 on 2 replicas
TRAFFIC = ((1, 1, 2, 0, 4), (2, 1, 1, 1, 2))
TRAFFIC_BATCH = 8


def _grid_64(ex):
    from minitorch_dist.parallelism.tensor_parallel import shard_dense_tensors
    from minitorch_dist.parallelism.three_d import reference_run

    out = []
    for dp, tp, batch in GRIDS:
        with float64():
            losses, params = ex.train_on_2d_grid_uneven(HCFG, dp, tp, HSTEPS, batch, HSEQ, lr=HLR)
            ref_losses, ref = reference_run(HCFG, HSTEPS, batch, HSEQ, lr=HLR)
            want = shard_dense_tensors(ref, HCFG) if tp > 1 else ref  # tp = world: the default group
        out.append({"losses": [float(v) for v in losses], "ref_losses": ref_losses,
                    "params": {k: v.detach().cpu() for k, v in params.items()}, "want": want})
    return out


def _traffic(ex):
    from minitorch_dist.parallelism.three_d import train_3d

    out = []
    for dp, tp, pp, zero, m in TRAFFIC:
        mine = ex.measure_rank_traffic(HCFG, dp, tp, pp, TRAFFIC_BATCH, HSEQ, m, zero=zero)
        res = train_3d(HCFG, dp, tp, pp, 1, TRAFFIC_BATCH, HSEQ, m, zero_stage=zero)
        meter = {"dp": sum(e.wire_bytes for e in res.events["dp"]),
                 "pp": sum(e.nbytes for e in res.events["pipeline"] if e.op == "send")}
        out.append({"mine": mine, "meter": meter, "stage": res.coords[2]})
    return out


def _on_ranks(impl):
    ex = load("ch12", impl)
    return run_cases({"grid": lambda: _grid_64(ex), "traffic": lambda: _traffic(ex)})


@pytest.fixture(scope="module")
def ranks(launches):
    return launches(_on_ranks, resolve_impl(), timeout_s=90)


@functools.cache
def _bound(batch):
    """The visible tests' bound for the weights after HSTEPS SGD steps (module docstring)."""
    with float64():
        ref = dense_run(lambda: GPT(HCFG), HSTEPS + 1, batch, HSEQ, seed=0, lr=HLR)
    scale = max(1.0, max(g.abs().max().item() for g in ref["grads"].values()))
    n, depth = max(batch * HSEQ, 4 * HCFG.n_embd), 6 * HCFG.n_layer + 2
    return sgd_bound(steps=HSTEPS, lr=HLR, grad_err=model_bound(n=n, depth=depth, scale=scale)), n, depth


def test_train_on_2d_grid_uneven_held_out_two_rank_grids(ranks):
    per_rank = ranks.case(2, "grid")
    for i, (dp, tp, batch) in enumerate(GRIDS):
        bound, n, depth = _bound(batch)
        runs = [r[i] for r in per_rank]
        for r, g in enumerate(runs):
            assert set(g["params"]) == set(g["want"]), f"{dp}x{tp}, rank {r}: parameter names"
            for k, want in g["want"].items():
                got = g["params"][k]
                assert got.shape == want.shape, f"{dp}x{tp}, rank {r} {k}: shape {tuple(got.shape)}"
                close(got, want, bound, f"{dp}x{tp}, batch {batch}, rank {r} {k}")
        if dp == 2:  # the replicas: bitwise equal; their losses weighted by rows 3 and 2 are the global loss
            a, b = runs[0]["params"], runs[1]["params"]
            assert all(torch.equal(a[k], b[k]) for k in a), "2x1: the DP replicas drifted apart"
            losses = [(3 * x + 2 * y) / 5 for x, y in zip(runs[0]["losses"], runs[1]["losses"])]
        else:  # one replica: both TP ranks report the loss of all rows
            assert runs[0]["losses"] == pytest.approx(runs[1]["losses"], rel=0, abs=1e-12)
            losses = runs[0]["losses"]
        assert len(losses) == HSTEPS
        for got, want in zip(losses, runs[0]["ref_losses"]):
            assert abs(got - want) <= model_bound(n=n, depth=depth, scale=max(1.0, abs(want))), \
                f"{dp}x{tp}: loss {got}, the single process's {want}"


def test_measure_rank_traffic_held_out_two_ranks(ranks):
    for r, runs in enumerate(ranks.case(2, "traffic")):
        for (dp, tp, pp, zero, m), got in zip(TRAFFIC, runs):
            where = f"rank {r} ({dp}x{tp}x{pp}, ZeRO-{zero}, {m} microbatches)"
            mine, meter, stage = got["mine"], got["meter"], got["stage"]
            assert mine["stage"] == stage, f"{where}: stage {mine['stage']}, the rank is at stage {stage}"
            assert mine["measured"]["pp"] == meter["pp"], f"{where}: pipeline bytes sent"
            assert mine["measured"]["dp"] == meter["dp"], f"{where}: data-parallel wire bytes"
            psi = costmodel.pipeline_stage_params(HCFG, tp, pp)[stage]
            want_dp = costmodel.zero_dp_bytes_per_step(psi, dp, zero, m, bytes_per_element=4)
            assert mine["predicted"]["dp"] == pytest.approx(want_dp, rel=1e-12, abs=1e-9), where
            assert mine["predicted"]["dp"] == pytest.approx(meter["dp"], rel=0.01), where
            # one neighbour: m activations (or gradients) of b x T x h floats, b = 8 / (dp m)
            want_pp = m * (TRAFFIC_BATCH // (dp * m)) * HSEQ * HCFG.n_embd * 4 if pp > 1 else 0
            assert mine["predicted"]["pp"] == want_pp == meter["pp"], where
