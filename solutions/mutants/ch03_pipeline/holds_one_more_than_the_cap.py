"""Wrong: caps the warm-up at cap forwards, one more than the cap allows.

1F1B's warm-up is p - r - 1 forwards because the steady state's forward comes before its backward; the
same off-by-one applies to the cap, and a warm-up of cap forwards holds cap + 1 microbatches.
"""


def one_f_one_b_capped(p: int, m: int, cap: int) -> list[list[str]]:
    _check_pm(p, m)
    _check_positive("cap", cap, "the most microbatches a stage may hold")
    stages = []
    for r in range(p):
        warmup = min(p - r - 1, cap, m)
        acts = [f"F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            acts += [f"F{warmup + i}", f"B{i}"]
        acts += [f"B{i}" for i in range(m - warmup, m)]
        stages.append(acts)
    return stages
