"""Wrong: reports the mean of the runs as their median: one slow run moves it."""

import statistics
import time


def median_and_spread(fn, reps, warmup=1, setup=None, clock=time.perf_counter):
    runs = []
    for i in range(warmup + reps):
        arg = setup() if setup is not None else None
        t0 = clock()
        fn(arg) if setup is not None else fn()
        t1 = clock()
        if i >= warmup:
            runs.append(t1 - t0)
    mean = statistics.fmean(runs)
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive") if len(runs) > 1 else (mean,) * 3
    return {"median": mean, "q1": q1, "q3": q3, "spread": (q3 - q1) / mean if mean else 0.0, "runs": runs}
