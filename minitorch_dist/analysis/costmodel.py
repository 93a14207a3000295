"""The formulas the course quotes, each once, each with its source.

Every notebook plots these (theory) next to a meter (measured). A chapter that needs a new
formula adds it here, with the paper and equation in its docstring.
"""
from __future__ import annotations

# --- collectives: the ring model ------------------------------------------------------------

#: Bytes each rank sends per byte of the collective's full buffer, under the ring algorithm.
#: These are the "bus bandwidth" factors of nccl-tests (PERFORMANCE.md): busbw = algbw * factor.
#: The full buffer is the tensor being all-reduced / broadcast, the *unsharded* tensor of a
#: reduce-scatter or all-gather, and a rank's whole input of an all-to-all.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # the sender is charged; counting both would double the wire
}


def bus_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank puts on the wire for collective ``op`` on a buffer of ``nbytes`` over ``n`` ranks.

    Ring model (Patarasuk & Yuan 2009; nccl-tests PERFORMANCE.md "bus bandwidth"):
    all-reduce 2(n-1)/n * S, reduce-scatter and all-gather (n-1)/n * S, all-to-all (n-1)/n * S,
    broadcast S. With n = 1 nothing moves.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}; expected one of {sorted(BUS_FACTORS)}")
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if n == 1:
        return 0.0
    return BUS_FACTORS[op](n) * nbytes
