"""Wrong: stops the busy processes only when the step succeeds; an error leaves them spinning."""

import multiprocessing as mp


def _spin_(stop):
    while not stop.is_set():
        pass


def slowdown_under_load(step, calibrated_s, busy=0, reps=5, warmup=1):
    if not calibrated_s > 0:
        raise ValueError(f"calibrated_s must be > 0, got {calibrated_s!r}")
    if isinstance(busy, bool) or not isinstance(busy, int) or busy < 0:
        raise ValueError(f"busy must be an int >= 0, got {busy!r}")
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin_, args=(stop,), daemon=True) for _ in range(busy)]
    for p in procs:
        p.start()
    res = median_and_spread(step, reps, warmup)
    stop.set()
    for p in procs:
        p.join()
    return {"now_s": res["median"], "calibrated_s": calibrated_s, "slowdown": res["median"] / calibrated_s,
            "busy": busy, "runs": res["runs"]}
