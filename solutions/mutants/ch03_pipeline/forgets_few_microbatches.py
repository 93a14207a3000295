"""Wrong: forgets that the warm-up cannot exceed m.

Right whenever m is at least p; with fewer microbatches than the warm-up asks for it names microbatches
that do not exist.
"""


def one_f_one_b_capped(p: int, m: int, cap: int) -> list[list[str]]:
    _check_pm(p, m)
    _check_positive("cap", cap, "the most microbatches a stage may hold")
    stages = []
    for r in range(p):
        warmup = min(p - r - 1, cap - 1)
        acts = [f"F{i}" for i in range(warmup)]
        for i in range(m - warmup):
            acts += [f"F{warmup + i}", f"B{i}"]
        acts += [f"B{i}" for i in range(m - warmup, m)]
        stages.append(acts)
    return stages
