"""Chapter 09 exercises: gradient compression — top-k with error feedback, QSGD, a batched PowerSGD
step by Cholesky QR, batched PowerSGD with error feedback on ranks, the bytes each compressor sends,
1-bit Adam.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch09_compression.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch09 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Exercises 1-3 and 6 need no ranks: each is what one rank does to its gradient before (or after) the
collective that sends it. Exercises 4 and 5 run on ranks (inside ``launch``): the collectives
themselves.

1. :func:`topk_with_error_feedback`: send only the ``k`` largest-magnitude entries of the gradient
   and keep the rest as a *residual* added to the next step's (Aji & Heafield 2017, "Sparse
   Communication for Distributed Gradient Descent", §2), with Deep Gradient Compression's momentum
   correction and momentum factor masking (Lin et al. 2018, §3.1-3.2): nothing is ever dropped, only
   delayed.
2. :func:`qsgd_quantize` / :func:`qsgd_dequantize`: stochastic quantisation with ``s`` levels, by
   buckets (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient Quantization and
   Encoding", §3.1): each ``|v_i| / ||v||`` is rounded to one of its two neighbouring levels
   ``l/s`` at random, with the probability that makes the result *unbiased*, ``E[Q(v)] = v``.
3. :func:`powersgd_step`: PowerSGD's power iteration (Vogels et al. 2019, "PowerSGD: Practical
   Low-Rank Gradient Compression for Distributed Optimization", Algorithm 1) on a stack of
   same-shape matrices at once, without the all-reduces, for ``iters`` rounds, orthogonalised by
   Cholesky QR (``R = chol(PᵀP)``, ``P ← P R⁻¹``), whose breakdown on a rank-deficient ``M Q`` is
   refused. Warm-started rounds converge toward the best rank-r approximation (the truncated SVD).
4. :class:`PowerSGDReducer`: *batched* PowerSGD as the gradient reduction of data-parallel training
   (Vogels et al. 2019, Algorithms 1 and 2), as torch's ``batched_powerSGD_hook``: warm-up
   all-reduces, then the whole gradient list padded to one square matrix, with error feedback over
   the padded matrix, a warm-started Q, and one all-reduce of P and one of Q.
5. :func:`meter_compressed_step`: predict from the cost model the bytes a compressed reduction puts
   through each collective, then count them with the comm meter on the ranks.
6. :func:`onebit_adam_step`: the idea of 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication
   Efficient Large-Scale Training with Adam's Convergence Speed", §3-4): Adam's variance ``v``
   stabilises early, so after a full-precision warm-up it is *frozen*; Adam is then SGD with
   momentum preconditioned by a fixed ``1 / sqrt(v)``, and the momentum can be sign-compressed with
   error feedback like any other linear quantity.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.communication import compressed_allreduce
from minitorch_dist.runtime import comm

# --- 1. top-k sparsification with error feedback -------------------------------------------------


def topk_with_error_feedback(grad: torch.Tensor, residual: torch.Tensor, k: int,
                             velocity: torch.Tensor | None = None, beta: float = 0.0,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build · about 40 minutes

    Top-k sparsification with error feedback, momentum correction and momentum factor masking for
    one rank's gradient: ``(values, indices, new_residual, new_velocity)`` (Aji & Heafield 2017,
    "Sparse Communication for Distributed Gradient Descent", §2; Lin et al. 2018, "Deep Gradient
    Compression", §3.1-3.2).

    Send only the ``k`` largest-magnitude entries; keep everything not sent in a residual, so nothing
    is dropped, only delayed. With momentum SGD (``beta > 0``), DGC's *momentum correction* keeps the
    momentum locally — a velocity ``u`` updated with each gradient — and accumulates the *velocity*,
    not the gradient, into the residual, so that what is eventually sent is what dense momentum SGD
    would have applied. *Momentum factor masking* then clears the velocity of every entry just sent,
    so a sent entry does not keep pushing from a stale momentum. With ``beta = 0`` (and no velocity)
    this is plain top-k with error feedback: the selection is made on ``grad + residual``.

    Interface: ``grad`` and ``residual`` (and ``velocity``, None meaning zeros) of one shape,
    ``1 <= k <= grad.numel()``, ``0 <= beta < 1``. ``indices`` (int64) index the flattened tensor;
    ``values`` are the accumulated entries there; ``new_residual`` and ``new_velocity`` have
    ``grad``'s shape. The receiver rebuilds ``torch.zeros(numel).index_put_((indices,), values)``.
    Inputs are not modified; ties in magnitude may go either way.

    Properties the tests check: the k sent entries are the k largest of the accumulated tensor; sent
    plus the new residual is exactly the old residual plus the new velocity, at every step of a run
    (and the total sent plus the residual is the sum of the velocities, within the float32 rounding of
    each step); the velocity of each sent entry is zero afterwards and the others are ``beta·u + g``;
    a hand-worked two-step run with beta 0.5; beta 0 equal to plain error feedback; inputs unchanged;
    bad input refused.

    Reference: ``minitorch_dist/communication/compression.py`` (``TopK`` and ``ErrorFeedback``: top-k
    with error feedback on the gradient; DGC's momentum correction and masking are not there).
    """
    if residual.shape != grad.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match gradient shape "
                         f"{tuple(grad.shape)}; start from torch.zeros_like(grad)")
    if velocity is not None and velocity.shape != grad.shape:
        raise ValueError(f"velocity shape {tuple(velocity.shape)} does not match gradient shape "
                         f"{tuple(grad.shape)}; start from None (zeros)")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= grad.numel():
        raise ValueError(f"k must be an int in [1, grad.numel() = {grad.numel()}], got {k!r}")
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1) (the momentum), got {beta!r}")
    # BEGIN SOLUTION
    u = grad.flatten() if velocity is None else beta * velocity.flatten() + grad.flatten()
    accumulated = residual.flatten() + u  # momentum correction: accumulate the velocity
    indices = accumulated.abs().topk(k, sorted=False).indices
    values = accumulated[indices]
    new_residual = accumulated.clone()
    new_residual[indices] = 0  # sent now: nothing left to carry
    new_velocity = u.clone()
    new_velocity[indices] = 0  # momentum factor masking
    return values, indices, new_residual.view(grad.shape), new_velocity.view(grad.shape)
    # END SOLUTION


# --- 2. QSGD ---------------------------------------------------------------------------------------


def qsgd_quantize(v: torch.Tensor, levels: int, generator: torch.Generator | None = None,
                  bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build · about 40 minutes

    QSGD's stochastic quantisation with ``s = levels`` levels and buckets of ``bucket`` entries:
    ``(norms, q)`` (Alistarh et al. 2017, "QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding", §3.1, and its bucketing with bucket size d).

    Each entry's magnitude relative to a 2-norm, ``|v_i| / ||·||``, lies in [0, 1]; it is rounded at
    random to one of its two neighbouring points of the grid ``0, 1/s, ..., 1``, with the
    probabilities that make the estimate *unbiased*; the sign is kept. With ``bucket=None`` the norm
    is the whole vector's (one float per tensor). With ``bucket = d`` the flattened vector is cut
    into buckets of d consecutive entries (the last may be shorter) and each is quantised with its
    own norm: one float per bucket more on the wire, and a variance bound of ``min(d/s², √d/s)`` per
    bucket instead of ``min(n/s², √n/s)`` (the paper uses d = 512). An all-zero bucket has norm 0 and
    levels 0.

    Interface: ``norms`` is a 0-dim tensor (``bucket=None``) or a 1-D tensor of ``ceil(n / d)``
    norms, in ``v``'s dtype; ``q`` is an int tensor of ``v``'s shape (int8 for ``s <= 127``, else
    int32) with ``|q_i| <= s``; draw one uniform number per entry, in the order of the flattened
    ``v``, from ``generator`` (``torch.rand(v.shape, generator=generator, ...)``).

    Properties the tests check: every ``q_i`` is one of the two grid points around its relative
    magnitude times s, with v's sign, against the whole-vector norm and against each bucket's norm
    (ragged last bucket); the mean of many quantisations is within a few standard errors of v
    (unbiased) and within the variance bound, with and without buckets; an all-zero bucket beside
    non-zero ones; the dtype of q and its bound; a seeded generator reproduces the result; bad input
    refused.

    Reference: ``minitorch_dist/communication/compression.py`` (``QSGD``: one norm per tensor; yours
    adds the paper's buckets and returns the norms and levels separately).
    """
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    if not v.is_floating_point():
        raise TypeError(f"v must be a floating-point tensor, got {v.dtype}")
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise ValueError(f"bucket must be an int >= 1 (d in the paper) or None (one bucket), got {bucket!r}")
    qdtype = torch.int8 if levels <= 127 else torch.int32
    # BEGIN SOLUTION
    flat = v.reshape(-1)
    d = flat.numel() if bucket is None else bucket
    n_buckets = max(1, -(-flat.numel() // d))
    padded = flat.new_zeros(n_buckets * d)
    padded[: flat.numel()] = flat
    norms = torch.linalg.vector_norm(padded.view(n_buckets, d), dim=1)  # zeros never add to a norm
    per_entry = norms.repeat_interleave(d)[: flat.numel()]
    safe = torch.where(per_entry > 0, per_entry, torch.ones_like(per_entry))
    a = torch.where(per_entry > 0, flat.abs() / safe * levels, torch.zeros_like(flat))
    lower = a.floor()
    up = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype).reshape(-1) < (a - lower)
    level = (lower + up.to(v.dtype)).clamp_(max=levels)  # |v_i| <= its norm: a <= s up to rounding
    q = (torch.sign(flat) * level).to(qdtype).view(v.shape)
    return (norms[0] if bucket is None else norms), q
    # END SOLUTION


def qsgd_dequantize(norm: torch.Tensor, q: torch.Tensor, levels: int,
                    dtype: torch.dtype = torch.float32, bucket: int | None = None) -> torch.Tensor:
    """Kind: build · about 10 minutes

    :func:`qsgd_quantize`'s estimate of ``v`` from ``(norm, q)`` in ``dtype``, with the same
    ``bucket`` (``norm`` then holds one norm per bucket of the flattened ``q``).

    Properties the tests check: exact values on hand-made levels and norms, with and without buckets
    (a ragged last bucket); the dtype asked for; ``qsgd_dequantize(*qsgd_quantize(v, s), s)``
    averaging to v.

    Reference: ``minitorch_dist/communication/compression.py`` (``QSGD.decompress``: one norm per tensor).
    """
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    if bucket is not None and norm.numel() != -(-q.numel() // bucket):
        raise ValueError(f"{norm.numel()} norms for {q.numel()} levels in buckets of {bucket}: expected "
                         f"ceil({q.numel()} / {bucket}); pass the bucket used to quantise")
    # BEGIN SOLUTION
    if bucket is None:
        return (norm.to(dtype) * q.to(dtype)) / levels
    per_entry = norm.to(dtype).repeat_interleave(bucket)[: q.numel()].view(q.shape)
    return (per_entry * q.to(dtype)) / levels
    # END SOLUTION


# --- 3. a batched PowerSGD step, orthogonalised by Cholesky QR --------------------------------------


def powersgd_step(M: torch.Tensor, Q: torch.Tensor, iters: int = 1,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build · about 35 minutes

    PowerSGD's power iteration on a stack of same-shape matrices at once, without the all-reduces,
    orthogonalised by Cholesky QR: ``(P, Q_new, M_hat)`` (Vogels et al. 2019, "PowerSGD: Practical
    Low-Rank Gradient Compression for Distributed Optimization", Algorithm 1, and §3 for repeating it
    from a warm start).

    A model has many gradients of one shape (the layers of a transformer block), and their power
    iterations are independent: one batched matmul serves them all. Each round, for every matrix
    of the stack: ``P = M Q``; orthogonalise P by *Cholesky QR*: ``R = chol(PᵀP)``, upper triangular
    with a positive diagonal, and ``P ← P R⁻¹`` (a triangular solve, never an inverse); then
    ``Q = Mᵀ P``. ``iters`` rounds, each fed the last round's Q; the approximation is
    ``M_hat = P Q_newᵀ = P Pᵀ M``. Cholesky QR costs two matmuls and an r x r factorisation instead
    of a Householder QR of the tall P, but it squares P's condition number: the columns it returns
    are orthonormal only to about ``κ(P)²·u`` (u the unit roundoff), and where PᵀP is not
    numerically positive definite (M Q rank-deficient: a zero column, M zero) there is nothing to
    factor.

    Interface: ``M`` is (b, n, m), ``Q`` is (b, m, r) with ``1 <= r <= min(n, m)``, one floating dtype;
    ``iters >= 1``. Returns P (b, n, r), Q_new (b, m, r) and M_hat (b, n, m), in M's dtype. When
    Cholesky breaks down for any matrix of the stack in any round (``torch.linalg.cholesky_ex``
    reports ``info != 0``), raise ``ValueError`` saying that PᵀP is "not positive definite" and
    which matrices; an ill-conditioned but full-rank P is not refused. Inputs are not modified.

    Properties the tests check, in float64: a rank-r matrix is reproduced from a generic Q in one
    round; P's columns are orthonormal within Yamamoto et al.'s bound for Cholesky QR,
    ``5·κ(P)²·u·(n r + r(r+1))``, on a well-conditioned and on an ill-conditioned (κ ~ 10⁴) P;
    ``Pᵀ (M Q)`` is upper triangular with a positive diagonal (R itself, not a QR with columns of
    either sign); ``Q_new = Mᵀ P``; more rounds are never worse toward the truncated SVD and converge
    to it, and ``iters=k`` equals k warm-started calls; each matrix of the stack equals the stack of
    that one matrix alone; float32 keeps its dtype; bad input refused, a rank-deficient M Q by the
    ValueError above.

    Reference: ``minitorch_dist/communication/powersgd.py`` (``orthogonalise``: Gram-Schmidt for
    r <= 2 or Householder QR; ``PowerSGD.compress``: one round on one matrix. Yours is batched, runs
    ``iters`` rounds, and orthogonalises by Cholesky QR, with its breakdown refused).
    """
    if M.dim() != 3 or Q.dim() != 3:
        raise ValueError(f"M and Q must be stacks of matrices, (b, n, m) and (b, m, r); got {M.dim()}-d and "
                         f"{Q.dim()}-d (one matrix is M.unsqueeze(0))")
    if Q.shape[0] != M.shape[0]:
        raise ValueError(f"Q stacks {Q.shape[0]} matrices but M stacks {M.shape[0]}: one Q per matrix")
    if Q.shape[1] != M.shape[2]:
        raise ValueError(f"Q has {Q.shape[1]} rows but M has {M.shape[2]} columns: "
                         "Q must be m x r for M n x m")
    if not 1 <= Q.shape[2] <= min(M.shape[1:]):
        raise ValueError(f"rank r = {Q.shape[2]} must be in [1, min(n, m) = {min(M.shape[1:])}]")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1 (rounds of power iteration), got {iters!r}")
    if not M.is_floating_point() or Q.dtype != M.dtype:
        raise TypeError(f"M and Q must share one floating dtype, got {M.dtype} and {Q.dtype}")
    # BEGIN SOLUTION
    for _ in range(iters):
        P = M @ Q
        R, info = torch.linalg.cholesky_ex(P.mT @ P, upper=True)  # PᵀP = RᵀR, R's diagonal > 0
        if bool((info != 0).any()):
            bad = torch.nonzero(info).flatten().tolist()
            raise ValueError(f"PᵀP is not positive definite for matrices {bad} of the stack: M Q is "
                             "rank-deficient there, and Cholesky QR cannot orthogonalise it")
        P = torch.linalg.solve_triangular(R, P, upper=True, left=False)  # P R⁻¹
        Q = M.mT @ P
    return P, Q, P @ Q.mT
    # END SOLUTION


# --- 4. batched PowerSGD with error feedback, on ranks ---------------------------------------------


def _orthogonalise(m: torch.Tensor) -> torch.Tensor:
    """Orthonormalise the columns of ``m`` (n x r) in place and return it: Gram-Schmidt for r <= 2,
    QR otherwise (what torch's PowerSGD hooks do)."""
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
    """Copy consecutive pieces of the flat ``buf`` into ``tensors``, in order (entries of ``buf`` past
    the tensors' total are left alone)."""
    off = 0
    for t in tensors:
        t.copy_(buf[off: off + t.numel()].view_as(t))
        off += t.numel()


class PowerSGDReducer:
    """Kind: build · about 60 minutes

    *Batched* PowerSGD as the gradient reduction of data-parallel training: the whole list of
    gradients compressed as one square matrix, as torch's ``batched_powerSGD_hook`` does with a DDP
    bucket (Vogels et al. 2019, Algorithm 1 for the compression, Algorithm 2 for error feedback, §3
    for the warm start). Called on every rank with the same list of gradients each step:
    ``reducer.reduce(grads)`` replaces each gradient, in place, by the estimate of its mean over the
    ranks, and returns the list.

    What it must do: the first ``start_iter`` calls are an exact mean, one all-reduce of the N
    gradient entries flattened in list order. After that, the flat gradients are padded with zeros
    to ``side² `` entries, ``side = ⌈√N⌉``, and viewed row by row as a side x side matrix M; error
    feedback adds the residual of the last compressed call over the *whole* padded matrix, padding
    included; one power-iteration round on the ranks sends one P (side x rank, summed) and one Q
    (side x rank, averaged); ``P Qᵀ``'s first N entries are written back into the gradients, and
    what the rank had minus ``P Qᵀ`` is the new residual. Q is warm-started from the last call's
    (the first from ``self._fresh_q``, given, drawn as torch draws it) and orthogonalised before
    use, as is P after its all-reduce (``_orthogonalise``, given). Every collective goes through
    ``comm.all_reduce`` so the comm meter sees it; ``self.iter`` counts the calls; ``self.error``
    holds the residual (flat, side² entries; None before the first compressed call) and ``self.q``
    the warm-start Q. A rank larger than side is refused (``ValueError`` naming the rank) on a call
    that would compress.

    Properties the tests check, in float64 on 2 ranks (ranks 1 and 3: Gram-Schmidt and QR) and 4
    (rank 1): the gradients equal, within a derived bound, those of torch's ``batched_powerSGD_hook``
    on one DDP bucket over several steps (the warm-up, then compressed steps); the comm meter sees
    exactly one all-reduce of N entries per warm-up call and exactly two, P's and Q's, of side x
    rank entries each, per compressed call; what was sent plus the new residual is what the rank had
    (its gradient plus the old residual), over all side² entries; the ranks agree; training with it
    follows exact data parallelism; a list of other shapes after the memory is set, mixed dtypes and
    bad settings are refused.

    Reference: ``minitorch_dist/communication/powersgd.py`` (``PowerSGD.reduce``: one P and Q per
    matrix, the 1-D tensors sent exactly, residuals per tensor. Yours compresses everything as one
    padded matrix, with one residual over the padded bucket).
    """

    def __init__(self, rank: int = 1, start_iter: int = 2, seed: int = 0):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank must be an int >= 1, got {rank!r}")
        if isinstance(start_iter, bool) or not isinstance(start_iter, int) or start_iter < 0:
            raise ValueError(f"start_iter must be an int >= 0, got {start_iter!r}")
        self.rank, self.start_iter = rank, start_iter
        self.rng = np.random.RandomState(seed)  # torch's hook: PowerSGDState(random_seed=seed)
        self.iter = 0
        self.error: torch.Tensor | None = None  # residual of the padded matrix, flat (side² entries)
        self.q: torch.Tensor | None = None  # the warm-start Q (side x rank)
        self._shapes: list[tuple[int, ...]] | None = None  # the list the memory belongs to

    def _fresh_q(self, side: int, dtype: torch.dtype) -> torch.Tensor:
        """A random starting Q (side x rank), not yet orthogonalised, drawn as torch's batched hook draws
        it: one seed from ``self.rng``, then N(0, 1) on the CPU."""
        gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        return torch.randn(side, self.rank, generator=gen, dtype=dtype)

    @torch.no_grad()
    def reduce(self, grads, group=None) -> list[torch.Tensor]:
        """Replace each gradient by the batched PowerSGD estimate of its mean over the ranks; return them."""
        if not dist.is_initialized():
            raise RuntimeError("PowerSGDReducer.reduce runs inside ranks: call it from a function started "
                               "with minitorch_dist.launch(fn, n)")
        grads = list(grads)
        if not grads or any(g is None for g in grads):
            raise ValueError("pass a non-empty list of gradients, none of them None")
        if len({g.dtype for g in grads}) > 1:
            raise ValueError(f"the gradients have dtypes {sorted({str(g.dtype) for g in grads})}: one bucket "
                             "holds one dtype, so reduce each dtype's gradients with a reducer of its own")
        shapes = [tuple(g.shape) for g in grads]
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(f"reduce got gradients of shapes {shapes}, but the residual and the warm-start "
                             f"Q belong to {self._shapes}: pass the same list, in the same order, every step")
        if self.iter >= self.start_iter:
            self._shapes = shapes  # this call compresses: the memory belongs to this list from now on
        n_ranks = dist.get_world_size(group)
        # BEGIN SOLUTION
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.iter < self.start_iter:  # warm-up: the exact mean of the N entries
            self.iter += 1
            comm.all_reduce(flat.div_(n_ranks), group=group)
            _unflatten(flat, grads)
            return grads
        n = flat.numel()
        side = math.isqrt(n - 1) + 1  # ⌈√N⌉, exactly
        if self.rank > side:
            raise ValueError(f"rank {self.rank} exceeds the side {side} of the {n} gradient entries padded "
                             "to a square: use a smaller rank")
        buf = flat.new_zeros(side * side)
        buf[:n] = flat
        if self.error is not None:
            buf += self.error  # error feedback, padding included
        given = buf.clone()
        M = buf.view(side, side)
        if self.q is None:
            self.q = self._fresh_q(side, buf.dtype).to(buf.device)
        _orthogonalise(self.q)  # warm start: the last call's Q, orthogonalised
        p = M @ self.q
        comm.all_reduce(p, group=group)  # sum_k M_k Q = (sum_k M_k) Q
        _orthogonalise(p)
        q = M.t() @ p
        comm.all_reduce(q, group=group)
        q.div_(n_ranks)
        M.copy_(p @ q.t())  # the rank-r estimate of the mean
        self.error = given - buf  # what this rank had and did not send
        self.q = q
        self.iter += 1
        _unflatten(buf, grads)
        return grads
        # END SOLUTION


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
    """Kind: measure · about 40 minutes

    The bytes one data-parallel reduction of ``grads`` with ``compressor`` puts through each
    collective on this rank: predicted from the cost model, then counted on a real reduction. Call
    it on every rank (inside ``launch``), each rank with its own gradients of the same shapes.

    **Predict** ``{op: S}``, S being what the comm meter's ``bytes`` counts for that collective (the
    tensor an all-reduce reduces; the *output* of an all-gather, n payloads), summed over the step's
    calls. ``_method_of(compressor)`` (given) names the cost model's method and parameters;
    ``costmodel.compressed_payload_bytes`` gives one rank's payload per tensor, and
    ``costmodel.SUMMABLE`` says which methods can be all-reduced (the others are all-gathered). A
    ``PowerSGD`` still in its warm-up (``compressor.iter < compressor.start_iter``) reduces exactly.

    **Measure** by running ``compressed_allreduce(grads, compressor)`` under ``comm.meter()``: the
    reduction really happens, and ``grads`` come back averaged over the ranks.

    Return ``{"predicted": {op: bytes}, "measured": {op: bytes}}`` (ints). No tolerance: both count
    bytes, and the prediction must equal the count.

    Properties the tests check, on 2 and 4 ranks for exact, fp16, top-k, random-k, sign, QSGD,
    PowerSGD (in and after warm-up) and error feedback: the prediction and the measurement, each
    equal to the payload sizes written out by hand in the test; every rank holding the same averaged
    gradients afterwards (the reduction ran); sign's all-gathered bytes doubling from 2 to 4 ranks.

    Reference: ``minitorch_dist/costmodel/compression.py`` (``compressed_payload_bytes``: the
    prediction; the exercise adds the collective and the metered run).
    """
    if not dist.is_initialized():
        raise RuntimeError("meter_compressed_step runs inside ranks: call it from a function started "
                           "with minitorch_dist.launch(fn, n)")
    grads = list(grads)
    method, params = _method_of(compressor)
    # BEGIN SOLUTION
    n = dist.get_world_size()
    if method == "powersgd" and compressor.iter < compressor.start_iter:
        predicted = {"all_reduce": sum(4 * g.numel() for g in grads)}
    else:
        payload = sum(costmodel.compressed_payload_bytes(method, tuple(g.shape), **params) for g in grads)
        if method in costmodel.SUMMABLE:
            predicted = {"all_reduce": payload}
        else:
            predicted = {"all_gather": n * payload}
    with comm.meter() as m:
        compressed_allreduce(grads, compressor)
    measured = {op: int(s["bytes"]) for op, s in m.summary().items()}
    return {"predicted": {op: int(b) for op, b in predicted.items()}, "measured": measured}
    # END SOLUTION


# --- 6. one step of 1-bit Adam -------------------------------------------------------------------


def onebit_adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     error: torch.Tensor, step: int, warmup_steps: int, lr: float,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build · about 35 minutes

    One step of 1-bit Adam for one rank: ``(new_param, new_m, new_v, new_error, sent)`` (Tang et al.
    2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's Convergence Speed",
    §3-4).

    Adam's variance ``v`` stabilises early. So 1-bit Adam runs plain Adam for ``warmup_steps`` steps
    (``step`` is 0-based), sending the momentum in full precision; then freezes ``v`` and sends the
    momentum as one sign per entry and one scale, the mean magnitude, with error feedback (Seide et
    al. 2014): what the signs dropped is added back next step. Either way the update uses what was
    sent, preconditioned by ``1 / (sqrt(v') + eps)``. Both phases update the momentum the same way,
    and neither uses Adam's bias correction (the paper's Algorithm 1 omits it). ``sign(0)`` is +1,
    so ``sent`` takes only the values ±scale. The paper's second, server-side compression stage is
    left out: ``sent`` is what one rank puts on the wire.

    Interface: all results are new tensors shaped like ``param``; the inputs are not modified.

    Properties the tests check: the warm-up equals Adam without bias correction (within a derived
    bound); after it ``v`` stays frozen and ``sent`` takes only ±mean|m' + error|; ``sent + new_error
    == m' + error`` exactly; a quadratic converges; bad input refused.

    Reference: ``minitorch_dist/communication/compression.py`` (the sign compressor with error
    feedback; the library has no 1-bit Adam optimizer step).
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
    # BEGIN SOLUTION
    new_m = beta1 * m + (1 - beta1) * grad
    if step < warmup_steps:
        new_v = beta2 * v + (1 - beta2) * grad * grad
        sent, new_error = new_m, error.clone()
    else:
        new_v = v.clone()  # frozen: 1 / sqrt(v) is now a fixed preconditioner
        corrected = new_m + error
        scale = corrected.abs().mean()
        sent = torch.where(corrected >= 0, scale, -scale)  # 1 bit per entry + one float
        new_error = corrected - sent
    new_param = param - lr * sent / (new_v.sqrt() + eps)
    return new_param, new_m, new_v, new_error, sent
    # END SOLUTION
