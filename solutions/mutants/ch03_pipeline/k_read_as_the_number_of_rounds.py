"""Wrong: reads k as the number of rounds, not the most microbatches per round.

Splitting the batch into k rounds of about m / k is the other natural reading of "rounds"; it agrees
when k * k = m, and otherwise stashes ceil(m / k) microbatches, more than the cap.
"""


def gpipe_rounds_schedule(p: int, m: int, k: int) -> list[list[str]]:
    _check_pm(p, m)
    _check_positive("k", k, "the most microbatches a stage may stash")
    acts = []
    size = -(-m // k)  # k rounds of about m / k
    for start in range(0, m, size):
        round_ = range(start, min(start + size, m))
        acts += [f"F{i}" for i in round_] + [f"B{i}" for i in round_]
    return [list(acts) for _ in range(p)]
