"""Chapter 06 — the flat, interleaved partition behind ZeRO stages 0-2: one padded buffer holding
every parameter, the elements of it this rank updates, and where each parameter's elements sit
among them (Rajbhandari et al. 2020, §5.1 P_os and §5.2 P_g partition "the optimizer states" and
"the gradients" of the flat model state into N_d equal parts).

**Layout.** Every parameter becomes a view into one flat buffer of ``Psi' = n*S`` elements,
``S = ceil(Psi / n)`` (:class:`.flat.FlatParams`: zero padding at the end), broadcast from rank 0
so that every replica starts equal. Rank r owns the *interleaved* elements ``r, r+n, r+2n, ...``:
the strided view ``flat_param[r::n]`` of S elements, its ``shard``. Interleaving is what lets
stage 2 reduce-scatter the gradient bucket by bucket: reduce-scatter hands rank r chunk r of its
input, so every bucket must hold some of every rank's part, and with interleaving bucket
``[lo, hi)`` holds ``(hi-lo)/n`` elements of each rank -- its part is the contiguous slice
``shard[lo/n : hi/n]``. On the wire a flat-order buffer goes rank-major, ``g.view(-1, n).t()``
(row r = rank r's elements), and an all-gathered one is transposed back into place.

**Pieces.** Parameter i lies at ``flat[a:z]``; on rank r its elements are the contiguous run
``shard[ceil((a-r)/n) : ceil((z-r)/n)]`` (empty when the tensor is smaller than n and misses r),
this rank's *piece* of it. An optimizer given the pieces as its parameters keeps one state per
parameter, exactly as in one process, and can skip a parameter that got no gradient. Replicated
(``replicate=True``: stage 0, plain data parallelism), a rank owns the whole buffer and a piece is
the whole parameter.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...runtime import comm
from .flat import FlatParams

__all__ = ["FlatPartition", "bucket_ranges"]


def bucket_ranges(padded_numel: int, n: int, cap_elements: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` buckets of a flat buffer of ``padded_numel`` (a multiple of n), each about
    ``cap_elements`` long and a multiple of n, so every bucket holds ``(hi-lo)/n`` elements of each
    rank; ``cap_elements=None``: one bucket. Not DDP's rule
    (:func:`~minitorch_dist.costmodel.data_parallel.bucket_assignment`, which packs whole parameters
    up to the cap): a reduce-scatter hands each rank one n-th of a bucket, so here every bucket is
    a multiple of n elements (all of one length but the last), and its edge may cut a parameter."""
    if padded_numel % n:
        raise ValueError(f"the padded flat buffer ({padded_numel}) must be a multiple of n = {n}")
    size = padded_numel if cap_elements is None else n * max(1, math.ceil(cap_elements / n))
    return [(lo, min(lo + size, padded_numel)) for lo in range(0, padded_numel, size)]


class FlatPartition:
    """``params`` moved into one flat buffer (rank 0's values), partitioned over ``group``.

    >>> partition = FlatPartition(params, group)  # every p.data is now a view of partition.flat_param
    >>> partition.shard                           # nn.Parameter, flat_param[rank::n] (S elements)
    >>> partition.pieces(partition.shard)         # one nn.Parameter per tensor: its elements in the shard
    >>> partition.reduce(flat_grad)               # this rank's averaged gradient (a view of flat_grad)
    >>> partition.all_gather(buckets)             # every rank's updated elements back into flat_param

    Attributes: ``flat`` (the :class:`FlatParams` layout), ``flat_param``, ``shard``, ``spans``
    (each parameter's ``(start, end)`` in the shard), ``n``, ``rank``, ``group``, ``replicate``.
    """

    def __init__(self, params, group: dist.ProcessGroup | None = None, replicate: bool = False):
        self.group, self.replicate = group, replicate
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.flat = FlatParams(params, self.n)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            self.flat_param = self.flat.flatten([p.detach() for p in self.flat.params])
            comm.broadcast(self.flat_param, src, group=group)  # every replica starts from rank 0's values
            for p, v in zip(self.flat.params, self.flat.views(self.flat_param)):
                p.data = v  # the parameter now lives in the flat buffer: updates to it reach the model
        # Owned elements: flat index first + j*stride is shard position j.
        self._stride, self._first = (1, 0) if replicate else (self.n, self.rank)
        own = self.flat_param if replicate else self.flat_param[self.rank::self.n]
        self.shard = nn.Parameter(own)  # an alias of those elements (same storage), not a copy
        self.spans = self.flat.spans(self._first, self._stride, own.numel())

    def pieces(self, shard: torch.Tensor) -> list[nn.Parameter]:
        """One parameter per tensor: its elements in ``shard`` (this rank's shard, or a copy of it
        such as an offloaded master), as aliases that an optimizer updates in place."""
        base = shard.detach()
        return [nn.Parameter(base[a:z]) for a, z in self.spans]

    def piece_slice(self, i: int) -> tuple[int, int, int]:
        """Where piece i sits in parameter i, flattened: ``(start, step, count)``, its elements being
        ``p.reshape(-1)[start::step][:count]`` (step n when sharded, 1 when replicated)."""
        a, z = self.spans[i]
        start = self.flat.element_of(i, a, self._first, self._stride)
        return (start if z > a else 0), self._stride, z - a

    def own_elements(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's elements of a tensor shaped like parameter ``i`` (its piece's values), a view."""
        start, step, count = self.piece_slice(i)
        return full.reshape(-1)[start::step][:count]

    def rank_major(self, g: torch.Tensor) -> torch.Tensor:
        """A flat-order stretch of the buffer as reduce-scatter wants it: row r = rank r's elements."""
        return g.view(-1, self.n).t().reshape(-1)  # a copy: the transpose is not contiguous

    def reduce(self, flat_grad: torch.Tensor) -> torch.Tensor:
        """Average a full flat gradient over the group; return this rank's part of it, a view of
        ``flat_grad``: all of it (replicated: one all-reduce) or its shard (one reduce-scatter)."""
        if self.replicate:
            comm.all_reduce(flat_grad, group=self.group)
            return flat_grad.div_(self.n)
        reduced = flat_grad.new_empty(self.flat.shard_numel)
        comm.reduce_scatter(reduced, self.rank_major(flat_grad), group=self.group)
        mine = flat_grad[self.rank::self.n]
        return mine.copy_(reduced.div_(self.n))

    @torch.no_grad()
    def all_gather(self, buckets) -> None:
        """§5.1: "an all-gather across all data parallel processes" of the updated parameters, one
        per bucket ``[lo, hi)``, transposed from rank-major back into flat order (not when replicated)."""
        if self.replicate:
            return
        n = self.n
        for lo, hi in buckets:
            got = self.flat_param.new_empty(hi - lo)
            # our elements of the bucket, strided: .contiguous() copies (and never aliases ``got``)
            comm.all_gather(got, self.shard.detach()[lo // n:hi // n].contiguous(), group=self.group)
            self.flat_param[lo:hi].view(-1, n).copy_(got.view(n, -1).t())

    def gather(self, shard_values: torch.Tensor) -> list[torch.Tensor]:
        """Per-element values of every rank's shard (``S`` of them here) as full tensors shaped like
        the parameters, on every rank (a collective unless replicated): how sharded state is saved."""
        values = shard_values.to(self.flat_param.device)
        if self.replicate:
            whole = values
        else:
            got = values.new_empty(self.flat.padded_numel)
            comm.all_gather(got, values.contiguous(), group=self.group)
            whole = got.view(self.n, -1).t().reshape(-1)  # rank-major back to flat order
        return [v.clone() for v in self.flat.views(whole)]

    def __repr__(self) -> str:
        kind = "replicated" if self.replicate else f"rank {self.rank} of {self.n}"
        return f"FlatPartition({len(self.flat.params)} tensors, {kind}, shard={self.shard.numel()})"
