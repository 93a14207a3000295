"""Wrong: runs m // k full rounds and drops the short last one.

Counting rounds as m // k is the first thing one writes; it is right whenever k divides m, and loses the
last m % k microbatches otherwise (and every microbatch when k > m).
"""


def gpipe_rounds_schedule(p: int, m: int, k: int) -> list[list[str]]:
    _check_pm(p, m)
    _check_positive("k", k, "the most microbatches a stage may stash")
    acts = []
    for start in range(0, (m // k) * k, k):
        round_ = range(start, min(start + k, m))
        acts += [f"F{i}" for i in round_] + [f"B{i}" for i in round_]
    return [list(acts) for _ in range(p)]
