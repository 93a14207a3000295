"""Wrong: starts the clock before the set-up, so each run's time includes it."""

import statistics
import time


def median_and_spread(fn, reps, warmup=1, setup=None, clock=time.perf_counter):
    runs = []
    for i in range(warmup + reps):
        t0 = clock()
        if setup is not None:
            fn(setup())
        else:
            fn()
        t1 = clock()
        if i >= warmup:
            runs.append(t1 - t0)
    median = statistics.median(runs)
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive") if len(runs) > 1 else (median,) * 3
    return {"median": median, "q1": q1, "q3": q3, "spread": (q3 - q1) / median if median else 0.0,
            "runs": runs}
