"""Wrong: runs the deferred W's of chunk 0 before those of chunk 1 at the end.

Chunk 0 comes first everywhere else, so it looks natural; but chunk 1's W's were deferred earlier and
the rank then holds their activations longer than PyTorch's order, and idles differently.
"""


def zbv_actions_any_m(p: int, m: int, rank: int) -> list[str]:  # noqa: C901 - the phases, as listed above
    _check_pm(p, m)
    if not (isinstance(rank, int) and 0 <= rank < p):
        raise ValueError(f"rank must be in 0..{p - 1}, got {rank!r}")
    done = {}  # (kind, chunk) -> microbatches run so far
    acts = []

    def n(kind, chunk):
        return done.get((kind, chunk), 0)

    def ready(kind, chunk):  # what this rank has run makes the next (kind, chunk) possible
        if kind == "F":
            return n("F", 0) < m if chunk == 0 else n("F", 1) < n("F", 0)
        if kind == "B":
            return n("B", 1) < n("F", 1) if chunk == 1 else n("B", 0) < n("B", 1)
        return n("W", chunk) < n("B", chunk)

    def run(kind, chunk):
        if ready(kind, chunk):  # with few microbatches the pipe runs dry: leave the action out
            done[(kind, chunk)] = n(kind, chunk) + 1
            acts.append(f"{kind}{n(kind, chunk) - 1}" + (".1" if chunk else ""))

    r = rank
    for _ in range(2 * (p - r) - 1):
        run("F", 0)
    for _ in range(r):
        run("F", 1)
        run("F", 0)
    for _ in range(p - r):
        for kind in "FBW":
            run(kind, 1)
    while n("F", 0) < m or n("F", 1) < n("F", 0):
        run("F", 0)
        for kind, chunk in (("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)):
            run(kind, chunk)
    for _ in range(r):
        run("B", 0)
        run("B", 1)
    for _ in range(p - r):
        run("B", 0)
        run("W", 0)
    for chunk in (0, 1):
        while ready("W", chunk):
            run("W", chunk)
    return acts
