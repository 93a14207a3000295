"""Wrong: runs no warm-up at all: the first, slow calls are among the timed ones."""

import statistics
import time


def median_and_spread(fn, reps, warmup=1, setup=None, clock=time.perf_counter):
    runs = []
    for _ in range(reps):
        arg = setup() if setup is not None else None
        t0 = clock()
        fn(arg) if setup is not None else fn()
        runs.append(clock() - t0)
    median = statistics.median(runs)
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive") if len(runs) > 1 else (median,) * 3
    return {"median": median, "q1": q1, "q3": q3, "spread": (q3 - q1) / median if median else 0.0,
            "runs": runs}
