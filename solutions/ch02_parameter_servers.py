"""Chapter 02 exercises: parameter servers — the SSP admission rule, backup workers,
sharding keys over servers, a stale-synchronous parameter server on ranks and its bytes.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch02_parameter_servers.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch02 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Exercises 1-3 are the rules a parameter server applies, written as plain functions; 4 assembles a
parameter server on ranks, 5 derives its bytes per clock, 6 predicts a rank's bytes and counts them.

1. :func:`ssp_can_read` / :func:`ssp_schedule`: Stale Synchronous Parallel (Ho et al. 2013, "More
   Effective Distributed ML via a Stale Synchronous Parallel Parameter Server", §3): a worker may
   run at most s clocks ahead of the slowest. s = 0 is BSP (lockstep), s = ∞ is ASP.
2. :func:`backup_workers_aggregate`: synchronous SGD with backup workers (Chen et al. 2016,
   "Revisiting Distributed Synchronous SGD", §3): of n gradients per step, average the first k to
   arrive and drop the n - k stragglers.
3. :func:`balanced_key_ranges` / :func:`server_of` / :func:`consistent_hash_server`: which server holds a
   key — contiguous key ranges balanced by bytes, or a hash ring with virtual nodes (Li et al. 2014, "Scaling
   Distributed Machine Learning with the Parameter Server", §3 key ranges, §4.3 consistent hashing).
4. :func:`ssp_parameter_server` (build): servers holding key ranges, workers that pull and push, and
   the staleness bound between them (Ho et al. 2013; Li et al. 2014, §3). s = 0 must be exactly
   synchronous SGD on the workers' batches; SSP's staleness must never exceed s.
5. :func:`predict_ps_traffic` (derive): the bytes of one clock, worker and server, against a ring
   all-reduce (Li et al. 2014, §3; Jiang et al. 2020, "A Unified Architecture for Accelerating
   Distributed DNN Training in Heterogeneous GPU/CPU Clusters", §4.1).
6. :func:`predict_and_meter_ps_traffic` (measure): a rank's bytes over a whole run with uneven key
   ranges, predicted, then counted on ranks running your server.
"""
from __future__ import annotations

import bisect
import hashlib
import math
import time

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm

# --- 1. SSP: the admission rule and a schedule ----------------------------------------------------


def _check_staleness(staleness):
    if not (staleness == math.inf or (int(staleness) == staleness and staleness >= 0)):
        raise ValueError("staleness must be a whole number >= 0 (0 = BSP) or math.inf "
                         f"(ASP), got {staleness}")


def ssp_can_read(worker_clock: int, all_clocks, staleness) -> bool:
    """Kind: derive · about 15 minutes

    May a worker at clock ``worker_clock`` start its next iteration (Ho et al. 2013, §3)?

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
    # BEGIN SOLUTION
    return min(all_clocks) >= worker_clock - staleness
    # END SOLUTION


def ssp_schedule(durations, staleness) -> tuple[list[list[float]], int]:
    """Kind: derive · about 45 minutes

    Simulate n SSP workers; return when each iteration started and the largest staleness seen.

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
    The tests compare with an event-by-event simulation on seeded random durations.
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
    # BEGIN SOLUTION
    n, iters = len(durations), len(durations[0])
    start = [[0.0] * iters for _ in range(n)]
    finish = [[0.0] * iters for _ in range(n)]
    for c in range(iters):
        gate = c - staleness - 1  # the iteration every worker must have finished
        ready = max(finish[v][gate] for v in range(n)) if gate >= 0 else 0.0
        for w in range(n):
            start[w][c] = max(finish[w][c - 1] if c else 0.0, ready)
            finish[w][c] = start[w][c] + durations[w][c]

    def clock(v, t):  # iterations of worker v finished by time t
        return sum(1 for f in finish[v] if f <= t)

    worst = max(c - min(clock(v, start[w][c]) for v in range(n)) for w in range(n) for c in range(iters))
    return start, worst
    # END SOLUTION


# --- 2. backup workers -----------------------------------------------------------------------------


def backup_workers_aggregate(grads_with_arrival_times, k: int) -> tuple[torch.Tensor, list[int]]:
    """Kind: build · about 30 minutes

    One step of synchronous SGD with n - k backup workers (Chen et al. 2016, §3).

    n workers compute a gradient on the same parameters; the aggregator averages the first k to
    arrive, applies the update and moves on; the n - k later ones are dropped. A few slow or
    dead machines no longer hold everyone up, and — unlike asynchronous SGD — no gradient is
    stale. k = n is plain BSP.

    ``grads_with_arrival_times[w] = (gradient, arrival_time)`` for worker w (time ``math.inf``:
    it never arrives).

    **Your task:** return ``(mean, dropped)``: the mean of the k gradients that arrive first —
    ties in time go to the smaller worker id — and the sorted ids of the workers left out.
    The tests check hand-worked arrivals (ties, workers that never arrive) and the refusals.

    Reference: ``minitorch_dist/parallelism/parameter_server.py`` (its synchronous server waits
    for all W pushes of a clock; you keep the first k and drop the rest).
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
    # BEGIN SOLUTION
    order = sorted(range(n), key=lambda w: (times[w], w))
    used = order[:k]
    mean = torch.stack([grads[w] for w in used]).mean(dim=0)
    return mean, sorted(order[k:])
    # END SOLUTION


# --- 3. which server holds a key ---------------------------------------------------------------------


def balanced_key_ranges(key_bytes, n_servers: int) -> list[range]:
    """Kind: build · about 60 minutes

    Cut keys ``0 .. K - 1`` into ``n_servers`` contiguous ranges that balance *bytes*, not keys
    (Li et al. 2014, §3).

    A parameter server stores the model as (key, value) pairs and gives each server one range of
    keys, so that a worker's push or pull of a key range touches few servers. Splitting the key
    count evenly (``torch.tensor_split``'s cut) balances the servers only when every key is as
    large as every other; a real model's keys are tensors of very different sizes (an embedding
    table next to a bias), and the server holding the most bytes is the hot spot every clock
    waits for. ``key_bytes[i]`` is the size of key i's value in bytes.

    **Interface.** Return a list of ``n_servers`` Python ``range`` objects (step 1), server i's
    keys: in order and contiguous (the first starting at 0, each starting where the last ended,
    the last ending at K), so that the largest server load, ``max_i sum(key_bytes[k] for k in
    ranges[i])``, is as small as any contiguous split can make it. Ranges may be empty (more
    servers than keys, or a key larger than the rest together). Among optimal splits any one
    will do. ``ValueError`` for negative sizes or ``n_servers < 1`` (the scaffolding).

    **What the tests check:** the ranges' shape (contiguous, in order, ``n_servers`` of them);
    the largest load equal to the optimum found by exhaustive search, on hand-worked and seeded
    random sizes (zeros, a huge key, more servers than keys); on equal sizes the largest load of
    ``torch.tensor_split``'s cut; and a split of 10^5 keys over 64 servers fast (well under a
    second: no search over all cuts).

    Reference: ``minitorch_dist/parallelism/parameter_server.py`` (``key_ranges`` splits the
    key *count* evenly; you balance the bytes).
    """
    sizes = [int(b) for b in key_bytes]
    if any(b < 0 for b in sizes):
        raise ValueError(f"key sizes must be >= 0 bytes, got {[b for b in sizes if b < 0][:5]}")
    if int(n_servers) != n_servers or n_servers < 1:
        raise ValueError(f"n_servers must be a whole number >= 1, got {n_servers}")
    # BEGIN SOLUTION
    n_servers = int(n_servers)

    def cuts_for(cap):  # greedy: fill each server up to cap; None if n_servers do not suffice
        out, start, load = [], 0, 0
        for k, b in enumerate(sizes):
            if b > cap:
                return None
            if load + b > cap:
                out.append(range(start, k))
                start, load = k, 0
            load += b
        out.append(range(start, len(sizes)))
        return out if len(out) <= n_servers else None

    lo, hi = max(sizes, default=0), sum(sizes)  # the optimum lies in [largest key, everything]
    while lo < hi:  # the smallest cap the greedy fill meets
        mid = (lo + hi) // 2
        if cuts_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    ranges = cuts_for(lo)
    return ranges + [range(len(sizes), len(sizes))] * (n_servers - len(ranges))
    # END SOLUTION


def server_of(key: int, ranges: list[range]) -> int:
    """Kind: build · about 20 minutes

    The server whose range holds ``key``, for contiguous ranges as :func:`balanced_key_ranges` makes them.

    A worker does this lookup for every key it pushes or pulls, and there may be thousands of
    servers: scanning the list is O(S), a binary search on the ranges' starts is O(log S)
    (``bisect``). Empty ranges hold nothing.

    **Your task:** return the index i with ``key in ranges[i]``, in O(log S). The tests
    compare with a scan on ranges with empty ones among them (at the start, the middle, the end).

    Reference: ``minitorch_dist/parallelism/parameter_server.py`` (``key_ranges`` makes the
    ranges; the library's workers slice by them and never look a key up).
    """
    if not ranges or ranges[0].start != 0:
        raise ValueError("ranges must be a non-empty list of contiguous key ranges starting at 0 (see "
                         "balanced_key_ranges)")
    if int(key) != key or not 0 <= key < ranges[-1].stop:
        raise ValueError(f"key {key} is outside the key space 0..{ranges[-1].stop - 1}")
    # BEGIN SOLUTION
    starts = [r.start for r in ranges]
    return bisect.bisect_right(starts, key) - 1  # the last range starting at or before key
    # END SOLUTION


def ring_position(label: str) -> int:
    """A point on the hash ring, 0 <= point < 2**64: the first 8 bytes of md5(label).

    (md5 for a stable, well-spread hash; Python's ``hash`` of a str changes from run to run.)
    """
    return int.from_bytes(hashlib.md5(label.encode()).digest()[:8], "big")


def consistent_hash_server(key, servers, virtual_nodes: int = 16):
    """Kind: build · about 40 minutes

    The server that holds ``key`` under consistent hashing (Li et al. 2014, §4.3; Karger et al. 1997).

    Keys and servers are hashed onto one ring of positions 0 .. 2**64 - 1. Each server is placed
    at ``virtual_nodes`` points, ``ring_position(f"{server}#{i}")`` for i = 0 .. virtual_nodes-1
    (many points per server even out the arcs each one owns). A key at ``ring_position(str(key))``
    belongs to the server owning the first point *at or after* it going round the ring, wrapping
    past 2**64 back to the smallest point. Adding or removing a server moves only the keys of
    the arcs it gains or loses, not nearly all of them as ``key % n_servers`` would.

    **Your task:** return that server (an element of ``servers``). Break ties between equal
    points (a hash collision, vanishingly rare) by the server's position in ``servers``. The
    tests compare with a scan of every point, and check that adding or removing a server moves
    only its own keys.

    Reference: ``minitorch_dist/parallelism/parameter_server.py`` (key ranges; the hash ring is
    not in the library).
    """
    servers = list(servers)
    if not servers:
        raise ValueError("no servers: pass at least one")
    if len(set(map(str, servers))) != len(servers):
        raise ValueError(f"server names must be distinct, got {servers}")
    if int(virtual_nodes) != virtual_nodes or virtual_nodes < 1:
        raise ValueError(f"virtual_nodes must be a whole number >= 1, got {virtual_nodes}")
    # BEGIN SOLUTION
    ring = sorted((ring_position(f"{s}#{i}"), j) for j, s in enumerate(servers)
                  for i in range(int(virtual_nodes)))
    points = [p for p, _ in ring]
    i = bisect.bisect_left(points, ring_position(str(key)))
    return servers[ring[i % len(ring)][1]]  # past the last point: wrap round to the first
    # END SOLUTION


# --- 4. a stale-synchronous parameter server, on ranks ---------------------------------------------
#
# Scaffolding: the messages. Ranks 0..S-1 are servers, ranks S..S+W-1 workers (worker w is rank S + w).
# Each message is metered by the comm layer (``with comm.meter() as m``) and leaves a status line that
# ``launch`` prints if the ranks hang.

PUSH, PULL, DONE = 0, 1, 2
_TAG_REQUEST, _TAG_GRADIENT, _TAG_REPLY, _TAG_VALUES = 21, 22, 23, 24


def _send(t: torch.Tensor, dst: int, tag: int, what: str) -> None:
    comm.record("send", t.numel() * t.element_size(), 2, t.dtype, tuple(t.shape))
    comm.set_status(f"in send {what} to rank {dst}")
    dist.send(t, dst, tag=tag)
    comm.set_status(f"after send {what} to rank {dst}")


def send_request(server: int, op: int, worker: int, clock: int, read_clock: int = 0) -> None:
    """Worker -> server ``server``: the header ``[op, worker, clock, read_clock]`` (int64).

    ``op`` is PUSH (then send the gradient slice with :func:`send_gradient`), PULL (the server
    answers with :func:`reply` when its rule admits it) or DONE (this worker has finished).
    For a PUSH, ``read_clock`` is the server clock of the values the gradient was computed from.
    """
    _send(torch.tensor([op, worker, clock, read_clock], dtype=torch.int64), server, _TAG_REQUEST,
          f"request {op} (clock {clock})")


def send_gradient(server: int, grad_slice: torch.Tensor) -> None:
    """Worker -> server: the slice of the gradient that server holds (right after a PUSH header)."""
    _send(grad_slice.detach().float().contiguous(), server, _TAG_GRADIENT, "gradient")


def recv_request(grad_buffer: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Server: wait for the next request from *any* worker; return ``(src, op, worker, clock, read_clock)``,
    ``src`` the sender's rank. A PUSH's gradient slice is received into ``grad_buffer`` (this server's
    number of keys) before returning."""
    header = torch.zeros(4, dtype=torch.int64)
    comm.set_status("in recv request from any rank")
    src = dist.recv(header, None, tag=_TAG_REQUEST)
    comm.record("recv", header.numel() * 8, 2, header.dtype, (4,))
    op, worker, clock, read_clock = header.tolist()
    if op == PUSH:
        comm.set_status(f"in recv gradient from rank {src}")
        dist.recv(grad_buffer, src, tag=_TAG_GRADIENT)
        comm.record("recv", grad_buffer.numel() * 4, 2, grad_buffer.dtype, tuple(grad_buffer.shape))
    comm.set_status(f"after recv request {op} from rank {src}")
    return src, op, worker, clock, read_clock


def reply(worker_rank: int, server_clock: int, values: torch.Tensor) -> list:
    """Server -> worker: the answer to a pull, ``[server_clock]`` then a *copy* of ``values``, sent
    without waiting (the server keeps serving meanwhile, and keeps changing its values: hence the
    copy). Returns the two pending sends: wait on them before the server returns."""
    header, snapshot = torch.tensor([server_clock], dtype=torch.int64), values.detach().clone()
    comm.record("send", 8, 2, header.dtype, (1,))
    comm.record("send", snapshot.numel() * 4, 2, snapshot.dtype, tuple(snapshot.shape))
    return [dist.isend(header, worker_rank, tag=_TAG_REPLY),
            dist.isend(snapshot, worker_rank, tag=_TAG_VALUES)]


def pull(bounds, worker: int, clock: int) -> tuple[torch.Tensor, list[int]]:
    """Worker: ask every server for its keys at ``clock`` and wait for all the answers; return the whole
    parameter vector and, per server, the server clock of the values it sent. The receives are
    posted before the requests go out, so a server's answer never waits for this worker."""
    headers = [torch.zeros(1, dtype=torch.int64) for _ in bounds]
    values = [torch.empty(hi - lo) for lo, hi in bounds]
    works = [dist.irecv(t, k, tag=tag) for k in range(len(bounds))
             for t, tag in ((headers[k], _TAG_REPLY), (values[k], _TAG_VALUES))]
    for k in range(len(bounds)):
        send_request(k, PULL, worker, clock)
    comm.set_status(f"waiting for the answers to pull (clock {clock})")
    for h in works:
        h.wait()
    for h, v in zip(headers, values):
        comm.record("recv", 8, 2, h.dtype, (1,))
        comm.record("recv", v.numel() * 4, 2, v.dtype, tuple(v.shape))
    return torch.cat(values), [int(h) for h in headers]


def _check_ps_arguments(problem, bounds, staleness, clocks, lr) -> int:
    """Validate; return S, the number of servers."""
    _check_staleness(staleness)
    if int(clocks) != clocks or clocks < 1:
        raise ValueError(f"clocks must be a whole number >= 1, got {clocks}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    bounds = [tuple(b) for b in bounds]
    if not bounds or bounds[0][0] != 0 or bounds[-1][1] != problem.n_params or \
            any(a[1] != b[0] for a, b in zip(bounds, bounds[1:])) or any(hi <= lo for lo, hi in bounds):
        raise ValueError(f"bounds must be non-empty contiguous (lo, hi) ranges covering "
                         f"0..{problem.n_params}, one per server, got {bounds}")
    if not dist.is_initialized():
        raise RuntimeError("ssp_parameter_server runs on ranks: call it inside launch(fn, S + W)")
    if dist.get_world_size() != len(bounds) + problem.n_workers:
        raise ValueError(f"the world has {dist.get_world_size()} ranks, but {len(bounds)} servers + "
                         f"{problem.n_workers} workers were asked for")
    return len(bounds)


def ssp_parameter_server(  # noqa: C901 - a server and a worker, one worked solution read top to bottom
        problem, bounds, staleness, clocks: int, lr: float, straggler=None) -> dict:
    """Kind: build · about 120 minutes

    One rank of a parameter server whose workers may run at most ``staleness`` clocks apart (Ho et
    al. 2013, SSP; s = 0 is BSP, ``math.inf`` ASP). Every rank of ``launch(fn, S + W)`` calls it; ranks
    0..S-1 are the servers, rank S + w is worker w (``W = problem.n_workers``, a ``LeastSquares``
    problem: ``problem.grad(x, rows)``, ``problem.batch_rows(w, c)``, ``problem.loss(x)``).

    **Server k** holds the keys ``bounds[k] = (lo, hi)`` of the parameter vector x, starting at zeros,
    and serves requests (:func:`recv_request`) until every worker has said DONE. It counts, per worker,
    the pushes received: that is the worker's clock as this server sees it, and the *server clock* is
    the smallest of them (every update of earlier clocks is in x).

    - A **PUSH** of clock c from worker w: its *staleness* is ``c - read_clock`` (clocks of updates the
      gradient may not have seen); log it. With s = 0, add the gradient to a running sum and, when the
      W-th of that clock has arrived, apply ``x -= lr * (sum / W)``: one step of synchronous SGD on the
      W batches. With s >= 1 apply each push at once, *staleness-aware* (Zhang et al. 2016, §3): a
      gradient that may have missed tau clocks of updates is worth less, so it moves x by
      ``(lr / (W * max(1, tau))) * g`` (W fresh pushes make one step of lr).
    - A **PULL** of clock c waits until the rule admits it: ``c - server_clock <= s``. After every
      request, answer each waiting pull the rule now admits (:func:`reply` with the server clock).

    **Worker w**, for c = 0, 1, ..., clocks: :func:`pull` the parameters for clock c, log
    ``problem.loss(x)``; after the last pull stop; otherwise compute the gradient on
    ``problem.batch_rows(w, c)``, sleep ``straggler.get(w, 0)`` seconds (a slow machine), and push each
    server its slice (:func:`send_request` with PUSH and that server's read clock, then
    :func:`send_gradient`). At the end send DONE to every server.

    **Your task:** return, on a server, ``{"params": x (its keys), "staleness": [per applied push, in
    order], "events": [("reply", w, c) when a pull is answered, ("push", w, c) when a push arrives, in
    order]}``; on a worker ``{"loss": [the loss of the parameters it pulled at clocks 0..clocks]}``. Wait
    on every pending reply before a server returns.

    **What the tests check**, on 2 servers and 2 workers: s = 0 equal to one process running
    synchronous SGD on the same batches (a bound derived for float32, in the test module); under
    SSP(2) with a straggler, every push's logged staleness equal to what the server's own event
    log implies, never above 2 and reaching 2; every pull answered once, only when the rule admits
    it; the parameters equal to ``0 - sum(lr / (W * max(1, tau)) * g)`` over every gradient the
    workers computed (s = 0: ``lr / W``), in any order of arrival; convergence near synchronous
    SGD's; a bad staleness refused.

    Reference: ``minitorch_dist/parallelism/parameter_server.py`` (``_Shard`` and ``_worker``: the
    library's server, with its own message format and a plain lr / W for every push; you build it
    on the chapter's messages, with staleness-aware steps).
    """
    n_servers = _check_ps_arguments(problem, bounds, staleness, clocks, lr)
    straggler = dict(straggler or {})
    rank, n_workers = dist.get_rank(), problem.n_workers
    # BEGIN SOLUTION
    if rank < n_servers:  # --- a server
        lo, hi = bounds[rank]
        x, grad = torch.zeros(hi - lo), torch.empty(hi - lo)
        pushed, pending, in_flight = [0] * n_workers, [], []
        total, arrived, finished = torch.zeros(hi - lo), 0, 0
        staleness_log, events = [], []
        while finished < n_workers:
            src, op, w, c, read_clock = recv_request(grad)
            if op == PUSH:
                pushed[w] += 1
                staleness_log.append(c - read_clock)
                events.append(("push", w, c))
                if staleness == 0:  # BSP: the mean of the clock's W gradients, all at once
                    total += grad
                    arrived += 1
                    if arrived == n_workers:
                        x -= lr * (total / n_workers)
                        total.zero_()
                        arrived = 0
                else:  # staleness-aware: a gradient tau clocks stale counts 1/tau as much
                    x -= (lr / (n_workers * max(1, c - read_clock))) * grad
            elif op == PULL:
                pending.append((src, w, c))
            else:
                finished += 1
            server_clock, waiting = min(pushed), []
            for src_, w_, c_ in pending:
                if c_ - server_clock <= staleness:
                    events.append(("reply", w_, c_))
                    in_flight += reply(src_, server_clock, x)
                else:
                    waiting.append((src_, w_, c_))
            pending = waiting
        for h in in_flight:
            h.wait()
        return {"params": x, "staleness": staleness_log, "events": events}
    w, losses = rank - n_servers, []  # --- a worker
    for c in range(clocks + 1):
        x, reads = pull(bounds, w, c)
        losses.append(problem.loss(x))
        if c == clocks:
            break
        g = problem.grad(x, problem.batch_rows(w, c))
        time.sleep(straggler.get(w, 0))
        for k, (lo, hi) in enumerate(bounds):
            send_request(k, PUSH, w, c, reads[k])
            send_gradient(k, g[lo:hi])
    for k in range(n_servers):
        send_request(k, DONE, w, clocks)
    return {"loss": losses}
    # END SOLUTION


# --- 5. the bytes of a step: parameter server against a ring all-reduce -----------------------------


def predict_ps_traffic(n_params: int, n_workers: int, n_servers: int, bytes_per_element: int = 4) -> dict:
    """Kind: derive · about 25 minutes

    Predict the bytes of values (gradients and parameters; the small headers left out) that one
    clock of a parameter server moves, and compare with a ring all-reduce of the same gradient.

    The keys are split evenly over S servers (separate machines from the n workers); Ψ is the bytes
    of the whole parameter vector. In one clock every worker pushes its gradient — each server its
    slice — and pulls the whole vector back; each server receives its slice from every worker and
    sends it back to every worker. The alternative, a ring all-reduce among the n workers, has each
    of them send chunks of Ψ/n; work out how many.

    **Your task:** return a dict of bytes per clock: ``worker_push`` and ``worker_pull`` (what one
    worker sends, and receives), ``server_in`` and ``server_out`` (what one server receives, and
    sends), ``busiest_link`` (the most any one machine sends, or receives, in a clock: worker or
    server) and ``ring_send`` (what each worker sends in the ring all-reduce).

    The tests check the prediction against ``costmodel.ps_bytes_per_step`` on seeded random
    sizes and hand-worked ones, then exactly (counted bytes, no tolerance) against what
    ``comm.meter()`` counts on the library's parameter server with 1 server and 3 workers and a
    ring all-reduce among those 3 workers, for a number of keys that both splits divide.
    """
    for name, v in (("n_params", n_params), ("n_workers", n_workers), ("n_servers", n_servers)):
        if isinstance(v, bool) or int(v) != v:
            raise ValueError(f"{name} must be a whole number, got {v!r}")
    if n_params < 0 or n_workers < 1 or n_servers < 1:
        raise ValueError(f"need n_params >= 0, n_workers >= 1 and n_servers >= 1, got {n_params}, "
                         f"{n_workers}, {n_servers}")
    if not bytes_per_element > 0:
        raise ValueError(f"bytes_per_element must be > 0 (4 for fp32), got {bytes_per_element}")
    # BEGIN SOLUTION
    psi, n, s = n_params * bytes_per_element, n_workers, n_servers
    server = n * psi / s
    return {"worker_push": float(psi), "worker_pull": float(psi), "server_in": server, "server_out": server,
            "busiest_link": max(float(psi), server), "ring_send": 2 * (n - 1) / n * psi}
    # END SOLUTION


# --- 6. the bytes of a whole run, predicted and counted on ranks ----------------------------------------


def predict_and_meter_ps_traffic(problem, bounds, clocks: int, lr: float) -> dict:
    """Kind: measure · about 40 minutes

    Predict the bytes of values (float32 gradients and parameters; the int64 headers left out) that
    *this rank* sends and receives in a synchronous (s = 0) run of the parameter server, then run
    it and count them. Every rank of ``launch(fn, S + W)`` calls it, with the arguments of
    :func:`ssp_parameter_server`; server k holds the keys ``bounds[k] = (lo, hi)``, which need not
    be equal in size.

    Returns ``{"predicted": {"sent": b, "received": b}, "measured": {"sent": b, "received": b}}``,
    in bytes, for the whole run of ``clocks`` clocks (the workers' last pull, of the final
    parameters, included).

    **Predict** from what each message carries: a push carries a server's slice of the gradient,
    a pull's answer that server's slice of the parameters (4 bytes per element). Count the pushes
    and pulls of a run; a server's bytes depend on its own range, not on an even share.

    **Measure** by running :func:`ssp_parameter_server` (your exercise 4) with staleness 0 inside
    ``comm.meter()``: every message goes through the comm layer's accounting, and the meter's
    events carry each message's ``op`` (``"send"``/``"recv"``), ``nbytes`` and ``dtype``.

    **What the tests check**, on 2 servers holding 30 and 71 keys and 2 workers: the predictions
    against counts worked out by hand from the bounds; the measured counts equal to what the tests'
    own meter saw around your call (so numbers computed from the prediction do not pass) and to
    the prediction, on every rank.

    Reference: ``minitorch_dist/costmodel/parameter_server.py`` (``ps_bytes_per_step``: one clock,
    keys split evenly; you count a whole run with uneven ranges, on ranks).
    """
    n_servers = _check_ps_arguments(problem, bounds, 0, clocks, lr)
    bounds = [tuple(b) for b in bounds]
    rank, n_workers = dist.get_rank(), problem.n_workers
    # BEGIN SOLUTION
    pulls = clocks + 1  # the last pull reads the final parameters
    if rank < n_servers:
        lo, hi = bounds[rank]
        slice_bytes = (hi - lo) * 4
        predicted = {"sent": n_workers * pulls * slice_bytes, "received": n_workers * clocks * slice_bytes}
    else:
        psi = problem.n_params * 4
        predicted = {"sent": clocks * psi, "received": pulls * psi}
    with comm.meter() as m:
        ssp_parameter_server(problem, bounds, 0, clocks, lr)
    values = [e for e in m.events if e.dtype == str(torch.float32)]
    measured = {"sent": sum(e.nbytes for e in values if e.op == "send"),
                "received": sum(e.nbytes for e in values if e.op == "recv")}
    return {"predicted": predicted, "measured": measured}
    # END SOLUTION
