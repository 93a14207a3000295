"""Chapter 00 — step time from a machine profile: each op's seconds, each collective's, the ranks replayed.

A training step's time is predicted in three layers, each a formula fed only by a machine profile
(:mod:`..profiles`: calibrated here or shipped with citations), never by a free efficiency:

1. **An op.** If the profile's kernel table holds the op with these shapes (``calibrate`` timed it
   alone, every rank busy), that time. Otherwise the roofline of its kind (Williams et al. 2009):
   a GEMM or attention kernel takes the profile's GEMM time for its FLOPs, an elementwise op
   ``op_overhead + bytes / copy bandwidth``, a view ``op_overhead``. Every op also pays the
   framework's fixed cost per op (``framework_overhead_s``: Python, the dispatcher, autograd's
   engine), which ``calibrate`` measures as the part of a whole step its ops alone do not explain.
2. **A collective.** Hockney's α-β model on the ring (``collective_time``): ``steps(n)·α + bus_bytes·β``
   with the α, β fitted to this collective's measured sweep, plus the per-call overhead. (The sweep
   itself is kept in the profile: on a busy CPU it is noisy point to point, and the fitted line
   averages that noise out, where interpolating between the points would carry it into every step.)
3. **The ranks together.** Each rank's recorded sequence of ops and collectives
   (:mod:`..workload`) is replayed on its own clock. A blocking collective starts when the last of its
   group arrives, and ends for all of them together (so a slow rank makes the others wait: the
   cost of imbalance is not a formula, it falls out). An asynchronous one (a DDP bucket) runs
   beside the compute; a fraction ``1 - overlap`` of it still takes the compute's place (on a CPU
   the communication thread needs a core), and the rank waits for it when backward ends. A
   receive waits for its send, which arrives α + bytes·β after it left. The step is the last rank's finish.

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
    """Seconds of one collective (or a point-to-point message) on ``c.group_size`` ranks: the ring's
    α-β time with this collective's α, β, plus the per-call overhead. A receive costs its send."""
    alpha, beta = profile.alpha_beta(c.op)
    if c.op in ("send", "recv"):
        return alpha + c.nbytes * beta + profile.collective_overhead_s
    return collective_time(c.op, c.nbytes, c.group_size, alpha, beta) + profile.collective_overhead_s


class _Rank:
    """One rank's cursor through its recorded items, its clock and its tallies."""

    def __init__(self, rank, items):
        self.rank, self.items, self.i, self.clock = rank, items, 0, 0.0
        self.compute = self.comm = self.overhead = 0.0
        self.done_at: dict = {}  # index of an asynchronous Comm item -> when it completes
        self.table_ops = self.ops = 0
        self.spans: list = []


class _Net:
    """What the ranks share: arrivals at each collective, messages in flight."""

    def __init__(self, ranks, profile):
        self.ranks, self.profile = ranks, profile
        self.arrived = defaultdict(dict)  # (group, k) -> {rank: (arrival, item index)}
        self.seen = defaultdict(int)  # (rank, group) -> collectives met so far
        self.sent = defaultdict(deque)  # (src, dst) -> arrival times of messages in flight


def replay_step(traces: dict, profile) -> dict:
    """Replay every rank's recorded step (``{rank: items}``) on ``profile``; see the module docstring.

    Returns ``{"step_s", "compute_s", "comm_s", "exposed_comm_s", "overhead_s", "per_rank": {...},
    "table_coverage"}`` where the totals are those of the rank that finishes last.
    """
    ranks = {k: _Rank(k, list(v)) for k, v in traces.items()}
    net = _Net(ranks, profile)
    progress = True
    while progress:
        progress = False
        for r in ranks.values():
            while r.i < len(r.items) and _advance(r, net):
                progress = True
    stuck = [r.rank for r in ranks.values() if r.i < len(r.items)]
    if stuck:
        raise ValueError(f"the recorded steps do not match up: ranks {stuck} wait on a collective or a "
                         f"message no other rank recorded (record every rank of the step)")
    for r in ranks.values():  # the step ends when its last asynchronous work has
        r.clock = max([r.clock, *r.done_at.values()])
    return _result(ranks)


def _advance(r, net) -> bool:
    """Take one step of rank ``r``; False when it must wait for another rank."""
    item, profile = r.items[r.i], net.profile
    kind = type(item).__name__
    if kind == "Op":
        _run_op(r, item, profile)
    elif kind == "Mark":
        r.spans.append((item.name, item.edge, r.clock))
    elif kind == "Wait":
        if r.items[item.ref].async_op:  # a blocking call (a receive) has already ended where it stood
            if item.ref not in r.done_at:
                return False  # its collective has not started on every rank yet
            r.clock = max(r.clock, r.done_at[item.ref])
    elif item.op == "send":
        t = comm_seconds(item, profile)
        net.sent[(r.rank, item.peer)].append(r.clock + t)
        _charge(r, item, r.clock, t, profile)
    elif item.op == "recv":
        queue = net.sent[(item.peer, r.rank)]
        if not queue:
            return False
        r.clock = max(r.clock, queue.popleft())
    elif not _collective(r, item, net):
        return False
    r.i += 1
    return True


def _run_op(r, op, profile) -> None:
    t, hit = op_seconds(op, profile)
    r.compute += t
    r.overhead += profile.framework_overhead_s
    r.clock += t + profile.framework_overhead_s
    r.ops += 1
    r.table_ops += hit


def _charge(r, c, start, t, profile) -> None:
    """A collective or message of ``t`` seconds starting at ``start``: a blocking one holds the rank until
    it ends; an asynchronous one ends then in the background, and ``1 - overlap`` of it takes the core."""
    r.comm += t
    if c.async_op:
        r.done_at[r.i] = start + t
        r.clock += (1 - profile.overlap) * t
    else:
        r.clock = max(r.clock, start + t)


def _collective(r, c, net) -> bool:
    """The k-th collective on group ``c.ranks`` starts when every member has arrived at it: a blocking
    one waits for that; an asynchronous one does not (its members learn its end when the last arrives)."""
    group = tuple(c.ranks) or tuple(sorted(net.ranks))
    key = (group, net.seen[(r.rank, group)])
    arrived = net.arrived[key]
    arrived.setdefault(r.rank, (r.clock, r.i))
    members = [m for m in group if m in net.ranks]
    if len(arrived) < len(members) and not c.async_op:
        return False
    net.seen[(r.rank, group)] += 1
    if len(arrived) == len(members):
        start, t = max(a for a, _ in arrived.values()), comm_seconds(c, net.profile)
        for m, (_, index) in arrived.items():
            other = net.ranks[m]
            if c.async_op:
                other.done_at[index] = start + t
            if m == r.rank:
                _charge(r, c, start, t, net.profile)
            elif not c.async_op:
                pass  # a blocking member still waiting is charged when it retries
    elif c.async_op:  # not everyone is here yet: the core cost now, the end when the last arrives
        r.comm += comm_seconds(c, net.profile)
        r.clock += (1 - net.profile.overlap) * comm_seconds(c, net.profile)
    return True


def _result(ranks) -> dict:
    last = max(ranks.values(), key=lambda r: r.clock)
    ops = sum(r.ops for r in ranks.values())
    per_rank = {k: {"step_s": r.clock, "compute_s": r.compute, "comm_s": r.comm, "overhead_s": r.overhead,
                    "spans": r.spans} for k, r in ranks.items()}
    exposed = max(0.0, last.clock - last.compute - last.overhead)
    return {"step_s": last.clock, "compute_s": last.compute, "comm_s": last.comm, "exposed_comm_s": exposed,
            "overhead_s": last.overhead, "per_rank": per_rank,
            "table_coverage": sum(r.table_ops for r in ranks.values()) / ops if ops else 1.0}
