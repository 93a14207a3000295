"""Chapter 00: collectives built from send/recv equal torch.distributed's, and send the bytes the
alpha-beta model says.

One launch per world size runs every case (algorithm x dtype x shape) and returns the results,
the torch.distributed results and the meter's counts; the tests below only inspect them.
Expected values are computed here, independently of the module: the inputs are regenerated from
their seeds and summed in float64, chunks come from torch.tensor_split, byte counts from the rule
written out below, not from `collectives.chunk_sizes` or `costmodel`. Each (dtype, shape) is its
own case of the launch (``run_cases``): one that raises fails only its own tests' checks of it.

Tolerances (tests/_support.py). A sum of n terms added in any order in ``dtype`` is within
γ_{n-1}·Σ|x_k| of the exact sum (Higham §4.2), elementwise; the float64 reference, itself a sum of n
terms, within γ_n(float64)·Σ|x_k|: so a collective's sum is within (γ_n(dtype) + γ_n(float64))·Σ|x_k|
of the reference, and two collectives' sums (ours, torch's) within ``reorder_bound(n, Σ|x_k|)`` =
2γ_n·Σ|x_k| of each other. A missing or doubled term moves a sum by |x_k|, far more. With n = 2 there is
one addition, and a + b == b + a: bitwise torch's. The busbw factor against the formula: two float64
products (rel 1e-12 >> 2u).
"""
import functools
import math
import time

import pytest
import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.runtime import collectives as C
from minitorch_dist.runtime.launch import launch

from _support import case, gamma, refusal, run_cases

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


def _one_case(dtype, shape):
    """Every algorithm on this rank's input of one (dtype, shape), and torch.distributed's."""
    r, n = dist.get_rank(), dist.get_world_size()
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
    return res


def _subgroup():
    """A subgroup of ranks 1..n-1 (group ranks differ from global ranks); None on rank 0."""
    r, n = dist.get_rank(), dist.get_world_size()
    group = dist.new_group(list(range(1, n)))
    if r == 0:
        return None
    x = torch.arange(7, dtype=torch.float64) * r
    want = x.clone()
    dist.all_reduce(want, group=group)
    out = {name: fn(x.clone(), group=group) for name, fn in ALL_REDUCES.items()}
    out["torch"] = want
    out["reduce_scatter"] = C.ring_reduce_scatter(x, group=group)
    out["all_gather"] = C.ring_all_gather(torch.full((2,), float(r)), group=group)
    return out


def _errors():
    n = dist.get_world_size()
    return {"non_contiguous": refusal(lambda: C.ring_all_reduce(torch.zeros(4, 6).t())),
            "bad_chunk": refusal(lambda: C.ring_all_gather(torch.zeros(5), out=torch.empty(4 * n)))}


def _run_every_case():
    cases = {(dtype, shape): functools.partial(_one_case, dtype, shape) for dtype, shape in CASES}
    return run_cases({**cases, "group": _subgroup, "errors": _errors})


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=30)  # a deadlock fails fast


def _case(n, key):
    """Each rank's value of case ``key`` on n ranks (a case that raised fails only the checks of it)."""
    return [case(res, key, r) for r, res in enumerate(_results(n))]


def _reference(n, dtype, shape):
    """The float64 sum of the ranks' inputs, and elementwise Σ|x_k| (module docstring)."""
    xs = [x.double() for x in _inputs(n, dtype, shape)]
    return sum(xs), sum(x.abs() for x in xs)


def _off_exact(n, dtype, scale):
    """A sum in ``dtype`` against the float64 reference: (γ_n(dtype) + γ_n(float64))·Σ|x_k|."""
    return (gamma(n, dtype) + gamma(n, torch.float64)) * scale


def _chunks(numel, n):
    return [len(c) for c in torch.tensor_split(torch.arange(numel), n)]


# --- results equal torch.distributed --------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("algo", list(ALL_REDUCES))
def test_all_reduce_equals_torch_distributed(n, algo):
    for dtype, shape in CASES:
        per_rank = _case(n, (dtype, shape))
        exact, scale = _reference(n, dtype, shape)
        where = f"{algo}, n={n}, {dtype}, shape {shape}"
        for r, res in enumerate(per_rank):
            got, _, _, in_place = res[algo]
            want = res["torch"]
            assert in_place, f"{where}: not in place"
            assert got.dtype == dtype and got.shape == shape, where
            assert ((got.double() - exact).abs() <= _off_exact(n, dtype, scale)).all(), \
                f"{where}, rank {r}: off the exact sum"
            assert ((got.double() - want.double()).abs() <= 2 * gamma(n, dtype) * scale).all(), \
                f"{where}, rank {r}: off torch's"  # reorder_bound(n, Σ|x_k|), entry by entry
            if n == 2:  # one addition, and a + b == b + a: bitwise what torch computes
                assert torch.equal(got, want), where
            # every rank holds the very same bits (the sum is formed once, or symmetrically)
            assert torch.equal(got, per_rank[0][algo][0]), f"{where}: ranks disagree"


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_reduce_scatter_and_all_gather_equal_torch(n):
    for dtype, shape in CASES:
        exact, scale = _reference(n, dtype, shape)
        numel = math.prod(shape)
        for r, res in enumerate(_case(n, (dtype, shape))):
            where = f"n={n}, {dtype}, shape {shape}, rank {r}"
            rs, _, untouched = res["reduce_scatter"]
            assert untouched, f"{where}: reduce-scatter modified its input"
            mine_exact = torch.tensor_split(exact.flatten(), n)[r]
            mine_scale = torch.tensor_split(scale.flatten(), n)[r]
            assert rs.shape == mine_exact.shape and rs.dtype == dtype, where
            assert ((rs.double() - mine_exact).abs() <= _off_exact(n, dtype, mine_scale)).all(), where
            ag, _ = res["all_gather"]
            gathered = torch.cat([torch.tensor_split(x.flatten(), n)[k]
                                  for k, x in enumerate(_inputs(n, dtype, shape))]).view(shape)
            assert torch.equal(ag, gathered), f"{where}: all-gather is not the concatenation"
            if numel % n == 0:
                rs_torch = res["torch_rs"]
                diff = (rs.double() - rs_torch.double()).abs()
                assert (diff <= 2 * gamma(n, dtype) * mine_scale).all(), where
                if n == 2:
                    assert torch.equal(rs, rs_torch), where
                assert torch.equal(ag.flatten(), res["torch_ag"]), where
                assert torch.equal(res["all_gather_no_out"], gathered.flatten()), where


# --- the bytes: 2(n-1)/n * S ----------------------------------------------------------------------


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_ring_sends_2_n_minus_1_over_n_of_S(n):
    for dtype, shape in CASES:
        numel = math.prod(shape)
        item = torch.finfo(dtype).bits // 8
        S = numel * item
        c = _chunks(numel, n)
        formula = 2 * (n - 1) / n * S
        assert costmodel.bus_bytes("all_reduce", S, n) == pytest.approx(formula, rel=1e-12)  # a few products
        total = 0
        for r, res in enumerate(_case(n, (dtype, shape))):
            where = f"n={n}, {dtype}, shape {shape}, rank {r}"
            sent = res["ring"][1]
            # reduce-scatter sends every chunk but r, all-gather every chunk but r+1
            assert sent == (2 * numel - c[r] - c[(r + 1) % n]) * item, where
            if numel % n == 0:
                assert sent == formula, where
            else:
                assert abs(sent - formula) <= 2 * (n - 1) / n * item, where
            assert res["reduce_scatter"][1] == (numel - c[r]) * item, where
            assert res["all_gather"][1] == (numel - c[(r + 1) % n]) * item, where
            total += sent
        assert total == 2 * (n - 1) * S  # over all ranks the formula is exact for any numel


@pytest.mark.parametrize("n", WORLD_SIZES)
def test_latency_optimal_algorithms_send_about_log2_n_messages(n):
    p = 2 ** int(math.log2(n))  # largest power of two <= n
    for dtype, shape in CASES:
        S = math.prod(shape) * (torch.finfo(dtype).bits // 8)
        per_rank = _case(n, (dtype, shape))
        rd = [res["recursive_doubling"] for res in per_rank]
        tree = [res["tree"] for res in per_rank]
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
    for dtype, shape in CASES:
        S = math.prod(shape) * (torch.finfo(dtype).bits // 8)
        sent = [res["naive"][1] for res in _case(n, (dtype, shape))]
        assert sent == [(n - 1) * S] + [S] * (n - 1)


# --- groups, errors, one process, the tour --------------------------------------------------------


def test_subgroup_ranks_are_translated_to_global_ranks():
    n = 4
    for r, group in enumerate(_case(n, "group")):
        if r == 0:
            assert group is None
            continue
        want = torch.arange(7, dtype=torch.float64) * sum(range(1, n))
        assert torch.equal(group["torch"], want)
        for name in ALL_REDUCES:
            assert torch.equal(group[name], want), name
        assert torch.equal(group["reduce_scatter"], torch.tensor_split(want, n - 1)[r - 1])
        assert torch.equal(group["all_gather"], torch.arange(1, n).repeat_interleave(2).float())


def test_bad_input_is_refused_with_the_fix_named():
    errors = _case(2, "errors")[0]
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
