"""Chapter 09 — gradient compression: send fewer bytes per data-parallel step, and keep what was not sent.

Chapter 09. The compressors, each a ``compress(g) -> Payload`` / ``decompress(Payload) -> g'`` pair:

* :class:`TopK` — keep the k = ceil(ratio * d) largest |g_i| (Aji & Heafield 2017, "Sparse
  Communication for Distributed Gradient Descent", §2; Lin et al. 2018, "Deep Gradient
  Compression", §2-3). Payload: k float32 values + k int32 indices = 8k bytes.
* :class:`RandomK` — keep k coordinates chosen by a generator every rank seeds alike (Stich et
  al. 2018, "Sparsified SGD with Memory", §2): the indices need not be sent, so 4k bytes.
* :class:`Sign` — 1-bit: sign(g) times one scale per tensor, mean |g| = ||g||_1 / d (Seide et al.
  2014, "1-Bit Stochastic Gradient Descent", §2; Bernstein et al. 2018, signSGD, §2; the scale as
  in Karimireddy et al. 2019, EF-SignSGD, Alg. 2). Payload: ceil(d/8) bytes of packed bits + 4.
* :class:`QSGD` — stochastic rounding of |g_i| / ||g||_2 to one of s levels (Alistarh et al.
  2017, "QSGD", §3.1, eq. (1))::

      Q_s(g)_i = ||g||_2 * sign(g_i) * xi_i,   xi_i = (l+1)/s with prob. p = s|g_i|/||g|| - l,
                                               xi_i = l/s     otherwise    (l = floor(s|g_i|/||g||))

  E[xi_i] = |g_i| / ||g||, so E[Q_s(g)] = g: unbiased. Payload: one signed level per coordinate
  (int8, s <= 127; the paper's Elias coding would shrink it further) + the float32 norm.
* :class:`FP16` — the baseline: cast to half, 2 bytes per coordinate.
* PowerSGD (rank r, warm start; Vogels et al. 2019) lives in ``powersgd.py``.

:class:`ErrorFeedback` wraps any compressor with a memory of what it dropped (Seide et al. 2014
§2; Karimireddy et al. 2019 Alg. 2; Stich et al. 2018)::

    c_t = C(g_t + e_t),   e_{t+1} = g_t + e_t - D(c_t)

so that sum_t D(c_t) = sum_t g_t - e_T: every coordinate is eventually sent. Biased compressors
(top-k, sign) converge only with it; unbiased ones (QSGD) do not need it.

:func:`compressed_allreduce` is the data-parallel reduction: each rank compresses its gradient;
sparse / sign / QSGD payloads are not summable, so they are *all-gathered* and every rank
decompresses the n payloads and averages them; fp16 is summable and is all-reduced, as are
PowerSGD's P and Q (linear in M). :func:`train_compressed` runs it in a small DP training loop.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import comm, require_process_group
from .activation_compression import pack_bits, unpack_bits  # one bit layout for masks and signs

__all__ = ["Payload", "Compressor", "ErrorFeedback", "TopK", "RandomK", "Sign", "QSGD", "FP16",
           "compressed_allreduce", "train_compressed", "train_on_rank", "regression_task"]


@dataclass
class Payload:
    """What one rank sends for one tensor: ``tensors`` go on the wire; ``shape``/``dtype`` and
    ``meta`` are known to every rank without sending (e.g. random-k's shared indices)."""

    tensors: dict
    shape: torch.Size
    dtype: torch.dtype
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class Compressor:
    """``compress(tensor, key) -> Payload``; ``decompress(payload) -> tensor`` (shape and dtype of
    the input). ``key`` names the tensor for compressors with per-tensor state (error memory,
    warm start). ``payload_nbytes(shape)`` predicts ``Payload.nbytes`` from the shape alone."""

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        raise NotImplementedError

    def decompress(self, payload: Payload) -> torch.Tensor:
        raise NotImplementedError

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        raise NotImplementedError


def _check_ratio(ratio):
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio}: it is the fraction of coordinates kept")


def _k(ratio, numel):
    return max(1, math.ceil(ratio * numel))


class ErrorFeedback(Compressor):
    """Compress ``g + e`` and remember the residual ``e <- g + e - D(C(g + e))`` per ``key``."""

    def __init__(self, compressor: Compressor) -> None:
        if not isinstance(compressor, Compressor):
            raise TypeError(f"ErrorFeedback wraps a Compressor, got {type(compressor).__name__}")
        self.inner = compressor
        self.error: dict[Hashable, torch.Tensor] = {}  # key -> residual, float32 like the gradient

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        corrected = tensor + self.error[key] if key in self.error else tensor.clone()
        payload = self.inner.compress(corrected, key)
        self.error[key] = corrected - self.inner.decompress(payload)
        return payload

    def decompress(self, payload: Payload) -> torch.Tensor:
        return self.inner.decompress(payload)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return self.inner.payload_nbytes(shape)

    def __repr__(self):
        return f"ErrorFeedback({self.inner!r})"


class TopK(Compressor):
    """The k = ceil(ratio * d) coordinates of largest magnitude: float32 values + int32 indices."""

    def __init__(self, ratio: float) -> None:
        _check_ratio(ratio)
        self.ratio = ratio

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        flat = tensor.detach().reshape(-1)
        idx = flat.abs().topk(_k(self.ratio, flat.numel()), sorted=False).indices
        return Payload({"values": flat[idx].float(), "indices": idx.to(torch.int32)}, tensor.shape,
                       tensor.dtype)

    def decompress(self, p: Payload) -> torch.Tensor:
        out = torch.zeros(math.prod(p.shape), dtype=p.dtype, device=p.tensors["values"].device)
        out[p.tensors["indices"].long()] = p.tensors["values"].to(p.dtype)
        return out.view(p.shape)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return 8 * _k(self.ratio, math.prod(shape))

    def __repr__(self):
        return f"TopK({self.ratio})"


class RandomK(Compressor):
    """k random coordinates. Every rank draws them from the same generator (``seed``, advanced on
    each call), so only the values travel; decompressing rank j's payload uses rank i's indices."""

    def __init__(self, ratio: float, seed: int = 0) -> None:
        _check_ratio(ratio)
        self.ratio, self.seed = ratio, seed
        self._gen: torch.Generator | None = None

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.seed)
        flat = tensor.detach().reshape(-1)
        k = _k(self.ratio, flat.numel())
        idx = torch.randperm(flat.numel(), generator=self._gen)[:k].to(flat.device)
        return Payload({"values": flat[idx].float()}, tensor.shape, tensor.dtype, {"indices": idx})

    def decompress(self, p: Payload) -> torch.Tensor:
        out = torch.zeros(math.prod(p.shape), dtype=p.dtype, device=p.tensors["values"].device)
        out[p.meta["indices"]] = p.tensors["values"].to(p.dtype)
        return out.view(p.shape)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return 4 * _k(self.ratio, math.prod(shape))

    def __repr__(self):
        return f"RandomK({self.ratio}, seed={self.seed})"


class Sign(Compressor):
    """1 bit per coordinate (sign, 0 counts as +) and one float32 scale, mean |g|."""

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        flat = tensor.detach().reshape(-1)
        scale = flat.abs().mean().float().reshape(1)
        return Payload({"bits": pack_bits(flat >= 0), "scale": scale}, tensor.shape, tensor.dtype)

    def decompress(self, p: Payload) -> torch.Tensor:
        sign = unpack_bits(p.tensors["bits"], (math.prod(p.shape),)).to(p.dtype) * 2 - 1
        return (sign * p.tensors["scale"].to(p.dtype)).view(p.shape)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return math.ceil(math.prod(shape) / 8) + 4

    def __repr__(self):
        return "Sign()"


class QSGD(Compressor):
    """Stochastic rounding to ``levels`` = s levels of |g_i| / ||g||_2 (Alistarh et al. 2017 §3.1).

    The random draws come from this rank's generator (``seed`` + rank): unbiased per rank, and
    independent across ranks so that averaging n payloads also averages the rounding noise.
    """

    def __init__(self, levels: int, seed: int = 0) -> None:
        if not (isinstance(levels, int) and 1 <= levels <= 127):
            raise ValueError("levels must be an int in [1, 127] "
                             f"(signed levels travel as int8), got {levels!r}")
        self.s, self.seed = levels, seed
        self._gen: torch.Generator | None = None

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        if self._gen is None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            self._gen = torch.Generator().manual_seed(self.seed * 1_000_003 + rank)
        flat = tensor.detach().reshape(-1).float()
        norm = flat.norm()
        r = flat.abs() / norm * self.s if norm > 0 else torch.zeros_like(flat)
        low = r.floor()
        up = torch.rand(flat.shape, generator=self._gen).to(flat.device) < (r - low)  # P(round up) = r - l
        level = (low + up) * flat.sign()
        return Payload({"levels": level.to(torch.int8), "norm": norm.reshape(1)}, tensor.shape, tensor.dtype)

    def decompress(self, p: Payload) -> torch.Tensor:
        g = p.tensors["levels"].float() * (p.tensors["norm"] / self.s)
        return g.to(p.dtype).view(p.shape)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return math.prod(shape) + 4

    def __repr__(self):
        return f"QSGD({self.s})"


class FP16(Compressor):
    """Half precision: 2 bytes per coordinate. Summable, so :func:`compressed_allreduce` all-reduces it."""

    def compress(self, tensor: torch.Tensor, key: Hashable = 0) -> Payload:
        return Payload({"half": tensor.detach().half()}, tensor.shape, tensor.dtype)

    def decompress(self, p: Payload) -> torch.Tensor:
        return p.tensors["half"].to(p.dtype).view(p.shape)

    def payload_nbytes(self, shape: Sequence[int]) -> int:
        return 2 * math.prod(shape)

    def reduce(self, grads: list[torch.Tensor], group: dist.ProcessGroup | None = None) -> None:
        # Divide before summing (as torch's fp16_compress_hook does), so the sum cannot overflow.
        n = dist.get_world_size(group)
        buf = torch.cat([g.detach().reshape(-1) for g in grads]).div_(n).half()
        comm.all_reduce(buf, group=group)
        off = 0
        for g in grads:
            g.copy_(buf[off: off + g.numel()].view_as(g))
            off += g.numel()

    def __repr__(self):
        return "FP16()"


def compressed_allreduce(grads: Iterable[torch.Tensor], compressor: Compressor | None,
                         group: dist.ProcessGroup | None = None) -> list[torch.Tensor]:
    """Replace each tensor in ``grads`` (same list on every rank) by the average over ranks of
    the decompressed payloads. ``compressor=None``: plain all-reduce mean (the reference).

    Compressors with a ``reduce(grads, group)`` method (FP16, PowerSGD) reduce themselves; the
    others' payload tensors are all-gathered (one call per payload tensor) and every rank
    decompresses all n payloads, so each rank sends ``payload.nbytes`` per tensor.
    """
    grads = list(grads)
    require_process_group("compressed_allreduce")
    n = dist.get_world_size(group)
    if compressor is None:
        for g in grads:
            comm.all_reduce(g, group=group)
            g.div_(n)
        return grads
    if any(g is None for g in grads):
        raise ValueError("a gradient is None: pass only parameters that received one "
                         "(the same on every rank)")
    if isinstance(compressor, ErrorFeedback) and type(compressor.inner).__name__ == "PowerSGD":
        raise ValueError("PowerSGD keeps its own error feedback (error_feedback=True): pass it unwrapped")
    if hasattr(compressor, "reduce"):
        compressor.reduce(grads, group)
        return grads
    with torch.no_grad():
        for i, g in enumerate(grads):
            p = compressor.compress(g, key=i)
            gathered = {}
            for name, t in p.tensors.items():
                out = t.new_empty(n * t.numel())
                comm.all_gather(out, t.contiguous().reshape(-1), group=group)
                gathered[name] = out.view(n, *t.shape)
            total = sum(compressor.decompress(replace(p, tensors={k: v[j] for k, v in gathered.items()}))
                        for j in range(n))
            g.copy_(total / n)  # type: ignore[arg-type]  # a sum of n >= 1 tensors is a tensor
    return grads


# --- a small data-parallel task to train on --------------------------------------------------


def regression_task(seed: int = 0, d_in: int = 32, d_hidden: int = 32, d_out: int = 8, noise: float = 0.01
                    ) -> tuple[torch.nn.Sequential, Callable[..., tuple[torch.Tensor, torch.Tensor]]]:
    """A teacher ``y = x W* + noise`` and a two-layer linear student (two matrices, two biases:
    PowerSGD compresses the matrices and sends the biases as they are). The loss floor is noise**2."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d_in, d_out, generator=g) / math.sqrt(d_in)
    torch.manual_seed(seed + 1)
    model = torch.nn.Sequential(torch.nn.Linear(d_in, d_hidden), torch.nn.Linear(d_hidden, d_out))

    def batch(step, size, rank=0, world_size=1):
        """The global batch of ``step``; rank r gets rows [r B/n, (r+1) B/n)."""
        gs = torch.Generator().manual_seed(seed * 100_003 + step)
        x = torch.randn(size, d_in, generator=gs)
        y = x @ w_star + noise * torch.randn(size, d_out, generator=gs)
        lo, hi = rank * size // world_size, (rank + 1) * size // world_size
        return x[lo:hi], y[lo:hi]

    return model, batch


def train_on_rank(compressor: Compressor | None, steps: int, lr: float, batch: int, seed: int,
                  eval_size: int) -> dict[str, Any]:
    rank, n = dist.get_rank(), dist.get_world_size()
    model, data = regression_task(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, per_step = [], []
    for step in range(steps):
        opt.zero_grad()
        x, y = data(step, batch, rank, n)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        with comm.meter() as m:
            compressed_allreduce([p.grad for p in model.parameters()], compressor)  # type: ignore[misc]  # backward set every .grad
        per_step.append(m.summary())
        losses.append(loss.item())
        opt.step()
    x, y = data(10**6, eval_size)  # a held-out batch, the same on every rank
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    return {"losses": losses, "final_loss": final, "comm": per_step,
            "params": [p.detach().clone() for p in model.parameters()]}


def train_compressed(compressor: Compressor | None, n: int = 2, steps: int = 100, lr: float = 0.1,
                     batch: int = 64, seed: int = 0, eval_size: int = 1024) -> list[dict[str, Any]]:
    """Data-parallel SGD on :func:`regression_task` across ``n`` ranks, gradients reduced by
    :func:`compressed_allreduce` (``compressor=None``: exact all-reduce). Returns per-rank dicts:
    ``losses``, ``final_loss`` (held-out MSE), ``comm`` (each step's meter summary), ``params``."""
    from ..runtime.launch import launch
    return launch(train_on_rank, n, compressor, steps, lr, batch, seed, eval_size)
