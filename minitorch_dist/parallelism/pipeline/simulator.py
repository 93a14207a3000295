"""Chapter 03 — time a pipeline schedule from action durations: each stage's timeline, makespan,
bubble, and the activations it stashes; and check that the schedule can run at all (no deadlock).

A :class:`~.schedules.Schedule` only fixes the *order* of work on each stage. Time follows from
two rules (the discrete-event model behind GPipe's Fig. 2, Huang et al. 2019, and Megatron-LM's
Fig. 3-4, Narayanan et al. 2021 §2.2):

1. a stage runs its own list in order, one action at a time;
2. an action starts when its stage is free *and* its inputs exist::

       start(a) = max(end of the previous action on the stage,
                      max over dependencies d of  end(d) + p2p * [d is on another stage])

With ``V = p*v`` virtual stages (chunk ``c`` of rank ``r`` is virtual stage ``c*p + r``, or in a V
``r`` and ``2p-1-r``: ``Schedule.virtual_stage``):

* F(i, s) needs F(i, s-1), the activation from the stage before (s > 0);
* B(i, s) needs B(i, s+1), the gradient from the stage after (s < V-1), and F(i, s), its own
  stashed activation;
* W(i, s) needs B(i, s) (Qi et al. 2024 §2: the weight gradient reuses B's output gradient);
* the F of an overlapped "F&B" pair (DualPipeV, ``Schedule.overlapped``) also needs what its B
  receives from another rank: the pair is launched once both inputs are there, as
  deepseek-ai/DualPipe's ``_forward_backward_chunk`` does.

Durations are per microbatch for a rank's *whole* share of the model, so one of ``v`` chunks
takes ``t/v``. An unsplit backward takes ``t_b + t_w``; a split one runs ``t_b`` (input gradient)
in B and ``t_w`` (weight gradient) in W. A B is split when its (microbatch, chunk) has a W
(``Schedule.split``): in every B of a zero-bubble schedule, in some of DualPipeV's.

Dependencies between two chunks of the *same* rank (the turn at the bottom of a V) cost no ``p2p``.
DualPipeV's overlapped "F&B" pairs are timed as their two actions back to back (``F&B = F + B``):
compute on one device is serial; what the overlap hides is communication (in DeepSeek-V3, the MoE
all-to-all), which this model has only as the ``p2p`` delay on a dependency, and does not hide.

What comes out, for stage r with busy time ``busy_r = sum of its action durations``:

* makespan ``T = max end``; idle ``T - busy_r``; bubble fraction ``sum_r idle_r / (p T)``.
  With equal times GPipe and 1F1B give ``T = (m+p-1)(t_F+t_B)``, i.e. a bubble of
  ``(p-1)/(m+p-1)`` (GPipe §2.2); with latency every one of the ``2(p-1)`` hops of the critical
  path adds ``p2p``: ``T = (m+p-1)(t_F+t_B) + 2(p-1) p2p``.
* peak stashed activations: microbatch i's chunk is held from the *start* of its F to the *end*
  of its last backward part (W if split, else B), and counts ``1/v`` of a microbatch. GPipe
  peaks at ``m``, 1F1B at ``min(p - r, m)`` (Narayanan et al. 2021, PipeDream-2BW §3.1); ZB-V at
  ``p`` on every rank (Qi et al. 2024 §6), DualPipeV at ``p + 1/2`` on every rank
  (:mod:`~minitorch_dist.costmodel.pipeline`).

The same replay, with any durations, decides whether the schedule deadlocks: if no stage can
start its next action, :func:`check_dependencies` names each stuck stage and what it waits for.
Weight versions under asynchronous pipelining (PipeDream, PipeDream-2BW) are in :mod:`.pipedream`.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass

from ...runtime.timeline import Event, plot_gantt
from .schedules import Action, Schedule

COLORS = {"F": "#4C72B0", "B": "#55A868", "W": "#DD8452"}  # forward blue, backward green, weight-grad orange


@dataclass
class Simulation:
    """A timed schedule. Per-stage lists are indexed by stage (rank)."""

    schedule: Schedule
    events: list[Event]          # one per action: rank=stage, name="F3", category="F", meta={"mb", "chunk"}
    makespan: float              # end of the last action (the step time)
    busy: list[float]            # per stage: sum of its action durations
    idle: list[float]            # per stage: makespan - busy
    bubble_fraction: float       # sum(idle) / (p * makespan)
    peak_stashed: list[float]    # per stage: most microbatches' activations held at once (a chunk = 1/v)

    def stage_events(self, rank: int) -> list[Event]:
        """The events of one stage, in start order."""
        return sorted((e for e in self.events if e.rank == rank), key=lambda e: e.t_start)


# --- the dependency graph -------------------------------------------------------------------

def _dependencies(schedule: Schedule, rank: int, a: Action) -> list[tuple[int, Action]]:
    """``(rank, action)`` pairs that must finish before ``a`` (run on ``rank``) can start."""
    n_virtual = schedule.p * schedule.v
    s = schedule.virtual_stage(rank, a.chunk)
    if a.kind == "F":
        if s == 0:
            return []
        r, c = schedule.placement(s - 1)
        return [(r, Action("F", a.mb, c))]
    if a.kind == "B":
        deps = [(rank, Action("F", a.mb, a.chunk))]
        if s < n_virtual - 1:
            r, c = schedule.placement(s + 1)
            deps.append((r, Action("B", a.mb, c)))
        return deps
    assert a.kind == "W"
    return [(rank, Action("B", a.mb, a.chunk))]


def _dependencies_of(schedule: Schedule, rank: int, a: Action) -> list[tuple[int, Action]]:
    """:func:`_dependencies`, and for the F of an overlapped "F&B" pair also what its B receives from
    another rank: the pair starts when both inputs are there (DualPipe's ``_forward_backward_chunk``)."""
    deps = _dependencies(schedule, rank, a)
    b = schedule.paired_backward(rank, a)
    if b is not None:
        deps += [d for d in _dependencies(schedule, rank, b) if d[0] != rank]
    return deps


def _check_structure(schedule: Schedule) -> None:
    """Every (microbatch, chunk) has exactly one F and one B (and one W iff split) on its stage."""
    p, m, v = schedule.p, schedule.m, schedule.v
    if len(schedule.stages) != p:
        raise ValueError(f"schedule {schedule.name!r} has {len(schedule.stages)} stage lists for p={p} "
                         "stages")
    kinds = ("F", "B", "W") if schedule.splits_backward else ("F", "B")
    needed = ("F", "B") if schedule.mixed_backward else kinds  # DualPipeV: a W only where B is split
    for r, acts in enumerate(schedule.stages):
        for a, n in Counter(acts).items():
            if a.kind not in kinds:
                raise ValueError(f"stage {r} has action {a} of unknown kind {a.kind!r}; "
                                 f"expected one of {kinds}")
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                raise ValueError(f"stage {r} has {a}, outside microbatches 0..{m - 1} / chunks 0..{v - 1} "
                                 f"of schedule {schedule.name!r} (m={m}, v={v})")
            if n > 1:
                raise ValueError(f"stage {r} runs {a} {n} times; each action must appear exactly once")
        have = set(acts)
        for c in range(v):
            for i in range(m):
                for k in needed:
                    if Action(k, i, c) not in have:
                        extra = " (the schedule splits backward, so every B needs its W)" if k == "W" else ""
                        raise ValueError(f"schedule {schedule.name!r} is missing {Action(k, i, c)} on stage "
                                         f"{r}: each microbatch needs one {'/'.join(kinds)} per chunk on "
                                         f"every stage{extra}")


def _waiting_on(schedule: Schedule, rank: int, a: Action) -> int | None:
    """The other stage whose next action may wait for ``a`` (run on ``rank``): F feeds the next
    virtual stage's F, B the previous one's B; W feeds nobody."""
    s = schedule.virtual_stage(rank, a.chunk)
    if a.kind == "F" and s < schedule.p * schedule.v - 1:
        return schedule.placement(s + 1)[0]
    if a.kind == "B" and s > 0:
        return schedule.placement(s - 1)[0]
    return None


def _replay(schedule: Schedule, duration,
            p2p: float) -> dict[tuple[int, Action], tuple[float, float]]:
    """List-schedule every stage's actions in order; ``{(rank, action): (start, end)}``.

    A stage runs its next actions as long as all their dependencies have *run* (times then follow
    from the max rule, so the visiting order does not change them); a finished action puts the
    stage that may wait for it back on the to-visit list. Each action is run once, so the replay
    takes time proportional to the number of actions. Raises ValueError naming the stuck actions
    when nothing is left to visit but actions are: a deadlock. ``duration(rank, action)`` -> time.
    """
    _check_structure(schedule)
    p = schedule.p
    done: dict[tuple[int, Action], tuple[float, float]] = {}
    nxt = [0] * p
    free = [0.0] * p
    todo, listed = deque(range(p)), [True] * p
    while todo:
        r = todo.popleft()
        listed[r] = False
        acts = schedule.stages[r]
        while nxt[r] < len(acts):
            a = acts[nxt[r]]
            deps = _dependencies_of(schedule, r, a)
            if any(d not in done for d in deps):
                break
            start = max([free[r]] + [done[(dr, da)][1] + (p2p if dr != r else 0.0) for dr, da in deps])
            end = start + duration(r, a)
            done[(r, a)] = (start, end)
            free[r] = end
            nxt[r] += 1
            q = _waiting_on(schedule, r, a)
            if q is not None and q != r and not listed[q]:
                todo.append(q)
                listed[q] = True
    if all(nxt[r] == len(schedule.stages[r]) for r in range(p)):
        return done
    raise ValueError(_deadlock_message(schedule, nxt, done))


def _deadlock_message(schedule: Schedule, nxt: list[int], done: dict) -> str:
    lines = []
    for r in range(schedule.p):
        acts = schedule.stages[r]
        if nxt[r] == len(acts):
            continue
        a = acts[nxt[r]]
        waits = []
        for dr, da in _dependencies_of(schedule, r, a):
            if (dr, da) in done:
                continue
            where = acts.index(da) if dr == r else schedule.stages[dr].index(da)
            if dr == r:
                waits.append(f"{da}, which stage {r} itself runs later (position {where} of its list)")
            else:
                blocked = schedule.stages[dr][nxt[dr]] if nxt[dr] < len(schedule.stages[dr]) else None
                waits.append(f"{da} on stage {dr} (position {where} there; stage {dr} is stuck at {blocked})")
        lines.append(f"  stage {r} is stuck at {a} (position {nxt[r]}): waits for " + " and ".join(waits))
    return (f"schedule {schedule.name!r} (p={schedule.p}, m={schedule.m}, v={schedule.v}) deadlocks; "
            f"reorder so every action's inputs are produced before it is due:\n" + "\n".join(lines))


def check_dependencies(schedule: Schedule) -> None:
    """Raise ValueError if ``schedule`` is incomplete or cannot run (a deadlock), naming the stuck
    stage(s) and the action each waits for. Returns None for a valid dependency order."""
    _replay(schedule, lambda r, a: 1.0, 0.0)


# --- timing ---------------------------------------------------------------------------------

def simulate(schedule: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
             p2p: float = 0.0) -> Simulation:
    """Time ``schedule``: F takes ``t_f/v``; B ``t_b/v`` if it is split (a W follows for its
    microbatch and chunk), else ``(t_b + t_w)/v``; W ``t_w/v``; every dependency between two ranks
    adds ``p2p``. See the module docstring for the rules and what each field means."""
    for name, t in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w), ("p2p", p2p)):
        if not t >= 0:
            raise ValueError(f"{name} must be a duration >= 0, got {t!r}")
    v = schedule.v
    whole = {"F": t_f / v, "B": (t_b + t_w) / v, "W": t_w / v}

    def duration(r: int, a: Action) -> float:
        return t_b / v if a.kind == "B" and schedule.split(r, a.mb, a.chunk) else whole[a.kind]

    times = _replay(schedule, duration, p2p)

    events = [Event(r, str(a), a.kind, s, e, {"mb": a.mb, "chunk": a.chunk})
              for (r, a), (s, e) in sorted(times.items(), key=lambda kv: (kv[1][0], kv[0][0]))]
    makespan = max((e for _, e in times.values()), default=0.0)
    busy = [sum(duration(r, a) for a in acts) for r, acts in enumerate(schedule.stages)]
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (schedule.p * makespan) if makespan > 0 else 0.0
    peak = []
    for r in range(schedule.p):
        # +1 chunk at the start of each F, -1 at the end of its last backward part (W if split, else
        # B); at equal times releases go first (a backward that ends as a forward starts frees its slot).
        marks = sorted([(times[(r, a)][0], 1) for a in schedule.stages[r] if a.kind == "F"]
                       + [(times[(r, a)][1], -1) for a in schedule.stages[r]
                          if a.kind == "W" or (a.kind == "B" and not schedule.split(r, a.mb, a.chunk))])
        held = most = 0
        for _, delta in marks:
            held += delta
            most = max(most, held)
        peak.append(most / v)
    return Simulation(schedule, events, makespan, busy, idle, bubble, peak)


def gantt(sim: Simulation, ax=None, title: str | None = None):
    """Gantt chart of a simulation (one row per stage; F blue, B green, W orange).

    ``plot_gantt`` reads times as seconds and draws milliseconds, so the events are scaled by
    1e-3 here: the x axis then reads in the units of ``t_f``, ``t_b``, ``t_w``."""
    scaled = [Event(e.rank, e.name, e.category, e.t_start * 1e-3, e.t_end * 1e-3, e.meta) for e in sim.events]
    s = sim.schedule
    if title is None:
        chunks = f", v={s.v}" if s.v > 1 else ""
        title = f"{s.name}: p={s.p}, m={s.m}{chunks}, bubble {sim.bubble_fraction:.1%}"
    ax = plot_gantt(scaled, ax=ax, colors=COLORS, title=title)
    ax.set_xlabel("time (units of t_f, t_b, t_w)")
    ax.set_yticks(range(s.p), [f"stage {r}" for r in range(s.p)])
    return ax
