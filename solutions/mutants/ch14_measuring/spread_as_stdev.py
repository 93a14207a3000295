"""Wrong: reports the standard deviation over the median as the spread, and the runs sorted."""

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
    runs.sort()
    median = statistics.median(runs)
    sd = statistics.stdev(runs) if len(runs) > 1 else 0.0
    return {"median": median, "q1": median - sd, "q3": median + sd,
            "spread": 2 * sd / median if median else 0.0, "runs": runs}
