"""ZeRO stages 0, 1 and 2: data parallelism whose optimizer state (stage 1) and gradients (stage 2)
are partitioned over the n ranks, each rank updating only its 1/n of the parameters.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"
(SC'20): §5.1 (P_os, optimizer-state partitioning), §5.2 (P_g, gradient partitioning, "bucketization"),
§7.2 (communication of ZeRO-DP).

**Layout: an interleaved partition.** Every parameter is a view into one flat fp32 buffer of
``Psi' = n*S`` elements, ``S = ceil(Psi / n)`` (:class:`.flat.FlatParams`: zero padding at the end).
Rank r owns the elements ``r, r+n, r+2n, ...`` -- the strided view ``flat_param[r::n]`` of S elements,
handed to the optimizer as ONE flat 1-D parameter. In fp32 training the parameters *are* the master
weights, and any elementwise ``torch.optim`` optimizer (SGD with momentum, Adam, AdamW's decoupled
weight decay) computes on those elements exactly what it computes on them in one process. The
padding sees zero gradients and zero weights, so it stays zero.

**Why interleaved: buckets.** Stage 2 cuts the flat buffer into buckets of about ``bucket_cap_mb``
(each a multiple of n long, cut from the padded buffer: no padding beyond Psi') and reduce-scatters
each bucket as soon as backward has produced all of its gradients (§5.2). Reduce-scatter hands
rank r chunk r of its input, so a bucket must contain a piece of *every* rank's partition. A
contiguous partition (rank r owns ``[r*S, (r+1)*S)``) puts rank r's piece of the whole gradient far
from everyone else's; interleaving puts ``m = len/n``
elements of every rank in every bucket, and rank r's part of bucket ``[lo, hi)`` is the contiguous
slice ``shard[lo/n : hi/n]``. The bucket goes on the wire rank-major, ``g.view(m, n).t()`` (row r =
rank r's elements), a transposed copy; the all-gather after the step comes back rank-major and is
transposed into place. Autograd produces gradients roughly in reverse parameter order, so buckets
are launched last to first, in that fixed order on every rank (so the collectives match), one
reduce-scatter in flight while backward goes on.

**Per step, per rank** (4-byte fp32; AdamW K = 8; ``B`` = the largest set of parameters that
overlap one bucket)::

    stage  gradients reduced by                  update     params   grads (bwd peak / at step)  optimizer state
    0      all-reduce(Psi') in step              all Psi'   4 Psi'   4 Psi' / 4 Psi'             8 Psi'
    1      reduce-scatter(Psi') in step          own S      4 Psi'   4 Psi' / 4 Psi'             8 S
    2      k reduce-scatters(bucket) in bwd      own S      4 Psi'   <= 4 (S + B) / 4 S          8 S
    (+ AdamW's ``step`` counter, one 4-byte scalar; stages 1 and 2 then all-gather: once, or per bucket)

Stage 2 frees every ``p.grad`` once its buckets are on the wire: the full gradient never exists.
Not counted as gradients (they are temporaries): the rank-major send copies -- a bucket being built
and the one in flight at stage 2, the whole 4 Psi' for stage 1's one reduce-scatter -- and autograd's own.
``bucket_cap_mb=None`` is one bucket: reduced when the last gradient arrives, peak gradients ~4 Psi.
Wire bytes (ring model, §7.2): all-reduce ``2(n-1)/n * 4Psi'``; reduce-scatter + all-gather
``(n-1)/n * 4Psi'`` each, summed over the buckets: the same 2Psi of the paper at every stage.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ...runtime import comm
from .flat import FlatParams

__all__ = ["ZeroDataParallel", "bucket_ranges"]

STAGES = (0, 1, 2)


def bucket_ranges(padded_numel: int, n: int, cap_elements: int | None) -> list[tuple[int, int]]:
    """``[lo, hi)`` pieces of a flat buffer of ``padded_numel`` (a multiple of n), each about
    ``cap_elements`` long and a multiple of n, so every bucket holds ``(hi-lo)/n`` elements of each
    rank; ``cap_elements=None``: one bucket."""
    if padded_numel % n:
        raise ValueError(f"the padded flat buffer ({padded_numel}) must be a multiple of n = {n}")
    size = padded_numel if cap_elements is None else n * max(1, math.ceil(cap_elements / n))
    return [(lo, min(lo + size, padded_numel)) for lo in range(0, padded_numel, size)]


class ZeroDataParallel(nn.Module):
    """ZeRO-DP stage 0, 1 or 2 over ``group``; the training loop is plain data parallelism::

        zero = ZeroDataParallel(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), stage=2)
        zero.zero_grad(); _, loss = zero(x, y); loss.backward(); zero.step()

    Each rank feeds its rows of the global batch; gradients are *averaged* over ranks, so n ranks
    take the step of one process on the whole batch. ``optimizer_factory(params)`` builds any
    ``torch.optim`` optimizer; it receives ``[self.shard]`` (stage 0: the whole flat buffer).
    ``offload="cpu"|"disk"`` steps the shard with :class:`.offload.OffloadedOptimizer` instead.
    ``bucket_cap_mb`` (MiB of gradient per reduce-scatter) is used by stage 2 only; stages 0 and 1
    reduce once, in ``step()``, so their one bucket is the whole buffer.

    Attributes: ``flat`` (FlatParams), ``flat_param`` (the padded buffer the parameters view),
    ``shard`` (the flat parameter the optimizer updates: ``flat_param[rank::n]``), ``buckets``
    (``[lo, hi)`` ranges of the flat buffer), ``optimizer`` (None under offload, where
    ``offloaded`` is the OffloadedOptimizer; ``close()`` removes its files).
    ``MemoryMeter(zero, zero.optimizer)`` sees parameters, gradients and optimizer state.
    """

    def __init__(self, model: nn.Module, optimizer_factory, stage: int, group=None,
                 offload: str | None = None, offload_dir=None, bucket_cap_mb: float | None = 1.0):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES} here, got {stage!r} "
                             f"(stage 3 shards the parameters too: use fsdp.fully_shard)")
        if offload not in (None, "cpu", "disk"):
            raise ValueError(f"offload must be None, 'cpu' or 'disk', got {offload!r}")
        if bucket_cap_mb is not None and not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be > 0 (or None for one bucket), got {bucket_cap_mb!r}")
        if not dist.is_initialized():
            raise RuntimeError("ZeRO needs torch.distributed initialised: build it inside a function "
                               "run by launch(fn, world_size) (or under torchrun)")
        params = [p for p in model.parameters() if p.requires_grad]  # a tied parameter once
        if not params:
            raise ValueError("the model has no parameters that require grad: nothing to train")
        self.module, self.group, self.stage = model, group, stage
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.flat = FlatParams(params, self.world_size)
        cap = None if stage < 2 or bucket_cap_mb is None else bucket_cap_mb * 2 ** 20 / params[0].element_size()
        self.buckets = bucket_ranges(self.flat.padded_numel, self.world_size, cap)

        # Every replica starts from rank 0's weights (and buffers), as in data parallelism.
        src = 0 if group is None else dist.get_global_rank(group, 0)
        with torch.no_grad():
            self.flat_param = self.flat.flatten([p.detach() for p in params])
            comm.broadcast(self.flat_param, src, group=group)
            for p, v in zip(params, self.flat.views(self.flat_param)):
                p.data = v  # the parameter now lives in the flat buffer: updates to it reach the model
            for b in model.buffers():
                comm.broadcast(b.data, src, group=group)

        # The one flat parameter the optimizer sees: all of Psi' at stage 0, this rank's S otherwise.
        own = self.flat_param if stage == 0 else self.flat_param[self.rank::self.world_size]
        shard = nn.Parameter(own)  # an alias of those elements (same storage, stride n), not a copy
        self.__dict__["shard"] = shard  # not registered: model.parameters() already covers the storage
        self.offloaded = None
        if offload is None:
            self.optimizer = optimizer_factory([shard])
        else:
            from .offload import OffloadedOptimizer  # written alongside; imported only when asked for
            self.optimizer = None
            self.offloaded = OffloadedOptimizer(shard, optimizer_factory, where=offload, directory=offload_dir)

        if stage < 2:
            # Gradients accumulate straight into one flat buffer (DDP's gradient_as_bucket_view).
            self.flat_grad = self.flat.empty()
            self._grad_views = self.flat.views(self.flat_grad)
            self._attach_grads()
        else:
            self.flat_grad = None  # never exists: each bucket is reduced and dropped during backward
            spans = [(o, o + k) for o, k in zip(self.flat.offsets, self.flat.numels)]
            # which parameters each bucket waits for, and the buckets of each parameter (ascending)
            self._members = [[i for i, (a, z) in enumerate(spans) if a < hi and lo < z] for lo, hi in self.buckets]
            self._buckets_of = [[b for b, ms in enumerate(self._members) if i in ms] for i in range(len(params))]
            self._index = {id(p): i for i, p in enumerate(params)}
            self._in_backward, self._in_flight = False, None
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _rank_major(self, g: torch.Tensor) -> torch.Tensor:
        """A flat-order piece of a gradient as reduce-scatter wants it: row r = rank r's elements."""
        return g.view(-1, self.world_size).t().reshape(-1)  # a copy: the transpose is not contiguous

    # --- gradients: stages 0 and 1 ---------------------------------------------------------------
    def _attach_grads(self) -> None:
        """Stages 0/1: make every ``p.grad`` a view of ``flat_grad`` (copying in any that are not)."""
        for p, v in zip(self.flat.params, self._grad_views):
            if p.grad is None:
                v.zero_()
            elif p.grad.data_ptr() != v.data_ptr():
                v.copy_(p.grad)
            p.grad = v

    def _reduce_grads(self) -> None:
        """Stages 0/1: average the full gradient (stage 0) or this rank's elements of it (stage 1)."""
        self._attach_grads()
        n = self.world_size
        if self.stage == 0:
            comm.all_reduce(self.flat_grad, group=self.group)
            self.flat_grad.div_(n)
            self.shard.grad = self.flat_grad
        else:
            reduced = torch.empty(self.flat.shard_numel, dtype=self.flat_grad.dtype, device=self.flat_grad.device)
            comm.reduce_scatter(reduced, self._rank_major(self.flat_grad), group=self.group)
            mine = self.flat_grad[self.rank::n]
            mine.copy_(reduced.div_(n))
            self.shard.grad = mine  # a view: the gradient memory stays the one flat buffer

    # --- gradients: stage 2, bucket by bucket during backward (§5.2) ----------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        """A gradient is ready: count it towards its buckets, launch every bucket now complete."""
        if not self._in_backward:  # the first gradient of this backward
            self._in_backward = True
            self._waiting = [len(ms) for ms in self._members]
            self._next = len(self.buckets) - 1  # launch order: last bucket first, the same on every rank
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        for b in self._buckets_of[self._index[id(p)]]:
            self._waiting[b] -= 1
        self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        while self._next >= 0 and (flush or self._waiting[self._next] == 0):
            self._launch(self._next)
            self._next -= 1

    def _launch(self, b: int) -> None:
        """Copy bucket b's gradients out of the parameters, free them, start its reduce-scatter."""
        lo, hi = self.buckets[b]
        g = self.flat_param.new_zeros(hi - lo)  # zeros: padding, and parameters that got no gradient
        for i in self._members[b]:
            p, off = self.flat.params[i], self.flat.offsets[i]
            if p.grad is None:
                continue
            a, z = max(lo, off), min(hi, off + self.flat.numels[i])
            g[a - lo:z - lo].copy_(p.grad.reshape(-1)[a - off:z - off])
            if b == self._buckets_of[i][0]:  # its lowest bucket goes last: the gradient is no longer needed
                p.grad = None
        send = self._rank_major(g)
        del g  # only the rank-major copy goes on the wire
        mine = send.new_empty((hi - lo) // self.world_size)
        self._finish()  # at most one reduce-scatter in flight: the memory stays one bucket or two
        work = comm.reduce_scatter(mine, send, group=self.group, async_op=True)
        self._in_flight = (b, mine, send, work)

    def _finish(self) -> None:
        """Wait for the bucket in flight; add its averaged chunk into this rank's gradient shard."""
        if self._in_flight is None:
            return
        b, mine, _send, work = self._in_flight  # ``_send`` kept alive until the collective is done
        self._in_flight = None
        work.wait()
        if self.shard.grad is None:
            self.shard.grad = mine.new_zeros(self.flat.shard_numel)
        lo, hi = self.buckets[b]
        n = self.world_size
        self.shard.grad[lo // n:hi // n].add_(mine.div_(n))  # several backwards before a step accumulate

    def _end_of_backward(self) -> None:
        """Launch what is left (buckets with a parameter that got no gradient) and wait for it."""
        self._launch_ready(flush=True)
        self._finish()
        self._in_backward = False

    # --- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Reduce gradients (stages 0/1), update this rank's part, all-gather parameters (stages 1/2)."""
        if self.stage < 2:
            self._reduce_grads()
        elif self.shard.grad is None:
            raise RuntimeError("no gradient to step with: call loss.backward() before step()")
        if self.offloaded is not None:
            self.offloaded.step(self.shard.grad)
        else:
            self.optimizer.step()
        if self.stage > 0:  # §5.1: "an all-gather across all data parallel processes", one per bucket
            n = self.world_size
            for lo, hi in self.buckets:
                got = self.flat_param.new_empty(hi - lo)
                # our elements of the bucket, strided: .contiguous() copies (and never aliases ``got``)
                comm.all_gather(got, self.shard.detach()[lo // n:hi // n].contiguous(), group=self.group)
                self.flat_param[lo:hi].view(-1, n).copy_(got.view(n, -1).t())

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Stages 0/1 zero the flat gradient in place (the views stay); stage 2 drops its shard."""
        if self.stage < 2:
            self.flat_grad.zero_()
            self._attach_grads()
            self.shard.grad = None
        else:
            self.shard.grad = None
            for p in self.flat.params:
                p.grad = None

    def close(self) -> None:
        """Release the offloaded master and state (their files, with ``offload="disk"``)."""
        if self.offloaded is not None:
            self.offloaded.close()

    # --- saving --------------------------------------------------------------------------------
    @torch.no_grad()
    def full_state_dict(self, optimizer: bool = False) -> dict:
        """The full (unsharded) model state dict, cloned; every rank holds every parameter at stages
        0-2, so nothing moves. With ``optimizer=True`` (a collective: every rank must call it):
        ``{"model": ..., "optimizer": {param_name: {state_key: full tensor}}}``, each flat state
        tensor all-gathered (stages 1/2), put back in flat order and cut into the parameters' shapes."""
        model = {k: v.detach().clone() for k, v in self.module.state_dict().items()}
        if not optimizer:
            return model
        if self.offloaded is not None:
            state = self.offloaded.state_dict().get("state", {})
            state = next(iter(state.values()), {}) if state else {}
        else:
            state = self.optimizer.state.get(self.shard, {})
        names = {id(p): name for name, p in self.module.named_parameters()}
        full: dict = {names[id(p)]: {} for p in self.flat.params}
        for key, t in state.items():
            if not (torch.is_tensor(t) and t.dim() == 1 and t.numel() == self.shard.numel()):
                for p in self.flat.params:  # scalars (Adam's step) are the same for every element
                    full[names[id(p)]][key] = t.clone() if torch.is_tensor(t) else t
                continue
            if self.stage == 0:
                whole = t.detach().clone()
            else:
                got = self.flat.empty(dtype=t.dtype, device=self.flat_param.device)
                comm.all_gather(got, t.detach().to(got.device).contiguous(), group=self.group)
                whole = got.view(self.world_size, -1).t().reshape(-1)  # rank-major back to flat order
            for p, v in zip(self.flat.params, self.flat.views(whole)):
                full[names[id(p)]][key] = v.clone()
        return {"model": model, "optimizer": full}
