"""Chapter 09 — PowerSGD: rank-r gradient compression by one step of power iteration, all-reduced.

Chapter 09. Vogels, Karimireddy & Jaggi 2019, "PowerSGD: Practical Low-Rank Gradient Compression
for Distributed Optimization" (NeurIPS), Algorithm 1 (rank-r PowerSGD compression) and
Algorithm 2 (distributed error-feedback SGD); §3 warm start (reuse last step's Q).

View each gradient as a matrix M (n x m: ``shape[0]`` x the rest) and let Q (m x r) be last
step's Q (random normal at the first step)::

    P  = M Q              all-reduce P (sum)     # P is linear in M, so summing P sums the M's
    P  = orthogonalise(P)
    Q  = M^T P            all-reduce Q, / n      # the mean of the ranks' Q
    M^ = P Q^T                                   # rank-r approximation of the *mean* gradient

Each rank sends (n + m) r numbers per matrix instead of n m. Error feedback keeps
``e = (M + e) - M^`` locally (Alg. 2: the residual against the *aggregated* approximation, the
only one a rank has). A matrix is compressed only when ``(n + m) r * min_compression_rate < n m``;
1-D tensors (biases, norms) and matrices that would not shrink are all-reduced as they are.
The first ``start_iter`` steps are plain all-reduces (as in torch's hook).

This mirrors ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook`` on one DDP bucket:
the same seeding (``numpy.random.RandomState(seed)`` draws a torch seed when Q is initialised;
the Qs are filled by shape group, in order), the same orthogonalisation (Gram-Schmidt for r <= 2,
QR otherwise), three all-reduces per step (uncompressed, all Ps, all Qs). One difference: torch
keeps its error memory for the whole bucket, so a 1-D tensor's "error" is its local value minus
the mean; those errors sum to zero over ranks, so they change the mean only by rounding (ulps).
We keep error only for compressed matrices.

Memory across steps. Warm start and error feedback remember one Q and one residual per position
in the list of gradients, from the first compressed step on (torch's hook: per bucket index, and it
needs ``start_powerSGD_iter`` >= 2 with either on, because DDP rebuilds its buckets after the
first iteration). A list of other shapes or order after that is refused with the fix: pass the
same list, or :meth:`PowerSGD.reset` the memory (torch's equivalent is a new bucket index: fresh
Qs and zero residuals). Only shapes are seen: two tensors of one shape swapped go unnoticed.
With both off nothing is remembered: every step draws fresh Qs, as torch's hook does, and any
list, in any order, is accepted.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ..runtime import comm
from .compression import Compressor, Payload

__all__ = ["PowerSGD", "orthogonalise"]


def orthogonalise(m: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalise the columns of ``m`` (... x n x r) in place: Gram-Schmidt for r <= 2, QR otherwise."""
    r = m.shape[-1]
    if r <= 2:
        for i in range(r):
            col = m[..., i: i + 1]
            col /= col.norm(dim=-2, keepdim=True) + epsilon
            if i + 1 < r:
                rest = m[..., i + 1:]
                rest -= (col * rest).sum(dim=-2, keepdim=True) * col
    else:
        m.copy_(torch.linalg.qr(m).Q)
    return m


class PowerSGD(Compressor):
    """Rank-``rank`` PowerSGD with warm start and error feedback, as a DP gradient reduction.

    Use ``compressed_allreduce(grads, PowerSGD(rank=r))`` (or ``.reduce(grads, group)``) with
    the same list of gradients every step. ``compress``/``decompress`` give the single-process
    rank-r approximation of one tensor (one power-iteration step, warm-started per ``key``).
    """

    def __init__(self, rank: int = 1, start_iter: int = 2, min_compression_rate: float = 2,
                 warm_start: bool = True, error_feedback: bool = True, seed: int = 0,
                 epsilon: float = 0.0) -> None:
        if not (isinstance(rank, int) and rank >= 1):
            raise ValueError(f"rank must be a positive int, got {rank!r}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        self.rank, self.start_iter, self.min_rate = rank, start_iter, min_compression_rate
        self.warm_start, self.error_feedback, self.epsilon = warm_start, error_feedback, epsilon
        self.seed, self.rng = seed, np.random.RandomState(seed)
        self.iter = 0
        self.error: dict[int, torch.Tensor] = {}  # index -> residual of a compressed matrix
        self.qs: list[torch.Tensor] | None = None  # warm-start Qs, one per compressed matrix
        self._local_q: dict[Hashable, torch.Tensor] = {}
        # the gradients' shapes at the first compressed step (only with memory)
        self._shapes: list[tuple[int, ...]] | None = None

    @property
    def has_memory(self) -> bool:
        """Does a step depend on the last one (warm start or error feedback)?"""
        return self.warm_start or self.error_feedback

    def reset(self) -> None:
        """Forget the warm-start Qs and the error memory (the step counter and the random stream go on):
        the next compressed step starts afresh, on any list of gradients. Call it after the list
        changes, e.g. after DDP rebuilds its buckets."""
        self.error, self.qs, self._shapes = {}, None, None

    def _r(self, shape):
        return min(shape[0], int(np.prod(shape[1:])), self.rank)

    def compresses(self, shape: Sequence[int]) -> bool:
        """Is a tensor of this shape sent as P, Q (torch's ``_should_compress``)?"""
        if len(shape) < 2:
            return False
        n, m = shape[0], int(np.prod(shape[1:]))
        return (n + m) * self._r(shape) * self.min_rate < n * m

    def payload_nbytes(self, shape: Sequence[int], itemsize: int = 4) -> int:
        """Bytes one rank all-reduces for one tensor: (n + m) r if compressed, else n m."""
        if not self.compresses(shape):
            return int(np.prod(shape)) * itemsize
        return (shape[0] + int(np.prod(shape[1:]))) * self._r(shape) * itemsize

    def _random_qs(self, matrices):
        """Fill fresh Qs from N(0, 1) like torch's hook: one seed per initialisation, shape groups in
        order."""
        groups = defaultdict(list)
        for i, mat in enumerate(matrices):
            groups[tuple(mat.shape)].append(i)
        qs = [None] * len(matrices)
        gen = torch.Generator().manual_seed(int(self.rng.randint(1_000_000_000)))
        for idx in groups.values():
            for i in idx:
                n, m = matrices[i].shape
                # on CPU, as torch
                q = torch.randn(1, m, self._r((n, m)), generator=gen, dtype=matrices[i].dtype)
                qs[i] = orthogonalise(q.to(matrices[i].device), self.epsilon)[0]
        return qs

    @torch.no_grad()
    def reduce(self, grads: Iterable[torch.Tensor],
               group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
        """Replace each gradient by the rank-r PowerSGD estimate of the mean over ranks."""
        grads = list(grads)
        n_ranks = dist.get_world_size(group)
        if self.iter < self.start_iter:  # warm-up: exact all-reduce of everything, one buffer
            self.iter += 1
            buf = torch.cat([g.reshape(-1) for g in grads]).div_(n_ranks)
            comm.all_reduce(buf, group=group)
            _unflatten(buf, grads)
            return grads
        big = [i for i, g in enumerate(grads) if self.compresses(g.shape)]
        small = [i for i, g in enumerate(grads) if not self.compresses(g.shape)]
        if self.has_memory:
            self._check_same_list([tuple(g.shape) for g in grads])
        ms = self._matrices(grads, big)
        if not self.warm_start or self.qs is None:
            self.qs = self._random_qs(ms)
        else:
            for q in self.qs:
                orthogonalise(q.unsqueeze(0), self.epsilon)
        # 1-D and incompressible tensors: one all-reduce, as they are.
        if small:
            buf = torch.cat([grads[i].reshape(-1) for i in small])
            comm.all_reduce(buf, group=group)
            _unflatten(buf.div_(n_ranks), [grads[i] for i in small])
        if ms:
            self._power_step(ms, big, group, n_ranks)
        self.iter += 1
        return grads

    def _matrices(self, grads: list, big: list[int]) -> list:
        """The compressed gradients as (rows, rest) views, each plus its error memory (error feedback)."""
        ms = []
        for i in big:
            mat = grads[i].view(grads[i].shape[0], -1)
            if self.error_feedback:
                if i in self.error:
                    mat += self.error[i]
                self.error[i] = mat.clone()  # becomes (M + e) - M^ below
            ms.append(mat)
        return ms

    def _power_step(self, ms: list, big: list[int], group: dist.ProcessGroup | None, n_ranks: int) -> None:
        """One power iteration over ranks: all-reduce P = M Q, orthogonalise, all-reduce Q = M^T P,
        and write M^ = P Q^T into the gradients (in place)."""
        assert self.qs is not None  # drawn or warm-started by reduce() first
        ps = [m @ q for m, q in zip(ms, self.qs)]
        p_buf = torch.cat([p.reshape(-1) for p in ps])
        comm.all_reduce(p_buf, group=group)  # sum: P = (sum_k M_k) Q
        _unflatten(p_buf, ps)
        for p in ps:
            orthogonalise(p.unsqueeze(0), self.epsilon)
        qs = [m.t() @ p for m, p in zip(ms, ps)]
        q_buf = torch.cat([q.reshape(-1) for q in qs])
        comm.all_reduce(q_buf, group=group)
        _unflatten(q_buf.div_(n_ranks), qs)
        for i, m, p, q in zip(big, ms, ps, qs):
            m.copy_(p @ q.t())
            if self.error_feedback:
                self.error[i] -= m
        self.qs = qs

    def _check_same_list(self, shapes) -> None:
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(f"PowerSGD.reduce got gradients of shapes {shapes}, in this order, but the "
                             f"warm-start Qs and the error memory belong to {self._shapes}: pass the same "
                             f"list, in the same order, every step; after the list changes (e.g. DDP rebuilt "
                             f"its buckets) call reset() to start the memory afresh, or use "
                             f"warm_start=False, error_feedback=False, which keep no memory and accept any "
                             f"order")
        self._shapes = shapes

    # single-process view: one power-iteration step on one tensor
    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        # at least float32 (a 16-bit gradient is compressed in fp32); a float64 one stays float64
        dtype = torch.promote_types(tensor.dtype, torch.float32)
        mat = tensor.detach().reshape(tensor.shape[0], -1).to(dtype)  # (rows, the rest flattened)
        r = self._r(mat.shape)
        if key not in self._local_q or not self.warm_start:
            # not hash(): it is salted per process; drawn in float32 so every dtype starts from the same Q
            gen = torch.Generator().manual_seed(self.seed * 7919 + len(self._local_q))
            self._local_q[key] = torch.randn(mat.shape[1], r, generator=gen, dtype=torch.float32).to(mat)
        q = orthogonalise(self._local_q[key].clone().unsqueeze(0), self.epsilon)[0]
        p = orthogonalise((mat @ q).unsqueeze(0), self.epsilon)[0]
        q = mat.t() @ p
        self._local_q[key] = q
        return Payload({"P": p, "Q": q}, tensor.shape, tensor.dtype)

    def decompress(self, payload: Payload) -> torch.Tensor:
        return (payload.tensors["P"] @ payload.tensors["Q"].t()).to(payload.dtype).view(payload.shape)

    def __repr__(self):
        return (f"PowerSGD(rank={self.rank}, warm_start={self.warm_start}, "
                f"error_feedback={self.error_feedback})")


def _unflatten(buf, tensors):
    off = 0
    for t in tensors:
        t.copy_(buf[off: off + t.numel()].view_as(t))
        off += t.numel()
