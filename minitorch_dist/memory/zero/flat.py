"""Chapter 06 — flat parameter buffers: many tensors as one padded 1-D buffer, cut into n equal shards.

Every ZeRO stage (Rajbhandari et al. 2020, §5) and FSDP (Zhao et al. 2023, §3.2 "FlatParameter")
works on a flat view of the parameters: one contiguous 1-D buffer holding every tensor end to
end, padded with zeros to a multiple of the world size n so that reduce-scatter and all-gather
see n equal chunks of ``S = ceil(numel / n)`` elements. *Which* S elements rank r owns is the
layout's choice, and the course uses two: ``fully_shard`` (ZeRO-3, as FSDP and DeepSpeed do) gives
rank r the contiguous block ``[r*S, (r+1)*S)`` (:func:`shard_range`), so an all-gather lands every
tensor in place; ZeRO-1/2 (:mod:`.partition`) give rank r the interleaved elements ``r, r+n, ...``,
so that stage 2 can reduce-scatter bucket by bucket during backward (every bucket holds a piece of
every rank's part; the reason is spelled out there and in chapter 06). Either way a tensor may
straddle two shards, which is fine: the optimizer sees only the flat shard, an elementwise update
(SGD, Adam) does not care where one tensor ends.

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
    """The layout of ``params`` in one padded flat buffer of ``n`` equal shards.

    >>> flat = FlatParams(model.parameters(), n=4)
    >>> buf = flat.flatten([p.data for p in flat.params])   # (padded,) with zeros at the end
    >>> flat.shard(buf, rank)                               # a view: this rank's S elements
    >>> for p, v in zip(flat.params, flat.views(buf)): ...  # each tensor's shaped view into buf
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
        """A zeroed padded flat buffer."""
        p = self.params[0]
        return torch.zeros(self.padded_numel, dtype=dtype or p.dtype, device=device or p.device)

    def flatten(self, tensors, out: torch.Tensor | None = None) -> torch.Tensor:
        """``tensors`` (shaped like the params) copied end to end into a padded flat buffer."""
        tensors = list(tensors)
        if out is None:
            out = self.empty(dtype=tensors[0].dtype, device=tensors[0].device)
        for t, off, k in zip(tensors, self.offsets, self.numels):
            out[off:off + k].copy_(t.reshape(-1))
        out[self.numel:].zero_()
        return out

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's shaped view into ``flat`` (a full padded buffer): writes land in it."""
        if flat.numel() != self.padded_numel:
            raise ValueError(f"flat buffer has {flat.numel()} elements, expected {self.padded_numel}")
        return [flat[off:off + k].view(shape)
                for off, k, shape in zip(self.offsets, self.numels, self.shapes)]

    def shard(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s ``S`` elements of ``flat``, a view."""
        start, end = shard_range(self.numel, self.n, rank)
        return flat[start:end]

    def __repr__(self) -> str:
        return (f"FlatParams({len(self.params)} tensors, numel={self.numel}, n={self.n}, "
                f"shard={self.shard_numel}, padding={self.padding})")
