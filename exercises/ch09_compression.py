# generated from solutions/ch09_compression.py by `make exercises`: fill in each NotImplementedError
# fingerprint a6aa54a6ef210dfe of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 09 exercises: gradient compression — top-k with error feedback, QSGD, one PowerSGD step,
1-bit Adam.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch09``.

Nothing here needs ranks: each exercise is what one rank does to its gradient before (or after)
the collective that sends it.

1. :func:`topk_with_error_feedback`: send only the ``k`` largest-magnitude entries of the gradient
   and keep the rest as a *residual* added to the next step's gradient (Aji & Heafield 2017,
   "Sparse Communication for Distributed Gradient Descent", §2; Lin et al. 2018, "Deep Gradient
   Compression", §2): nothing is ever dropped, only delayed, so ``sent + residual`` is exactly
   ``gradient + old residual``.
2. :func:`qsgd_quantize` / :func:`qsgd_dequantize`: stochastic quantisation with ``s`` levels
   (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization and
   Encoding", §3.1): each ``|v_i| / ||v||`` is rounded to one of its two neighbouring levels
   ``l/s`` at random, with the probability that makes the result *unbiased*, ``E[Q(v)] = v``.
3. :func:`powersgd_step`: one step of PowerSGD (Vogels et al. 2019, "PowerSGD: Practical Low-Rank
   Gradient Compression for Distributed Optimization", Algorithm 1) on one matrix, without the
   all-reduces: one power iteration ``P = M Q``, orthogonalise ``P``, ``Q = Mᵀ P``; the rank-r
   approximation is ``P Qᵀ``. Warm-starting from the last ``Q`` makes successive steps a power
   iteration that converges toward the best rank-r approximation (the truncated SVD).
4. :func:`onebit_adam_step`: the idea of 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication
   Efficient Large-Scale Training with Adam's Convergence Speed", §3-4): Adam's variance ``v``
   stabilises early, so after a full-precision warm-up it is *frozen*; Adam is then SGD with
   momentum preconditioned by a fixed ``1 / sqrt(v)``, and the momentum can be sign-compressed with
   error feedback like any other linear quantity.
"""
from __future__ import annotations

import torch

# --- 1. top-k sparsification with error feedback -------------------------------------------------


def topk_with_error_feedback(grad: torch.Tensor, residual: torch.Tensor,
                             k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, indices, new_residual)``: the ``k`` entries to send and what stays behind.

    Error feedback: compress the *corrected* gradient ``c = grad + residual``, not ``grad``.
    ``indices`` (int64, into ``c.flatten()``) are the ``k`` positions of largest ``|c|``;
    ``values = c.flatten()[indices]``; ``new_residual`` is ``c`` with those ``k`` entries set to 0,
    shaped like ``grad``. So ``dense(values, indices) + new_residual == c`` exactly (every entry of
    ``c`` is in one or the other), and an entry too small to be sent this step grows in the residual
    until it is. Ties in ``|c|`` may be broken either way. The inputs are not modified.

    The receiver rebuilds ``torch.zeros(numel).index_put_((indices,), values).view(shape)``: the
    payload is ``k`` values and ``k`` indices instead of ``numel`` values.
    """
    if residual.shape != grad.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match gradient shape "
                         f"{tuple(grad.shape)}; start from torch.zeros_like(grad)")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= grad.numel():
        raise ValueError(f"k must be an int in [1, grad.numel() = {grad.numel()}], got {k!r}")
    raise NotImplementedError("exercise: topk_with_error_feedback — see chapters/09_compression.md")


# --- 2. QSGD ---------------------------------------------------------------------------------------


def qsgd_quantize(v: torch.Tensor, levels: int,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm, q)``: ``v``'s 2-norm (a 0-dim tensor of ``v``'s dtype) and signed integer levels.

    QSGD (Alistarh et al. 2017, §3.1) with ``s = levels``: for each entry let
    ``a = |v_i| / ||v|| * s`` (in ``[0, s]``) and ``l = floor(a)``; round up to ``l + 1`` with
    probability ``a - l``, else down to ``l`` (one ``torch.rand`` draw per entry from
    ``generator``). ``q_i = sign(v_i) * (that level)``, an int tensor (int8 for ``s <= 127``, else
    int32) of ``v``'s shape with ``|q_i| <= s``. Then ``E[q_i] * ||v|| / s = v_i``: unbiased.
    A zero vector gives ``norm = 0`` and ``q = 0``. The payload is one float and ``n`` small ints
    (``log2(2s + 1)`` bits each before the paper's Elias coding).
    """
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    if not v.is_floating_point():
        raise TypeError(f"v must be a floating-point tensor, got {v.dtype}")
    qdtype = torch.int8 if levels <= 127 else torch.int32
    raise NotImplementedError("exercise: qsgd_quantize — see chapters/09_compression.md")


def qsgd_dequantize(norm: torch.Tensor, q: torch.Tensor, levels: int,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The vector ``norm * q / levels`` in ``dtype``: :func:`qsgd_quantize`'s estimate of ``v``."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    raise NotImplementedError("exercise: qsgd_dequantize — see chapters/09_compression.md")


# --- 3. one PowerSGD step ------------------------------------------------------------------------


def powersgd_step(M: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(P, Q_new, M_hat)``: one step of PowerSGD (Vogels et al. 2019, Algorithm 1) on ``M`` (n x m).

    ``Q`` (m x r) is the previous step's ``Q`` (warm start) or a random start. Without the
    all-reduces of the distributed algorithm:

        P     = M Q                  (n x r)   [all-reduce P]
        P     = orthogonalise(P)     columns orthonormal: Pᵀ P = I_r
        Q_new = Mᵀ P                 (m x r)   [all-reduce Q]
        M_hat = P Q_newᵀ  = P Pᵀ M   (n x m)   the rank-r approximation

    ``M_hat`` is the projection of ``M`` onto the span of ``P``: exact when ``M`` has rank ``<= r``
    and ``Q`` is generic; repeated steps (feeding ``Q_new`` back) are subspace iteration, and
    ``M_hat`` approaches the best rank-r approximation. Orthogonalise with ``torch.linalg.qr``
    (reduced) or Gram-Schmidt, as the paper does. Returns tensors of ``M``'s dtype.
    """
    if M.dim() != 2 or Q.dim() != 2:
        raise ValueError(f"M and Q must be matrices, got {M.dim()}-d and {Q.dim()}-d; reshape a "
                         "conv gradient to (out_channels, -1) first")
    if Q.shape[0] != M.shape[1]:
        raise ValueError(f"Q has {Q.shape[0]} rows but M has {M.shape[1]} columns: "
                         "Q must be m x r for M n x m")
    if Q.shape[1] > min(M.shape):
        raise ValueError(f"rank r = {Q.shape[1]} exceeds min(n, m) = {min(M.shape)}")
    raise NotImplementedError("exercise: powersgd_step — see chapters/09_compression.md")


# --- 4. one step of 1-bit Adam -------------------------------------------------------------------


def onebit_adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     error: torch.Tensor, step: int, warmup_steps: int, lr: float,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(new_param, new_m, new_v, new_error, sent)``: one step of 1-bit Adam (Tang et al. 2021, §3-4).

    ``step`` is this step's 0-based index. Both phases first update the momentum,
    ``m' = b1 m + (1 - b1) g``; neither uses Adam's bias correction (a constant factor the warm-up
    absorbs; the paper's Algorithm 1 omits it too).

    Warm-up, ``step < warmup_steps``: plain Adam, all in full precision::

        v' = b2 v + (1 - b2) g²        sent = m'        error' = error (unchanged)

    Compression, ``step >= warmup_steps``: ``v`` is frozen (``v' = v``) and the momentum goes on the
    wire as one sign per entry plus one scale, with error feedback (Seide et al. 2014)::

        c      = m' + error
        scale  = mean |c|
        sent   = scale * sign(c)        with sign(0) = +1, so sent takes only the values ±scale
        error' = c - sent               what the sign dropped, added back next step

    Either way the update uses what was sent: ``param' = param - lr * sent / (sqrt(v') + eps)``.
    Single-process: ``sent`` is what one rank would put on the wire (the paper all-reduces it and
    compresses again on the server side; that second error-feedback stage is left out here). All
    results are new tensors shaped like ``param``; the inputs are not modified.
    """
    for name, t in (("grad", grad), ("m", m), ("v", v), ("error", error)):
        if t.shape != param.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match param shape "
                             f"{tuple(param.shape)}; start m, v and error from torch.zeros_like(param)")
    for name, n in (("step", step), ("warmup_steps", warmup_steps)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps 1 / sqrt(v) finite), got {eps!r}")
    beta1, beta2 = betas
    raise NotImplementedError("exercise: onebit_adam_step — see chapters/09_compression.md")
