"""Wrong: reports calibration over now as the slowdown (a slower machine reads below 1)."""


_solution_slowdown = slowdown_under_load


def slowdown_under_load(step, calibrated_s, busy=0, reps=5, warmup=1):
    got = _solution_slowdown(step, calibrated_s, busy, reps, warmup)
    return dict(got, slowdown=calibrated_s / got["now_s"])

