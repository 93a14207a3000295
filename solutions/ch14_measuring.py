"""Chapter 14 exercises (the appendix): measuring time on the machine you have — a benchmark that reports
its statistic and its spread, and how much slower a busy machine runs a step than when it was calibrated.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch14_measuring.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch14 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

1. :func:`median_and_spread` (build): time a function as a benchmark should — warm-up runs dropped,
   the set-up of each run left out of its time, the median and the interquartile range reported, every
   run kept (Hoefler & Belli 2015, "Scientific benchmarking of parallel computing systems", SC'15:
   report the statistic, its spread and the runs, never one number alone).
2. :func:`slowdown_under_load` (measure): a step timed while other processes spin on the cores,
   against its time at calibration — the ratio ``predict --measure`` prints beside each prediction.
"""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time


def _whole(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


# --- 1. a benchmark: median and spread after a warm-up ----------------------------------------------------


def median_and_spread(fn, reps: int, warmup: int = 1, setup=None, clock=time.perf_counter) -> dict:
    """Kind: build · about 30 minutes

    Time ``fn`` as a benchmark should, and report what the times say.

    Run ``fn`` ``warmup + reps`` times. Before *every* run, warm-up runs included, call ``setup()``
    when one is given, and pass what it returns to ``fn`` as its only argument (``fn(setup())``:
    fresh inputs, a flushed cache); without ``setup`` call ``fn()``. The set-up is never timed. Time
    each run by reading ``clock()`` (seconds, a float) immediately before and immediately after the
    call of ``fn``; drop the ``warmup`` first runs (a first call pays for allocation and lazy set-up).

    Return ``{"median", "q1", "q3", "spread", "runs"}``: ``runs`` the ``reps`` timed seconds in the
    order they ran; ``median`` their median; ``q1`` and ``q3`` their first and third quartiles, as
    ``statistics.quantiles(runs, n=4, method="inclusive")`` gives them (both equal to the median for
    a single run); ``spread`` the interquartile range relative to the median, ``(q3 - q1) / median``
    (0 when the median is 0). The median, not the mean: one run slowed by another process moves the
    mean, not the median; the spread says how far to trust the median.

    The tests drive ``fn`` and ``setup`` with a fake clock that only they advance, so every expected
    number is exact: warm-up runs that are slow, a set-up that takes long, outliers, one run.

    Reference: ``minitorch_dist/runtime/timing.py`` (``timed_runs`` and ``seconds``: warm-up, a
    ``before`` hook that is never timed, a statistic; here the set-up hands its result to the run,
    and the spread is reported beside the median).
    """
    reps, warmup = _whole("reps", reps, 1), _whole("warmup", warmup, 0)
    if not callable(fn) or (setup is not None and not callable(setup)):
        raise TypeError("fn (and setup, when given) must be callable")
    # BEGIN SOLUTION
    runs = []
    for i in range(warmup + reps):
        if setup is None:
            t0 = clock()
            fn()
            t1 = clock()
        else:
            arg = setup()  # before the clock starts: never timed
            t0 = clock()
            fn(arg)
            t1 = clock()
        if i >= warmup:
            runs.append(t1 - t0)
    median = statistics.median(runs)
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive") if len(runs) > 1 else (median,) * 3
    return {"median": median, "q1": q1, "q3": q3, "spread": (q3 - q1) / median if median else 0.0,
            "runs": runs}
    # END SOLUTION


# --- 2. a busy machine: the step now, against the step at calibration --------------------------------------


def slowdown_under_load(step, calibrated_s: float, busy: int = 0, reps: int = 5, warmup: int = 1) -> dict:
    """Kind: measure · about 30 minutes

    How much slower does this machine run ``step`` now, with ``busy`` other processes spinning on its
    cores, than when the machine was calibrated (``calibrated_s``, the step's median then)?

    Start ``busy`` processes (``multiprocessing``, the ``"fork"`` context), each spinning in a loop that
    uses its core — no sleeping — until told to stop. While all of them run, time ``step`` with your
    :func:`median_and_spread` (``reps`` runs after ``warmup``; ``step()`` takes no argument). Then stop
    every process and wait for it to end, also when ``step`` raises (the error then propagates): a
    measurement leaves no process behind.

    Return ``{"now_s", "calibrated_s", "slowdown", "busy", "runs"}``: the median now, the calibration's
    time, ``now_s / calibrated_s`` (above 1: the machine is slower than it was), ``busy``, and the
    timed runs.

    The tests run steps that record, at every call, which processes are alive and how much CPU time
    each has used; they check the spinners run during every call and spin, that none is left
    afterwards (also after an error), and the ratio, the warm-up and the median on steps whose times
    they set.

    Reference: ``minitorch_dist/analysis/calibrate.py`` (``reference_step_seconds``: the reference step
    timed again) and ``minitorch_dist/analysis/predict.py`` (``_slowdown``: its ratio to the calibration).
    """
    busy, reps, warmup = _whole("busy", busy, 0), _whole("reps", reps, 1), _whole("warmup", warmup, 0)
    if not calibrated_s > 0:
        raise ValueError(f"calibrated_s must be > 0 (the step's median at calibration), got {calibrated_s!r}")
    # BEGIN SOLUTION
    ctx = mp.get_context("fork")
    stop = ctx.Event()

    def spin(stop):
        while not stop.is_set():  # uses its core: a sleeping process would leave it free
            pass
    procs = [ctx.Process(target=spin, args=(stop,), daemon=True) for _ in range(busy)]
    try:
        for p in procs:
            p.start()
        res = median_and_spread(step, reps, warmup)
    finally:
        stop.set()
        for p in procs:
            if p.pid is not None:
                p.join()
    return {"now_s": res["median"], "calibrated_s": calibrated_s, "slowdown": res["median"] / calibrated_s,
            "busy": busy, "runs": res["runs"]}
    # END SOLUTION
