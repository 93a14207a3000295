"""Wrong: takes the mean of the timed runs as the step's time now: one slow run moves it."""

import statistics

_solution_slowdown = slowdown_under_load


def slowdown_under_load(step, calibrated_s, busy=0, reps=5, warmup=1):
    got = _solution_slowdown(step, calibrated_s, busy, reps, warmup)
    now = statistics.fmean(got["runs"])
    return dict(got, now_s=now, slowdown=now / calibrated_s)

