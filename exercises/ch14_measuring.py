# generated from solutions/ch14_measuring.py by `make exercises`: fill in each NotImplementedError
# fingerprint eeb20aee94450106 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 14 exercises (the appendix): measuring time on the machine you have — a benchmark that reports
its statistic and its spread, and how much slower a busy machine runs a step than when it was calibrated.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch14``.

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
    raise NotImplementedError("exercise: median_and_spread — see chapters/14_measuring.md")


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
    raise NotImplementedError("exercise: slowdown_under_load — see chapters/14_measuring.md")
