"""Wrong: gives every stage the warm-up of the cap, forgetting the stage's place in the pipe.

With a tight cap the first stages are all bound by it, so one warm-up for everybody looks right; but the
last stages then warm up more than 1F1B does and hold more than p - r microbatches.
"""


def one_f_one_b_capped(p: int, m: int, cap: int) -> list[list[str]]:
    _check_pm(p, m)
    _check_positive("cap", cap, "the most microbatches a stage may hold")
    stages = []
    for _r in range(p):
        warmup = min(cap - 1, m)
        acts = [f"F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            acts += [f"F{warmup + i}", f"B{i}"]
        acts += [f"B{i}" for i in range(m - warmup, m)]
        stages.append(acts)
    return stages
