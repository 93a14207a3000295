"""Chapter 13 — what a save costs the training loop: the stall, predicted from this machine, then measured.

A synchronous save stops every rank until its file is on disk: copy to host memory, write and fsync,
read back for the SHA-256. An asynchronous save (DCP's ``async_save``, torchtitan's ``async_mode``;
CheckFreq, Mohan et al. 2021: snapshot, then persist in the background) stops the loop only for the
copy; the writing overlaps the next steps, which it may slow down where it competes with them for
cores or memory bandwidth (on a GPU node it does not: the GPUs compute, the CPUs write).

:func:`storage_profile` measures the three speeds on this machine (a copy, a write with fsync, a
SHA-256 pass); ``costmodel.save_stall_seconds`` turns them into the predicted stall of each kind;
:func:`measure_stalls` runs a layout on its ranks, saving every k steps (none, sync, async), and
times every step, so the notebook puts the prediction next to the clock.
"""
from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..runtime import observe
from ..runtime.timeline import Timeline
from .checkpoint import async_save, save
from .layouts import world
from .storage import sha256
from .trainers import Trainer

__all__ = ["storage_profile", "save_phases", "measure_stalls"]


def _best(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def storage_profile(folder=None, nbytes: int = 32 * 2 ** 20) -> dict:
    """Bytes per second of the three things a save does, each timed on ``nbytes`` (default 32 MiB) the
    way the save does it, best of 3: copy a tensor to host memory (``clone``), ``torch.save`` it to a
    file with ``fsync``, and read the file back through :func:`.storage.sha256`. ``folder``: where to
    write (default: a temporary folder). Run it on every rank at once (``launch(storage_profile, n)``)
    to measure what each rank gets while all of them save."""
    x = torch.ones(nbytes // 4)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        path = Path(tmp) / "probe.pt"

        def write():
            with open(path, "wb") as f:
                torch.save({"x": x}, f)
                f.flush()
                os.fsync(f.fileno())

        write_s = _best(write)
        hash_s = _best(lambda: sha256(path))
        copy_s = _best(lambda: x.clone())
    return {"copy_bytes_per_s": nbytes / copy_s, "write_bytes_per_s": nbytes / write_s,
            "hash_bytes_per_s": nbytes / hash_s}


def save_phases(events) -> list[dict]:
    """Each save's seconds by phase, in the order of the saves, from the checkpoint spans a
    :class:`..runtime.timeline.Timeline` heard (category "checkpoint": "plan", "stage", "write", "hash",
    "commit"). A save begins with its "plan"; the spans after it are its own until the next "plan",
    because a process never has two saves under way (the next one waits for the last)."""
    saves: list[dict] = []
    for ev in sorted((e for e in events if e.category == "checkpoint"), key=lambda e: e.t_start):
        if ev.name == "plan" or not saves:
            saves.append({})
        saves[-1][ev.name] = saves[-1].get(ev.name, 0.0) + ev.duration
    return saves


def measure_stalls(layout: str, cfg, batch: int, seq: int, steps: int, every: int, root: str,
                   mode: str) -> dict:
    """Run on every rank: ``steps`` steps of ``layout``, saving every ``every`` (``mode``: "none", "sync"
    or "async") under ``root``. Returns this rank's step times (s), the steps that saved, the bytes it
    wrote per save, and each save's seconds by phase (:func:`save_phases`)."""
    if mode not in ("none", "sync", "async"):
        raise ValueError(f"mode {mode!r}: choose 'none', 'sync' or 'async'")
    trainer = Trainer(layout, cfg, batch, seq)
    times, saved, written = [], [], 0
    handle = None
    with observe.watching(Timeline(clock=time.perf_counter)) as timeline:
        for step in range(steps):
            t0 = time.perf_counter()
            trainer.step(step)
            if mode != "none" and (step + 1) % every == 0:
                path, state = Path(root) / f"{mode}_{step + 1:06d}", trainer.state(step=step + 1)
                handle = save(state, path) if mode == "sync" else async_save(state, path)
                saved.append(step)
                written += handle.bytes_written
            times.append(time.perf_counter() - t0)
        if handle is not None:
            handle.wait()  # the last save's phases are all heard
    if world()[1] > 1:
        dist.barrier()
    return {"rank": world()[0], "times": times, "saved": saved, "phases": save_phases(timeline.events),
            "bytes_per_save": written / max(len(saved), 1)}
