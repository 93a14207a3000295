"""Chapter 14 — the one clock of the course: how long a function takes on its device, after a
warm-up, as the median (or another statistic) of several runs.

A GPU runs asynchronously: the host queues kernels and returns at once, so a clock read right
after a call times the launch, not the work. :func:`sync` waits for a device's queued work (on a
CPU or on ``meta`` there is nothing to wait for, and CUDA is never touched). :func:`timed_runs`
times each run by the wall clock, waiting for the device after it -- or, with ``cuda_events=True``
on a GPU, by two CUDA events recorded around it on the stream, which time the GPU's own work. Warm-up
runs come first, untimed: a first call pays for allocation, autotuning, lazy initialisation.
:func:`seconds` reduces the runs to one number: the median by default, which resists the outliers
(a context switch, a page fault, a busy moment of a shared machine) that the mean does not;
``reduce=min`` gives the best run, ``reduce=statistics.fmean`` the mean a long loop would pay.

Every measurement of the course goes through these: calibrate's op and step timings, the meters'
``Timer``, the techniques' step times, the GPU report's benchmarks and the kernel benchmarks.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeAlias

import torch

__all__ = ["sync", "timed_runs", "seconds", "cache_flusher"]

#: Where work runs: a ``torch.device``, its name, a tensor (its device), or None (see :func:`sync`).
DeviceLike: TypeAlias = torch.device | str | torch.Tensor | None


def _device(device: DeviceLike) -> torch.device | None:
    """``device`` as a ``torch.device`` (a tensor stands for its own device); None stays None."""
    if device is None or isinstance(device, torch.device):
        return device
    return device.device if isinstance(device, torch.Tensor) else torch.device(device)


def sync(device: DeviceLike = None) -> None:
    """Wait until ``device`` has done the work queued on it, so that a clock read next sees it done.

    ``device``: a ``torch.device``, its name, or a tensor (its device). None: the current CUDA
    device when this process has used CUDA (the caller does not say where its work runs), else
    nothing. Only a CUDA device is waited for: a CPU runs its ops before returning, and ``meta``
    runs none, so for them this returns at once without touching CUDA."""
    dev = _device(device)
    if dev is None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
    elif dev.type == "cuda":
        torch.cuda.synchronize(dev)


def timed_runs(fn: Callable[[], object], reps: int = 5, warmup: int = 1, device: DeviceLike = None,
               before: Callable[[], object] | None = None, cuda_events: bool = False) -> list[float]:
    """Seconds of each of ``reps`` runs of ``fn()``, after ``warmup`` untimed runs.

    ``device``: where ``fn``'s work runs (as for :func:`sync`): waited for before each run's clock
    starts and after it stops. ``before``: called before every run, warm-up included, and never
    timed -- a barrier, so that every rank starts each run together; a cache flush, so that each run
    reads its inputs from memory. ``cuda_events``: on a CUDA device, time each run with CUDA events
    on the current stream instead of the wall clock (ignored elsewhere)."""
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"reps must be an int >= 1, got {reps!r}")
    dev = _device(device)
    for _ in range(warmup):
        if before is not None:
            before()
        fn()
    if cuda_events and dev is not None and dev.type == "cuda":
        return _event_runs(fn, reps, dev, before)
    sync(dev)
    times = []
    for _ in range(reps):
        if before is not None:
            before()
            sync(dev)  # what ``before`` queued is not the run's
        t0 = time.perf_counter()
        fn()
        sync(dev)
        times.append(time.perf_counter() - t0)
    return times


def _event_runs(fn: Callable[[], object], reps: int, dev: torch.device,
                before: Callable[[], object] | None) -> list[float]:
    """Seconds of each run between two CUDA events on ``dev``'s current stream (work ``before``
    queued runs ahead of the first event, so it is not timed)."""
    times = []
    with torch.cuda.device(dev):
        for _ in range(reps):
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
    return times


def seconds(fn: Callable[[], object], reps: int = 5, warmup: int = 1, device: DeviceLike = None,
            before: Callable[[], object] | None = None, cuda_events: bool = False,
            reduce: Callable[[list[float]], float] = statistics.median) -> float:
    """``reduce`` (the median unless told) of :func:`timed_runs`' seconds: one number for ``fn``."""
    return reduce(timed_runs(fn, reps, warmup, device=device, before=before, cuda_events=cuda_events))


def cache_flusher(device: torch.device | str, nbytes: int = 256 * 2 ** 20) -> Callable[[], object]:
    """A function that overwrites ``nbytes`` on ``device`` (more than a GPU's L2 cache holds): passed
    as ``before=``, it makes every timed run read its inputs from memory, as a kernel in a real step
    does (``triton.testing.do_bench`` flushes the same way)."""
    buffer = torch.empty(nbytes, dtype=torch.int8, device=device)
    return buffer.zero_
