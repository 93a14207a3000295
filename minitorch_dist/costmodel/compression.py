"""Chapter 09 — gradient compression: the bytes each method sends for a tensor, and the time of a
compressed data-parallel reduction under the alpha-beta model.

Bytes one rank contributes for one fp32 tensor of ``d`` elements (a matrix ``n x m`` for PowerSGD),
in the encodings of ``communication/compression.py`` and ``powersgd.py``::

    exact      4d                      fp32
    fp16       2d
    topk       8k,  k = ceil(ratio d)  fp32 value + int32 index per kept entry
                                       (Aji & Heafield 2017, "Sparse Communication for Distributed
                                       Gradient Descent", §2)
    randomk    4k                      values only: every rank draws the indices from one seed
                                       (Stich et al. 2018, "Sparsified SGD with Memory")
    sign       ceil(d/8) + 4           packed sign bits + one fp32 scale (Seide et al. 2014;
                                       Karimireddy et al. 2019, "Error Feedback Fixes SignSGD", Alg. 2)
    qsgd       d + 4                   one int8 signed level (s <= 127) + the fp32 norm (Alistarh et
                                       al. 2017, "QSGD", §3.1, without the paper's Elias coding)
    powersgd   4 (n + m) r             P (n x r) and Q (m x r), when (n + m) r * rate < n m;
                                       4 n m otherwise, as for every 1-D tensor (Vogels et al. 2019,
                                       "PowerSGD", Algorithm 1; torch's ``_should_compress``)

The collective (Thakur, Rabenseifner & Gropp 2005, §4; chapter 00's ring model). exact, fp16 and
PowerSGD's P and Q are *summable*: a ring all-reduce of S bytes costs 2(n-1) alpha + 2(n-1)/n S
beta. The other payloads are not (two ranks' top-k sets differ; a sum of signs is not a sign), so
each rank must receive every rank's payload: an all-gather of n payloads of p bytes costs (n-1)
alpha + (n-1)/n (n p) beta, which grows with n. Compression by a factor c therefore beats the exact
all-reduce in bandwidth only while c > n/2. PowerSGD makes up to three all-reduces per step: the
tensors it leaves uncompressed, all Ps, all Qs.
"""
from __future__ import annotations

import math

from .collectives import collective_time

#: the methods priced here, by the names of chapter 09
COMPRESSION_METHODS = ("exact", "fp16", "topk", "randomk", "sign", "qsgd", "powersgd")
#: the methods whose payloads can be summed in flight (all-reduced); the others are all-gathered
SUMMABLE = ("exact", "fp16", "powersgd")


def _matrix(shape) -> tuple[int, int]:
    """PowerSGD's view of a tensor: ``shape[0]`` rows, the rest flattened into columns."""
    return shape[0], math.prod(shape[1:])


def powersgd_compresses(shape, rank: int = 1, min_compression_rate: float = 2) -> bool:
    """Does PowerSGD send a tensor of ``shape`` as P and Q? Only matrices, and only when
    ``(n + m) r * min_compression_rate < n m`` with ``r = min(n, m, rank)`` (torch's
    ``_should_compress``; Vogels et al. 2019, Algorithm 1)."""
    if len(shape) < 2:
        return False
    n, m = _matrix(shape)
    return (n + m) * min(n, m, rank) * min_compression_rate < n * m


def compressed_payload_bytes(method: str, shape, *, ratio: float = 0.01, levels: int = 4, rank: int = 1,
                             min_compression_rate: float = 2) -> int:
    """Bytes one rank contributes for one fp32 tensor of ``shape`` under ``method`` (the table of the
    module docstring). ``ratio``: top-k / random-k's kept fraction; ``levels``: QSGD's s (1..127);
    ``rank``: PowerSGD's r."""
    if method not in COMPRESSION_METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {COMPRESSION_METHODS}")
    d = math.prod(shape)
    if method in ("topk", "randomk") and not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}: the fraction of entries kept")
    if method == "qsgd" and not (isinstance(levels, int) and 1 <= levels <= 127):
        raise ValueError(f"levels must be an int in [1, 127] (an int8 signed level), got {levels!r}")
    if method == "powersgd" and not (isinstance(rank, int) and rank >= 1):
        raise ValueError(f"rank must be an int >= 1, got {rank!r}")
    k = max(1, math.ceil(ratio * d))
    if method == "exact":
        return 4 * d
    if method == "fp16":
        return 2 * d
    if method == "topk":
        return 8 * k
    if method == "randomk":
        return 4 * k
    if method == "sign":
        return math.ceil(d / 8) + 4
    if method == "qsgd":
        return d + 4
    if not powersgd_compresses(shape, rank, min_compression_rate):
        return 4 * d
    n, m = _matrix(shape)
    return 4 * (n + m) * min(n, m, rank)


def compressed_reduce_time(method: str, shapes, n: int, alpha: float, beta: float, **kw) -> float:
    """Alpha-beta seconds of one data-parallel reduction of fp32 gradients of ``shapes`` over ``n``
    ranks: one all-reduce of the summed payloads for exact and fp16; for PowerSGD one all-reduce of
    the tensors it leaves uncompressed (if any), one of all Ps and one of all Qs; one all-gather of
    n payloads for the others. ``kw`` as :func:`compressed_payload_bytes`. Compute is not counted."""
    shapes = [tuple(s) for s in shapes]
    if method == "powersgd":
        rank, rate = kw.get("rank", 1), kw.get("min_compression_rate", 2)
        big = [s for s in shapes if powersgd_compresses(s, rank, rate)]
        small = sum(4 * math.prod(s) for s in shapes if not powersgd_compresses(s, rank, rate))
        ps = sum(4 * _matrix(s)[0] * min(*_matrix(s), rank) for s in big)
        qs = sum(4 * _matrix(s)[1] * min(*_matrix(s), rank) for s in big)
        return sum(collective_time("all_reduce", b, n, alpha, beta) for b in (small, ps, qs) if b > 0)
    payload = sum(compressed_payload_bytes(method, s, **kw) for s in shapes)
    if method in SUMMABLE:
        return collective_time("all_reduce", payload, n, alpha, beta)
    return collective_time("all_gather", n * payload, n, alpha, beta)
