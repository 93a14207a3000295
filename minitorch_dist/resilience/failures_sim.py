"""Chapter 13 — a job with random failures, simulated: does saving every √(2·MTBF·C) really win?

Young's and Daly's optimal intervals (``costmodel.resilience``) are derived, not measured. This
module checks them the simple way: run many jobs of W seconds of work, each in segments of τ seconds
of work followed by a C-second save; failures arrive as a Poisson process of mean gap M (the
exponential distribution is memoryless, so every segment starts afresh); a failure anywhere in a
segment, save included, throws the segment away and costs an R-second restart (which a failure may
also strike). The mean wall time over many jobs, swept over τ, shows where the optimum lies::

    for each job:   t = 0
        for each segment of work w = min(τ, work left):
            repeat: f ~ Exp(M);  if f >= w + C: t += w + C, next segment
                                 else: t += f; then the restart: g ~ Exp(M) until g >= R (t += g each), t += R

Vectorised over the jobs with NumPy; a seed makes it repeatable.
"""
from __future__ import annotations

import math

import numpy as np

__all__ = ["simulate_runtime", "sweep_intervals"]


def _restart(rng, mtbf: float, restart: float, count: int) -> np.ndarray:
    """Seconds each of ``count`` restarts takes, failures during a restart included."""
    total, left = np.zeros(count), np.ones(count, dtype=bool)
    while left.any():
        g = rng.exponential(mtbf, left.sum())
        ok = g >= restart
        spent = np.where(ok, restart, g)
        total[left] += spent
        idx = np.flatnonzero(left)
        left[idx[ok]] = False
    return total


def _segment(rng, mtbf: float, need: float, restart: float, jobs: int) -> np.ndarray:
    """Seconds each of ``jobs`` takes to get ``need`` uninterrupted seconds (work + save) done."""
    total, left = np.zeros(jobs), np.ones(jobs, dtype=bool)
    while left.any():
        idx = np.flatnonzero(left)
        f = rng.exponential(mtbf, idx.size)
        ok = f >= need
        total[idx[ok]] += need
        failed = idx[~ok]
        total[failed] += f[~ok] + _restart(rng, mtbf, restart, failed.size)
        left[idx[ok]] = False
    return total


def simulate_runtime(work_s: float, interval_s: float, mtbf_s: float, checkpoint_s: float,
                     restart_s: float = 0.0, jobs: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Mean and standard error of the wall time of ``jobs`` simulated jobs (see the module docstring)."""
    if not (work_s > 0 and interval_s > 0 and mtbf_s > 0 and checkpoint_s >= 0 and restart_s >= 0):
        raise ValueError("work_s, interval_s and mtbf_s must be > 0; checkpoint_s and restart_s >= 0")
    rng = np.random.default_rng(seed)
    wall = np.zeros(jobs)
    done = 0.0
    while done < work_s - 1e-9:
        w = min(interval_s, work_s - done)
        wall += _segment(rng, mtbf_s, w + checkpoint_s, restart_s, jobs)
        done += w
    return float(wall.mean()), float(wall.std(ddof=1) / math.sqrt(jobs))


def sweep_intervals(work_s: float, intervals, mtbf_s: float, checkpoint_s: float, restart_s: float = 0.0,
                    jobs: int = 2000, seed: int = 0) -> list[dict]:
    """:func:`simulate_runtime` at each interval: ``[{"interval_s", "mean_s", "stderr_s"}]``."""
    out = []
    for i, tau in enumerate(intervals):
        mean, err = simulate_runtime(work_s, tau, mtbf_s, checkpoint_s, restart_s, jobs, seed + i)
        out.append({"interval_s": float(tau), "mean_s": mean, "stderr_s": err})
    return out
