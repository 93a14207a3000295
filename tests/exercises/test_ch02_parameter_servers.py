"""Chapter 02 exercises, autograded: the SSP admission rule and schedule, backup workers, key sharding,
a stale-synchronous parameter server on ranks, and the bytes of one clock.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: the rule written as "the fastest and slowest
are at most s apart", an event-by-event simulation of the workers, a sort of the arrivals written
out by hand, a linear scan over the ranges and over the hash ring; for the parameter server, one
process running synchronous SGD with autograd on the same batches, and the staleness rebuilt from the
server's own log of events; for the bytes, the closed forms and the comm meter on real ranks.

Adversarial inputs: key sizes where an even key count, a greedy fill to the average or a search
capped at the largest key is not optimal (checked against an exhaustive search); ranges with empty
ones at the start and in the middle (bisect_left, an inclusive stop); arrivals whose stragglers come
out of id order; uneven key ranges (30 and 71 keys) for the bytes of a run, so an even share is wrong;
the gradients each worker computed, recorded by the problem itself, so the server's parameters can be
checked against x = -Σ lr/(W·max(1, τ))·g whatever order the pushes came in.

Ranks are launched three times in all, once per fixture (4 ranks each). Checks of bad input first make a
valid call, so a stub fails them too.

Tolerances (see tests/_support.py). Schedules, staleness, keys, bytes and counts are exact; a closed
form of bytes is a few float64 products (rel 1e-12 >> 10 u). The backup workers' mean of k float64
gradients is one sum of k terms and a division: two orders differ by ``reorder_bound(k, Σ|g|/k)``.
The parameter server's parameters against -Σ lr/(W·max(1, τ))·g over the m = W·clocks gradients pushed:
the server adds m float32 terms (each a product rounded once, its scalar rounded to float32 once, BSP's
pre-sum of W gradients once more), so per element within ``gamma(m + 2, float32)·Σ|step|`` of the
float64 sum.

The parameter server runs in float32: the chapter's messages are float32 (``send_gradient`` sends
``.float()`` into float32 buffers), so BSP is compared with synchronous SGD in float32 by a bound
derived for this least-squares problem (:func:`_bsp_bound`), not ``model_bound`` (which only float64
affords). Each clock both runs compute x <- x - lr·g(x), g = A_Bᵀ(A_B x - b_B)/|B| over the clock's
128 rows, in other orders: per element the residual is within γ_{n+1}·(|A_B||x| + |b_B|), n = 101,
and the gradient within γ_{|B|+3}·|A_B|ᵀ|r|/|B| plus |A_B|ᵀ|δr|/|B|; the update rounds by γ_3·(|x| +
lr|g|). A rounding error e of x is carried to the next clock by I - lr·H (H = A_BᵀA_B/|B|), whose
2-norm ρ = max|1 - lr·λ(H)| the test computes (below 1 here), so ‖e‖₂ grows by at most ρ·‖e‖₂ + the
clock's new errors; the two runs are within twice that of the exact iterates, and ‖·‖∞ <= ‖·‖₂. The
losses (float64, from the pulled float32 x) then differ by at most ‖∇f‖₂·‖e‖₂ + λ_max(AᵀA/N)·‖e‖₂²/2
plus the float64 rounding of two evaluations. The bound is about 3e-3 on x (entries ~0.1) and grows
with the gradient on the losses; a pull answered before the clock's updates are in (BSP broken) moves
x by lr·|g|, and a step with lr·W or lr/W moves it by as much as x itself.
"""
import functools
import hashlib
import heapq
import itertools
import math
import random
import time

import pytest
import torch
import torch.distributed as dist

from minitorch_dist import comm, launch
from minitorch_dist.parallelism.parameter_server import LeastSquares

from _support import close, gamma, refusal, reorder_bound

pytestmark = pytest.mark.ch02


# --- 1. SSP -------------------------------------------------------------------------------------------


def test_ssp_can_read_brute_force(ex):
    for clocks in itertools.product(range(4), repeat=3):
        for s in (0, 1, 2, math.inf):
            for w, c in enumerate(clocks):
                # proceeding would put w at clock c while the slowest is at min: allowed iff c - min <= s
                expected = all(c - other <= s for other in clocks)
                got = ex.ssp_can_read(c, clocks, s)
                assert bool(got) == expected, \
                    f"worker {w} at clock {c}, clocks {clocks}, s={s}: expected {expected}"


def test_ssp_can_read_bsp_and_asp(ex):
    assert ex.ssp_can_read(3, [3, 3, 3], 0), "BSP: everyone at the same clock proceeds"
    assert not ex.ssp_can_read(4, [4, 3, 4], 0), "BSP: one worker behind blocks the others"
    assert ex.ssp_can_read(1000, [0, 1000], math.inf), "ASP never waits"
    assert not ex.ssp_can_read(5, [2, 5], 2) and ex.ssp_can_read(5, [3, 5], 2)


def test_ssp_can_read_rejects_bad_input(ex):
    ex.ssp_can_read(0, [0], 0)  # a valid call first
    with pytest.raises(ValueError, match="staleness"):
        ex.ssp_can_read(0, [0], -1)
    with pytest.raises(ValueError, match="empty"):
        ex.ssp_can_read(0, [], 0)
    with pytest.raises(ValueError, match="clocks"):
        ex.ssp_can_read(0, [1.5], 0)


def _simulate(durations, s):
    """Event-driven SSP: a heap of finish events; after each instant, start every worker allowed.
    Returns start times and every observed staleness."""
    n, iters = len(durations), len(durations[0])
    clock = [0] * n  # finished iterations
    running = [False] * n
    start = [[None] * iters for _ in range(n)]
    seen, events, t = [], [], 0.0
    while True:
        progress = True
        while progress:  # start whoever may, at time t (a start with zero duration may unblock others)
            progress = False
            for w in range(n):
                c = clock[w]
                if not running[w] and c < iters and all(c - clock[v] <= s for v in range(n)):
                    start[w][c] = t
                    seen.append(c - min(clock))
                    running[w] = True
                    heapq.heappush(events, (t + durations[w][c], w))
                    progress = True
            # zero-length iterations end at once
            while events and events[0][0] <= t:
                _, w = heapq.heappop(events)
                clock[w] += 1
                running[w] = False
                progress = True
        if not events:
            return start, seen
        t = events[0][0]
        while events and events[0][0] == t:  # every iteration ending at this instant
            _, w = heapq.heappop(events)
            clock[w] += 1
            running[w] = False


def _durations(seed, n=4, iters=8, straggler=True):
    rng = random.Random(seed)
    d = [[float(rng.randint(1, 5)) for _ in range(iters)] for _ in range(n)]
    if straggler:
        d[0] = [3 * t for t in d[0]]
    return d


@pytest.mark.parametrize("s", [0, 1, 2, 3, math.inf])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ssp_schedule_matches_event_simulation(ex, s, seed):
    d = _durations(seed)
    start, worst = ex.ssp_schedule(d, s)
    ref, seen = _simulate(d, s)
    assert [[float(x) for x in row] for row in start] == ref, \
        f"s={s}: start times differ from the event simulation"
    assert worst == max(seen), f"s={s}: max observed staleness {worst}, the simulation saw {max(seen)}"
    assert worst <= s, f"SSP with s={s} let a worker run {worst} clocks ahead"


def test_ssp_schedule_bsp_is_lockstep(ex):
    d = _durations(5)
    start, worst = ex.ssp_schedule(d, 0)
    assert worst == 0
    finish_of = [max(start[w][c] + d[w][c] for w in range(len(d))) for c in range(len(d[0]))]
    for c in range(len(d[0])):
        assert len({start[w][c] for w in range(len(d))}) == 1, \
            f"BSP: iteration {c} starts at one time for all"
        if c:
            assert start[0][c] == finish_of[c - 1], "BSP: iteration c starts when the slowest finishes c - 1"


def test_ssp_schedule_asp_never_waits_and_staleness_grows(ex):
    d = _durations(7, iters=10)
    start, worst = ex.ssp_schedule(d, math.inf)
    for w, row in enumerate(d):
        assert start[w] == [sum(row[:c]) for c in range(len(row))], "ASP: each worker runs back to back"
    assert worst > 3, "with a 3x straggler, ASP should let others run far ahead"


def test_ssp_schedule_larger_s_finishes_no_later(ex):
    d = _durations(3, iters=12)
    ends = []
    for s in (0, 1, 2, 4, math.inf):
        start, _ = ex.ssp_schedule(d, s)
        ends.append(max(start[w][-1] + d[w][-1] for w in range(len(d))))
    assert all(a >= b for a, b in zip(ends, ends[1:])), f"makespan by s = 0, 1, 2, 4, inf: {ends}"


def test_ssp_schedule_rejects_bad_input(ex):
    ex.ssp_schedule([[1.0], [2.0]], 0)  # a valid call first
    with pytest.raises(ValueError, match="same number"):
        ex.ssp_schedule([[1.0], [1.0, 2.0]], 1)
    with pytest.raises(ValueError, match=">= 0"):
        ex.ssp_schedule([[1.0, -1.0]], 1)
    with pytest.raises(ValueError, match="staleness"):
        ex.ssp_schedule([[1.0]], 0.5)


# --- 2. backup workers ------------------------------------------------------------------------------


def _grads(times, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 2, generator=g, dtype=torch.float64), t) for t in times]


def _mean_bound(grads):
    """The mean of k float64 tensors in two orders: a sum of k terms (the division rounds once more)."""
    return reorder_bound(len(grads) + 1, torch.stack(grads).abs().sum(0) / len(grads), torch.float64)


@pytest.mark.parametrize("times, k",
                         [([3.0, 1.0, 2.0, 5.0], 2), ([1.0, 1.0, 1.0, 0.5], 2), ([2.0, 2.0, 2.0], 1),
                          ([4.0, math.inf, 1.0, 3.0, 2.0], 3), ([0.1, 0.2], 2), ([1.0, 5.0, 3.0, 2.0], 2)])
def test_backup_workers_aggregate_first_k(ex, times, k):
    items = _grads(times)
    mean, dropped = ex.backup_workers_aggregate(items, k)
    # the k earliest, written out: repeatedly take the smallest time, smallest id first
    left, used = list(range(len(times))), []
    for _ in range(k):
        w = min(left, key=lambda i: (times[i], i))
        used.append(w)
        left.remove(w)
    expected = sum(items[w][0] for w in used) / k
    close(mean, expected, _mean_bound([items[w][0] for w in used]), f"the mean of workers {used}")
    assert list(dropped) == sorted(left), f"dropped {list(dropped)}, expected {sorted(left)}"


def test_backup_workers_aggregate_k_equals_n_is_bsp(ex):
    items = _grads([5.0, 1.0, 3.0, 2.0], seed=1)
    mean, dropped = ex.backup_workers_aggregate(items, 4)
    grads = [g for g, _ in items]
    close(mean, torch.stack(grads).mean(0), _mean_bound(grads), "the mean of all 4 workers")
    assert list(dropped) == []


def test_backup_workers_aggregate_ties_go_to_smaller_id(ex):
    items = _grads([1.0, 1.0, 1.0, 1.0], seed=2)
    mean, dropped = ex.backup_workers_aggregate(items, 2)
    close(mean, (items[0][0] + items[1][0]) / 2, _mean_bound([items[0][0], items[1][0]]), "workers 0 and 1")
    assert list(dropped) == [2, 3]


def test_backup_workers_aggregate_rejects_bad_input(ex):
    ex.backup_workers_aggregate(_grads([1.0, 2.0]), 1)  # a valid call first
    with pytest.raises(ValueError, match="k must be"):
        ex.backup_workers_aggregate(_grads([1.0, 2.0]), 3)
    with pytest.raises(ValueError, match="k must be"):
        ex.backup_workers_aggregate(_grads([1.0, 2.0]), 0)
    with pytest.raises(ValueError, match="one shape"):
        ex.backup_workers_aggregate([(torch.zeros(2), 1.0), (torch.zeros(3), 2.0)], 1)
    with pytest.raises(RuntimeError, match="only 1 of 3"):
        ex.backup_workers_aggregate(_grads([1.0, math.inf, math.inf]), 2)


# --- 3. key ranges and consistent hashing --------------------------------------------------------------


def _optimal_max_load(sizes, s):
    """The smallest possible largest load of s contiguous ranges, by trying every set of cuts."""
    K, best = len(sizes), None
    for cuts in itertools.combinations_with_replacement(range(K + 1), s - 1):
        edges = (0, *cuts, K)
        load = max(sum(sizes[a:b]) for a, b in zip(edges, edges[1:]))
        best = load if best is None else min(best, load)
    return best


def _check_key_ranges(rs, sizes, s):
    K = len(sizes)
    assert len(rs) == s, f"{len(rs)} ranges for {s} servers: return one per server, empty ones too"
    assert all(isinstance(r, range) and r.step == 1 for r in rs), f"Python ranges of step 1, got {rs}"
    assert rs[0].start == 0 and rs[-1].stop == K, f"from key 0 to key {K}: {rs}"
    assert all(a.stop == b.start for a, b in zip(rs, rs[1:])), f"not contiguous: {rs}"
    assert [k for r in rs for k in r] == list(range(K)), "every key exactly once, in order"
    return max(sum(sizes[k] for k in r) for r in rs)


BALANCE_HAND = [  # (sizes, servers, the optimal largest load), worked by hand
    ([4, 4, 4, 4], 2, 8),
    ([1, 2, 3, 4, 5], 2, 9),         # [1 2 3 | 4 5]: 6 and 9; [1 2 3 4 | 5]: 10
    ([10, 1, 1, 1, 1, 1, 1], 2, 10),  # the big key alone, the rest together
    ([1, 1, 1, 1, 1, 1, 10], 3, 10),  # three servers: the small keys split, the big one alone
    ([5, 0, 0, 5], 2, 5),            # zero-byte keys go anywhere
    ([7], 3, 7),                     # more servers than keys: two empty ranges
    ([], 2, 0),
    ([3, 3, 3, 3, 3, 3, 3], 3, 9),   # 7 equal keys on 3 servers: 3 + 2 + 2 keys
    ([1, 100, 1, 1, 1, 1, 100], 3, 101),  # [1 100 | 1 1 1 1 | 100]
]


@pytest.mark.parametrize("sizes, s, best", BALANCE_HAND)
def test_balanced_key_ranges_hand_worked(ex, sizes, s, best):
    assert _optimal_max_load(sizes, s) == best, "the test's own premise"
    rs = ex.balanced_key_ranges(sizes, s)
    assert _check_key_ranges(rs, sizes, s) == best, \
        f"sizes {sizes} on {s} servers: ranges {rs}; the best split's largest load is {best}"


def test_balanced_key_ranges_optimal_on_random_sizes(ex):
    rng = random.Random(2014)
    for _ in range(150):
        K, s = rng.randrange(0, 9), rng.randrange(1, 5)
        sizes = [rng.choice([0, 1, rng.randrange(1, 20), rng.randrange(1, 1000)]) for _ in range(K)]
        rs = ex.balanced_key_ranges(sizes, s)
        assert _check_key_ranges(rs, sizes, s) == _optimal_max_load(sizes, s), \
            f"sizes {sizes}, {s} servers: {rs}"


@pytest.mark.parametrize("num_keys, s", [(10, 3), (12, 4), (7, 1), (3, 5), (1000, 7)])
def test_balanced_key_ranges_equal_sizes_as_tensor_split(ex, num_keys, s):
    rs = ex.balanced_key_ranges([8] * num_keys, s)
    even = max(len(c) for c in torch.tensor_split(torch.arange(num_keys), s)) * 8
    assert _check_key_ranges(rs, [8] * num_keys, s) == even


def test_balanced_key_ranges_large_and_fast(ex):
    rng = random.Random(5)
    sizes = [rng.choice([4, 4, 4, 4096, rng.randrange(1, 10**6)]) for _ in range(100_000)]
    t = time.perf_counter()
    rs = ex.balanced_key_ranges(sizes, 64)
    took = time.perf_counter() - t
    load = _check_key_ranges(rs, sizes, 64)
    # optimal: no 64 ranges can all hold less (a greedy fill of load - 1 needs a 65th range)
    ranges, cur = 1, 0
    for b in sizes:
        if cur + b > load - 1:
            ranges, cur = ranges + 1, 0
        cur += b
    assert ranges > 64, f"largest load {load}: a split with a smaller one exists"
    assert took < 5, f"{took:.1f} s for 100,000 keys: search the load, not the cuts"


def test_balanced_key_ranges_rejects_bad_input(ex):
    ex.balanced_key_ranges([4, 4], 2)  # a valid call first
    with pytest.raises(ValueError, match="n_servers"):
        ex.balanced_key_ranges([4, 4], 0)
    with pytest.raises(ValueError, match="key sizes"):
        ex.balanced_key_ranges([4, -1], 2)


@pytest.mark.parametrize("ranges", [[range(0, 4), range(4, 7), range(7, 10)],
                                    [range(0, 1), range(1, 2), range(2, 2), range(2, 2)],
                                    [range(0, 2), range(2, 2), range(2, 5), range(5, 6)],
                                    [range(0, 0), range(0, 3), range(3, 3), range(3, 4)],
                                    [range(0, 100)]])
def test_server_of_matches_a_scan(ex, ranges):
    for key in range(ranges[-1].stop):
        expected = next(i for i, r in enumerate(ranges) if key in r)
        assert ex.server_of(key, ranges) == expected, f"key {key} in {ranges}"


def test_server_of_with_balanced_key_ranges(ex):
    rs = [range(k * 77, (k + 1) * 77) for k in range(13)]  # 1001 keys in 13 ranges of 77
    for key in range(0, 1001, 7):
        assert key in rs[ex.server_of(key, rs)]


def test_server_of_rejects_keys_outside(ex):
    rs = [range(0, 5), range(5, 9)]
    ex.server_of(8, rs)  # a valid call first
    for bad in (9, -1, 100):
        with pytest.raises(ValueError, match="outside"):
            ex.server_of(bad, rs)


def _ring_point(label):
    return int.from_bytes(hashlib.md5(label.encode()).digest()[:8], "big")


def _owner_by_scan(key, servers, v):
    """The first server point at or after the key's point, scanning every point; else the smallest."""
    kp = _ring_point(str(key))
    points = [(_ring_point(f"{s}#{i}"), j) for j, s in enumerate(servers) for i in range(v)]
    after = [p for p in points if p[0] >= kp]
    return servers[min(after or points)[1]]


@pytest.mark.parametrize("servers, v",
                         [(["a", "b", "c"], 1), (["a", "b", "c", "d"], 16), ([0, 1], 4), (["solo"], 3)])
def test_consistent_hash_server_matches_a_scan(ex, servers, v):
    for key in range(300):
        assert ex.consistent_hash_server(key, servers, virtual_nodes=v) == _owner_by_scan(key, servers, v), \
            f"key {key}, servers {servers}, {v} virtual nodes"


def test_consistent_hash_server_moves_few_keys(ex):
    keys = range(2000)
    four = ["s0", "s1", "s2", "s3"]
    before = {k: ex.consistent_hash_server(k, four, 32) for k in keys}
    after = {k: ex.consistent_hash_server(k, four + ["s4"], 32) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == "s4" for k in moved), "adding a server may only move keys to it"
    assert 0.1 < len(moved) / len(keys) < 0.35, f"{len(moved)} of {len(keys)} keys moved; about 1/5 expected"
    removed = {k: ex.consistent_hash_server(k, ["s0", "s1", "s3"], 32) for k in keys}
    assert all(removed[k] == before[k] for k in keys if before[k] != "s2"), \
        "removing s2 may only move s2's keys"
    # key % n would move most keys
    assert sum(k % 4 != k % 5 for k in keys) / len(keys) > 0.7


def test_consistent_hash_server_rejects_bad_input(ex):
    ex.consistent_hash_server(1, ["a"])  # a valid call first
    with pytest.raises(ValueError, match="no servers"):
        ex.consistent_hash_server(1, [])
    with pytest.raises(ValueError, match="virtual_nodes"):
        ex.consistent_hash_server(1, ["a"], virtual_nodes=0)


# --- 4. a stale-synchronous parameter server on ranks ------------------------------------------------

PS_SERVERS, PS_WORKERS, PS_CLOCKS, PS_LR, PS_S = 2, 2, 15, 0.2, 2
PS_BOUNDS = [(0, 51), (51, 101)]        # the 101 keys of LeastSquares() over 2 servers
PS_STRAGGLER = {1: 0.025}               # worker 1 sleeps 25 ms per clock in the SSP run


class _RecordingProblem(LeastSquares):
    """The least-squares problem, keeping every gradient a worker computes (the test reads them back)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.grads = []

    def grad(self, x, rows):
        g = super().grad(x, rows)
        self.grads.append(g.detach().clone())
        return g


def _ps_on_ranks(fn):
    """On every rank: a call with a bad staleness, then BSP (s = 0), then SSP(PS_S) with a straggler."""
    problem = _RecordingProblem(n_workers=PS_WORKERS)
    out = {"bad": refusal(lambda: fn(problem, PS_BOUNDS, -1, PS_CLOCKS, PS_LR))}
    problem.grads = []
    out["bsp"] = fn(problem, PS_BOUNDS, 0, PS_CLOCKS, PS_LR)
    out["bsp_grads"], problem.grads = problem.grads, []
    dist.barrier()                      # one run's last messages before the next run's first
    out["ssp"] = fn(problem, PS_BOUNDS, PS_S, PS_CLOCKS, PS_LR, straggler=PS_STRAGGLER)
    out["ssp_grads"] = problem.grads
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def ps_runs(ex):
    return launch(_ps_on_ranks, PS_SERVERS + PS_WORKERS, ex.ssp_parameter_server, timeout_s=60)


def _clock_rows(p, c):
    return torch.cat([p.batch_rows(w, c) for w in range(PS_WORKERS)])


@functools.cache
def _synchronous_sgd_autograd():
    """One process: autograd on the concatenation of the workers' batches of each clock (float32, as
    the parameter server); the losses and the iterates of clocks 0..PS_CLOCKS."""
    p = LeastSquares(n_workers=PS_WORKERS)
    x, losses, iterates = torch.zeros(p.n_params, requires_grad=True), [], []
    for c in range(PS_CLOCKS):
        losses.append(p.loss(x.detach()))
        iterates.append(x.detach().clone())
        rows = _clock_rows(p, c)
        (g,) = torch.autograd.grad(0.5 * ((p.A[rows] @ x - p.b[rows]) ** 2).mean(), x)
        with torch.no_grad():
            x -= PS_LR * g
    iterates.append(x.detach().clone())
    return x.detach(), losses + [p.loss(x.detach())], iterates


@functools.cache
def _bsp_bound():
    """(bound on |x_ps - x_ref|, per-clock bounds on |loss_ps - loss_ref|): float32 synchronous SGD on the
    least-squares problem computed in two orders (the module docstring's derivation)."""
    p = LeastSquares(n_workers=PS_WORKERS)
    _, _, iterates = _synchronous_sgd_autograd()
    A, b = p.A.double(), p.b.double()
    full_curvature = torch.linalg.eigvalsh(A.T @ A / p.n_rows).max().item()
    err, loss_bounds = 0.0, []  # err: a bound on ||x_hat - x_exact||_2 of one run, clock by clock
    for c in range(PS_CLOCKS + 1):
        x = iterates[c].double()
        grad_full = A.T @ (A @ x - b) / p.n_rows
        f_scale = 0.5 * (((A.abs() @ x.abs() + b.abs()) ** 2).mean()).item()
        loss_bounds.append(grad_full.norm().item() * 2 * err + full_curvature * (2 * err) ** 2 / 2
                           + reorder_bound(p.n_params + p.n_rows + 2, f_scale, torch.float64))
        if c == PS_CLOCKS:
            break
        rows = _clock_rows(p, c)
        Ab, bb, m = A[rows], b[rows], len(rows)
        r = Ab @ x - bb
        dr = gamma(p.n_params + 1, torch.float32) * (Ab.abs() @ x.abs() + bb.abs())
        g = Ab.T @ r / m
        dg = (gamma(m + 3, torch.float32) * (Ab.abs().T @ r.abs()) + Ab.abs().T @ dr) / m
        dx = gamma(3, torch.float32) * (x.abs() + PS_LR * g.abs())
        lam = torch.linalg.eigvalsh(Ab.T @ Ab / m)
        rho = max(abs(1 - PS_LR * lam.min().item()), abs(1 - PS_LR * lam.max().item()))
        err = rho * err + (PS_LR * dg + dx).norm().item()  # carried, plus the new errors of clock c
    return 2 * err, loss_bounds


def _rebuild_staleness(events):
    """From a server's event log alone: each push's clock minus the slowest worker's clock (pushes
    seen here) when that worker's pull of the same clock was answered."""
    pushed, read_at, out = [0] * PS_WORKERS, {}, []
    for kind, w, c in events:
        if kind == "reply":
            read_at[(w, c)] = min(pushed)
        else:
            pushed[w] += 1
            out.append(c - read_at[(w, c)])
    return out


def test_ssp_parameter_server_bsp_is_synchronous_sgd(ps_runs):
    x_ref, losses_ref, _ = _synchronous_sgd_autograd()
    x_bound, loss_bounds = _bsp_bound()
    servers, workers = ps_runs[:PS_SERVERS], ps_runs[PS_SERVERS:]
    x = torch.cat([srv["bsp"]["params"] for srv in servers])
    close(x, x_ref, x_bound, "s = 0: the parameters differ from synchronous SGD on the same batches")
    for w, wk in enumerate(workers):
        assert len(wk["bsp"]["loss"]) == PS_CLOCKS + 1, f"worker {w}: one loss per pull, 0..{PS_CLOCKS}"
        for c, (got, want, bound) in enumerate(zip(wk["bsp"]["loss"], losses_ref, loss_bounds)):
            assert abs(got - want) <= bound, \
                f"worker {w}, clock {c}: loss {got}, synchronous SGD {want} (bound {bound:.2g}): under BSP " \
                f"every pull must see the synchronous iterate"
    for srv in servers:
        assert srv["bsp"]["staleness"] == [0] * (PS_WORKERS * PS_CLOCKS), "BSP: no push is ever stale"


def test_ssp_parameter_server_staleness_never_above_the_bound(ps_runs):
    seen = []
    for k, srv in enumerate(ps_runs[:PS_SERVERS]):
        run = srv["ssp"]
        assert len(run["staleness"]) == PS_WORKERS * PS_CLOCKS, f"server {k}: every push of every clock, once"
        assert run["staleness"] == _rebuild_staleness(run["events"]), \
            f"server {k}: the logged staleness disagrees with its own event log"
        seen += run["staleness"]
    assert min(seen) >= 0 and max(seen) <= PS_S, f"SSP({PS_S}) staleness histogram {sorted(seen)}"
    assert max(seen) == PS_S, \
        f"with a 25 ms straggler the fast worker should run {PS_S} clocks ahead: {sorted(seen)}"


def test_ssp_parameter_server_answers_pulls_by_the_rule(ps_runs):
    for run, s in ((srv[m], b) for srv in ps_runs[:PS_SERVERS] for m, b in (("bsp", 0), ("ssp", PS_S))):
        pushed, replies = [0] * PS_WORKERS, 0
        for kind, w, c in run["events"]:
            if kind == "push":
                pushed[w] += 1
            else:
                replies += 1
                assert c - min(pushed) <= s, f"s={s}: a pull of clock {c} answered with pushes {pushed}"
        assert replies == PS_WORKERS * (PS_CLOCKS + 1), f"s={s}: every pull answered once"


@pytest.mark.parametrize("run", ["bsp", "ssp"])
def test_ssp_parameter_server_steps_are_lr_over_w_tau_times_every_push(ps_runs, run):
    # whatever order the pushes come in, each server's x = 0 - sum over its pushes of lr / (W * max(1, tau))
    # times the pushed slice (BSP: tau = 0). tau comes from the server's log, checked against its own
    # events by the staleness test; the gradients are those the workers computed, recorded by the problem.
    # Both the server's float32 updates and this float64 sum add the same m = W * PS_CLOCKS terms, each
    # scaled once: within gamma_{m+2}(fp32) * sum |step| per element (m + 1 terms, one more product).
    grads = {w: [g.double() for g in wk[f"{run}_grads"]] for w, wk in enumerate(ps_runs[PS_SERVERS:])}
    assert all(len(g) == PS_CLOCKS for g in grads.values()), "one gradient per worker and clock"
    for k, srv in enumerate(ps_runs[:PS_SERVERS]):
        lo, hi = PS_BOUNDS[k]
        pushes = [(w, c) for kind, w, c in srv[run]["events"] if kind == "push"]
        taus = srv[run]["staleness"]
        assert len(taus) == len(pushes) == PS_WORKERS * PS_CLOCKS, f"server {k}: every push once"
        steps = torch.stack([PS_LR / (PS_WORKERS * max(1, tau)) * grads[w][c][lo:hi]
                             for (w, c), tau in zip(pushes, taus)])
        x = srv[run]["params"].double()
        bound = gamma(len(pushes) + 2, torch.float32) * steps.abs().sum(0)
        err = (x + steps.sum(0)).abs()
        assert bool((err <= bound).all()), \
            f"{run}, server {k}: the parameters are not 0 - sum(lr / (W * max(1, tau)) * g) over the " \
            f"pushes: off by up to {err.max():.3g} (allowed {bound.max():.3g})"
    if run == "ssp":
        assert max(t for srv in ps_runs[:PS_SERVERS] for t in srv[run]["staleness"]) >= 2, \
            "the premise: some push is 2 clocks stale, where 1/tau matters"


def test_ssp_parameter_server_converges(ps_runs):
    p = LeastSquares(n_workers=PS_WORKERS)
    x = torch.cat([srv["ssp"]["params"] for srv in ps_runs[:PS_SERVERS]])
    _, losses_ref, _ = _synchronous_sgd_autograd()
    gap, gap_ref = p.loss(x) - p.loss_opt, losses_ref[-1] - p.loss_opt
    assert losses_ref[0] - p.loss_opt > 50 * gap_ref, "it had far to go"
    # stale gradients cost a little progress, never most of it
    assert gap <= 2.5 * gap_ref, \
        f"SSP({PS_S}) ends {gap:.2e} above the optimum, synchronous SGD at {gap_ref:.2e}"


def test_ssp_parameter_server_rejects_bad_input(ps_runs):
    for r, out in enumerate(ps_runs):
        assert out["bsp"] is not None                       # the valid calls ran
        assert out["bad"] is not None and "staleness" in out["bad"], f"rank {r}: staleness -1 must be refused"


# --- 5. the bytes of one clock, predicted and counted ----------------------------------------------


def _closed_forms(p, n, s, b=4):
    psi = p * b
    return {"worker_push": psi, "worker_pull": psi, "server_in": n * psi / s, "server_out": n * psi / s,
            "busiest_link": psi * max(1, n / s), "ring_send": 2 * (n - 1) / n * psi}


@pytest.mark.parametrize("p, n, s, b", [(10**9, 8, 1, 4), (10**9, 8, 2, 4), (10**9, 8, 8, 4),
                                        (10**9, 8, 16, 4), (7 * 10**9, 32, 4, 2), (102, 3, 1, 4),
                                        (1000, 1, 1, 4)])
def test_predict_ps_traffic_closed_forms(ex, p, n, s, b):
    got = ex.predict_ps_traffic(p, n, s, bytes_per_element=b)
    for key, want in _closed_forms(p, n, s, b).items():
        assert got[key] == pytest.approx(want, rel=1e-12), f"{key} for {p} keys, {n} workers, {s} servers"


def test_predict_ps_traffic_matches_costmodel_on_random_sizes(ex):
    from minitorch_dist import costmodel

    rng = random.Random(2020)
    for _ in range(200):
        p, n, s = rng.randrange(0, 10**10), rng.randrange(1, 513), rng.randrange(1, 65)
        b = rng.choice([1, 2, 4])
        got = ex.predict_ps_traffic(p, n, s, bytes_per_element=b)
        ref = costmodel.ps_bytes_per_step(p, n, s, b)
        for mine, theirs in (("worker_push", "worker_send"), ("worker_pull", "worker_recv"),
                             ("server_in", "server_recv"), ("server_out", "server_send"),
                             ("busiest_link", "bottleneck"), ("ring_send", "allreduce_per_rank")):
            assert got[mine] == pytest.approx(ref[theirs], rel=1e-12), \
                f"{mine} for {p} keys, {n} workers, {s} servers"


# --- 6. predict_and_meter_ps_traffic ------------------------------------------------------------------

METER_BOUNDS, METER_CLOCKS = [(0, 30), (30, 101)], 4  # 30 and 71 keys: an even share (50.5) fits neither


def _meter_on_ranks(fn):
    problem = LeastSquares(n_workers=2)
    with comm.meter() as m:  # the test's own count of what ran
        got = fn(problem, METER_BOUNDS, METER_CLOCKS, PS_LR)
    values = [e for e in m.events if e.dtype == str(torch.float32)]
    return {"got": got, "sent": sum(e.nbytes for e in values if e.op == "send"),
            "received": sum(e.nbytes for e in values if e.op == "recv")}


@pytest.fixture(scope="module")
def ps_metered(ex):
    return launch(_meter_on_ranks, 4, ex.predict_and_meter_ps_traffic, timeout_s=60)


def test_predict_and_meter_ps_traffic_predictions(ps_metered):
    W, pulls = 2, METER_CLOCKS + 1
    for r, res in enumerate(ps_metered):
        if r < len(METER_BOUNDS):  # server r: its slice in from every worker each clock, out on every pull
            keys = METER_BOUNDS[r][1] - METER_BOUNDS[r][0]
            want = {"sent": W * pulls * keys * 4, "received": W * METER_CLOCKS * keys * 4}
        else:  # a worker: the whole gradient out each clock, the whole vector in on every pull
            want = {"sent": METER_CLOCKS * 101 * 4, "received": pulls * 101 * 4}
        got = {k: res["got"]["predicted"][k] for k in ("sent", "received")}
        assert got == want, f"rank {r} ({'server' if r < 2 else 'worker'}): predicted {got}, expected {want}"


def test_predict_and_meter_ps_traffic_measured(ps_metered):
    for r, res in enumerate(ps_metered):
        measured = {k: res["got"]["measured"][k] for k in ("sent", "received")}
        seen = {"sent": res["sent"], "received": res["received"]}
        assert seen["sent"] or seen["received"], \
            f"rank {r}: no value moved; run the server inside the function"
        assert measured == seen, f"rank {r}: measured {measured}, the ranks moved {seen} (float32 values)"
        assert measured == {k: res["got"]["predicted"][k] for k in ("sent", "received")}, \
            f"rank {r}: prediction and count differ"


TRAFFIC_KEYS, TRAFFIC_CLOCKS = 102, 3   # 102 keys: the 3 workers' ring chunks are whole


def _metered_ps_and_ring():
    """1 server and 3 workers run the chapter's parameter server (BSP) under the comm meter; then the
    3 workers run a ring all-reduce of a gradient-sized vector, also metered. Values only: fp32 bytes."""
    from minitorch_dist.parallelism.parameter_server import PSConfig, _ps_main
    from minitorch_dist.runtime.collectives import ring_all_reduce

    cfg = PSConfig("bsp", 0, 1, 3, TRAFFIC_CLOCKS, 0.1, {}, {})
    problem = dict(n_params=TRAFFIC_KEYS, n_rows=240, n_workers=3, batch_size=16, noise=0.1, seed=0)
    with comm.meter() as m:
        _ps_main(cfg, problem, time.monotonic())
    workers = dist.new_group([1, 2, 3])
    ring = 0
    if dist.get_rank() >= 1:
        with comm.meter() as mr:
            ring_all_reduce(torch.ones(TRAFFIC_KEYS), group=workers)
        ring = mr.bytes["send"]

    def values(op):
        return sum(e.nbytes for e in m.events if e.op == op and e.dtype == str(torch.float32))

    return {"sent": values("send"), "received": values("recv"), "ring": ring}


@pytest.fixture(scope="module")
def traffic():
    return launch(_metered_ps_and_ring, 4, timeout_s=60)


def test_predict_ps_traffic_measured_on_ranks(ex, traffic):
    got = ex.predict_ps_traffic(TRAFFIC_KEYS, 3, 1)
    server, workers = traffic[0], traffic[1:]
    pulls = TRAFFIC_CLOCKS + 1          # a last pull reads the final parameters
    assert got["server_in"] == server["received"] / TRAFFIC_CLOCKS, "the server's bytes in per clock"
    assert got["server_out"] == server["sent"] / pulls, "the server's bytes out per pull"
    for r, wk in enumerate(workers, start=1):
        assert got["worker_push"] == wk["sent"] / TRAFFIC_CLOCKS, f"rank {r}: a worker's push per clock"
        assert got["worker_pull"] == wk["received"] / pulls, f"rank {r}: a worker's pull"
        assert got["ring_send"] == wk["ring"], f"rank {r}: the ring all-reduce's bytes sent"
    assert got["busiest_link"] == max(server["received"] / TRAFFIC_CLOCKS, server["sent"] / pulls), \
        "one server and 3 workers: the server's link is the busiest"


def test_predict_ps_traffic_rejects_bad_input(ex):
    ex.predict_ps_traffic(100, 2, 2)  # a valid call first
    with pytest.raises(ValueError, match="n_workers"):
        ex.predict_ps_traffic(100, 0, 2)
    with pytest.raises(ValueError, match="n_params"):
        ex.predict_ps_traffic(1.5, 2, 2)
