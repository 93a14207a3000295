"""Chapter 02 exercises, autograded: the SSP admission rule and schedule, backup workers, key sharding.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: the rule written as "the fastest and slowest
are at most s apart", an event-by-event simulation of the workers, a sort of the arrivals written
out by hand, a linear scan over the ranges and over the hash ring.

Nothing here needs ranks. Checks of bad input first make a valid call, so a stub fails them too.
"""
import hashlib
import heapq
import itertools
import math
import random

import pytest
import torch

from minitorch_dist.course.exercises import load

pytestmark = pytest.mark.ch02


@pytest.fixture(scope="module")
def ex():
    """The chapter's stubs or its worked solutions (see the module docstring)."""
    return load("ch02")


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


@pytest.mark.parametrize("times, k",
                         [([3.0, 1.0, 2.0, 5.0], 2), ([1.0, 1.0, 1.0, 0.5], 2), ([2.0, 2.0, 2.0], 1),
                          ([4.0, math.inf, 1.0, 3.0, 2.0], 3), ([0.1, 0.2], 2)])
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
    torch.testing.assert_close(mean, expected)
    assert list(dropped) == sorted(left), f"dropped {list(dropped)}, expected {sorted(left)}"


def test_backup_workers_aggregate_k_equals_n_is_bsp(ex):
    items = _grads([5.0, 1.0, 3.0, 2.0], seed=1)
    mean, dropped = ex.backup_workers_aggregate(items, 4)
    torch.testing.assert_close(mean, torch.stack([g for g, _ in items]).mean(0))
    assert list(dropped) == []


def test_backup_workers_aggregate_ties_go_to_smaller_id(ex):
    items = _grads([1.0, 1.0, 1.0, 1.0], seed=2)
    mean, dropped = ex.backup_workers_aggregate(items, 2)
    torch.testing.assert_close(mean, (items[0][0] + items[1][0]) / 2)
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


@pytest.mark.parametrize("num_keys, s", [(10, 3), (12, 4), (7, 1), (3, 5), (0, 2), (1000, 7), (1, 1)])
def test_key_ranges_contiguous_balanced(ex, num_keys, s):
    rs = ex.key_ranges(num_keys, s)
    assert len(rs) == s
    assert all(isinstance(r, range) and r.step == 1 for r in rs)
    assert rs[0].start == 0 and rs[-1].stop == num_keys
    assert all(a.stop == b.start for a, b in zip(rs, rs[1:])), f"not contiguous: {rs}"
    assert [k for r in rs for k in r] == list(range(num_keys)), "every key exactly once, in order"
    sizes = [len(r) for r in rs]
    assert max(sizes) - min(sizes) <= 1, f"sizes {sizes} differ by more than 1"
    assert sizes == sorted(sizes, reverse=True), f"the larger ranges come first: {sizes}"
    # the same cut as torch.tensor_split
    assert sizes == [len(c) for c in torch.tensor_split(torch.arange(num_keys), s)]


def test_key_ranges_rejects_bad_input(ex):
    ex.key_ranges(4, 2)  # a valid call first
    with pytest.raises(ValueError, match="n_servers"):
        ex.key_ranges(4, 0)
    with pytest.raises(ValueError, match="num_keys"):
        ex.key_ranges(-1, 2)


@pytest.mark.parametrize("ranges", [[range(0, 4), range(4, 7), range(7, 10)],
                                    [range(0, 1), range(1, 2), range(2, 2), range(2, 2)],
                                    [range(0, 2), range(2, 2), range(2, 5), range(5, 6)],
                                    [range(0, 100)]])
def test_server_of_matches_a_scan(ex, ranges):
    for key in range(ranges[-1].stop):
        expected = next(i for i, r in enumerate(ranges) if key in r)
        assert ex.server_of(key, ranges) == expected, f"key {key} in {ranges}"


def test_server_of_with_key_ranges(ex):
    rs = ex.key_ranges(1001, 13)
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
