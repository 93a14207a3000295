"""Chapter 00 — collectives under the alpha-beta model: the ring (bus-bandwidth factors of nccl-tests) and
its latency-optimal rivals (recursive doubling, trees), and the least-squares fit of alpha, beta.

Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations in
MPICH" (IJHPCA), §2 (cost model) and §4 (algorithms); Patarasuk & Yuan 2009 (ring all-reduce).
"""
from __future__ import annotations

import math

from ..runtime.busbw import BUS_FACTORS, bus_bytes

# --- collectives: the ring model ------------------------------------------------------------

# BUS_FACTORS and bus_bytes (the ring's bytes per rank, nccl-tests' bus-bandwidth factors) are
# defined once in runtime.busbw, where the comm meter charges every call with them; they are the
# bandwidth term of the times below, and this package re-exports them.

#: (alpha in s, beta in s/byte) of links the notebooks use for what-if predictions. beta is
#: 1 / the nominal per-direction bandwidth of one device from the vendor's specification (H100
#: SXM: 900 GB/s of NVLink 4 in both directions together; PCIe 4.0 x16: ~32 GB/s; InfiniBand
#: NDR: 400 Gb/s; 100 Gb/s Ethernet); alpha is a typical per-message latency, an order of
#: magnitude, not a measurement. Real collectives reach a fraction of these bandwidths.
LINKS = {
    "NVLink 4 (H100 SXM, in a node)": (2e-6, 1 / 450e9),
    "PCIe 4.0 x16": (5e-6, 1 / 32e9),
    "InfiniBand NDR 400 Gb/s": (5e-6, 1 / 50e9),
    "Ethernet 100 Gb/s": (20e-6, 1 / 12.5e9),
}


# Latency terms: how many sequential message steps each algorithm takes on n ranks.
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),  # reduce-scatter ring, then all-gather ring
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,  # pairwise exchange
    "broadcast": lambda n: n - 1,  # pipelined ring: the first chunk crosses n-1 links
    "send": lambda n: 1,
}

def _check_n(n):
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")


def collective_time(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of ring collective ``op``: ``steps(n)*alpha + bus_bytes(op, S, n)*beta``.

    Hockney's model, per message t = alpha + m*beta (alpha: latency in s, beta: s per byte =
    1/bandwidth), summed over the steps of the ring algorithms of Thakur, Rabenseifner & Gropp
    (2005) and Patarasuk & Yuan (2009). Computation (the reduction) is ignored.
    """
    if op not in _STEPS:
        raise ValueError(f"no alpha-beta model for {op!r}; expected one of {sorted(_STEPS)}")
    _check_n(n)
    if n == 1:
        return 0.0
    return _STEPS[op](n) * alpha + bus_bytes(op, nbytes, n) * beta


def allreduce_time(nbytes, n, alpha, beta):
    """Ring all-reduce (Patarasuk & Yuan 2009; Thakur et al. 2005 §4.4, Rabenseifner's algorithm).

    Reduce-scatter then all-gather, each n-1 steps moving S/n bytes:
    ``t = 2(n-1)*alpha + 2(n-1)/n * S * beta``. Bandwidth-optimal: the beta term tends to 2*S*beta,
    independent of n.
    """
    return collective_time("all_reduce", nbytes, n, alpha, beta)


def reduce_scatter_time(nbytes, n, alpha, beta):
    """Ring reduce-scatter of an S-byte buffer (Thakur et al. 2005 §4.5):
    ``t = (n-1)*alpha + (n-1)/n * S * beta``."""
    return collective_time("reduce_scatter", nbytes, n, alpha, beta)


def all_gather_time(nbytes, n, alpha, beta):
    """Ring all-gather producing an S-byte buffer (Thakur et al. 2005 §4.1):
    ``t = (n-1)*alpha + (n-1)/n * S * beta``."""
    return collective_time("all_gather", nbytes, n, alpha, beta)


def all_to_all_time(nbytes, n, alpha, beta):
    """Pairwise-exchange all-to-all, S = one rank's whole input (Thakur et al. 2005 §4.6):
    n-1 steps each sending S/n bytes, ``t = (n-1)*alpha + (n-1)/n * S * beta``."""
    return collective_time("all_to_all", nbytes, n, alpha, beta)


def broadcast_time(nbytes, n, alpha, beta):
    """Pipelined ring broadcast (the NCCL algorithm; bus factor 1):
    ``t = (n-1)*alpha + S*beta``, in the limit of many small chunks. Thakur et al. 2005 §4.2
    use a binomial tree for short messages, ``ceil(log2 n) * (alpha + S*beta)``."""
    return collective_time("broadcast", nbytes, n, alpha, beta)


def p2p_time(nbytes, alpha, beta):
    """One point-to-point message (Hockney 1994): ``t = alpha + S*beta``."""
    return alpha + nbytes * beta


def recursive_doubling_allreduce_time(nbytes, n, alpha, beta):
    """Recursive-doubling all-reduce (Thakur et al. 2005 §4.4): log2(n) rounds, each rank
    swapping its whole S-byte buffer with its partner: ``t = ceil(log2 n) * (alpha + S*beta)``.
    Latency-optimal, so best for small messages; ceil models non-powers of two optimistically."""
    _check_n(n)
    return math.ceil(math.log2(n)) * (alpha + nbytes * beta)


def tree_allreduce_time(nbytes, n, alpha, beta):
    """Binomial-tree all-reduce: tree reduce to a root, then tree broadcast
    (Thakur et al. 2005 §4.3-4.4): ``t = 2*ceil(log2 n) * (alpha + S*beta)``, full-size messages
    on every level (no pipelining). Twice recursive doubling; O(log n) latency versus the ring's O(n)."""
    return 2 * recursive_doubling_allreduce_time(nbytes, n, alpha, beta)


def ring_latency_bandwidth_crossover(n, alpha, beta):
    """Message size at which the ring all-reduce's latency and bandwidth terms are equal:
    ``2(n-1)*alpha = 2(n-1)/n * S * beta``  =>  ``S = n * alpha / beta``.

    Below it most of the ring's time is its 2(n-1) latencies, above it most is bytes. It is *not*
    where another algorithm overtakes the ring: that size compares two algorithms' times, see
    :func:`allreduce_crossover_bytes` (for recursive doubling on n = 8 it is 8.8*alpha/beta, not
    8*alpha/beta; for a binomial tree 1.9*alpha/beta).
    """
    _check_n(n)
    return n * alpha / beta


#: (latency steps, bytes sent per byte of S) of each all-reduce algorithm on n ranks, L = ceil(log2 n):
#: the two coefficients of ``t = steps*alpha + factor*S*beta`` in the functions above.
_ALLREDUCE_COEFFS = {
    "ring": lambda n, L: (2 * (n - 1), 2 * (n - 1) / n),
    "recursive_doubling": lambda n, L: (L, L),
    "tree": lambda n, L: (2 * L, 2 * L),
    "naive": lambda n, L: (2 * (n - 1), 2 * (n - 1)),
}


def allreduce_crossover_bytes(n, alpha, beta, algorithm="recursive_doubling"):
    """Message size S* below which ``algorithm``'s all-reduce is faster than the ring's.

    Both times are linear in S: the ring's ``a0*alpha + b0*S*beta`` with a0 = 2(n-1),
    b0 = 2(n-1)/n (:func:`allreduce_time`), the other's ``a1*alpha + b1*S*beta`` (recursive
    doubling a1 = b1 = L = ceil(log2 n), :func:`recursive_doubling_allreduce_time`; binomial tree
    a1 = b1 = 2L, :func:`tree_allreduce_time`; naive a1 = b1 = 2(n-1)). Equal times give

        S* = (a0 - a1) / (b1 - b0) * alpha / beta        (b1 > b0)

    so recursive doubling wins below ``(2(n-1) - L) / (L - 2(n-1)/n) * alpha/beta`` — 8*alpha/beta
    on 4 ranks, 8.8 on 8, about 2n/(log2(n) - 2) for large n — and the tree below
    ``(n-1-L) / (L - (n-1)/n) * alpha/beta``. Returns ``inf`` when the algorithm sends no more bytes
    than the ring and takes fewer steps (recursive doubling on 2 ranks: the same bytes, one step
    instead of two), and 0.0 when it never wins (the naive algorithm; a tree on 2 or 3 ranks).
    MPICH likewise runs recursive doubling for short messages and a bandwidth-optimal algorithm for
    long ones (Thakur, Rabenseifner & Gropp 2005 §4.4).
    """
    if algorithm not in _ALLREDUCE_COEFFS or algorithm == "ring":
        raise ValueError(f"unknown algorithm {algorithm!r}; expected one of "
                         f"{sorted(set(_ALLREDUCE_COEFFS) - {'ring'})}")
    _check_n(n)
    if n == 1:
        return 0.0  # nothing moves: every algorithm takes no time
    L = math.ceil(math.log2(n))
    a0, b0 = _ALLREDUCE_COEFFS["ring"](n, L)
    a1, b1 = _ALLREDUCE_COEFFS[algorithm](n, L)
    if b1 <= b0:
        return math.inf if a1 < a0 else 0.0
    return max(0.0, (a0 - a1) / (b1 - b0)) * alpha / beta


def naive_allreduce_time(nbytes, n, alpha, beta):
    """Reduce to a root, then broadcast from it, all messages through the root:
    ``t = 2(n-1) * (alpha + S*beta)``.

    Assumption (one-port model): the root sends or receives one message at a time, so its
    n-1 incoming and n-1 outgoing full-size messages are serialised. The bandwidth term grows
    linearly with n: the root is the bottleneck the ring removes.
    """
    _check_n(n)
    return 2 * (n - 1) * (alpha + nbytes * beta)


def fit_alpha_beta(sizes_bytes, times_s, n, op="all_reduce"):
    """Fit (alpha, beta) to measured collective times by least squares on the ring model
    ``t = steps(n)*alpha + busfactor(n)*S*beta`` (see :func:`collective_time`).

    Residuals are *relative*, ``(model - t) / t``: a sweep spans many decades of sizes, and
    plain squared error would let 1% noise on the largest message swamp the latency of the
    smallest. Non-negative: both must be >= 0 physically. If the unconstrained solution has a
    negative coefficient (noise can push alpha below zero), that coefficient is fixed at 0 and
    the other refit alone, which is the exact NNLS solution for two unknowns.
    Returns ``(alpha_seconds, beta_seconds_per_byte)``; bandwidth = 1/beta.
    """
    import numpy as np

    if op not in _STEPS:
        raise ValueError(f"no alpha-beta model for {op!r}; expected one of {sorted(_STEPS)}")
    if n < 2:
        raise ValueError(f"need n >= 2 ranks to fit a collective (n={n} moves no bytes)")
    S = np.asarray(sizes_bytes, dtype=np.float64).ravel()
    t = np.asarray(times_s, dtype=np.float64).ravel()
    if S.shape != t.shape:
        raise ValueError(f"{S.size} sizes but {t.size} times; pass one time per size")
    if np.unique(S).size < 2:
        raise ValueError("need at least two distinct message sizes to separate alpha from beta")
    if np.any(t <= 0):
        raise ValueError("times must be > 0 seconds")
    # rows divided by t: least squares on relative error, target 1
    A = np.stack([np.full_like(S, _STEPS[op](n)), BUS_FACTORS[op](n) * S], axis=1) / t[:, None]
    t = np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    # Best fit on each boundary (one coefficient at 0); keep the one with smaller residual.
    candidates = []
    for j in (0, 1):
        col = A[:, j]
        c = max(0.0, float(col @ t) / float(col @ col))
        coef = [0.0, 0.0]
        coef[j] = c
        candidates.append((float(np.sum((A @ np.array(coef) - t) ** 2)), coef))
    return tuple(min(candidates, key=lambda rc: rc[0])[1])

