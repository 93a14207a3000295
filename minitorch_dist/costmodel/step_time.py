"""Chapter 14 — step time from a machine profile: each op's seconds, each collective's, the ranks replayed.

A training step's time is predicted in three layers, each a formula fed only by a machine profile
(:mod:`..profiles`: calibrated here or shipped with citations), never by a free efficiency:

1. **An op.** If the profile's kernel table holds the op with these shapes (``calibrate`` timed it
   alone, every rank busy, its inputs as far from the core as its step's footprint puts them), that
   time. Otherwise the roofline of its kind (Williams et al. 2009):
   a GEMM or attention kernel takes the profile's GEMM time for its FLOPs, an elementwise op
   ``op_overhead + bytes / copy bandwidth``, a view ``op_overhead``. Before it the framework runs:
   the Python lines the recorder counted since the previous op (module calls, hooks, a wrapper's
   bookkeeping), each at ``python_line_s``, which ``calibrate`` measures as the part of a whole step
   that its ops alone do not explain, per line; plus a fixed ``framework_overhead_s`` per op.
2. **A collective.** Inside the sizes ``calibrate`` swept (on the ranks it swept), the measured curve,
   interpolated; elsewhere Hockney's α-β model on the ring (``collective_time``): ``steps(n)·α +
   bus_bytes·β`` with the α, β fitted to that sweep; plus the per-call overhead. (On a busy CPU the
   curve is no line: between about 64 kB and 1 MB a collective that follows compute often waits for
   the scheduler, and a line through the sweep would miss the steps' most common sizes.)
3. **The ranks together.** Each rank's recorded sequence of ops and collectives
   (:mod:`..workload`) is replayed on its own clock. A blocking collective starts when the last of its
   group arrives, and ends for all of them together (so a slow rank makes the others wait: the
   cost of imbalance is not a formula, it falls out). An asynchronous one (a DDP bucket, a pipeline's
   message) flies beside the compute. While the rank computes it starts ``async_start_s`` after its
   launch (on a busy CPU the communication thread waits for the scheduler to give it the core;
   a message whose receive was already posted when it was sent is written at once instead) and
   ``1 - overlap`` of the time it then moves is taken from the computation; while the rank waits it
   moves at once. The rank pays for it where the step waits for it. A receive waits for its message
   where it is waited on (a receive posted early, ``irecv``, costs nothing until then).
   The step is the last rank's finish.

The result says where the time went: ``compute_s`` (op seconds on the slowest rank), ``comm_s`` (its
collectives' seconds), ``exposed_comm_s`` (the part of the step that is neither compute nor
overhead: communication, and waiting for other ranks), ``overhead_s`` (the per-op and per-call costs).
"""
from __future__ import annotations

from collections import defaultdict, deque

from .collectives import collective_time

__all__ = ["op_seconds", "comm_seconds", "replay_step"]

_BLOCKING = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def op_seconds(op, profile, table=None) -> tuple[float, bool]:
    """``(seconds, from_table)`` of one recorded op (without the framework's per-op overhead)."""
    table = profile.kernels if table is None else table
    t = table.get(op.key) if table else None
    if t is not None:
        return t, True
    if op.kind in ("matmul", "attention"):
        return profile.matmul_seconds(op.flops, op.dtype), False
    if op.kind == "view":
        return profile.op_overhead_s, False
    return profile.op_overhead_s + op.nbytes / profile.copy_bytes_per_s, False


def comm_seconds(c, profile) -> float:
    """Seconds of one collective (or a point-to-point message) on ``c.group_size`` ranks: the measured
    sweep where it covers the size, else the ring's α-β time, plus the per-call overhead. A receive
    costs its send."""
    swept = profile.swept_seconds(c.op, c.nbytes, c.group_size)
    if swept is not None:  # inside the measured sweep: the curve itself (on a busy CPU it is no line)
        return swept + profile.collective_overhead_s
    alpha, beta = profile.alpha_beta(c.op)
    if c.op in ("send", "recv"):
        return alpha + c.nbytes * beta + profile.collective_overhead_s
    return collective_time(c.op, c.nbytes, c.group_size, alpha, beta) + profile.collective_overhead_s


class _Flight:
    """An asynchronous collective or message of this rank still moving: launched at ``launch``,
    ``remaining`` seconds of it at full speed; ``done(t)`` is called with the moment it completes;
    ``ready()``: True for a message whose receive was posted before it was sent (it moves at once)."""

    def __init__(self, launch, remaining, done, ready=lambda: False):
        self.launch, self.remaining, self.done, self.ready = launch, remaining, done, ready


class _Rank:
    """One rank's cursor through its recorded items, its clock, its communication in flight, its tallies."""

    def __init__(self, rank, items, profile):
        self.rank, self.items, self.i, self.clock = rank, items, 0, 0.0
        self.compute = self.comm = self.overhead = 0.0
        self.done_at: dict = {}  # index of an asynchronous Comm item -> when it completes
        self.flights: list = []  # in launch order: served one after the other
        self.table_ops = self.ops = 0
        self.spans: list = []
        self.asked: set = set()  # indices of the receives already posted
        self.moved = False  # a flush completed something since the replay last looked
        self.delay, self.steal = profile.async_start_s, 1.0 - profile.overlap

    def progress(self, t0: float, duration: float, computing: bool) -> float:
        """Move the flights over ``[t0, t0 + duration]``, first launched first. While the rank computes a
        flight starts only ``async_start_s`` after its launch, and ``1 - overlap`` of the time it moves
        is taken from the computation (returned); while the rank waits it moves at once, for free."""
        end, cursor, taken = t0 + duration, t0, 0.0
        while self.flights:
            f = self.flights[0]
            begin = max(cursor, f.launch + (self.delay if computing and not f.ready() else 0.0))
            if begin >= end:
                break
            move = min(f.remaining, end - begin)
            f.remaining -= move
            cursor = begin + move
            taken += move * self.steal if computing else 0.0
            if f.remaining > 1e-12:
                break
            self.flights.pop(0).done(cursor)
        return taken

    def flush(self) -> None:
        """The rank waits from now on: everything in flight moves at once and completes."""
        self.moved = self.moved or bool(self.flights)  # what it completes may unblock another rank
        self.progress(self.clock, float("inf"), False)


class _Net:
    """What the ranks share: arrivals at each collective, messages and asynchronous collectives."""

    def __init__(self, ranks, profile):
        self.ranks, self.profile = ranks, profile
        self.arrived = defaultdict(dict)  # (group, k) -> {rank: (arrival, item index)}
        self.seen = defaultdict(int)  # (rank, group) -> collectives met so far
        self.sent = defaultdict(deque)  # (src, dst) -> arrival times of messages that have arrived
        self.async_done = defaultdict(dict)  # (group, k) -> {rank: when its share completed}
        self.posted = defaultdict(list)  # (src, dst) -> when dst posted (or blocked in) each receive
        self.n_sent = defaultdict(int)  # (src, dst) -> messages sent so far


def replay_step(traces: dict, profile) -> dict:
    """Replay every rank's recorded step (``{rank: items}``) on ``profile``; see the module docstring.

    Returns ``{"step_s", "compute_s", "comm_s", "exposed_comm_s", "overhead_s", "per_rank": {...},
    "table_coverage"}`` where the totals are those of the rank that finishes last.
    """
    ranks = {k: _Rank(k, list(v), profile) for k, v in traces.items()}
    net = _Net(ranks, profile)
    progress = True
    while progress:  # one item at a time, the rank furthest behind first: the ranks' clocks stay close,
        progress = False  # so a send knows whether its receive was already posted
        for r in sorted(ranks.values(), key=lambda q: q.clock):
            if r.i < len(r.items) and _advance(r, net):
                progress = True
            elif r.i == len(r.items) and r.flights:
                r.flush()  # the step's end waits for whatever is still in flight
            progress, r.moved = progress or r.moved, False
            if progress:
                break
    stuck = [r.rank for r in ranks.values() if r.i < len(r.items)]
    if stuck:
        raise ValueError(f"the recorded steps do not match up: ranks {stuck} wait on a collective or a "
                         f"message no other rank recorded (record every rank of the step)")
    for r in ranks.values():  # the step ends when its last asynchronous work has
        r.clock = max([r.clock, *r.done_at.values()])
    return _result(ranks)


def _advance(r, net) -> bool:
    """Take one step of rank ``r``; False when it must wait for another rank (it then waits: what it
    has in flight moves at full speed)."""
    item, profile = r.items[r.i], net.profile
    kind = type(item).__name__
    if kind == "Op":
        _run_op(r, item, profile)
    elif kind == "Mark":
        r.spans.append((item.name, item.edge, r.clock))
    elif kind == "Wait":
        if not _wait(r, item, net):
            return False
    elif item.op == "send":
        _send(r, item, net)
    elif item.op == "recv":
        if not _post_receive(r, item, net):
            return False
    elif not _collective(r, item, net):
        r.flush()
        return False
    r.i += 1
    return True


def _wait(r, item, net) -> bool:
    """``work.wait()`` of an earlier asynchronous call; False while it cannot end yet."""
    posted = r.items[item.ref]
    if posted.async_op and posted.op == "recv":  # a receive posted earlier: wait for its message
        return _receive(r, posted, net)
    if posted.async_op:  # a blocking call has already ended where it stood
        if item.ref not in r.done_at:
            r.flush()
            if item.ref not in r.done_at:
                return False  # its collective still waits for another rank
        _wait_until(r, r.done_at[item.ref])
    return True


def _post_receive(r, item, net) -> bool:
    """A receive: posted now (once); a blocking one also waits for its message (False until it came)."""
    if r.i not in r.asked:
        r.asked.add(r.i)
        net.posted[(item.peer, r.rank)].append(r.clock)
    if not item.async_op and not _receive(r, item, net):
        return False  # a posted receive (irecv) waits where its work is waited on
    return True


def _receive(r, c, net) -> bool:
    """The rank waits for the next message from ``c.peer``; False while none has been sent yet."""
    queue = net.sent[(c.peer, r.rank)]
    if not queue:
        r.flush()
        return False
    _wait_until(r, queue.popleft())
    return True


def _wait_until(r, t: float) -> None:
    """The rank is idle until ``t``: its flights move at full speed meanwhile."""
    if t > r.clock:
        r.progress(r.clock, t - r.clock, False)
        r.clock = t


def _run_op(r, op, profile) -> None:
    t, hit = op_seconds(op, profile)
    framework = profile.framework_overhead_s + op.lines * profile.python_line_s
    d = t + framework
    taken = r.progress(r.clock, d, True)  # communication in flight, beside (or in the way of) the op
    r.compute += t
    r.overhead += framework
    r.clock += d + taken
    r.ops += 1
    r.table_ops += hit


def _send(r, c, net) -> None:
    """A message: a blocking send holds the rank until it is delivered; an asynchronous one flies while
    the rank goes on, and arrives when it has been moved (:meth:`_Rank.progress`)."""
    t = comm_seconds(c, net.profile)
    r.comm += t
    queue = net.sent[(r.rank, c.peer)]
    if c.async_op:
        index, launch, k = r.i, r.clock, net.n_sent[(r.rank, c.peer)]
        net.n_sent[(r.rank, c.peer)] += 1
        busy = r.i + 1 < len(r.items) and type(r.items[r.i + 1]).__name__ == "Op"  # it computes next
        posted = net.posted[(r.rank, c.peer)]
        ready = lambda: len(posted) > k and posted[k] <= launch  # the receiver is waiting

        def delivered(at, index=index):
            if busy and not ready():  # sent before compute, asked for later: no sooner than that
                at = max(at, launch + r.delay)
            r.done_at[index] = at
            queue.append(at)
        r.flights.append(_Flight(launch, t, delivered, ready))
    else:
        _wait_until(r, r.clock + t)
        queue.append(r.clock)


def _collective(r, c, net) -> bool:
    """The k-th collective on group ``c.ranks``. A blocking one starts when every member has arrived and
    holds them all until it ends; an asynchronous one flies on each member from its launch, and ends for
    all when every member's share has been moved and not before the last arrival plus its time."""
    group = tuple(c.ranks) or tuple(sorted(net.ranks))
    members = [m for m in group if m in net.ranks]
    key = (group, net.seen[(r.rank, group)])
    arrived = net.arrived[key]
    arrived.setdefault(r.rank, (r.clock, r.i))
    t = comm_seconds(c, net.profile)
    if not c.async_op:
        if len(arrived) < len(members):
            return False
        r.comm += t
        _wait_until(r, max(a for a, _ in arrived.values()) + t)
    else:
        r.comm += t
        share = lambda at, key=key: _share_done(net, key, r.rank, at, members, t)
        r.flights.append(_Flight(r.clock, t, share))
    net.seen[(r.rank, group)] += 1
    return True


def _share_done(net, key, rank, at, members, t) -> None:
    shares = net.async_done[key]
    shares[rank] = at
    arrived = net.arrived[key]
    if len(shares) == len(members) and len(arrived) == len(members):
        end = max(max(shares.values()), max(a for a, _ in arrived.values()) + t)
        for m, (_, index) in arrived.items():
            net.ranks[m].done_at[index] = end


def _result(ranks) -> dict:
    last = max(ranks.values(), key=lambda r: r.clock)
    ops = sum(r.ops for r in ranks.values())
    per_rank = {k: {"step_s": r.clock, "compute_s": r.compute, "comm_s": r.comm, "overhead_s": r.overhead,
                    "spans": r.spans} for k, r in ranks.items()}
    exposed = max(0.0, last.clock - last.compute - last.overhead)
    return {"step_s": last.clock, "compute_s": last.compute, "comm_s": last.comm, "exposed_comm_s": exposed,
            "overhead_s": last.overhead, "per_rank": per_rank,
            "table_coverage": sum(r.table_ops for r in ranks.values()) / ops if ops else 1.0}
