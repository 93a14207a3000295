"""Chapter 12 exercises, autograded: the rank grid, the memory-feasibility filter, microbatches for a
bubble, training on a 2 x 2 grid of ranks whose replicas hold unequal shares of the batch, and a 3D
step's bytes predicted, then measured.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Expected values
come from independent sources: the library's ``parallelism.mesh.RankGrid``, torch's row-major
``DeviceMesh`` layout (an ``arange`` reshaped to (pp, dp, tp)) and the example in Megatron-LM's
``initialize_model_parallel`` docstring for the grid; the library's planner and ``costmodel``
(ZeRO §5.1, Korthikanti et al. 2022 eq. 1 written out here) and a published configuration for
the memory filter; exact brute force with ``fractions.Fraction`` and ``costmodel``'s bubble for
the microbatch count; the single-process run (``models.train``) cut as chapter 04 cuts it for the
2-D grid step (a batch of 7 rows over 2 replicas: 4 and 3); ``costmodel`` on seeded random
configurations and the comm meter on the library's 3D step for the bytes, the measurement exercise's
numbers compared exactly with the same step metered here.

One launch of 4 ranks, shared by a module fixture, runs the two exercises that need ranks (each a case
of its own, ``_support.run_cases``, so an unfinished one fails only its own tests). Checks of bad input
first make a valid call, so a stub fails them too.

Tolerances (derived in tests/_support.py). Grids, ranks, counts and verdicts are exact; memory and
bubble formulas against the planner's and costmodel's are a few float64 operations (rel 1e-12 >> k·u;
abs 1e-6 of a byte where a part is 0). The 2 x 2 grid trains in float64 against the single process
(``reference_run``): the same GPT's sums in other groupings, the longest N = 128 terms (a weight
gradient over B·T = 128 tokens; 4h = 128 inputs of c_proj), GRID_DEPTH = 6 per layer + 2 chained:
``model_bound`` of the gradients' size, the weights after GRID_STEPS SGD steps (lr 0.1)
``sgd_bound`` of it, a loss (the replicas' losses weighted by their rows) ``model_bound`` of itself;
all below 1e-9 of the values, where a replica
whose gradient is not averaged, or a TP slice of the wrong heads, moves them by O(lr·|g|). The DP
replicas are compared bitwise (one all-reduce's result on both). The 3D step's data-parallel bytes are
the float32 model's: the meter also counts a one-byte flag per tensor (2·(dp-1)/dp·#tensors <= 52
bytes), below 1e-3 of the ~1e5 bytes the forecast predicts; 1 % bounds that.
"""
import functools
import itertools
import math
import random
import sys
from fractions import Fraction

import cloudpickle
import pytest
import torch

from minitorch_dist import costmodel
from minitorch_dist.analysis import planner
from minitorch_dist.analysis.planner_presets import GPUS, PUBLISHED, get_model
from minitorch_dist.course.exercises import load, resolve_impl
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.mesh import RankGrid

from _support import close, dense_run, float64, model_bound, run_cases, sgd_bound

pytestmark = pytest.mark.ch12

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this file.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

TIMEOUT_S = 90  # a rank stuck in a collective its peers never call fails after this long


def _shapes(n):
    """Every (dp, tp, pp) with dp * tp * pp = n."""
    return [(d, t, n // (d * t)) for d in range(1, n + 1) for t in range(1, n + 1) if n % (d * t) == 0]


SHAPES = [s for n in range(1, 13) for s in _shapes(n)] + _shapes(16) + _shapes(24)
SHAPES_OF_8 = _shapes(8)


def _mesh(dp, tp, pp):
    """torch's DeviceMesh layout of our grid: ranks row-major in shape (pp, dp, tp), slowest first."""
    return torch.arange(dp * tp * pp).reshape(pp, dp, tp)


# --- 1. the rank grid --------------------------------------------------------------------------------

def test_rank_to_coords_matches_the_rank_grid_for_every_shape(ex):
    assert len(SHAPES_OF_8) == 10  # 1x1x8, 1x2x4, ..., 8x1x1
    for dp, tp, pp in SHAPES:
        grid, mesh = RankGrid(dp * tp * pp, dp, tp, pp), _mesh(dp, tp, pp)
        for rank in range(dp * tp * pp):
            got = ex.rank_to_coords(rank, dp, tp, pp)
            assert tuple(got) == tuple(grid.coords(rank)), f"rank {rank} of dp={dp} tp={tp} pp={pp}"
            d, t, p = got
            assert mesh[p, d, t].item() == rank, \
                f"rank {rank}: ({d}, {t}, {p}) is not where DeviceMesh puts it"


def test_rank_to_coords_worked_example(ex):
    # 5 = tp 1 + 2 * (dp 0 + 2 * pp 1)
    assert tuple(ex.rank_to_coords(5, 2, 2, 2)) == (0, 1, 1)
    # 16 GPUs, t = 2, p = 4 (d = 2): rank 13 = 1 + 2 * (0 + 2 * 3)
    assert tuple(ex.rank_to_coords(13, 2, 2, 4)) == (0, 1, 3)
    # the axis sizes matter, not only the product: rank 5 of 1 x 2 x 4 and of 4 x 2 x 1
    assert tuple(ex.rank_to_coords(5, 1, 2, 4)) == (0, 1, 2)
    assert tuple(ex.rank_to_coords(5, 4, 2, 1)) == (2, 1, 0)


def test_rank_to_coords_rejects_bad_input(ex):
    ex.rank_to_coords(0, 2, 2, 2)  # a valid call first
    with pytest.raises(ValueError, match="outside the grid"):
        ex.rank_to_coords(8, 2, 2, 2)
    with pytest.raises(ValueError, match="outside the grid"):
        ex.rank_to_coords(-1, 2, 2, 2)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        ex.rank_to_coords(0, 2, 0, 2)


def test_coords_to_rank_inverts_rank_to_coords(ex):
    for dp, tp, pp in SHAPES:
        n, grid = dp * tp * pp, RankGrid(dp * tp * pp, dp, tp, pp)
        seen = []
        for d, t, p in itertools.product(range(dp), range(tp), range(pp)):
            rank = ex.coords_to_rank((d, t, p), dp, tp, pp)
            assert rank == grid.rank_of(d, t, p) == _mesh(dp, tp, pp)[p, d, t].item(), (dp, tp, pp, d, t, p)
            assert tuple(grid.coords(rank)) == (d, t, p)
            seen.append(rank)
        assert sorted(seen) == list(range(n)), f"dp={dp} tp={tp} pp={pp}: not a bijection onto 0..{n - 1}"


def test_coords_to_rank_rejects_bad_input(ex):
    ex.coords_to_rank((1, 1, 1), 2, 2, 2)  # a valid call first
    with pytest.raises(ValueError, match="tp coordinate 2 is outside"):
        ex.coords_to_rank((0, 2, 0), 2, 2, 2)
    with pytest.raises(ValueError, match="coords must be"):
        ex.coords_to_rank((0, 1), 2, 2, 2)
    with pytest.raises(ValueError, match="pp must be a positive int"):
        ex.coords_to_rank((0, 0, 0), 2, 2, 0)


@pytest.mark.parametrize("axis", ["dp", "tp", "pp"])
def test_group_ranks_match_the_rank_grid_and_the_device_mesh(ex, axis):
    dim = {"pp": 0, "dp": 1, "tp": 2}[axis]
    for dp, tp, pp in SHAPES:  # every shape of 8 ranks among them
        size = {"dp": dp, "tp": tp, "pp": pp}[axis]
        got = ex.group_ranks(axis, dp, tp, pp)
        assert got == RankGrid(dp * tp * pp, dp, tp, pp).groups(axis), \
            f"{axis} groups of dp={dp} tp={tp} pp={pp}"
        # DeviceMesh: a group along a mesh dimension is the ranks at fixed indices of the others
        mesh_groups = sorted(_mesh(dp, tp, pp).movedim(dim, -1).reshape(-1, size).tolist())
        assert got == mesh_groups, f"{axis} groups of dp={dp} tp={tp} pp={pp} differ from torch's mesh layout"


def test_group_ranks_partition_the_ranks_by_one_coordinate(ex):
    for dp, tp, pp in SHAPES_OF_8 + _shapes(12):
        n, grid = dp * tp * pp, RankGrid(dp * tp * pp, dp, tp, pp)
        for axis, size in (("dp", dp), ("tp", tp), ("pp", pp)):
            groups = ex.group_ranks(axis, dp, tp, pp)
            assert len(groups) == n // size and all(len(g) == size for g in groups)
            assert sorted(r for g in groups for r in g) == list(range(n)), \
                "the groups must partition the ranks"
            for g in groups:
                coords = [grid.coords(r)._asdict() for r in g]
                assert [c[axis] for c in coords] == list(range(size)), "members listed by their coordinate"
                for other in {"dp", "tp", "pp"} - {axis}:
                    assert len({c[other] for c in coords}) == 1, \
                        f"an {axis} group must share its {other} rank"
        # Megatron's point: TP groups are consecutive ranks, so they fit in a node
        assert ex.group_ranks("tp", dp, tp, pp) == [list(range(k, k + tp)) for k in range(0, n, tp)]


def test_group_ranks_megatron_example(ex):
    # megatron/core/parallel_state.py, initialize_model_parallel's docstring: 16 GPUs, tensor 2, pipeline 4
    assert ex.group_ranks("tp", 2, 2, 4) == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                             [14, 15]]
    assert ex.group_ranks("dp", 2, 2, 4) == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                                             [13, 15]]
    assert ex.group_ranks("pp", 2, 2, 4) == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_group_ranks_rejects_bad_input(ex):
    ex.group_ranks("tp", 2, 2, 2)  # a valid call first
    with pytest.raises(ValueError, match="unknown axis 'ep'"):
        ex.group_ranks("ep", 2, 2, 2)
    with pytest.raises(ValueError, match="dp must be a positive int"):
        ex.group_ranks("dp", 0, 2, 2)


# --- 2. fits_in_memory -------------------------------------------------------------------------------

def _fits(ex, model, memory, c, **kw):
    """ex.fits_in_memory for a ModelSpec and a planner Config (grad_bytes: the exercise's default, 4)."""
    return ex.fits_in_memory(model.as_cfg(), memory, dp=c.dp, tp=c.tp, pp=c.pp, micro_batch=c.micro_batch,
                             microbatches=c.microbatches, zero=c.zero, recompute=c.recompute,
                             sequence_parallel=c.sequence_parallel, **kw)


@pytest.mark.parametrize("name, gpu, n_gpus", [("gpt3-175b", "a100", 1024), ("gpt3-13b", "a100", 64),
                                                ("llama-7b", "h100", 32), ("tiny-3d", "cpu", 8)])
def test_fits_in_memory_matches_the_planner(ex, name, gpu, n_gpus):
    # memory only: any profile gives the rates (the cpu preset's own is this machine's, calibrated)
    model, cluster = get_model(name), planner.Cluster(gpu, n_gpus, profile="h100" if gpu == "cpu" else None)
    configs = planner.candidates(model, cluster, sequence_parallel=(False, True))
    rng = random.Random(0)
    verdicts = set()
    # the search leaves out ZeRO-2 under a pipeline (the same row as ZeRO-1): add a few explicitly
    extra = [planner.Config(c.tp, c.pp, c.dp, c.micro_batch, c.microbatches, 2, c.recompute,
                            c.sequence_parallel) for c in configs if c.zero == 1 and c.pp > 1][:20]
    for i, c in enumerate(rng.sample(configs, min(150, len(configs))) + extra):
        main_grad = i % 3 != 2  # Megatron's fp32 main_grad (4 bytes), and 16-bit gradients (2) for a third
        plan = planner.evaluate(c, model, cluster, planner.Assumptions(main_grad=main_grad))
        fits, parts = _fits(ex, model, cluster.gpu.memory_bytes, c, grad_bytes=4 if main_grad else 2)
        for key in ("weights", "gradients", "optimizer", "buffers", "activations", "total", "capacity"):
            assert math.isclose(parts[key], plan.memory[key], rel_tol=1e-12, abs_tol=1e-6), \
                f"{name} {c}: {key} {parts[key]:.6g} B, the planner says {plan.memory[key]:.6g} B"
        assert fits == plan.fits, f"{name} {c}"
        verdicts.add(fits)
    if name in ("gpt3-175b", "gpt3-13b"):
        assert verdicts == {True, False}, "sanity: the sample has configurations on both sides of the filter"


def test_fits_in_memory_model_states_follow_zero(ex):
    model = get_model("gpt3-13b")
    cfg = model.as_cfg()
    for tp, pp, dp in ((1, 1, 8), (2, 4, 8), (8, 5, 4), (4, 2, 64), (8, 1, 16)):
        psi = costmodel.pipeline_stage_params(cfg, tp, pp)[0]
        for g in (2, 4):  # 16-bit gradients (the ZeRO paper: 16 B/param), Megatron's fp32 main_grad (18)
            states = []
            for zero in (0, 1, 2, 3):
                _, parts = ex.fits_in_memory(cfg, 80e9, dp=dp, tp=tp, pp=pp, micro_batch=1, microbatches=8,
                                             zero=zero, grad_bytes=g)
                state = parts["weights"] + parts["gradients"] + parts["optimizer"]
                # ZeRO §5.1 with 16-bit weights, g-byte gradients and K = 12; under a pipeline ZeRO-2
                # holds the whole gradient until its one reduction: ZeRO-1's states
                as_stage = 1 if zero == 2 and pp > 1 else zero
                assert math.isclose(state, costmodel.zero_memory_bytes(psi, dp, as_stage, grad_bytes=g),
                                    rel_tol=1e-12), (tp, pp, dp, zero, g)
                assert parts["buffers"] == 0 or zero == 3
                states.append(state)
            assert math.isclose(states[0], (14 + g) * psi, rel_tol=1e-12)
            assert math.isclose(states[3], (14 + g) * psi / dp, rel_tol=1e-12)
            if pp == 1:
                assert states[0] > states[1] > states[2] > states[3], "each ZeRO stage shards one more part"
            else:
                assert states[0] > states[1] == states[2] > states[3], "ZeRO-2 in a pipeline: ZeRO-1's states"
    # TP x PP sharding: t*p GPUs of the first stage hold at least 1/(t*p) of the model (embeddings and
    # LayerNorms are replicated), and more GPUs means fewer bytes each
    full = costmodel.transformer_params(cfg)
    _, one = ex.fits_in_memory(cfg, 80e9, dp=1, tp=1, pp=1, micro_batch=1, microbatches=1)
    _, split = ex.fits_in_memory(cfg, 80e9, dp=1, tp=8, pp=4, micro_batch=1, microbatches=1)
    assert math.isclose(one["weights"], 2 * full, rel_tol=1e-12)
    assert 2 * full / 32 < split["weights"] < 2 * full / 16


def test_fits_in_memory_activations_follow_korthikanti(ex):
    model = get_model("gpt3-175b")
    cfg = model.as_cfg()
    s, h, a, L = model.seq, model.hidden, model.heads, model.layers
    for b, tp, pp, m, sp, r in itertools.product((1, 2), (1, 8), (1, 4, 8), (1, 3, 16), (False, True),
                                                 costmodel.RECOMPUTE):
        if sp and tp == 1:
            continue
        _, parts = ex.fits_in_memory(cfg, 80e9, dp=1, tp=tp, pp=pp, micro_batch=b, microbatches=m,
                                     recompute=r, sequence_parallel=sp)
        want = costmodel.pipeline_activation_bytes(s, b, h, a, L, tp, pp, m, sp, r)
        assert math.isclose(parts["activations"], want, rel_tol=1e-12), (b, tp, pp, m, sp, r)
    # Korthikanti et al. 2022, eq. 1 (no parallelism, no recomputation), written out: s b h (34 + 5 a s / h)
    _, parts = ex.fits_in_memory(cfg, 80e9, dp=1, tp=1, pp=1, micro_batch=1, microbatches=4)
    assert math.isclose(parts["activations"], L * s * h * (34 + 5 * a * s / h), rel_tol=1e-12)
    # §4.2: with m >= p the first stage's activations do not depend on p (p stashes of L/p layers)
    by_pp = [ex.fits_in_memory(cfg, 80e9, dp=1, tp=8, pp=pp, micro_batch=1, microbatches=32,
                               recompute="selective")[1]["activations"] for pp in (1, 2, 4, 8, 16, 32)]
    assert all(math.isclose(x, by_pp[0], rel_tol=1e-12) for x in by_pp)
    # recomputation trades memory for compute: none > selective > full
    act = {r: ex.fits_in_memory(cfg, 80e9, dp=1, tp=8, pp=8, micro_batch=1, microbatches=64,
                                recompute=r)[1]["activations"] for r in costmodel.RECOMPUTE}
    assert act["none"] > act["selective"] > act["full"]


def test_fits_in_memory_compares_the_total_with_usable_memory(ex):
    cfg = get_model("gpt3-13b").as_cfg()
    kw = dict(dp=8, tp=4, pp=2, micro_batch=2, microbatches=16, zero=1, recompute="selective")
    _, parts = ex.fits_in_memory(cfg, 80e9, **kw)
    assert math.isclose(parts["total"], sum(parts[k] for k in ("weights", "gradients", "optimizer", "buffers",
                                                               "activations")), rel_tol=1e-12)
    assert math.isclose(parts["capacity"], 0.9 * 80e9, rel_tol=1e-12)
    total = parts["total"]
    assert ex.fits_in_memory(cfg, total, usable=1.0, **kw)[0] is True, "exactly full still fits"
    assert ex.fits_in_memory(cfg, total * (1 - 1e-9), usable=1.0, **kw)[0] is False
    assert ex.fits_in_memory(cfg, total / 0.5 * (1 + 1e-9), usable=0.5, **kw)[0] is True
    assert ex.fits_in_memory(cfg, total / 0.5 * (1 - 1e-9), usable=0.5, **kw)[0] is False


def test_fits_in_memory_published_gpt3_175b(ex):
    # Megatron-LM trained GPT-3 175B on 1024 A100s with this configuration: it must fit
    pub, model = PUBLISHED["gpt3-175b"], get_model("gpt3-175b")
    dp = pub.gpus // (pub.tp * pub.pp)
    c = planner.Config(pub.tp, pub.pp, dp, pub.micro_batch, model.global_batch // (dp * pub.micro_batch),
                       pub.zero, pub.recompute)
    memory = GPUS[pub.gpu].memory_bytes
    fits, parts = _fits(ex, model, memory, c)
    assert fits, f"{c} needs {parts['total'] / 1e9:.1f} GB of {memory / 1e9:.0f}"
    # ...and 175B parameters at 18 bytes each (3.1 TB) do not fit on one GPU, whatever the recompute
    for r in costmodel.RECOMPUTE:
        fits, parts = ex.fits_in_memory(model.as_cfg(), memory, dp=1, tp=1, pp=1, micro_batch=1,
                                        microbatches=1, recompute=r)
        assert not fits and parts["total"] > 18 * 174e9


def test_fits_in_memory_rejects_bad_input(ex):
    cfg = get_model("tiny-3d").as_cfg()  # 4 layers, 4 heads, vocab 64, seq 16
    ok = dict(dp=2, tp=2, pp=2, micro_batch=1, microbatches=4)
    ex.fits_in_memory(cfg, 1e9, **ok)  # a valid call first
    with pytest.raises(ValueError, match="n_layer 4 is not divisible by pp=3"):
        ex.fits_in_memory(cfg, 1e9, **{**ok, "pp": 3})
    with pytest.raises(ValueError, match="divisible by tp=3"):
        ex.fits_in_memory(cfg, 1e9, **{**ok, "tp": 3})
    with pytest.raises(ValueError, match="zero must be"):
        ex.fits_in_memory(cfg, 1e9, **ok, zero=4)
    with pytest.raises(ValueError, match="recompute must be one of"):
        ex.fits_in_memory(cfg, 1e9, **ok, recompute="some")
    with pytest.raises(ValueError, match="memory_bytes must be > 0"):
        ex.fits_in_memory(cfg, 0, **ok)
    with pytest.raises(ValueError, match="microbatches must be a positive int"):
        ex.fits_in_memory(cfg, 1e9, **{**ok, "microbatches": 0})
    with pytest.raises(ValueError, match="grad_bytes must be 2"):
        ex.fits_in_memory(cfg, 1e9, **ok, grad_bytes=3)


# --- 3. microbatches_for_bubble ------------------------------------------------------------------------

def _brute_force(p, target, global_batch, dp, b, v):
    """The smallest m by enumeration with exact arithmetic, or None."""
    units = global_batch // (dp * b)
    for m in range(1, units + 1):
        if units % m == 0 and (v == 1 or m % p == 0) and Fraction(p - 1, v * m) <= Fraction(target):
            return m
    return None


def test_microbatches_for_bubble_is_the_smallest_valid_count(ex):
    rng = random.Random(0)
    found = missing = 0
    for _ in range(400):
        p, v = rng.choice([1, 2, 3, 4, 8, 16]), rng.choice([1, 1, 2, 4])
        dp, b = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4])
        global_batch = dp * b * rng.choice([1, 6, 12, 16, 30, 48, 64, 96, 192])
        target = rng.choice([0.0, 0.01, 0.05, 0.1, 0.125, 0.25, 0.5, 1.0, 3.0])
        want = _brute_force(p, target, global_batch, dp, b, v)
        if want is None:
            with pytest.raises(ValueError):
                ex.microbatches_for_bubble(p, target, global_batch, dp, b, v)
            missing += 1
            continue
        m = ex.microbatches_for_bubble(p, target, global_batch, dp, b, v)
        assert m == want, f"p={p} target={target} B={global_batch} dp={dp} b={b} v={v}: got {m}, want {want}"
        # the same bubble in costmodel's words (Narayanan §2.2); as a share of the step it is smaller
        schedule = "interleaved" if v > 1 else "1f1b"
        ratio = costmodel.pipeline_bubble_ratio(schedule, p, m, v)
        assert ratio <= target * (1 + 1e-12)
        assert math.isclose(costmodel.pipeline_bubble_fraction(schedule, p, m, v), ratio / (1 + ratio),
                            rel_tol=1e-12, abs_tol=1e-15)
        found += 1
    assert found > 100 and missing > 20, \
        f"sanity: both outcomes are exercised ({found} found, {missing} missing)"


def test_microbatches_for_bubble_exact_boundaries(ex):
    assert ex.microbatches_for_bubble(4, 0.1, 30, 1) == 30, "3/30 <= 0.1 must hold exactly"
    assert ex.microbatches_for_bubble(5, 0.25, 64, 1) == 16, "4/16 = 0.25 meets a target of 0.25"
    assert ex.microbatches_for_bubble(1, 0.0, 64, 4) == 1, "no pipeline, no bubble: one microbatch will do"
    # m must divide the per-replica batch: 48/(1*2) = 24 units; bubble 7/m <= 0.5 needs m >= 14: 24
    assert ex.microbatches_for_bubble(8, 0.5, 48, 1, micro_batch_size=2) == 24
    # interleaving divides the bubble by v, but needs m to be a multiple of p
    # 3/(2m) <= 1/4 needs m >= 6; 6 is no multiple of 4
    assert ex.microbatches_for_bubble(4, 0.25, 64, 1, v=2) == 8


def test_microbatches_for_bubble_gpt3_175b(ex):
    # the published 175B configuration: batch 1536 on dp = 1024 / (8 * 16) = 8 replicas, p = 16
    pub, model = PUBLISHED["gpt3-175b"], get_model("gpt3-175b")
    dp, B = pub.gpus // (pub.tp * pub.pp), model.global_batch
    m = ex.microbatches_for_bubble(pub.pp, 0.1, B, dp)
    assert m == _brute_force(pub.pp, 0.1, B, dp, 1, 1)
    assert costmodel.pipeline_bubble_ratio("1f1b", pub.pp, m) <= 0.1
    smaller = [k for k in range(1, m) if (B // dp) % k == 0]
    assert all(costmodel.pipeline_bubble_ratio("1f1b", pub.pp, k) > 0.1 for k in smaller)


def test_microbatches_for_bubble_rejects_bad_input(ex):
    ex.microbatches_for_bubble(4, 0.5, 64, 2)  # a valid call first
    with pytest.raises(ValueError, match="raise the global batch"):
        ex.microbatches_for_bubble(8, 0.01, 64, 1)  # needs m >= 700
    with pytest.raises(ValueError, match="multiple of p=4"):
        ex.microbatches_for_bubble(4, 0.25, 6, 1, v=2)
    with pytest.raises(ValueError, match="not divisible by dp=3"):
        ex.microbatches_for_bubble(4, 0.5, 64, 3)
    with pytest.raises(ValueError, match="micro_batch_size=3"):
        ex.microbatches_for_bubble(4, 0.5, 64, 2, micro_batch_size=3)
    with pytest.raises(ValueError, match="target must be"):
        ex.microbatches_for_bubble(4, -0.1, 64, 2)
    with pytest.raises(ValueError, match="p must be a positive int"):
        ex.microbatches_for_bubble(0, 0.5, 64, 2)


# --- 4 and 5: on ranks -----------------------------------------------------------------------------------

GRID_CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)  # chapter 12's 3D model
GRID_STEPS, GRID_BATCH, GRID_SEQ = 2, 8, 16
UNEVEN_BATCH = 7  # exercise 4's global batch: 4 rows on replica 0, 3 on replica 1
#: the library's 3D steps whose bytes the meter counts: (dp, tp, pp, zero, microbatches) on 4 ranks
TRAFFIC_RUNS = ((2, 1, 2, 2, 2), (2, 2, 1, 1, 2))


def _grid_step(ex):
    """The student's 2 x 2 grid, then the single-process run cut to this rank's slices (chapter 04's
    layout, over a TP group the test makes itself), in float64."""
    with float64():
        return _grid_step_64(ex)


def _grid_step_64(ex):
    import torch.distributed as dist

    from minitorch_dist.parallelism.mesh import init_groups
    from minitorch_dist.parallelism.tensor_parallel import shard_dense_tensors
    from minitorch_dist.parallelism.three_d import reference_run

    losses, params = ex.train_on_2d_grid_uneven(GRID_CFG, 2, 2, GRID_STEPS, UNEVEN_BATCH, GRID_SEQ, lr=0.1)
    groups = init_groups(RankGrid(dist.get_world_size(), 2, 2, 1))
    ref_losses, ref = reference_run(GRID_CFG, GRID_STEPS, UNEVEN_BATCH, GRID_SEQ, lr=0.1)
    want = shard_dense_tensors(ref, GRID_CFG, groups.tp_group)
    return {"coords": tuple(groups.coords), "losses": [float(v) for v in losses], "ref_losses": ref_losses,
            "params": {k: v.detach().cpu() for k, v in params.items()}, "want": want}


def _traffic():
    """The library's 3D step, one step per configuration: what this rank sent, by axis (the meter)."""
    from minitorch_dist.parallelism.three_d import train_3d

    out = []
    for dp, tp, pp, zero, m in TRAFFIC_RUNS:
        res = train_3d(GRID_CFG, dp, tp, pp, 1, GRID_BATCH, GRID_SEQ, m, zero_stage=zero)
        out.append({"coords": tuple(res.coords),
                    "dp": sum(e.wire_bytes for e in res.events["dp"]),
                    "pp": sum(e.nbytes for e in res.events["pipeline"] if e.op == "send"),
                    "dp_ops": sorted({e.op for e in res.events["dp"] if e.dtype != "torch.uint8"})})
    return out


def _measured(ex):
    """Exercise 6 on this rank, for every configuration of TRAFFIC_RUNS."""
    return [ex.measure_rank_traffic(GRID_CFG, dp, tp, pp, GRID_BATCH, GRID_SEQ, m, zero=zero)
            for dp, tp, pp, zero, m in TRAFFIC_RUNS]


def _on_ranks(impl):
    ex = load("ch12", impl)  # each rank imports the chapter by its path
    return run_cases({"grid": lambda: _grid_step(ex), "traffic": _traffic, "measured": lambda: _measured(ex)})


@pytest.fixture(scope="module")
def ranks(launches):
    """The per-rank results of _on_ranks on 4 ranks, launched once for the module."""
    return launches(_on_ranks, resolve_impl(), timeout_s=TIMEOUT_S)


def _part(ranks, part):
    """Each rank's value of case ``part`` (a case that raised fails only its own tests)."""
    return ranks.case(4, part)


GRID_N = max(UNEVEN_BATCH * GRID_SEQ, 4 * GRID_CFG.n_embd)  # a weight gradient's tokens; c_proj's inputs
GRID_DEPTH = 6 * GRID_CFG.n_layer + 2  # chained reductions: 6 per block, the final LayerNorm, the head


@functools.cache
def _grid_bounds():
    """(weights, loss scale -> bound): the single process's gradients (float64, the run reference_run
    makes) give the gradients' bound; GRID_STEPS SGD steps carry it to the weights."""
    with float64():
        ref = dense_run(lambda: GPT(GRID_CFG), GRID_STEPS + 1, UNEVEN_BATCH, GRID_SEQ, seed=0, lr=0.1)
    scale = max(1.0, max(g.abs().max().item() for g in ref["grads"].values()))
    grad_err = model_bound(n=GRID_N, depth=GRID_DEPTH, scale=scale)
    return sgd_bound(steps=GRID_STEPS, lr=0.1, grad_err=grad_err)


def test_train_on_2d_grid_uneven_equals_one_process(ranks):
    grid = _part(ranks, "grid")
    bound = _grid_bounds()
    for r, g in enumerate(grid):
        assert set(g["params"]) == set(g["want"]), f"rank {r}: parameter names differ from the dense GPT's"
        for k, want in g["want"].items():
            got = g["params"][k]
            assert got.shape == want.shape, f"rank {r} {k}: shape {tuple(got.shape)}, this rank's slice is " \
                                            f"{tuple(want.shape)}"
            close(got, want, bound, f"rank {r} {k}")
    # the global loss of each step is the replicas' losses weighted by their rows (4 and 3 of 7)
    by_dp = {g["coords"][0]: g["losses"] for g in grid if g["coords"][1] == 0}
    assert sorted(by_dp) == [0, 1]
    mean = [(4 * a + 3 * b) / UNEVEN_BATCH for a, b in zip(by_dp[0], by_dp[1])]
    assert len(mean) == GRID_STEPS
    for got, want in zip(mean, grid[0]["ref_losses"]):
        bound = model_bound(n=GRID_N, depth=GRID_DEPTH, scale=max(1.0, abs(want)))
        assert abs(got - want) <= bound, f"the replicas' mean loss {got} is not the single process's {want}"


def test_train_on_2d_grid_uneven_keeps_replicas_identical(ranks):
    grid = {g["coords"]: g for g in _part(ranks, "grid")}
    for tp_rank in (0, 1):  # the two DP replicas of one TP slice: bitwise the same after the steps
        a, b = grid[(0, tp_rank, 0)]["params"], grid[(1, tp_rank, 0)]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), f"tp rank {tp_rank}: the DP replicas drifted apart"
    # replicated inside a TP group (LayerNorms, wpe): the same on both TP ranks
    same = [k for k in grid[(0, 0, 0)]["params"] if ".ln_" in k or k.startswith(("wpe", "ln_f"))]
    assert same and all(torch.equal(grid[(0, 0, 0)]["params"][k], grid[(0, 1, 0)]["params"][k]) for k in same)


def test_train_on_2d_grid_uneven_rejects_bad_input(ex, ranks):
    _part(ranks, "grid")  # a valid call first (on the ranks)
    with pytest.raises(RuntimeError, match="runs on every rank"):
        ex.train_on_2d_grid_uneven(GRID_CFG, 2, 2, 1, UNEVEN_BATCH, GRID_SEQ)  # no process group here
    with pytest.raises(ValueError, match="dp must be a positive int"):
        ex.train_on_2d_grid_uneven(GRID_CFG, 0, 2, 1, UNEVEN_BATCH, GRID_SEQ)


def test_predict_rank_traffic_matches_the_meter(ex, ranks):
    measured = _part(ranks, "traffic")
    for i, (dp, tp, pp, zero, m) in enumerate(TRAFFIC_RUNS):
        for r, runs in enumerate(measured):
            got = runs[i]
            stage = got["coords"][2]
            pred = ex.predict_rank_traffic(GRID_CFG, dp, tp, pp, GRID_BATCH, GRID_SEQ, m, zero=zero,
                                           stage=stage)
            where = f"rank {r} ({dp}x{tp}x{pp}, ZeRO-{zero}, stage {stage})"
            assert pred["pp"] == got["pp"], \
                f"{where}: predicted {pred['pp']} pipeline bytes, the meter counted {got['pp']}"
            assert pred["dp"] == pytest.approx(got["dp"], rel=0.01), \
                f"{where}: predicted {pred['dp']:.0f} data-parallel bytes, the meter counted {got['dp']:.0f}"
            assert got["dp_ops"] == (["all_gather", "reduce_scatter"] if zero else ["all_reduce"])


@pytest.mark.parametrize("seed", range(6))
def test_predict_rank_traffic_equals_the_costmodel_on_seeded_configurations(ex, seed):
    rng = random.Random(900 + seed)
    cfg = GPTConfig(vocab_size=rng.choice([64, 128, 256]), block_size=rng.choice([16, 32]),
                    n_layer=rng.choice([2, 4, 8]), n_head=4, n_embd=rng.choice([32, 64]))
    dp, tp, pp = rng.choice([1, 2, 4]), rng.choice([1, 2, 4]), rng.choice([1, 2])
    m, zero = rng.choice([1, 2, 4]), rng.choice([0, 1, 2])
    batch, seq = dp * m * rng.choice([1, 2, 3]), rng.choice([8, 16])
    for stage in range(pp):
        got = ex.predict_rank_traffic(cfg, dp, tp, pp, batch, seq, m, zero=zero, stage=stage)
        psi = costmodel.pipeline_stage_params(cfg, tp, pp)[stage]
        z = costmodel.zero_stage_under_pipeline(zero, pp)
        want = costmodel.zero_dp_bytes_per_step(psi, dp, z, m, bytes_per_element=4)
        assert got["dp"] == pytest.approx(want, rel=1e-12, abs=1e-9)
        msg = batch // (dp * m) * seq * cfg.n_embd * 4
        assert got["pp"] == m * msg * ((stage < pp - 1) + (stage > 0))


def test_predict_rank_traffic_by_hand(ex):
    """The same numbers worked by hand for the tiny GPT (h = 32, 4 layers, vocabulary 64, 16 positions)."""
    h, V, T = 32, 64, 16
    layer = 12 * h * h + 13 * h  # c_attn, c_proj, c_fc, c_proj with biases, two LayerNorms
    first, last = 2 * layer + V * h + T * h, 2 * layer + 2 * h + V * h  # embeddings / ln_f + tied head
    for zero in (0, 1, 2):  # two replicas: a ring moves (n-1)/n = 1/2 of the buffer per pass, two passes
        got = [ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 2, zero=zero, stage=s)["dp"] for s in (0, 1)]
        assert got == pytest.approx([4 * first, 4 * last]), zero
    # ZeRO-2 reducing every microbatch would send (m + 1) / 2 times as much: not what the 3D step does
    assert ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 4, zero=2)["dp"] == pytest.approx(4 * first)
    msg = 2 * 16 * h * 4  # b = 8 / (2 * 2) sequences of 16 tokens, fp32
    assert ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 2, stage=0)["pp"] == 2 * msg
    assert ex.predict_rank_traffic(GRID_CFG, 1, 1, 4, 8, 16, 2, stage=1)["pp"] == 2 * 2 * (2 * msg)
    assert ex.predict_rank_traffic(GRID_CFG, 1, 2, 1, 8, 16, 2)["dp"] == 0


def test_predict_rank_traffic_rejects_bad_input(ex):
    ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 2)  # a valid call first
    with pytest.raises(ValueError, match="stage 2 is outside"):
        ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 2, stage=2)
    with pytest.raises(ValueError, match="no ZeRO-3"):
        ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 2, zero=3)
    with pytest.raises(ValueError, match="not divisible by dp \\* microbatches"):
        ex.predict_rank_traffic(GRID_CFG, 2, 1, 2, 8, 16, 3)


def test_measure_rank_traffic_measures_the_step(ranks):
    measured, want = _part(ranks, "measured"), _part(ranks, "traffic")
    for i, (dp, tp, pp, zero, _) in enumerate(TRAFFIC_RUNS):
        for r in range(4):
            got, ref = measured[r][i], want[r][i]
            where = f"rank {r} ({dp}x{tp}x{pp}, ZeRO-{zero})"
            assert got["stage"] == ref["coords"][2], \
                f"{where}: stage {got['stage']}, the rank is at {ref['coords']}"
            assert got["measured"]["pp"] == ref["pp"], \
                f"{where}: measured {got['measured']['pp']} pipeline bytes sent, the meter saw {ref['pp']}"
            assert got["measured"]["dp"] == ref["dp"], (
                f"{where}: measured {got['measured']['dp']} data-parallel wire bytes, the meter counted "
                f"{ref['dp']}")


def test_measure_rank_traffic_predicts_what_it_measures(ranks):
    for i, (dp, tp, pp, zero, m) in enumerate(TRAFFIC_RUNS):
        for r, runs in enumerate(_part(ranks, "measured")):
            got = runs[i]
            psi = costmodel.pipeline_stage_params(GRID_CFG, tp, pp)[got["stage"]]
            z = costmodel.zero_stage_under_pipeline(zero, pp)
            want = costmodel.zero_dp_bytes_per_step(psi, dp, z, m, bytes_per_element=4)
            assert got["predicted"]["dp"] == pytest.approx(want, rel=1e-12), \
                f"rank {r}: the prediction for its stage"
            assert got["predicted"]["pp"] == got["measured"]["pp"]
            assert got["predicted"]["dp"] == pytest.approx(got["measured"]["dp"], rel=0.01)


def test_measure_rank_traffic_rejects_bad_input(ex, ranks):
    _part(ranks, "measured")  # a valid call first (on the ranks)
    with pytest.raises(RuntimeError, match="runs on every rank"):
        ex.measure_rank_traffic(GRID_CFG, 2, 1, 2, GRID_BATCH, GRID_SEQ, 2)
