"""Chapter 00: collectives built from send/recv equal torch.distributed's, and send the bytes the
alpha-beta model says.

One launch per world size runs every case (algorithm x dtype x shape) and returns the results,
the torch.distributed results and the meter's counts; the tests below only inspect them.
Expected values are computed here, independently of the module: the inputs are regenerated from
their seeds and summed in float64, chunks come from torch.tensor_split, byte counts from the rule
written out below, not from `collectives.chunk_sizes` or `costmodel`.
"""
import functools
import math
import time

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.analysis import costmodel
from minitorch_dist.runtime import collectives as C
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch00

WORLD_SIZES = [2, 3, 4]
SHAPES = [(1,), (7,), (1000,), (1001,), (4, 6)]  # numel 1000 and 24 divide by 2 and 4; 24 by 3
DTYPES = [torch.float32, torch.float64, torch.bfloat16]
ALL_REDUCES = {"ring": C.ring_all_reduce, "recursive_doubling": C.recursive_doubling_all_reduce,
               "tree": C.tree_all_reduce, "naive": C.naive_all_reduce}
CASES = [(d, s) for d in DTYPES for s in SHAPES]


def _inputs(n, dtype, shape):
    """Rank k's input for one case, the same in every process (seeded by rank and case)."""
    case = CASES.index((dtype, shape))
    gen = [torch.Generator().manual_seed(100 * k + case) for k in range(n)]
    return [torch.randn(shape, dtype=torch.float64, generator=gen[k]).to(dtype)
            for k in range(n)]


def _run_every_case():
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype, shape in CASES:
        x = _inputs(n, dtype, shape)[r]
        want = x.clone()
        dist.all_reduce(want)
        res = {"torch": want}
        for name, fn in ALL_REDUCES.items():
            t = x.clone()
            got, nbytes, nmsg = C.metered(fn, t)
            res[name] = (got, nbytes, nmsg, got is t)
        x_before = x.clone()
        rs, rs_bytes, _ = C.metered(C.ring_reduce_scatter, x)
        res["reduce_scatter"] = (rs, rs_bytes, torch.equal(x, x_before))
        mine = torch.tensor_split(x.flatten(), n)[r].clone()
        ag, ag_bytes, _ = C.metered(C.ring_all_gather, mine, out=torch.empty(shape, dtype=dtype))
        res["all_gather"] = (ag, ag_bytes)
        if x.numel() % n == 0:  # torch's tensor forms need equal chunks
            rs_t = torch.empty(x.numel() // n, dtype=dtype)
            dist.reduce_scatter_tensor(rs_t, x.flatten())
            ag_t = torch.empty(x.numel(), dtype=dtype)
            dist.all_gather_into_tensor(ag_t, mine)
            res["torch_rs"], res["torch_ag"] = rs_t, ag_t
            res["all_gather_no_out"] = C.ring_all_gather(mine)  # equal chunks: a 1-D result
        out[(dtype, shape)] = res

    # A subgroup of ranks 1..n-1 (group ranks differ from global ranks) and bad input.
    extra = {}
    group = dist.new_group(list(range(1, n)))
    if r >= 1:
        x = torch.arange(7, dtype=torch.float64) * r
        want = x.clone()
        dist.all_reduce(want, group=group)
        extra["group"] = {name: fn(x.clone(), group=group) for name, fn in ALL_REDUCES.items()}
        extra["group"]["torch"] = want
        extra["group"]["reduce_scatter"] = C.ring_reduce_scatter(x, group=group)
        extra["group"]["all_gather"] = C.ring_all_gather(torch.full((2,), float(r)), group=group)
    errors = {}
    try:
        C.ring_all_reduce(torch.zeros(4, 6).t())
    except ValueError as e:
        errors["non_contiguous"] = str(e)
    try:
        C.ring_all_gather(torch.zeros(5), out=torch.empty(4 * n))
    except ValueError as e:
        errors["bad_chunk"] = str(e)
    extra["errors"] = errors
    return out, extra


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=30)  # a deadlock fails fast


def _reference(n, dtype, shape):
    """Exact-enough sum (float64) and the rounding tolerance: summing n terms in any order in
    `dtype` is within (n-1)*u*sum|x_k| of the exact sum (Higham), u = eps/2; we allow n*eps*sum|x_k|,
    which also covers the float64 reference's own rounding, and is far below a missing term."""
    xs = [x.double() for x in _inputs(n, dtype, shape)]
    exact = sum(xs)
    tol = n * torch.finfo(dtype).eps * sum(x.abs() for x in xs)
    return exact, tol


def _chunks(numel, n):
    return [len(c) for c in torch.tensor_split(torch.arange(numel), n)]


# --- results equal torch.distributed --------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algo", list(ALL_REDUCES))
def test_all_reduce_equals_torch_distributed(n, algo):
    per_rank = [res for res, _ in _results(n)]
    for dtype, shape in CASES:
        exact, tol = _reference(n, dtype, shape)
        where = f"{algo}, n={n}, {dtype}, shape {shape}"
        for r, res in enumerate(per_rank):
            got, _, _, in_place = res[(dtype, shape)][algo]
            want = res[(dtype, shape)]["torch"]
            assert in_place, f"{where}: not in place"
            assert got.dtype == dtype and got.shape == shape, where
            assert ((got.double() - exact).abs() <= tol).all(), f"{where}, rank {r}: off the exact sum"
            assert ((got.double() - want.double()).abs() <= 2 * tol).all(), f"{where}, rank {r}: off torch's"
            if n == 2:  # one addition, and a + b == b + a: bitwise what torch computes
                assert torch.equal(got, want), where
            # every rank holds the very same bits (the sum is formed once, or symmetrically)
            assert torch.equal(got, per_rank[0][(dtype, shape)][algo][0]), f"{where}: ranks disagree"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_reduce_scatter_and_all_gather_equal_torch(n):
    per_rank = [res for res, _ in _results(n)]
    for dtype, shape in CASES:
        exact, tol = _reference(n, dtype, shape)
        numel = math.prod(shape)
        for r, res in enumerate(per_rank):
            where = f"n={n}, {dtype}, shape {shape}, rank {r}"
            rs, _, untouched = res[(dtype, shape)]["reduce_scatter"]
            assert untouched, f"{where}: reduce-scatter modified its input"
            mine_exact = torch.tensor_split(exact.flatten(), n)[r]
            assert rs.shape == mine_exact.shape and rs.dtype == dtype, where
            assert ((rs.double() - mine_exact).abs() <= torch.tensor_split(tol.flatten(), n)[r]).all(), where
            ag, _ = res[(dtype, shape)]["all_gather"]
            gathered = torch.cat([torch.tensor_split(x.flatten(), n)[k]
                                  for k, x in enumerate(_inputs(n, dtype, shape))]).view(shape)
            assert torch.equal(ag, gathered), f"{where}: all-gather is not the concatenation"
            if numel % n == 0:
                rs_torch = res[(dtype, shape)]["torch_rs"]
                assert ((rs.double() - rs_torch.double()).abs()
                        <= 2 * torch.tensor_split(tol.flatten(), n)[r]).all(), where
                if n == 2:
                    assert torch.equal(rs, rs_torch), where
                assert torch.equal(ag.flatten(), res[(dtype, shape)]["torch_ag"]), where
                assert torch.equal(res[(dtype, shape)]["all_gather_no_out"], gathered.flatten()), where


# --- the bytes: 2(n-1)/n * S ----------------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_sends_2_n_minus_1_over_n_of_S(n):
    per_rank = [res for res, _ in _results(n)]
    for dtype, shape in CASES:
        numel = math.prod(shape)
        item = torch.finfo(dtype).bits // 8
        S = numel * item
        c = _chunks(numel, n)
        formula = 2 * (n - 1) / n * S
        assert costmodel.bus_bytes("all_reduce", S, n) == pytest.approx(formula)
        total = 0
        for r, res in enumerate(per_rank):
            where = f"n={n}, {dtype}, shape {shape}, rank {r}"
            sent = res[(dtype, shape)]["ring"][1]
            # reduce-scatter sends every chunk but r, all-gather every chunk but r+1
            assert sent == (2 * numel - c[r] - c[(r + 1) % n]) * item, where
            if numel % n == 0:
                assert sent == formula, where
            else:
                assert abs(sent - formula) <= 2 * (n - 1) / n * item, where
            assert res[(dtype, shape)]["reduce_scatter"][1] == (numel - c[r]) * item, where
            assert res[(dtype, shape)]["all_gather"][1] == (numel - c[(r + 1) % n]) * item, where
            total += sent
        assert total == 2 * (n - 1) * S  # over all ranks the formula is exact for any numel


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_latency_optimal_algorithms_send_about_log2_n_messages(n):
    per_rank = [res for res, _ in _results(n)]
    p = 2 ** int(math.log2(n))  # largest power of two <= n
    for dtype, shape in CASES:
        S = math.prod(shape) * (torch.finfo(dtype).bits // 8)
        rd = [res[(dtype, shape)]["recursive_doubling"] for res in per_rank]
        tree = [res[(dtype, shape)]["tree"] for res in per_rank]
        for r in range(n):
            expected = 1 if r >= p else int(math.log2(p)) + (1 if r < n - p else 0)
            assert rd[r][2] == expected and rd[r][1] == expected * S, (n, r, rd[r][1:3])
            assert rd[r][2] <= math.ceil(math.log2(n))
            if n == p:
                assert rd[r][2] == math.log2(n)
        assert tree[0][2] == math.ceil(math.log2(n))  # the root feeds the broadcast tree
        assert sum(t[2] for t in tree) == 2 * (n - 1)  # each non-root: one up, one down
        assert all(t[1] == t[2] * S for t in tree)


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_naive_all_reduce_concentrates_traffic_at_rank_0(n):
    per_rank = [res for res, _ in _results(n)]
    for dtype, shape in CASES:
        S = math.prod(shape) * (torch.finfo(dtype).bits // 8)
        sent = [res[(dtype, shape)]["naive"][1] for res in per_rank]
        assert sent == [(n - 1) * S] + [S] * (n - 1)


# --- groups, errors, one process, the tour --------------------------------------------------------


def test_subgroup_ranks_are_translated_to_global_ranks():
    n = 4
    for r, (_, extra) in enumerate(_results(n)):
        if r == 0:
            assert "group" not in extra
            continue
        want = torch.arange(7, dtype=torch.float64) * sum(range(1, n))
        assert torch.equal(extra["group"]["torch"], want)
        for name in ALL_REDUCES:
            assert torch.equal(extra["group"][name], want), name
        assert torch.equal(extra["group"]["reduce_scatter"], torch.tensor_split(want, n - 1)[r - 1])
        assert torch.equal(extra["group"]["all_gather"], torch.arange(1, n).repeat_interleave(2).float())


def test_bad_input_is_refused_with_the_fix_named():
    errors = _results(2)[0][1]["errors"]
    assert "contiguous" in errors["non_contiguous"]
    assert "5 elements" in errors["bad_chunk"] and "tensor_split" in errors["bad_chunk"]


def test_chunk_sizes_follow_tensor_split():
    for numel in (0, 1, 7, 10, 1001):
        for n in (1, 2, 3, 4, 5):
            assert C.chunk_sizes(numel, n) == _chunks(numel, n)


def test_one_process_without_a_process_group_is_the_identity():
    assert not dist.is_initialized()
    x = torch.randn(5)
    for fn in ALL_REDUCES.values():
        t = x.clone()
        assert fn(t) is t and torch.equal(t, x)
    assert torch.equal(C.ring_reduce_scatter(x), x)
    assert torch.equal(C.ring_all_gather(x), x)


def _sleepy(t):
    """A 'collective' whose duration is known: 20 ms, once warm (the warm-up call takes 200 ms)."""
    _sleepy.calls = getattr(_sleepy, "calls", 0) + 1
    time.sleep(0.2 if _sleepy.calls == 1 else 0.02)


def test_time_collective_times_the_call_best_of_repeats_after_a_warm_up():
    times = launch(C.time_collective, 2, _sleepy, [64, 4096], 3, timeout_s=60)
    for per_rank in times:
        assert len(per_rank) == 2
        for t in per_rank:
            assert 0.02 <= t < 0.1  # the call, not the warm-up and not the barrier
