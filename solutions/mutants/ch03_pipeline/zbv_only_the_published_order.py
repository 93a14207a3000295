"""Wrong: runs every phase in full whatever m: the published order only.

Right for every m >= 2p - 1, which is all the paper, the library and PyTorch cover; with fewer
microbatches it names microbatches that do not exist and backwards whose forward never ran.
"""


def zbv_actions_any_m(p: int, m: int, rank: int) -> list[str]:  # noqa: C901 - the phases, as listed above
    _check_pm(p, m)
    if not (isinstance(rank, int) and 0 <= rank < p):
        raise ValueError(f"rank must be in 0..{p - 1}, got {rank!r}")
    done = {}  # (kind, chunk) -> microbatches run so far
    acts = []

    def run(kind, chunk):
        mb = done.get((kind, chunk), 0)
        done[(kind, chunk)] = mb + 1
        acts.append(f"{kind}{mb}" + (".1" if chunk else ""))

    r = rank
    for _ in range(2 * (p - r) - 1):
        run("F", 0)
    for _ in range(r):
        run("F", 1)
        run("F", 0)
    for _ in range(p - r):
        for kind in "FBW":
            run(kind, 1)
    while done.get(("F", 0), 0) < m or done.get(("F", 1), 0) < done.get(("F", 0), 0):
        if done.get(("F", 0), 0) < m:
            run("F", 0)
        for kind, chunk in (("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)):
            run(kind, chunk)
    for _ in range(r):
        run("B", 0)
        run("B", 1)
    for _ in range(p - r):
        run("B", 0)
        run("W", 0)
    for chunk in (1, 0):
        while done.get(("W", chunk), 0) < m:
            run("W", chunk)
    return acts
