"""Wrong: places chunk 1 of rank r at p + r, Megatron's loop, not the V.

Every stage is held once and the first p hand-overs are one hop, so it looks right until the turn:
rank p-1 then hands stage p-1's output to rank 0, and the loss sits on rank p-1, not beside the
embedding.
"""


def v_stage(p: int, rank: int, chunk: int) -> int:
    _check_pm(p, 1)
    if not (isinstance(rank, int) and 0 <= rank < p and chunk in (0, 1)):
        raise ValueError(f"need 0 <= rank < p={p} and chunk 0 or 1, got rank={rank!r}, chunk={chunk!r}")
    return rank + chunk * p
