"""Chapter 06 — flat parameter buffers: many tensors as one padded 1-D buffer, cut into n equal shards.

Every ZeRO stage (Rajbhandari et al. 2020, §5) and FSDP (Zhao et al. 2023, §3.2 "FlatParameter")
works on a flat view of the parameters: one contiguous 1-D buffer holding every tensor end to
end, padded with zeros to a multiple of the world size n so that reduce-scatter and all-gather
see n equal chunks of ``S = ceil(numel / n)`` elements. *Which* S elements rank r owns is the
layout's choice, and the course uses two: ``fully_shard`` (ZeRO-3, as FSDP and DeepSpeed do) gives
rank r the contiguous block ``[r*S, (r+1)*S)`` (:func:`shard_range`), so an all-gather lands every
tensor in place; ZeRO-1/2 (:mod:`.partition`) give rank r the interleaved elements ``r, r+n, ...``,
so that stage 2 can reduce-scatter bucket by bucket during backward (every bucket holds some of
every rank's part; the reason is spelled out there and in chapter 06). Either way a tensor may
straddle two shards, which is fine: the optimizer sees only the flat shard, an elementwise update
(SGD, Adam) does not care where one tensor ends. DDP's gradient buckets (chapter 01) use the
same layout with n = 1: no padding, nothing to shard.

    numel = sum_i p_i.numel()          S = ceil(numel / n)          padded = n * S
"""
from __future__ import annotations

import math

import torch


def shard_size(numel: int, n: int) -> int:
    """Elements per shard, ``ceil(numel / n)``: every rank's shard has the same size."""
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return math.ceil(numel / n)


def shard_range(numel: int, n: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s shard in the padded flat buffer (end may pass numel:
    the tail of the last shard(s) is padding)."""
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a world of {n}")
    s = shard_size(numel, n)
    return rank * s, (rank + 1) * s


class FlatParams:
    """The layout of ``params`` in one padded flat buffer of ``n`` equal shards: the one flat buffer
    of the course (ZeRO-1/2's :class:`.partition.FlatPartition`, ``fully_shard``'s
    :class:`.fsdp_unit.FlatPart`, and with ``n = 1``, no padding, DDP's gradient buckets).

    >>> flat = FlatParams(model.parameters(), n=4)
    >>> buf = flat.flatten([p.data for p in flat.params])   # (padded,) with zeros at the end
    >>> flat.shard(buf, rank)                               # a view: this rank's S elements
    >>> for p, v in zip(flat.params, flat.views(buf)): ...  # each tensor's shaped view into buf
    >>> flat.spans(rank, n, flat.shard_numel)               # where each tensor sits in a strided shard
    """

    def __init__(self, params, n: int):
        self.params = list(params)
        if not self.params:
            raise ValueError("no parameters to flatten")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"one flat buffer holds one dtype, got {sorted(map(str, dtypes))}; "
                             f"flatten each dtype separately")
        self.n = n
        self.shapes = [p.shape for p in self.params]
        self.numels = [p.numel() for p in self.params]
        self.offsets = [0]
        for k in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + k)
        self.numel = sum(self.numels)
        self.shard_numel = shard_size(self.numel, n)
        self.padded_numel = n * self.shard_numel
        self.padding = self.padded_numel - self.numel

    def empty(self, dtype=None, device=None) -> torch.Tensor:
        """A zeroed padded flat buffer (by default in the params' dtype, on their device)."""
        if dtype is None or device is None:
            p = self.params[0]
            dtype, device = dtype or p.dtype, device or p.device
        return torch.zeros(self.padded_numel, dtype=dtype, device=device)

    def flatten(self, tensors, out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensors`` (shaped like the params) copied end to end into a padded flat buffer (cast to
        ``out``'s dtype); a ``None`` among them leaves zeros in its slice."""
        tensors = list(tensors)
        if out is None:
            first = next(t for t in tensors if t is not None)
            out = self.empty(dtype=first.dtype, device=first.device)
        for t, off, k in zip(tensors, self.offsets, self.numels):
            if t is None:
                out[off:off + k].zero_()
            else:
                out[off:off + k].copy_(t.reshape(-1))
        out[self.numel:].zero_()
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shaped view into ``flat`` (a full padded buffer): writes land in it."""
        if flat.numel() != self.padded_numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, expected {self.padded_numel}")
        return [flat[off:off + k].view(shape)
                for off, k, shape in zip(self.offsets, self.numels, self.shapes)]

    def split_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """As :meth:`views`, by one ``split`` of ``flat`` (under autograd its backward is one ``cat``)."""
        chunks = flat.split([*self.numels, self.padding] if self.padding else self.numels)
        return [t.view(shape) for t, shape in zip(chunks, self.shapes)]

    def spans(self, first: int = 0, stride: int = 1, count: int | None = None) -> list[tuple[int, int]]:
        """Where each tensor's elements sit among ``count`` positions (default: the whole padded
        buffer), position ``j`` being flat index ``first + j*stride``: a contiguous shard or bucket
        ``[lo, hi)`` is ``(lo, 1, hi - lo)``, ZeRO-1/2's interleaved shard ``(r, n, S)``. Tensor i,
        at ``flat[o:o+k]``, holds positions ``[a, z)``, ``a = ceil((o - first)/stride)`` and
        ``z = ceil((o + k - first)/stride)`` clipped to ``[0, count]`` (``a == z``: none); position
        ``j`` of it is its flattened element ``first + j*stride - o`` (:meth:`element_of`)."""
        count = self.padded_numel if count is None else count
        return [(min(max(-(-(o - first) // stride), 0), count),
                 min(max(-(-(o + k - first) // stride), 0), count))
                for o, k in zip(self.offsets, self.numels)]

    def element_of(self, i: int, j: int, first: int = 0, stride: int = 1) -> int:
        """Which flattened element of tensor ``i`` position ``j`` (flat index ``first + j*stride``) is."""
        return first + j * stride - self.offsets[i]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s ``S`` elements of ``flat``, a view."""
        start, end = shard_range(self.numel, self.n, rank)
        return flat[start:end]

    def __repr__(self) -> str:
        return (f"FlatParams({len(self.params)} tensors, numel={self.numel}, n={self.n}, "
                f"shard={self.shard_numel}, padding={self.padding})")
