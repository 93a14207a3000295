# generated from solutions/ch02_parameter_servers.py by `make exercises`: fill in each NotImplementedError
# fingerprint 3aa08bb17dc0885e of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 02 exercises: parameter servers — the SSP admission rule, backup workers,
sharding keys over servers.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch02``.

Nothing here needs ranks: these are the rules a parameter server applies, written as plain functions.

1. :func:`ssp_can_read` / :func:`ssp_schedule`: Stale Synchronous Parallel (Ho et al. 2013, "More
   Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", §3): a worker may
   run at most s clocks ahead of the slowest. s = 0 is BSP (lockstep), s = ∞ is ASP.
2. :func:`backup_workers_aggregate`: synchronous SGD with backup workers (Chen et al. 2016,
   "Revisiting Distributed Synchronous SGD", §3): of n gradients per step, average the first k to
   arrive and drop the n - k stragglers.
3. :func:`key_ranges` / :func:`server_of` / :func:`consistent_hash_server`: which server holds a
   key — contiguous key ranges, or a hash ring with virtual nodes (Li et al. 2014, "Scaling
   Distributed Machine Learning with the Parameter Server", §3 key ranges, §4.3 consistent hashing).
"""
from __future__ import annotations

import bisect
import hashlib
import math

import torch

# --- 1. SSP: the admission rule and a schedule ----------------------------------------------------


def _check_staleness(staleness):
    if not (staleness == math.inf or (int(staleness) == staleness and staleness >= 0)):
        raise ValueError("staleness must be a whole number >= 0 (0 = BSP) or math.inf "
                         f"(ASP), got {staleness}")


def ssp_can_read(worker_clock: int, all_clocks, staleness) -> bool:
    """May a worker at clock ``worker_clock`` start its next iteration (Ho et al. 2013, §3)?

    Every worker has a clock: the number of iterations it has finished (and pushed). Under SSP
    with staleness bound s, "the fastest and slowest workers must be <= s clocks apart": a worker
    at clock c may read the parameters and start iteration c only if every worker has reached
    clock c - s, which guarantees it sees every update from clocks 0 .. c - s - 1. Otherwise it
    waits. ``all_clocks`` holds every worker's clock (the asking worker's own included or not: it
    cannot matter). s = 0 is BSP, a barrier every clock; s = ``math.inf`` is ASP, never wait.

    **Your task:** return ``True`` when the worker may proceed, ``False`` when it must wait.
    """
    all_clocks = list(all_clocks)
    if not all_clocks:
        raise ValueError("all_clocks is empty: pass the clock of every worker")
    if any(int(c) != c or c < 0 for c in all_clocks + [worker_clock]):
        raise ValueError(f"clocks are whole numbers >= 0, got worker_clock={worker_clock}, "
                         f"all_clocks={all_clocks}")
    _check_staleness(staleness)
    raise NotImplementedError("exercise: ssp_can_read — see chapters/02_parameter_servers.md")


def ssp_schedule(durations, staleness) -> tuple[list[list[float]], int]:
    """Simulate n SSP workers; return when each iteration started and the largest staleness seen.

    ``durations[w][c]`` is how long worker w computes iteration c (every worker runs the same
    number of iterations; pushes are instantaneous). All start at time 0 with clock 0. Worker w
    starts iteration c as soon as both

    - it has finished iteration c - 1 (at time 0 for c = 0), and
    - :func:`ssp_can_read` lets it: every worker v has reached clock c - s, i.e. finished its
      iteration c - s - 1 (no condition when c - s - 1 < 0),

    and it finishes at start + duration, when its clock becomes c + 1. A worker that finishes
    counts as having done so at that instant: one that starts at time t sees every iteration that
    ends at or before t.

    The *observed staleness* of a start is how many clocks the starting worker is ahead of the
    slowest one at that instant: ``c - min_v clock_v(t)``. SSP promises it never exceeds s.

    **Your task:** return ``(start, max_staleness)``: ``start[w][c]`` the start time of worker
    w's iteration c (a float), and the largest observed staleness over all starts (an int).
    Hint: the start times depend only on finish times of earlier iterations, so compute them
    iteration by iteration, c = 0, 1, 2, ...
    """
    durations = [[float(t) for t in row] for row in durations]
    if not durations or not durations[0]:
        raise ValueError("durations must be a non-empty list "
                         "(one per worker) of non-empty lists (one per iteration)")
    if len({len(row) for row in durations}) != 1:
        raise ValueError("every worker runs the same number of iterations, got "
                         f"{[len(r) for r in durations]}")
    if any(t < 0 or t != t for row in durations for t in row):
        raise ValueError("durations must be >= 0 seconds")
    _check_staleness(staleness)
    raise NotImplementedError("exercise: ssp_schedule — see chapters/02_parameter_servers.md")


# --- 2. backup workers -----------------------------------------------------------------------------


def backup_workers_aggregate(grads_with_arrival_times, k: int) -> tuple[torch.Tensor, list[int]]:
    """One step of synchronous SGD with n - k backup workers (Chen et al. 2016, §3).

    n workers compute a gradient on the same parameters; the aggregator averages the first k to
    arrive, applies the update and moves on; the n - k later ones are dropped. A few slow or
    dead machines no longer hold everyone up, and — unlike asynchronous SGD — no gradient is
    stale. k = n is plain BSP.

    ``grads_with_arrival_times[w] = (gradient, arrival_time)`` for worker w (time ``math.inf``:
    it never arrives).

    **Your task:** return ``(mean, dropped)``: the mean of the k gradients that arrive first —
    ties in time go to the smaller worker id — and the sorted ids of the workers left out.
    """
    items = list(grads_with_arrival_times)
    n = len(items)
    if n == 0:
        raise ValueError("no gradients: pass one (gradient, arrival_time) pair per worker")
    if int(k) != k or not 1 <= k <= n:
        raise ValueError(f"k must be a whole number in 1..{n} (the number of gradients to average), got {k}")
    grads = [g for g, _ in items]
    if any(g.shape != grads[0].shape for g in grads):
        raise ValueError(f"all gradients must have one shape, got {sorted({tuple(g.shape) for g in grads})}")
    times = [float(t) for _, t in items]
    if any(t != t for t in times):
        raise ValueError("an arrival time is NaN")
    arrived = sum(t < math.inf for t in times)
    if arrived < k:
        raise RuntimeError(f"only {arrived} of {n} gradients arrive but k={k} are needed: "
                           "the step cannot complete (lower k or add backup workers)")
    raise NotImplementedError("exercise: backup_workers_aggregate — see chapters/02_parameter_servers.md")


# --- 3. which server holds a key ---------------------------------------------------------------------


def key_ranges(num_keys: int, n_servers: int) -> list[range]:
    """Cut keys ``0 .. num_keys - 1`` into ``n_servers`` contiguous ranges (Li et al. 2014, §3).

    A parameter server stores the model as (key, value) pairs and gives each server one range of
    keys, so that a worker's push or pull of a key range touches few servers. The ranges must be
    in order, contiguous (each starts where the last ended, the first at 0, the last ending at
    ``num_keys``) and balanced: sizes differ by at most 1, the larger ones first (as
    ``torch.tensor_split`` cuts). More servers than keys leaves some ranges empty.

    **Your task:** return a list of ``n_servers`` Python ``range`` objects, server i's keys.
    """
    if int(num_keys) != num_keys or num_keys < 0:
        raise ValueError(f"num_keys must be a whole number >= 0, got {num_keys}")
    if int(n_servers) != n_servers or n_servers < 1:
        raise ValueError(f"n_servers must be a whole number >= 1, got {n_servers}")
    raise NotImplementedError("exercise: key_ranges — see chapters/02_parameter_servers.md")


def server_of(key: int, ranges: list[range]) -> int:
    """The server whose range holds ``key``, for ranges as :func:`key_ranges` makes them.

    A worker does this lookup for every key it pushes or pulls, and there may be thousands of
    servers: scanning the list is O(S), a binary search on the ranges' starts is O(log S)
    (``bisect``). Empty ranges hold nothing.

    **Your task:** return the index i with ``key in ranges[i]``.
    """
    if not ranges or ranges[0].start != 0:
        raise ValueError("ranges must be a non-empty list of contiguous key ranges starting at 0 (see "
                         "key_ranges)")
    if int(key) != key or not 0 <= key < ranges[-1].stop:
        raise ValueError(f"key {key} is outside the key space 0..{ranges[-1].stop - 1}")
    raise NotImplementedError("exercise: server_of — see chapters/02_parameter_servers.md")


def ring_position(label: str) -> int:
    """A point on the hash ring, 0 <= point < 2**64: the first 8 bytes of md5(label).

    (md5 for a stable, well-spread hash; Python's ``hash`` of a str changes from run to run.)
    """
    return int.from_bytes(hashlib.md5(label.encode()).digest()[:8], "big")


def consistent_hash_server(key, servers, virtual_nodes: int = 16):
    """The server that holds ``key`` under consistent hashing (Li et al. 2014, §4.3; Karger et al. 1997).

    Keys and servers are hashed onto one ring of positions 0 .. 2**64 - 1. Each server is placed
    at ``virtual_nodes`` points, ``ring_position(f"{server}#{i}")`` for i = 0 .. virtual_nodes-1
    (many points per server even out the arcs each one owns). A key at ``ring_position(str(key))``
    belongs to the server owning the first point *at or after* it going round the ring, wrapping
    past 2**64 back to the smallest point. Adding or removing a server moves only the keys of
    the arcs it gains or loses, not nearly all of them as ``key % n_servers`` would.

    **Your task:** return that server (an element of ``servers``). Break ties between equal
    points (a hash collision, vanishingly rare) by the server's position in ``servers``.
    """
    servers = list(servers)
    if not servers:
        raise ValueError("no servers: pass at least one")
    if len(set(map(str, servers))) != len(servers):
        raise ValueError(f"server names must be distinct, got {servers}")
    if int(virtual_nodes) != virtual_nodes or virtual_nodes < 1:
        raise ValueError(f"virtual_nodes must be a whole number >= 1, got {virtual_nodes}")
    raise NotImplementedError("exercise: consistent_hash_server — see chapters/02_parameter_servers.md")
