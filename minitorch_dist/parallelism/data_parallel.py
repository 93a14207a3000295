"""Chapter 01 — data parallelism: every rank holds the whole model, takes a slice of the batch, and
the ranks average their gradients, so every replica takes the same optimizer step.

Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (VLDB): §3.2.1 the naive solution, §3.2.2 gradient bucketing, §3.2.3 overlapping
communication with backward (and parameters that get no gradient), §3.2.4 gradient
accumulation (``no_sync``), §4.2 the reducer (bucket buffers, the bitmap of unused parameters).

**Why averaging is exact.** Let the loss be the mean over a global batch of B rows,
``L = (1/B) sum_b l_b``, and give each of n ranks B/n rows. Rank r's local loss is
``L_r = (n/B) sum_{b in r} l_b``, so ::

    grad L = (1/n) sum_r grad L_r

All-reducing (SUM) the local gradients and dividing by n gives every rank the gradient of the
single-process run; replicas that start equal (rank 0's weights are broadcast at construction)
and apply the same optimizer to the same gradient stay equal, step after step.

**Two implementations.**

* :class:`NaiveDataParallel` (§3.2.1): after ``backward()`` the training loop calls
  ``average_gradients()``, one blocking all-reduce per parameter. Correct, but it pays one
  latency (alpha) per parameter and leaves the network idle during backward.
* :class:`DistributedDataParallel` (§3.2.2-3.2.4): gradients are packed into a few flat
  *buckets*; a bucket's all-reduce is launched asynchronously as soon as all its gradients are
  ready, while backward keeps computing the rest, and everything is waited for when backward
  ends. Fewer alphas, and communication hidden behind computation:
  ``costmodel.ddp_step_time`` models the step.

Bytes on the wire per step (ring all-reduce, any bucketing): ``2(n-1)/n * gradient bytes``.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from .. import costmodel
from ..memory.zero.flat import FlatParams
from ..runtime import comm, observe, require_process_group
from ..runtime.devices import values_or
from ..runtime.replica_shapes import check_same_shapes

__all__ = ["NaiveDataParallel", "Bucket", "DistributedDataParallel"]

MiB = 2**20  # torch's bucket_cap_mb is in MiB (distributed.py: _MB_TO_BYTES = 1024 * 1024)


def _require_member(what: str, group: dist.ProcessGroup | None) -> None:
    require_process_group(what)
    if dist.get_rank(group) < 0:
        raise ValueError(f"this rank is not a member of `group`; only the group's ranks may call {what}")


def _broadcast_state(module: nn.Module, group: dist.ProcessGroup | None, who: str) -> None:
    """Make every replica rank 0's: check that every rank built the same shapes (a broadcast would
    reshape another model's tensors of equal sizes silently), then broadcast each parameter (a tied one
    once) and buffer."""
    check_same_shapes(itertools.chain(module.named_parameters(), module.named_buffers()), group, who=who)
    src = 0 if group is None else dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in itertools.chain(module.parameters(), module.buffers()):
            buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
            comm.broadcast(buf, src, group=group)
            if buf.data_ptr() != t.data_ptr():
                t.copy_(buf)


# --- §3.2.1: the naive solution ---------------------------------------------------------------


class NaiveDataParallel(nn.Module):
    """The tutorial version: broadcast at construction, all-reduce every gradient after backward.

    Usage: ``loss = dp(x).sum(); loss.backward(); dp.average_gradients(); opt.step()``.

    ``average_gradients`` all-reduces (SUM) each parameter's ``.grad`` in registration order,
    one blocking call per parameter, then divides by the world size. A parameter whose ``.grad``
    is None is skipped: every rank must agree on which those are (true when all ranks run the same
    code on batches of the same shape), otherwise the ranks issue different collectives and hang.
    """

    def __init__(self, module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        _require_member("NaiveDataParallel", group)
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        _broadcast_state(module, group, "NaiveDataParallel")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def average_gradients(self) -> None:
        for p in self.module.parameters():  # a tied parameter once: its .grad holds both uses
            if p.grad is None:
                continue
            g = p.grad if p.grad.is_contiguous() else p.grad.contiguous()
            comm.all_reduce(g, group=self.group)
            g.div_(self.world_size)
            if g is not p.grad:
                p.grad.copy_(g)


# --- §3.2.2-3.2.4: buckets, overlap, no_sync ------------------------------------------------------


class Bucket:
    """One gradient bucket (Li et al. 2020 §3.2.2): a few parameters' gradients packed into one flat
    buffer, so one all-reduce (one latency) carries them all.

    ``flat`` has ``sum(p.numel())`` elements, laid out by ``layout`` (the flat buffer of chapter 06,
    :class:`~minitorch_dist.memory.zero.flat.FlatParams`, with ``n = 1``: no padding): parameter k
    owns the slice after the first k, viewed in its own shape. Per backward: :meth:`add_grad` copies
    each fresh gradient into its slice (scaled), :attr:`complete` says every slice is filled,
    :meth:`launch` starts the asynchronous all-reduce of ``flat``, :meth:`wait` waits for it and
    :meth:`copy_out` writes a slice back into its ``param.grad``; :meth:`reset` starts the next backward.
    """

    def __init__(self, names: list[str], params: list[nn.Parameter]):
        self.names, self.params = list(names), list(params)
        self.nbytes = sum(p.numel() * p.element_size() for p in self.params)
        self.layout = FlatParams(self.params, n=1)
        self.flat = self.layout.empty()  # (sum of numel,), zeros
        self._views = {id(p): v for p, v in zip(self.params, self.layout.views(self.flat))}
        self._names = {id(p): name for p, name in zip(self.params, self.names)}
        self.reset()

    def reset(self) -> None:
        self._ready: set[int] = set()
        self.work = None

    def name_of(self, p: torch.Tensor) -> str:
        return self._names[id(p)]

    def has_grad(self, p: torch.Tensor) -> bool:
        """Whether ``p``'s gradient is already in the bucket this backward."""
        return id(p) in self._ready

    @property
    def complete(self) -> bool:
        return len(self._ready) == len(self.params)

    def add_grad(self, p: torch.Tensor, scale: float) -> None:
        """Copy ``p.grad * scale`` into ``p``'s slice (zeros when ``p.grad`` is None); ``p`` is ready."""
        view = self._views[id(p)]
        if p.grad is None:
            view.zero_()
        else:
            torch.mul(p.grad, scale, out=view)
        self._ready.add(id(p))

    def launch(self, group: dist.ProcessGroup | None) -> Any:
        """Start the all-reduce (SUM) of the flat buffer; returns its work handle."""
        self.work = comm.all_reduce(self.flat, group=group, async_op=True)
        return self.work

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()

    def copy_out(self, p: torch.Tensor) -> None:
        """Write ``p``'s (reduced) slice into ``p.grad`` (a copy, not a view of the bucket)."""
        view = self._views[id(p)]
        if p.grad is None:
            p.grad = view.clone()
        else:
            p.grad.copy_(view)


class DistributedDataParallel(nn.Module):
    """Bucketed data parallelism with communication overlapped with backward; a drop-in for
    ``torch.nn.parallel.DistributedDataParallel``::

        ddp = DistributedDataParallel(model, bucket_cap_mb=25)
        loss = ddp(x).sum(); loss.backward(); opt.step()   # grads are averaged when backward returns

    **Buckets** (:func:`costmodel.bucket_assignment`, the rule lives there). Parameters with
    ``requires_grad`` are taken in *reverse* registration order (gradients become ready roughly
    in reverse, §3.2.3), a tied Parameter once under its first name. Bucket 0 holds at most
    ``first_bucket_mb`` MiB, every later bucket ``bucket_cap_mb`` MiB: a bucket closes when the
    next parameter would push it past its cap or has another dtype/device, so a parameter larger
    than the cap gets a bucket of its own. Each :class:`Bucket` owns one flat buffer; ``ddp.buckets`` lists
    the parameter names per bucket, ``ddp.bucket_bytes`` their sizes, ``ddp.bucket_table()``
    prints both.

    **Backward.** A ``register_post_accumulate_grad_hook`` on every bucketed parameter copies its
    fresh ``.grad``, times 1/n, into the bucket's slice and marks it ready (the gradient is
    copied, not aliased: torch's default ``gradient_as_bucket_view=False``). When a bucket is
    complete *and* every earlier bucket has been launched, ``comm.all_reduce(flat, async_op=True)``
    is launched: buckets go out in bucket order on every rank, as collectives must, so a complete
    later bucket waits for an earlier one. The first hook of a backward queues an autograd
    engine callback that runs when backward is finished: it waits for every bucket and copies the
    averaged slices back into ``param.grad``.

    **Averaging: pre-divide.** Each gradient is multiplied by 1/n while it is copied into the
    bucket (one pass instead of two, as torch's reducer does), so the all-reduce's SUM is already
    the mean. Summing first then dividing is the same in exact arithmetic; in floating point it
    is bitwise the same when n is a power of two (barring underflow). Pre-dividing keeps
    low-precision sums (fp16) from overflowing, at the price of underflowing tiny gradients sooner.

    **no_sync()** (§3.2.4): a forward run inside ``with ddp.no_sync():`` makes its backward skip
    communication, so gradients just accumulate in ``param.grad``; the first backward of a forward
    outside the block all-reduces the accumulated sum. Calling backward twice without ``no_sync``
    and without ``opt.step()`` also works as in torch: the second backward all-reduces
    ``param.grad`` = (already averaged first gradient, equal on every rank) + (new local gradient),
    giving the sum of the two averages, at the price of a second round of communication.

    **Unused parameters** (§3.2.3, §4.2). A bucketed parameter that gets no gradient in a backward
    would leave its bucket incomplete forever. With ``find_unused_parameters=False`` the
    end-of-backward callback raises a RuntimeError naming it. With ``True`` it counts as ready at
    the end of backward, contributing its current ``.grad`` (zeros if None), and one extra
    all-reduce of a 0/1 "has a gradient" bitmap tells every rank which parameters got a gradient
    on *some* rank: those receive the average, the rest keep ``.grad`` None, so an optimizer
    skips them exactly as torch's DDP arranges. (torch finds unused parameters by walking the
    autograd graph after forward, so their buckets can go out early; here they go at the end.)

    **Observability** (:mod:`runtime.observe`). A synchronised backward announces the ``"ddp"`` marks
    ``"grad"`` (param=), ``"launch"``, ``"wait"`` (bucket=) in order, and the spans ``"backward"`` (first
    output gradient to engine callback), ``"wait"``, ``"all_reduce b{i}"`` (launch to the backend's done).

    Differences from torch's DDP: buffers are broadcast only at construction (torch also does it
    before every forward, ``broadcast_buffers=True``); parameters are broadcast one by one, not
    coalesced; buckets are fixed at construction (torch 2.x starts with a single bucket and
    rebuilds buckets in the observed gradient order after the first iteration); the bucket rule
    closes a bucket *before* it overflows (torch's, after); sparse gradients are not supported.
    Move the model to its device before wrapping it (the buckets live on the parameters' device).
    """

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25, first_bucket_mb: float = 1,
                 group: dist.ProcessGroup | None = None, find_unused_parameters: bool = False) -> None:
        super().__init__()
        for name, v in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number of MiB, got {v!r} "
                                 f"(e.g. {name}=25; fractions such as 0.25 are fine)")
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]  # tied: once
        if not named:
            raise ValueError(f"{type(module).__name__} has no parameters with requires_grad=True: "
                             f"there are no gradients to average; wrap a model that trains")
        _require_member("DistributedDataParallel", group)
        self.module, self.group = module, group
        self.find_unused_parameters = bool(find_unused_parameters)
        self.world_size = dist.get_world_size(group)
        _broadcast_state(module, group, "DistributedDataParallel")

        named.reverse()  # the order in which backward (roughly) produces the gradients
        sizes = [p.numel() * p.element_size() for _, p in named]
        keys = [(p.dtype, p.device) for _, p in named]
        cap, first = max(1, int(bucket_cap_mb * MiB)), max(1, int(first_bucket_mb * MiB))
        self._buckets = [Bucket([named[i][0] for i in b], [named[i][1] for i in b])
                         for b in costmodel.bucket_assignment(sizes, cap, first, keys)]
        self.buckets = [b.names for b in self._buckets]
        self.bucket_bytes = [b.nbytes for b in self._buckets]
        self._bucket_of = {id(p): b for b in self._buckets for p in b.params}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for b in self._buckets for p in b.params]
        self.require_backward_grad_sync = True  # False inside no_sync()
        self._sync_this_backward = True  # what the latest forward saw
        self._reset()

    # --- the public surface ------------------------------------------------------------------

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._sync_this_backward = self.require_backward_grad_sync
        out = self.module(*args, **kwargs)
        if observe.watched() and self._sync_this_backward and torch.is_grad_enabled():
            for t in tree_flatten(out)[0]:  # the "backward" span begins at the first output's gradient
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._begin_backward)
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward of forwards run inside the block does no communication (gradient accumulation)."""
        before, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = before

    def bucket_table(self) -> str:
        """One line per bucket: index, bytes, parameter names (in the order they are packed)."""
        return "\n".join(f"b{i:<3}{b.nbytes:>10,} B  {', '.join(b.names)}"
                         for i, b in enumerate(self._buckets))

    # --- backward: hooks, launches, the end-of-backward callback --------------------------------

    def _reset(self) -> None:
        self._in_backward = False
        for b in self._buckets:
            b.reset()
        self._next = 0  # the next bucket to launch
        self._backward_span = None  # observe's key of this backward's span, when it is watched

    def _begin_backward(self, grad):
        if self._backward_span is None:
            self._backward_span = observe.begin("backward", "backward")

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if not self._sync_this_backward:
            return  # no_sync: the gradient just accumulates in p.grad
        if not self._in_backward:  # the first gradient of this backward
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        bucket = self._bucket_of[id(p)]
        if bucket.has_grad(p) or (p.grad is not None and p.grad.is_sparse):  # set: a post-accumulate hook
            twice, name = bucket.has_grad(p), bucket.name_of(p)
            self._reset()
            raise RuntimeError(
                f"parameter {name} received two gradients in one backward (use "
                f"torch.utils.checkpoint(..., use_reentrant=False))" if twice else
                f"parameter {name} has a sparse gradient; only dense gradients are supported "
                f"(use nn.Embedding(..., sparse=False))")
        bucket.add_grad(p, 1.0 / self.world_size)
        observe.mark("grad", "ddp", param=bucket.name_of(p))
        self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets, in bucket order: a complete bucket waits for earlier ones."""
        while self._next < len(self._buckets) and self._buckets[self._next].complete:
            i = self._next
            work = self._buckets[i].launch(self.group)
            observe.mark("launch", "ddp", bucket=i)
            if observe.watched():  # the span ends when the backend finishes, in the backend's thread
                key = observe.begin(f"all_reduce b{i}", "all_reduce", bucket=i, nbytes=self.bucket_bytes[i])
                if key is not None:
                    work.get_future().add_done_callback(lambda _, key=key: observe.end(key))
            self._next += 1

    def _finish_backward(self) -> None:
        """Runs once backward has produced every gradient: wait, write the averages back."""
        observe.end(self._backward_span)
        try:
            unready = [(b, p) for b in self._buckets for p in b.params if not b.has_grad(p)]
            if unready and not self.find_unused_parameters:
                for b in self._buckets[:self._next]:  # every rank launched the same buckets: finish them
                    b.wait()
                names = ", ".join(b.name_of(p) for b, p in unready)
                raise RuntimeError(
                    f"DistributedDataParallel: these parameters received no gradient in this "
                    f"backward: {names}. Their buckets can never complete, and every rank must "
                    f"all-reduce every bucket. If the model does not use them in every forward, pass "
                    f"find_unused_parameters=True (or set requires_grad=False on those that never train).")
            for b, p in unready:  # find_unused_parameters=True: ready, with whatever this rank holds
                b.add_grad(p, 1.0 / self.world_size)
            self._launch_ready_buckets()
            used = self._globally_used() if self.find_unused_parameters else None
            with observe.span("wait", "wait"):
                for i, b in enumerate(self._buckets[:self._next]):  # all of them, after the launch above
                    b.wait()
                    observe.mark("wait", "ddp", bucket=i)
            pairs = [(b, p) for b in self._buckets for p in b.params]  # the order of the used bitmap
            for k, (bucket, param) in enumerate(pairs):
                if used is None or used[k]:  # no rank produced a gradient: leave .grad as it is (None)
                    bucket.copy_out(param)
        finally:
            self._reset()

    def _globally_used(self) -> list[bool]:
        """All-reduce a 0/1 bitmap: which parameters have a gradient on at least one rank (§4.2)."""
        params = [p for b in self._buckets for p in b.params]
        local = torch.tensor([p.grad is not None for p in params], dtype=torch.int32,
                             device=self._buckets[0].flat.device)  # (n_params,)
        comm.all_reduce(local, group=self.group)
        return [x > 0 for x in values_or(local, [p.grad is not None for p in params])]
