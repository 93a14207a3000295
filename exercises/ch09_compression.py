# generated from solutions/ch09_compression.py by `make exercises`: fill in each NotImplementedError
# fingerprint df8942155f935793 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 09 exercises: gradient compression — top-k with error feedback, QSGD, one PowerSGD step,
PowerSGD with error feedback on ranks, the bytes each compressor sends, 1-bit Adam.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch09``.

Exercises 1-3 and 6 need no ranks: each is what one rank does to its gradient before (or after) the
collective that sends it. Exercises 4 and 5 run on ranks (inside ``launch``): the collectives
themselves.

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
4. :class:`PowerSGDReducer`: the whole of PowerSGD as the gradient reduction of data-parallel
   training (Vogels et al. 2019, Algorithms 1 and 2): warm-up all-reduces, then error feedback, a
   warm-started Q, and the all-reduces of P and Q, with the 1-D tensors sent as they are.
5. :func:`meter_compressed_step`: predict from the cost model the bytes a compressed reduction puts
   through each collective, then count them with the comm meter on the ranks.
6. :func:`onebit_adam_step`: the idea of 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication
   Efficient Large-Scale Training with Adam's Convergence Speed", §3-4): Adam's variance ``v``
   stabilises early, so after a full-precision warm-up it is *frozen*; Adam is then SGD with
   momentum preconditioned by a fixed ``1 / sqrt(v)``, and the momentum can be sign-compressed with
   error feedback like any other linear quantity.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.communication import compressed_allreduce
from minitorch_dist.runtime import comm

# --- 1. top-k sparsification with error feedback -------------------------------------------------


def topk_with_error_feedback(grad: torch.Tensor, residual: torch.Tensor,
                             k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build

    ``(values, indices, new_residual)``: the ``k`` entries to send and what stays behind.

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
    """Kind: build

    ``(norm, q)``: ``v``'s 2-norm (a 0-dim tensor of ``v``'s dtype) and signed integer levels.

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
    """Kind: build

    The vector ``norm * q / levels`` in ``dtype``: :func:`qsgd_quantize`'s estimate of ``v``."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    raise NotImplementedError("exercise: qsgd_dequantize — see chapters/09_compression.md")


# --- 3. one PowerSGD step ------------------------------------------------------------------------


def powersgd_step(M: torch.Tensor, Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build

    ``(P, Q_new, M_hat)``: one step of PowerSGD (Vogels et al. 2019, Algorithm 1) on ``M`` (n x m).

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


# --- 4. PowerSGD with error feedback, on ranks ----------------------------------------------------


def _orthogonalise(m: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the columns of ``m`` (n x r) in place and return it: Gram-Schmidt for r <= 2,
    QR otherwise (what torch's ``powerSGD_hook`` does)."""
    r = m.shape[-1]
    if r <= 2:
        for i in range(r):
            col = m[:, i: i + 1]
            col /= col.norm(dim=0, keepdim=True)
            if i + 1 < r:
                rest = m[:, i + 1:]
                rest -= (col * rest).sum(dim=0, keepdim=True) * col
    else:
        m.copy_(torch.linalg.qr(m).Q)
    return m


def _unflatten(buf: torch.Tensor, tensors) -> None:
    """Copy consecutive pieces of the flat ``buf`` into ``tensors``, in order."""
    off = 0
    for t in tensors:
        t.copy_(buf[off: off + t.numel()].view_as(t))
        off += t.numel()


class PowerSGDReducer:
    """Kind: build

    PowerSGD as the gradient reduction of data-parallel training (Vogels et al. 2019, Algorithm 1
    for the compression, Algorithm 2 for error feedback, §3 for the warm start), called on every
    rank with the same list of gradients each step: ``reducer.reduce([p.grad for p in params])``
    replaces each gradient, in place, by the estimate of its mean over the ranks.

    **Warm-up.** The first ``start_iter`` calls are exact: concatenate every gradient into one flat
    buffer, divide it by the number of ranks, all-reduce it, and copy it back.

    **After the warm-up**, each call:

    1. splits the gradients into the matrices it compresses (``self.compresses(shape)``: viewed as
       ``M = g.view(g.shape[0], -1)``, n x m) and the rest (1-D tensors, small matrices);
    2. error feedback: for the i-th gradient of the list, ``M += self.error[i]`` (when there is
       one), and remembers the corrected ``M`` (a clone) as the start of the new residual;
    3. the Qs: the first time, ``self._fresh_qs(matrices)`` (given: the random start torch draws,
       already orthonormal); afterwards the warm start, last call's Qs, each orthogonalised again;
    4. the rest: one flat buffer, all-reduced, divided by the number of ranks, copied back;
    5. ``P = M Q`` for every matrix; all the Ps in one flat buffer, all-reduced (the *sum*: P is
       linear in M, so summing the Ps is P of the summed M); each P orthogonalised
       (``_orthogonalise``, given);
    6. ``Q = Mᵀ P``; all the Qs in one flat buffer, all-reduced, divided by the number of ranks;
    7. ``M̂ = P Qᵀ`` replaces the gradient (``M.copy_(...)``, which writes into the gradient), the
       residual becomes ``(corrected M) - M̂``, and these Qs are kept for the next call.

    Every collective goes through ``comm.all_reduce`` (``from minitorch_dist.runtime import comm``),
    so that the comm meter counts it. ``self.iter`` counts the calls.

    **Your task:** the body of ``reduce``. Follow the order above: it is the order of torch's
    ``powerSGD_hook`` on one DDP bucket, and the tests compare your gradients with that hook's.
    """

    def __init__(self, rank: int = 1, start_iter: int = 2, seed: int = 0, min_compression_rate: float = 2):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        self.rank, self.start_iter, self.min_rate = rank, start_iter, min_compression_rate
        self.rng = np.random.RandomState(seed)  # torch's hook: PowerSGDState(random_seed=seed)
        self.iter = 0
        self.error: dict[int, torch.Tensor] = {}  # position in the list -> residual of that matrix
        self.qs: list[torch.Tensor] | None = None  # the warm-start Qs, one per compressed matrix

    def _r(self, shape) -> int:
        return min(shape[0], int(np.prod(shape[1:])), self.rank)

    def compresses(self, shape) -> bool:
        """Is a tensor of this shape sent as P and Q? Matrices with (n + m) r * rate < n m."""
        if len(shape) < 2:
            return False
        n, m = shape[0], int(np.prod(shape[1:]))
        return (n + m) * self._r(shape) * self.min_rate < n * m

    def _fresh_qs(self, matrices) -> list[torch.Tensor]:
        """Random orthonormal starting Qs (m x r), drawn as torch's hook draws them: one seed from
        ``self.rng``, then the Qs filled from N(0, 1) shape group by shape group, in order."""
        groups = defaultdict(list)
        for i, mat in enumerate(matrices):
            groups[tuple(mat.shape)].append(i)
        qs = [None] * len(matrices)
        gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        for idx in groups.values():
            for i in idx:
                n, m = matrices[i].shape
                q = torch.randn(1, m, self._r((n, m)), generator=gen, dtype=matrices[i].dtype)[0]
                qs[i] = _orthogonalise(q).to(matrices[i].device)
        return qs

    @torch.no_grad()
    def reduce(self, grads, group=None) -> list[torch.Tensor]:
        """Replace each gradient by the PowerSGD estimate of its mean over the ranks; return them."""
        if not dist.is_initialized():
            raise RuntimeError("PowerSGDReducer.reduce runs inside ranks: call it from a function started "
                               "with minitorch_dist.launch(fn, n)")
        grads = list(grads)
        if any(g is None for g in grads):
            raise ValueError("a gradient is None: pass only parameters that received one")
        n_ranks = dist.get_world_size(group)
        raise NotImplementedError("exercise: PowerSGDReducer.reduce — see chapters/09_compression.md")


# --- 5. the bytes of a compressed step: predicted, then counted ---------------------------------------


def _method_of(compressor) -> tuple[str, dict]:
    """The cost model's name and parameters of a compressor of ``minitorch_dist.communication``
    (``ErrorFeedback`` unwrapped: it sends what its inner compressor sends)."""
    if compressor is None:
        return "exact", {}
    inner = getattr(compressor, "inner", compressor)
    name = type(inner).__name__
    table = {"FP16": ("fp16", {}), "Sign": ("sign", {}),
             "TopK": ("topk", {"ratio": getattr(inner, "ratio", None)}),
             "RandomK": ("randomk", {"ratio": getattr(inner, "ratio", None)}),
             "QSGD": ("qsgd", {"levels": getattr(inner, "s", None)}),
             "PowerSGD": ("powersgd", {"rank": getattr(inner, "rank", None),
                                       "min_compression_rate": getattr(inner, "min_rate", None)})}
    if name not in table:
        raise TypeError(f"no cost-model method for {type(compressor).__name__}; expected None or one of "
                        f"{sorted(table)} (optionally in ErrorFeedback)")
    return table[name]


def meter_compressed_step(grads, compressor) -> dict:
    """Kind: measure

    The bytes one data-parallel reduction of ``grads`` with ``compressor`` puts through each
    collective on this rank: first predicted from the cost model, then counted. Call it on every
    rank (inside ``launch``), each rank with its own gradients of the same shapes.

    **Predict** ``{op: S}``, where S is what the comm meter's ``bytes`` counts for that collective
    (the tensor an all-reduce reduces; the *output* of an all-gather, n payloads), summed over the
    calls of the step. ``_method_of(compressor)`` (given) names the method and its parameters for
    ``costmodel.compressed_payload_bytes(method, shape, **params)``, the bytes one rank contributes
    per tensor. Then the collective: ``"exact"``, ``"fp16"`` and ``"powersgd"`` are summable and go
    through ``"all_reduce"`` (S = the payloads); every other method's payloads are all-gathered
    (``"all_gather"``, S = n x the payloads, n = ``dist.get_world_size()``). One exception: a
    ``PowerSGD`` still in its warm-up (``compressor.iter < compressor.start_iter``) all-reduces
    the gradients exactly, 4 bytes per element.

    **Measure** by running ``compressed_allreduce(grads, compressor)`` inside ``with comm.meter()
    as m:`` and reading ``{op: s["bytes"] for op, s in m.summary().items()}``. The reduction really
    happens: ``grads`` come back averaged over the ranks.

    Tolerance: none — both are counts of bytes, and the prediction must equal the count exactly.

    **Your task:** return ``{"predicted": {op: bytes}, "measured": {op: bytes}}`` (ints).
    """
    if not dist.is_initialized():
        raise RuntimeError("meter_compressed_step runs inside ranks: call it from a function started "
                           "with minitorch_dist.launch(fn, n)")
    grads = list(grads)
    method, params = _method_of(compressor)
    raise NotImplementedError("exercise: meter_compressed_step — see chapters/09_compression.md")


# --- 6. one step of 1-bit Adam -------------------------------------------------------------------


def onebit_adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     error: torch.Tensor, step: int, warmup_steps: int, lr: float,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build

    ``(new_param, new_m, new_v, new_error, sent)``: one step of 1-bit Adam (Tang et al. 2021, §3-4).

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
