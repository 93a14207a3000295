"""Chapter 00 — bus bandwidth: the bytes one rank puts on the wire for each collective (ring model).

A collective on a buffer of S bytes over n ranks makes each rank send ``factor(n) * S`` bytes
when it runs as a ring (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations"). These are the "bus bandwidth" factors of nccl-tests
(NVIDIA/nccl-tests, doc/PERFORMANCE.md: busbw = algbw * factor)::

    all-reduce                 2(n-1)/n     a reduce-scatter, then an all-gather
    reduce-scatter, all-gather  (n-1)/n     every chunk but one leaves (or reaches) each rank
    all-to-all                  (n-1)/n     every block but one's own
    broadcast                   1           a pipelined ring forwards the whole buffer once
    send                        1           (recv 0: the sender is charged, not both ends)

S is the *full* buffer: the tensor being all-reduced or broadcast, the unsharded tensor of a
reduce-scatter or all-gather, a rank's whole input of an all-to-all. The metered wrappers of
:mod:`.comm` charge every call with :func:`bus_bytes`; ``costmodel`` re-exports both
names for its formulas. This module imports nothing of the package: everything may use it.
"""
from __future__ import annotations

__all__ = ["BUS_FACTORS", "bus_bytes"]

#: Bytes each rank sends per byte of the collective's full buffer, under the ring algorithm.
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
