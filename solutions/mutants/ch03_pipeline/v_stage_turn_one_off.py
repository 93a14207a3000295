"""Wrong: counts the way back up from 2p, so chunk 1 of rank r is 2p - r, one past the V.

The V's shape is right; the off-by-one at the turn puts rank 0's chunk 1 at stage 2p, past the model,
and leaves stage p held by no one.
"""


def v_stage(p: int, rank: int, chunk: int) -> int:
    _check_pm(p, 1)
    if not (isinstance(rank, int) and 0 <= rank < p and chunk in (0, 1)):
        raise ValueError(f"need 0 <= rank < p={p} and chunk 0 or 1, got rank={rank!r}, chunk={chunk!r}")
    return rank if chunk == 0 else 2 * p - rank
