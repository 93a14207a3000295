"""Chapter 06 — ZeRO stages 0, 1 and 2 as a module wrapper: data parallelism whose optimizer state
(stage 1) and gradients (stage 2) are partitioned over the n ranks, each rank updating only its 1/n
of the parameters.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC'20): §5.1 (P_os, optimizer-state partitioning), §5.2 (P_g, gradient partitioning, "bucketization"),
§7.2 (communication of ZeRO-DP).

``ZeroDataParallel`` is the model plus a :class:`.sharded_optimizer.ShardedOptimizer` over its
trainable parameters: the partition, the gradient reduction and the update are that optimizer's
(one implementation); this module adds the model's buffers (broadcast from rank 0), ``forward``
and the training-loop shape ``zero.zero_grad(); loss.backward(); zero.step()``.

**Layout: an interleaved partition** (:mod:`.partition`). Every parameter is a view into one flat
fp32 buffer of ``Psi' = n*S`` elements, ``S = ceil(Psi / n)`` (zero padding at the end). Rank r owns
the elements ``r, r+n, r+2n, ...`` -- the strided view ``flat_param[r::n]`` of S elements. In fp32
training the parameters *are* the master weights, and any elementwise ``torch.optim`` optimizer
(SGD with momentum, Adam, AdamW's decoupled weight decay) computes on those elements exactly what
it computes on them in one process. The optimizer is given each tensor's elements in the shard as
a parameter of its own, so its state, its step counts and its skipping of a tensor without a
gradient are per tensor, as in one process (see :mod:`.sharded_optimizer`).

**Why interleaved: buckets.** Stage 2 cuts the flat buffer into buckets of about ``bucket_cap_mb``
(each a multiple of n long) and reduce-scatters each bucket as soon as backward has produced all of
its gradients (§5.2). Reduce-scatter hands rank r chunk r of its input, so a bucket must contain
some of *every* rank's partition: interleaving puts ``m = len/n`` elements of every rank in every
bucket, and rank r's part of bucket ``[lo, hi)`` is the contiguous slice ``shard[lo/n : hi/n]``.
The bucket goes on the wire rank-major, ``g.view(m, n).t()``; the all-gather after the step comes
back rank-major and is transposed into place. Autograd produces gradients roughly in reverse
parameter order, so buckets are launched last to first, in that fixed order on every rank (so the
collectives match), one reduce-scatter in flight while backward goes on.

**Per step, per rank** (4-byte fp32; AdamW K = 8; ``B`` = the largest set of parameters that
overlap one bucket; ``P`` tensors, ``Psi_r`` the non-padding elements this rank owns)::

    stage  gradients reduced by              update     params   grads (bwd peak / at step)  optimizer state
    0      all-reduce(Psi') in step          all Psi    4 Psi'   4 Psi' / 4 Psi'             8 Psi + 4 P
    1      reduce-scatter(Psi') in step      own Psi_r  4 Psi'   4 Psi' / 4 Psi'             8 Psi_r + 4 P
    2      k reduce-scatters(bucket) in bwd  own Psi_r  4 Psi'   <= 4 (S + B) / 4 S          8 Psi_r + 4 P
    (4 P: AdamW's per-tensor ``step`` counter; stages 1 and 2 then all-gather: once, or per bucket)

Stage 2 frees every ``p.grad`` once its buckets are on the wire: the full gradient never exists.
Not counted as gradients (they are temporaries): the rank-major send copies -- a bucket being built
and the one in flight at stage 2, the whole 4 Psi' for stage 1's one reduce-scatter -- and autograd's own.
``bucket_cap_mb=None`` is one bucket: reduced when the last gradient arrives, peak gradients ~4 Psi.
Wire bytes (ring model, §7.2): all-reduce ``2(n-1)/n * 4Psi'``; reduce-scatter + all-gather
``(n-1)/n * 4Psi'`` each, summed over the buckets: the same 2Psi of the paper at every stage; plus,
every step, an all-reduce of one byte per tensor: which tensors got a gradient on some rank.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...runtime import comm, require_process_group
from .flat import FlatParams
from .offload import OffloadedOptimizer
from .partition import bucket_ranges
from .sharded_optimizer import STAGES, ShardedOptimizer

__all__ = ["ZeroDataParallel", "bucket_ranges"]


class ZeroDataParallel(nn.Module):
    """ZeRO-DP stage 0, 1 or 2 over ``group``; the training loop is plain data parallelism::

        zero = ZeroDataParallel(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=2)
        zero.zero_grad(); _, loss = zero(x, y); loss.backward(); zero.step()

    Each rank feeds its rows of the global batch; gradients are *averaged* over ranks, so n ranks
    take the step of one process on the whole batch. ``optimizer_factory(param_groups)`` builds any
    elementwise ``torch.optim`` optimizer over this rank's pieces of the parameters. A parameter
    that got no gradient on any rank in a step is left untouched (no decay, no state update).
    ``offload="cpu"|"disk"`` steps the shard with :class:`.offload.OffloadedOptimizer` instead.
    ``bucket_cap_mb`` (MiB of gradient per reduce-scatter) is used by stage 2 only; stages 0 and 1
    reduce once, in ``step()``, so their one bucket is the whole buffer. With a loss scaler (chapter
    08) step the optimizer through it, ``scaler.step(zero.sharded)``: it unscales the gradients where
    they live (``sharded.grads_to_step()``) and skips on every rank when any rank saw an inf.

    Attributes: ``sharded`` (the :class:`ShardedOptimizer` doing the work), ``optimizer`` (the same,
    or None under offload, where ``offloaded`` is the OffloadedOptimizer; ``close()`` removes its
    files), ``flat`` (FlatParams), ``flat_param`` (the padded buffer the parameters view), ``shard``
    (this rank's elements: ``flat_param[rank::n]``, all of it at stage 0), ``buckets`` (``[lo, hi)``
    ranges of the flat buffer). ``MemoryMeter(zero, zero.optimizer)`` sees parameters, gradients
    and optimizer state.
    """

    def __init__(self, model: nn.Module, optimizer_factory: Callable[..., torch.optim.Optimizer], stage: int,
                 group: dist.ProcessGroup | None = None, offload: str | None = None,
                 offload_dir: str | os.PathLike | None = None, bucket_cap_mb: float | None = 1.0) -> None:
        super().__init__()
        if isinstance(stage, bool) or stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES} here, got {stage!r} "
                             f"(stage 3 shards the parameters too: use fsdp.fully_shard)")
        require_process_group("ZeroDataParallel")
        params = [p for p in model.parameters() if p.requires_grad]  # a tied parameter once
        if not params:
            raise ValueError("the model has no parameters that require grad: nothing to train")
        self.module, self.group, self.stage = model, group, stage
        self.sharded = ShardedOptimizer(params, optimizer_factory, stage=stage, group=group,
                                        bucket_cap_mb=bucket_cap_mb, offload=offload, offload_dir=offload_dir)
        self.optimizer = self.sharded if offload is None else None
        partition = self.sharded.partition
        self.world_size, self.rank = partition.n, partition.rank
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():  # the parameters were broadcast by the partition; the buffers here
            for b in model.buffers():
                comm.broadcast(b.data, src, group=group)

    @property
    def flat(self) -> FlatParams:
        return self.sharded.partition.flat

    @property
    def flat_param(self) -> torch.Tensor:
        return self.sharded.partition.flat_param

    @property
    def shard(self) -> nn.Parameter:
        return self.sharded.partition.shard

    @property
    def flat_grad(self) -> torch.Tensor | None:
        return self.sharded.flat_grad

    @property
    def buckets(self) -> list[tuple[int, int]]:
        return self.sharded.buckets

    @property
    def offloaded(self) -> OffloadedOptimizer | None:
        return self.sharded.offloaded

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def step(self) -> None:
        """Reduce gradients (stages 0/1), update this rank's part, all-gather parameters (stages 1/2)."""
        self.sharded.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.sharded.zero_grad(set_to_none)

    def close(self) -> None:
        """Release the offloaded master and state (their files, with ``offload="disk"``)."""
        self.sharded.close()

    @torch.no_grad()
    def full_state_dict(self, optimizer: bool = False) -> dict:
        """The full (unsharded) model state dict, cloned; every rank holds every parameter at stages
        0-2, so nothing moves. With ``optimizer=True`` (a collective: every rank must call it):
        ``{"model": ..., "optimizer": {param_name: {state_key: full tensor}}}`` from the optimizer's
        consolidated state dict ({} for a parameter that never had a gradient)."""
        model = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if not optimizer:
            return model
        state = self.sharded.state_dict()["state"]
        names = {id(p): name for name, p in self.module.named_parameters()}
        full = {names[id(p)]: state.get(i, {}) for i, p in enumerate(self.flat.params)}
        return {"model": model, "optimizer": full}
