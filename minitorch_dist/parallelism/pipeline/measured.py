"""Chapter 03 — the bubble measured: a real pipeline step's per-rank timeline beside the simulator fed
with stage times measured alone.

The simulator (:mod:`.simulator`) predicts a schedule's bubble from three numbers, t_F, t_B, t_W. Here
they are *calibrated*: each rank times its own stage's forward, backward and weight gradient on one
microbatch, alone (no messages, both ranks busy at once, as in a step), before any pipeline step
runs. Then the executor runs real steps with a :class:`~minitorch_dist.analysis.timeline.Timeline`
and the bubble is read off its spans: on rank r, idle = step − Σ its action spans.

Two predictions sit beside the measurement:

* :func:`simulate_stages` -- the simulator's rules with each stage's own times (the first stage
  embeds, the last projects onto the vocabulary and takes the loss: they are not equal);
* the same with a message latency ``p2p`` on every cross-stage dependency (the profile's measured
  one-way send, ``profile.swept_seconds("send", bytes, 2)``).

:func:`message_delays` measures what the schedule actually paid per message: for every action that
waited on the other rank, the time from the producer's end to its own start.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ...analysis.timeline import Timeline, busy_fraction
from ...models.data import MarkovCorpus
from ...models.gpt import GPT
from ...runtime.launch import launch
from .executor import local_stages, run_schedule
from .schedules import make_schedule
from .simulator import _check_structure, _dependencies
from .zero_bubble import LinearTap, b_params, backward_input, backward_weights

__all__ = ["build_step", "time_stage_alone", "measure_pipeline", "idle_fractions", "simulate_stages",
           "message_delays"]


def build_step(name: str, size: str, m: int, p: int, seed: int = 0):
    """This rank's pipeline step of ``techniques``' GPT at ``size`` with ``m`` microbatches:
    ``(step(timeline=None), schedule, stages, x, y)``; the step runs the schedule, then AdamW."""
    from ...analysis import techniques as T

    cfg = T.model_config(size)
    torch.manual_seed(seed)
    model = GPT(cfg)
    schedule = make_schedule(name, p, m)
    stages = local_stages(model, schedule)
    opt = torch.optim.AdamW([q for s in stages.values() for q in s.parameters()], lr=T.LR)
    x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, T.GLOBAL_BATCH[size], cfg.block_size)

    def step(timeline=None):
        opt.zero_grad()
        res = run_schedule(schedule, stages, x, y, timeline=timeline)
        opt.step()
        return res

    return step, schedule, stages, x, y


def time_stage_alone(schedule, stage, x, y, reps: int = 5) -> dict:
    """Median seconds of this rank's F, B (and W) on one microbatch, with no message sent or waited for:
    the stage input is the tokens (first stage) or a random activation, the output gradient random."""
    m, split = schedule.m, schedule.splits_backward
    xs, ys = x.chunk(m)[0], y.chunk(m)[0]
    taps = LinearTap([stage]) if split else None
    own = b_params(stage)
    ids = {id(q) for q in own}
    out = {"F": [], "B": [], "W": []}
    for _ in range(reps + 1):  # the first round warms up
        inp = xs if stage.is_first else torch.randn(stage.boundary_shape(*xs.shape), requires_grad=True)
        t0 = time.perf_counter()
        if taps is not None:
            taps.active = []
        yv = stage(inp, ys) / m if stage.is_last else stage(inp)
        t1 = time.perf_counter()
        g = None if stage.is_last else torch.randn_like(yv)
        if split:
            _, stash = backward_input(yv, g, None if stage.is_first else inp, taps.active, own)
            t2 = time.perf_counter()
            backward_weights(stash, ids)
        else:
            torch.autograd.backward(yv, g)
            t2 = time.perf_counter()
        t3 = time.perf_counter()
        for k, dt in zip("FBW", (t1 - t0, t2 - t1, t3 - t2)):
            out[k].append(dt)
    if taps is not None:
        taps.remove()
    stage.zero_grad(set_to_none=True)
    return {k: statistics.median(v[1:]) for k, v in out.items()}


def _rank(name: str, size: str, m: int, reps: int, origin: float) -> dict:
    step, schedule, stages, x, y = build_step(name, size, m, dist.get_world_size())
    alone = time_stage_alone(schedule, stages[0], x, y, reps)  # before any pipeline step
    step()  # warm-up: AdamW's state, the first messages
    steps, step_s = [], []
    for _ in range(reps):
        dist.barrier()  # start together
        tl = Timeline(origin=origin)  # one clock for every rank: the parent's time.monotonic()
        t0 = time.perf_counter()
        step(tl)
        step_s.append(time.perf_counter() - t0)
        steps.append(tl.events)
    return {"alone": alone, "steps": steps, "step_s": step_s}


def measure_pipeline(name: str, size: str, m: int, p: int = 2, reps: int = 5, timeout_s: float = 300) -> dict:
    """Launch ``p`` ranks; each times its stage alone, then ``reps`` timed steps with a timeline.

    Returns ``{"alone": [per rank {"F","B","W"} seconds], "events": the median step's events (all
    ranks), "step_s": each step's slowest rank's seconds, "schedule"}``."""
    out = launch(_rank, p, name, size, m, reps, time.monotonic(), timeout_s=timeout_s)
    per_step = [max(r["step_s"][i] for r in out) for i in range(reps)]
    events = [[e for r in out for e in r["steps"][i]] for i in range(reps)]
    spans = [max(e.t_end for e in ev) - min(e.t_start for e in ev) for ev in events]
    median = sorted(range(reps), key=spans.__getitem__)[reps // 2]
    return {"alone": [r["alone"] for r in out], "events": events[median], "step_s": per_step,
            "schedule": make_schedule(name, p, m)}


def idle_fractions(events, p: int) -> tuple[list[float], float]:
    """Per rank: idle / makespan, where idle = makespan − Σ its action spans and the makespan runs
    from the first action's start to the last one's end on any rank; and the bubble, their mean."""
    window = (min(e.t_start for e in events), max(e.t_end for e in events))
    idle = [1.0 - busy_fraction(events, r, window) for r in range(p)]
    return idle, sum(idle) / p


def simulate_stages(schedule, times: list[dict], p2p: float = 0.0) -> dict:
    """The simulator's rules (:mod:`.simulator`) with each stage's own ``times[r]`` = ``{"F","B","W"}``
    seconds (B includes W when the schedule does not split the backward) and ``p2p`` seconds on every
    cross-stage dependency. Returns ``{"events": {(rank, action): (start, end)}, "makespan", "idle"
    (per rank, fraction of the makespan), "bubble"}``; equal times give :func:`.simulate`'s numbers."""
    _check_structure(schedule)
    split = schedule.splits_backward
    dur = [{"F": t["F"], "B": t["B"] if split else t["B"] + t["W"], "W": t["W"]} for t in times]
    done, nxt, free = {}, [0] * schedule.p, [0.0] * schedule.p
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(schedule.stages):
            while nxt[r] < len(acts):
                a = acts[nxt[r]]
                deps = _dependencies(schedule, r, a)
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d][1] + (p2p if d[0] != r else 0.0) for d in deps])
                done[(r, a)] = (start, start + dur[r][a.kind])
                free[r], nxt[r], progress = start + dur[r][a.kind], nxt[r] + 1, True
    if any(nxt[r] < len(acts) for r, acts in enumerate(schedule.stages)):
        raise ValueError(f"schedule {schedule.name!r} deadlocks: check it with simulator.check_dependencies")
    makespan = max(e for _, e in done.values())
    idle = [1.0 - sum(dur[r][a.kind] for a in acts) / makespan for r, acts in enumerate(schedule.stages)]
    return {"events": done, "makespan": makespan, "idle": idle, "bubble": sum(idle) / schedule.p}


def message_delays(events, schedule) -> list[float]:
    """For each action that waited for the other rank (it started later than both its own previous
    action's end and its input's producer's end), ``start − producer's end``: what a message cost."""
    by = {(e.rank, e.name): e for e in events if e.category in ("F", "B", "W")}
    out = []
    for r, acts in enumerate(schedule.stages):
        prev_end = None
        for a in acts:
            e = by[(r, str(a))]
            remote = [by[(dr, str(da))] for dr, da in _dependencies(schedule, r, a) if dr != r]
            if remote and (prev_end is None or remote[0].t_end > prev_end):
                out.append(e.t_start - remote[0].t_end)
            prev_end = e.t_end
    return out
