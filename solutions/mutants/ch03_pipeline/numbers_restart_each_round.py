"""Wrong: numbers each round's microbatches from 0 again.

Each round looks like a small GPipe, so reusing a GPipe of k microbatches per round is natural; but the
rounds then run microbatches 0..k-1 over and over, and the rest of the batch never runs.
"""


def gpipe_rounds_schedule(p: int, m: int, k: int) -> list[list[str]]:
    _check_pm(p, m)
    _check_positive("k", k, "the most microbatches a stage may stash")
    acts = []
    for start in range(0, m, k):
        round_ = range(min(k, m - start))
        acts += [f"F{i}" for i in round_] + [f"B{i}" for i in round_]
    return [list(acts) for _ in range(p)]
