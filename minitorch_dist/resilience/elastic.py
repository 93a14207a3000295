"""Chapter 13 — surviving a failure: checkpoint, crash, restart on the ranks that are left, go on.

Llama 3's 405B run saw 419 unexpected interruptions in 54 days (Dubey et al. 2024, §3.3.4): about one
every three hours. A job at that scale is a loop::

    attempt 1 on n ranks:   load the latest checkpoint (none: step 0)
                            train; every k steps save a checkpoint (step_000040/, ...)
                            a rank dies mid-step  -> launch kills the others and names it (RankError)
    attempt 2 on n-1 ranks: load the latest *complete* checkpoint, resharded to n-1 ranks (elastic)
                            redo the steps since it ("lost work"), then carry on

:func:`train_with_checkpoints` is one attempt, run on every rank (any layout of :mod:`.trainers`);
:func:`run_elastic` is the loop around it, in the calling process, as ``torchrun``'s elastic agent is
for a real job: on a failure it starts the next attempt with the world size the policy gives.
A :class:`Failure` injects the fault: rank r SIGKILLs itself in step s, after its backward and before
the optimizer step, when the gradients are computed but nothing is saved. Because every step's batch
depends only on the step (``MarkovCorpus.batch``), the resumed run recomputes exactly the steps it
lost and its loss curve is the uninterrupted one.

Lost work is the time between the last checkpoint and the failure, plus the restart (start the
ranks, load): on average half an interval plus the restart, the quantity Young's and Daly's formulas
trade against the checkpoint cost (``costmodel.resilience``).
"""
from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..runtime.launch import RankError, launch
from .checkpoint import async_save, save
from .layouts import world
from .loading import load
from .storage import METADATA
from .trainers import Trainer

__all__ = ["Failure", "Attempt", "ElasticRun", "latest_checkpoint", "train_with_checkpoints", "run_elastic",
           "checkpoint_name"]

_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Failure:
    """Kill rank ``rank`` with SIGKILL during step ``step`` (between its backward and its update)."""

    rank: int
    step: int


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def latest_checkpoint(root) -> tuple[int, Path] | None:
    """The complete checkpoint with the highest step under ``root`` (folders ``step_NNNNNN`` holding a
    ``metadata.json``); a ``.partial`` folder, a save that never finished, is not one."""
    root = Path(root)
    found = []
    for p in root.iterdir() if root.exists() else []:
        m = _STEP_DIR.match(p.name)
        if m and (p / METADATA).exists():
            found.append((int(m[1]), p))
    return max(found) if found else None


def _log(path, **event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()


def _die(log, attempt: int, r: int, step: int) -> None:
    """The injected fault: note the moment, then SIGKILL this rank (no cleanup runs, as in a crash)."""
    _log(log, event="killed", attempt=attempt, rank=r, step=step, t=time.time())
    os.kill(os.getpid(), signal.SIGKILL)


def train_with_checkpoints(layout: str, cfg, batch: int, seq: int, steps: int, every: int, root: str,
                           log: str, attempt: int = 0, fail: Failure | None = None,
                           asynchronous: bool = False, microbatches: int = 2) -> dict:
    """One attempt of a job, on every rank: resume from the latest checkpoint under ``root`` (if any),
    train the course GPT in ``layout`` to ``steps``, saving every ``every`` steps (``asynchronous``:
    :func:`.checkpoint.async_save`); rank 0 appends one JSON line per event to ``log``."""
    r, n = world()
    t0 = time.time()
    trainer = Trainer(layout, cfg, batch, seq, microbatches)
    start, latest = 0, latest_checkpoint(root)
    if latest is not None:
        state = trainer.state(step=0)
        load(state, latest[1])
        start = state["step"]
    if r == 0:
        _log(log, event="start", attempt=attempt, world_size=n, step=start, t=t0, loaded=time.time())
    pending = None
    for step in range(start, steps):
        between = None
        if fail is not None and fail.rank == r and fail.step == step:
            between = lambda step=step: _die(log, attempt, r, step)  # the injected fault
        loss = trainer.step(step, between=between)
        if r == 0:
            _log(log, event="step", attempt=attempt, world_size=n, step=step, loss=loss, t=time.time())
        if (step + 1) % every == 0:
            state, path = trainer.state(step=step + 1), Path(root) / checkpoint_name(step + 1)
            if asynchronous:
                pending = async_save(state, path)
            else:
                save(state, path)
                if r == 0:
                    _log(log, event="saved", attempt=attempt, step=step + 1, t=time.time())
    if pending is not None:
        pending.wait()
    return {"rank": r, "start": start}


@dataclass
class Attempt:
    world_size: int
    started: float
    ended: float
    failed_rank: int | None = None
    error: str = ""


@dataclass
class ElasticRun:
    """What :func:`run_elastic` did: its attempts and the rank-0 log (dicts, in order)."""

    attempts: list = field(default_factory=list)
    events: list = field(default_factory=list)

    def losses(self) -> dict:
        """``{step: loss}`` of the run as it finally stands (a redone step: its last value)."""
        return {e["step"]: e["loss"] for e in self.events if e["event"] == "step"}

    def _first(self, event: str, attempt: int, **match):
        return next((e for e in self.events if e["event"] == event and e["attempt"] == attempt
                     and all(e.get(k) == v for k, v in match.items())), None)

    def lost_work(self) -> list[dict]:
        """Per failure: the step the next attempt resumed from; the steps redone (those finished since
        that checkpoint, and the one in progress); and the seconds lost, in three parts: computing since
        the checkpoint (to the fault), detection (the fault to the launcher's error; None when the
        fault was not an injected one) and restart (the error to resumed, starting and loading)."""
        out = []
        for i, a in enumerate(self.attempts[:-1]):
            resumed = self._first("start", i + 1)
            saved = self._first("saved", i, step=resumed["step"]) or self._first("start", i)
            since = saved.get("loaded", saved["t"])  # the checkpoint's save, or the attempt's own load
            killed = self._first("killed", i)
            fault = killed["t"] if killed else a.ended
            redone = [e for e in self.events if e["event"] == "step" and e["attempt"] == i
                      and e["step"] >= resumed["step"]]
            out.append({"failed_rank": a.failed_rank, "resumed_from": resumed["step"],
                        "steps_redone": len(redone) + 1, "compute_lost_s": fault - since,
                        "detect_s": a.ended - fault if killed else None,
                        "restart_s": resumed["loaded"] - a.ended})
        return out


def run_elastic(layout_for, world_sizes, cfg, batch: int, seq: int, steps: int, every: int, root, fail=None,
                asynchronous: bool = False, max_attempts: int = 3, timeout_s: float = 300) -> ElasticRun:
    """Run the job to ``steps``: attempt i on ``world_sizes[i]`` ranks (the last size for later
    attempts) in layout ``layout_for(n)``; a failed attempt (``launch``'s :class:`RankError`) is followed
    by the next, which resumes from the latest checkpoint. ``fail`` applies to the first attempt only."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    log = root / "events.jsonl"
    run = ElasticRun()
    while True:
        i = len(run.attempts)
        n = world_sizes[min(i, len(world_sizes) - 1)]
        started = time.time()
        try:
            launch(train_with_checkpoints, n, layout_for(n), cfg, batch, seq, steps, every, str(root),
                   str(log), i, fail if i == 0 else None, asynchronous, timeout_s=timeout_s)
            run.attempts.append(Attempt(n, started, time.time()))
            break
        except RankError as e:
            why = e.remote_traceback.strip().splitlines()[0] if e.remote_traceback.strip() else str(e)
            run.attempts.append(Attempt(n, started, time.time(), e.rank, why))
            if len(run.attempts) >= max_attempts:
                raise RuntimeError(f"the job failed {len(run.attempts)} times; the last: {e}") from e
    run.events = [json.loads(line) for line in log.read_text().splitlines()]
    return run
