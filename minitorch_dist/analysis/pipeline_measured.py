"""Chapter 03 — the bubble measured: a real pipeline step's per-rank timeline beside the simulator fed
with stage times measured apart, and where the difference goes.

Each rank times its own stage's F, B and W alone (no message; both ranks busy, as in a step) between
the steps that the executor runs while a :class:`~minitorch_dist.runtime.timeline.Timeline` listens
(``observe.watching``: the executor announces each action as a span); on rank r, idle = makespan
− Σ its action spans. :func:`simulate_stages` plays the simulator's rules with each stage's own
times (the first stage embeds, the last takes the loss) and a message time ``p2p`` per hop (e.g.
the profile's one-way send); :func:`idle_breakdown` splits a timeline's idle into waiting for the
other stage, messages, gaps between actions, and the drain;
:func:`late_message` times a receive whose sender went on computing after posting it (and the same
receive posted before the receiver's own compute, as the executor posts it).

Clocks. Every measured duration goes through :mod:`~minitorch_dist.runtime.timing`, which waits for
the device before and after: on a GPU a pass is its kernels done, not their launch. A receive's wait
is timed there by CUDA events on the compute stream (from the end of the compute queued before it to
the message's arrival), since waiting for the whole device would also wait for a receive already
posted. On a GPU the step's timeline waits for the device at every span's edge
(``Timeline(cuda_sync=True)``), which also waits for sends still in flight: its spans can only be
longer than the kernels they launched.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..models.data import MarkovCorpus
from ..models.gpt import GPT
from ..parallelism.pipeline.executor import local_stages, run_schedule
from ..parallelism.pipeline.schedules import Action, make_schedule, validate_structure
from ..parallelism.pipeline.simulator import check_dependencies
from ..parallelism.pipeline.zero_bubble import LinearTap, b_params, backward_input, backward_weights
from ..runtime import observe
from ..runtime.launch import device as rank_device
from ..runtime.launch import launch
from ..runtime.timeline import Event, Timeline
from ..runtime.timing import seconds, timed_runs

__all__ = ["build_step", "time_stage_alone", "measure_pipeline", "simulate_stages",
           "late_message", "message_delays", "idle_breakdown"]


def build_step(name: str, size: str, m: int, p: int, seed: int = 0):
    """This rank's step of schedule ``name`` on ``p`` ranks for the GPT of :mod:`~minitorch_dist.analysis.
    techniques` at ``size``, its global batch cut into ``m`` microbatches: ``(step, schedule, stage,
    x, y)``; ``step()`` runs the schedule, then AdamW, and returns the PipelineResult."""
    from . import techniques as T

    cfg = T.model_config(size)
    torch.manual_seed(seed)
    model = GPT(cfg)
    schedule = make_schedule(name, p, m)
    stages = local_stages(model, schedule)
    opt = torch.optim.AdamW(stages[0].parameters(), lr=T.LR)
    x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, T.GLOBAL_BATCH[size], cfg.block_size)

    def step():
        opt.zero_grad()
        res = run_schedule(schedule, stages, x, y)
        opt.step()
        return res

    return step, schedule, stages[0], x, y


def _timed(device, fn: Callable[..., object], *args) -> tuple[object, float]:
    """``fn(*args)``'s result and its seconds, ``device`` waited for before and after it."""
    out = []
    t = seconds(lambda: out.append(fn(*args)), reps=1, warmup=0, device=device)
    return out[0], t


def time_stage_alone(schedule, stage, x, y, rounds: int = 1) -> dict:
    """Seconds ``{"F": [...], "B": [...], "W": [...]}`` of this rank's actions on one microbatch each,
    with no message: ``rounds`` times all m forwards, then all m backwards (B then W when the schedule
    splits them). The input is the tokens (first stage) or a random activation, the output gradient
    random: the step's arithmetic, not its values. W is 0 for an unsplit backward."""
    m, split = schedule.m, schedule.splits_backward
    taps = LinearTap([stage]) if split else None
    own = b_params(stage)
    ids = {id(q) for q in own}
    times = {"F": [], "B": [], "W": []}
    like = next(stage.parameters())  # the boundary activation lives where the stage does
    where = like.device

    def forward(inp, ys):
        return stage(inp, ys) / m if stage.is_last else stage(inp)
    for _ in range(rounds):
        live = []
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            inp = xs if stage.is_first else torch.randn(stage.boundary_shape(*xs.shape), dtype=like.dtype,
                                                        device=where, requires_grad=True)
            seen = [] if split else None  # split: the Linear inputs and outputs B and W need
            if split:
                taps.active = seen
            out, t = _timed(where, forward, inp, ys)
            times["F"].append(t)
            live.append((inp, out, seen))
        for inp, out, seen in live:
            g = None if stage.is_last else torch.randn_like(out)
            if split:
                (_, stash), t = _timed(where, backward_input, out, g, None if stage.is_first else inp, seen,
                                       own)
                times["B"].append(t)
                times["W"].append(_timed(where, backward_weights, stash, ids)[1])
            else:
                times["B"].append(_timed(where, torch.autograd.backward, out, g)[1])
                times["W"].append(0.0)
    if split:
        taps.remove()
    stage.zero_grad(set_to_none=True)
    return times


def _rank(name: str, size: str, m: int, reps: int, origin: float) -> dict:
    step, schedule, stage, x, y = build_step(name, size, m, dist.get_world_size())
    where = next(stage.parameters()).device
    step()  # warm-up: AdamW's state, the first messages
    time_stage_alone(schedule, stage, x, y)  # warm-up
    alone, steps, step_s = {"F": [], "B": [], "W": []}, [], []
    for _ in range(reps):  # alternate, so that both see the machine in the same state
        dist.barrier()
        for k, v in time_stage_alone(schedule, stage, x, y).items():
            alone[k] += v
        dist.barrier()  # start the step together
        # one clock for every rank: the parent's time.monotonic(); on a GPU, spans wait for the device
        tl = Timeline(origin=origin, cuda_sync=where.type == "cuda")
        step_s.append(_timed(where, _watched, tl, step)[1])
        steps.append(tl.events)
    return {"alone": {k: statistics.median(v) for k, v in alone.items()}, "steps": steps, "step_s": step_s}


def _watched(tl: Timeline, step: Callable[[], object]) -> None:
    """``step()`` while ``tl`` records the spans the executor announces."""
    with observe.watching(tl):
        step()


def measure_pipeline(name: str, size: str, m: int, p: int = 2, reps: int = 5, timeout_s: float = 300) -> dict:
    """Launch ``p`` ranks; after a warm-up each alternates ``reps`` times: its stage alone
    (:func:`time_stage_alone`, all m microbatches), then one step with a timeline. Returns ``{"schedule",
    "alone": [rank r's median {"F","B","W"} seconds], "events": every rank's action spans in the step
    of median makespan, "step_s": each step's slowest rank (the optimizer included)}``."""
    out = launch(_rank, p, name, size, m, reps, time.monotonic(), timeout_s=timeout_s)
    events = [[e for r in out for e in r["steps"][i]] for i in range(reps)]
    spans = [max(e.t_end for e in ev) - min(e.t_start for e in ev) for ev in events]
    median = sorted(range(reps), key=spans.__getitem__)[reps // 2]
    return {"schedule": make_schedule(name, p, m), "alone": [r["alone"] for r in out],
            "events": events[median], "step_s": [max(r["step_s"][i] for r in out) for i in range(reps)]}


def _inputs(schedule, r: int, a: Action) -> list[tuple[int, Action]]:
    """``(rank, action)`` that must end before ``a`` runs on rank ``r`` (one chunk per rank): the
    simulator's dependencies -- F after the previous stage's F; B after its own F and the next
    stage's B; W after its own B."""
    if a.kind == "F":
        return [(r - 1, a)] if r > 0 else []
    if a.kind == "B":
        return [(r, Action("F", a.mb))] + ([(r + 1, a)] if r < schedule.p - 1 else [])
    return [(r, Action("B", a.mb))]


def simulate_stages(schedule, times: list[dict], p2p: float = 0.0) -> dict:
    """The simulator's two rules (:mod:`.simulator`) with rank r's own ``times[r]`` = ``{"F","B","W"}``
    seconds (B takes B + W when the schedule does not split the backward) and ``p2p`` seconds on every
    cross-stage dependency. Returns ``{"events": [Event], "makespan", "idle": per rank, fraction of
    the makespan, "bubble": their mean}``; equal times give :func:`.simulate`'s numbers."""
    if schedule.v != 1:
        raise ValueError(f"simulate_stages times one chunk per rank; {schedule.name!r} has v={schedule.v}: "
                         f"use simulator.simulate for interleaved schedules")
    validate_structure(schedule)
    check_dependencies(schedule)  # a deadlock is named there
    split = schedule.splits_backward
    dur = [{"F": t["F"], "B": t["B"] if split else t["B"] + t["W"], "W": t["W"]} for t in times]
    done, nxt, free = {}, [0] * schedule.p, [0.0] * schedule.p
    progress = True
    while progress:  # every rank runs its list in order while its next action's inputs exist
        progress = False
        for r, acts in enumerate(schedule.stages):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                deps = _inputs(schedule, r, a)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d][1] + (p2p if d[0] != r else 0.0) for d in deps])
                done[(r, a)] = (start, start + dur[r][a.kind])
                free[r], nxt[r], progress = start + dur[r][a.kind], nxt[r] + 1, True
    makespan = max(e for _, e in done.values())
    idle = [1.0 - sum(dur[r][a.kind] for a in acts) / makespan for r, acts in enumerate(schedule.stages)]
    events = [Event(r, str(a), a.kind, s, e, {"mb": a.mb}) for (r, a), (s, e) in sorted(done.items(),
                                                                                     key=lambda kv: kv[1])]
    return {"events": events, "makespan": makespan, "idle": idle, "bubble": sum(idle) / schedule.p}


def _late_message(nbytes: int, sender_busy_s: float, receiver_busy_s: float, reps: int,
                  posted_early: bool) -> list[float]:
    where = rank_device()
    buf, a, out = torch.ones(nbytes // 4, device=where), torch.randn(128, 128, device=where), []
    for i in range(reps + 1):  # the first is a warm-up
        dist.barrier()
        t0 = time.perf_counter()  # the compute's own clock: it runs for a wall-clock time
        sender = dist.get_rank() == 0
        work = dist.isend(buf, 1, tag=i) if sender else dist.irecv(buf, 0, tag=i) if posted_early else None
        while time.perf_counter() - t0 < (sender_busy_s if sender else receiver_busy_s):
            a @ a  # compute: the sender's next action, or the receiver's current one
        if sender:
            work.wait()
            continue

        def receive(work=work, tag=i):
            (work if posted_early else dist.irecv(buf, 0, tag=tag)).wait()
        # from the end of the compute to the message: on a GPU, events on the compute stream (a sync of
        # the whole device first would also wait for a receive posted early)
        out += timed_runs(receive, reps=1, warmup=0, device=where, cuda_events=True)
    return out[1:]


def late_message(nbytes: int, sender_busy_s: float, receiver_busy_s: float = 0.005, reps: int = 30,
                 posted_early: bool = False) -> list:
    """Seconds each of ``reps`` receives of ``nbytes`` waited, on 2 ranks: rank 0 posts its send, then
    computes for ``sender_busy_s`` (0: just waits for it); rank 1 computes for ``receiver_busy_s``, then
    asks for the message -- a stage whose input was sent while it was busy. ``posted_early``: rank 1
    posts its receive before it computes and only waits for it afterwards, as the executor does."""
    return launch(_late_message, 2, nbytes, sender_busy_s, receiver_busy_s, reps, posted_early)[1]


def _gaps(events, schedule):
    """``(rank, part, seconds)`` for every gap of every rank's timeline; see :func:`idle_breakdown`."""
    by = {(e.rank, e.name): e for e in events if e.category in ("F", "B", "W")}
    t0, t1 = min(e.t_start for e in by.values()), max(e.t_end for e in by.values())
    for r, acts in enumerate(schedule.stages):
        prev_end = t0
        for a in acts:
            start = by[(r, str(a))].t_start
            remote = [by[(dr, str(da))].t_end for dr, da in _inputs(schedule, r, a) if dr != r]
            if remote:  # the input comes from the other rank
                ready = max(prev_end, *remote)
                yield r, "waiting", ready - prev_end
                yield r, "message", start - ready
            else:
                yield r, "between", start - prev_end
            prev_end = by[(r, str(a))].t_end
        yield r, "drain", t1 - prev_end


def message_delays(events, schedule) -> list[float]:
    """Seconds each input received from the other rank cost in a timeline: the action's start − the
    later of its producer's end and the rank's own previous end (the message in flight, then received)."""
    return [t for _, part, t in _gaps(events, schedule) if part == "message"]


def idle_breakdown(events, schedule) -> list[dict]:
    """Where each rank's idle time went in a timeline (measured or simulated), seconds per rank: before
    each action, ``"waiting"`` while the other stage had not yet produced its input (what the schedule
    implies), then ``"message"`` until it started (:func:`message_delays`); ``"between"``, the gap
    before an action with only local inputs (posting sends, Python); ``"drain"``, from the rank's last
    end to the step's. The four add up to makespan − Σ the rank's spans."""
    out = [{"waiting": 0.0, "message": 0.0, "between": 0.0, "drain": 0.0} for _ in range(schedule.p)]
    for r, part, t in _gaps(events, schedule):
        out[r][part] += t
    return out
