"""Chapter 01 exercises: data parallelism — gradient buckets, overlapped all-reduce, no_sync.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch01_data_parallel.py`` is generated from this file with each such
region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch01 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

All three follow Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (VLDB), the design of ``torch.nn.parallel.DistributedDataParallel`` (DDP):

1. :func:`assign_buckets`: group gradients into all-reduce buckets, in the order backward
   produces them (§3.2.2 "Gradient Bucketing", §3.2.3 on the reverse order).
2. :func:`install_gradient_averaging_hooks`: all-reduce each gradient the moment backward
   produces it, so communication overlaps the rest of backward (§3.2.3 "Overlap Computation
   with Communication"), without buckets.
3. :func:`accumulate_gradients`: gradient accumulation over micro-batches with DDP's
   ``no_sync()``, one all-reduce per k micro-batches (§3.2.4 "Gradient Accumulation").
4. :func:`install_bucketed_gradient_hooks`: the two ideas together — gradients packed into
   buckets whose all-reduces are launched during backward, in bucket order (§3.2.2-3.2.3).
5. :func:`predict_and_meter_ddp_traffic`: predict the all-reduces and bytes of one DDP step with
   gradient accumulation, then count them with the comm meter.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn

from minitorch_dist.runtime import comm

# --- 1. gradient buckets ------------------------------------------------------------------------


def assign_buckets(param_sizes_bytes, cap_bytes: int, first_cap_bytes: int | None = None) -> list[list[int]]:
    """Kind: derive

    Group parameters into all-reduce buckets; return the parameter indices of each bucket.

    One all-reduce per gradient pays the latency alpha once per tensor (a GPT has hundreds);
    one all-reduce of everything cannot start until backward has finished. DDP takes the middle
    road (§3.2.2): gradients are packed into buckets of about ``cap_bytes`` (DDP's
    ``bucket_cap_mb``, 25 MB by default) and a bucket is all-reduced as soon as all its gradients
    are ready. Backward produces gradients roughly in *reverse* registration order (the last
    layer's first), so buckets are filled in that order (§3.2.3), and the first bucket may use a
    smaller cap, ``first_cap_bytes`` (DDP uses 1 MB), so the first all-reduce starts early.

    ``param_sizes_bytes[i]`` is the gradient size of parameter i, in registration order
    (``model.parameters()``). The rule, walking the indices n-1, n-2, ..., 0:

    - add the parameter to the open bucket, unless that would take the bucket past its cap:
      then close the bucket and open a new one with this parameter;
    - the first bucket's cap is ``first_cap_bytes`` (when given), every later one ``cap_bytes``;
    - so a parameter larger than the cap ends up in a bucket of its own.

    For sizes ``[1, 2, 3, 4, 5]`` and ``cap_bytes=6``: ``[[4], [3], [2, 1, 0]]`` (5 + 4 > 6,
    4 + 3 > 6, 3 + 2 + 1 = 6).

    **Your task:** return the buckets, a list of lists of indices, in the order they fill (so
    the indices, read bucket after bucket, are n-1, n-2, ..., 0). One pass, a running total.
    """
    sizes = [int(s) for s in param_sizes_bytes]
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    if first_cap_bytes is not None and first_cap_bytes <= 0:
        raise ValueError("first_cap_bytes must be > 0 (or None for no special first bucket), got "
                         f"{first_cap_bytes}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"parameter sizes must be >= 0 bytes, got {sizes}")
    # BEGIN SOLUTION
    buckets, bucket, filled = [], [], 0
    cap = cap_bytes if first_cap_bytes is None else first_cap_bytes
    for i in reversed(range(len(sizes))):  # the order backward produces gradients
        if bucket and filled + sizes[i] > cap:
            buckets.append(bucket)
            bucket, filled, cap = [], 0, cap_bytes  # only the first bucket has the small cap
        bucket.append(i)
        filled += sizes[i]
    if bucket:
        buckets.append(bucket)
    return buckets
    # END SOLUTION


# --- 2. overlapping the all-reduce with backward ------------------------------------------------


def install_gradient_averaging_hooks(model: nn.Module, group=None) -> list:
    """Kind: build

    Make every backward of ``model`` average its gradients over the ranks, as they are produced.

    Data parallelism in its simplest overlapped form: each rank runs forward and backward on its
    slice of the global batch, and the gradient of the *global* mean loss is the mean over ranks
    of the local gradients, ``g = (1/n) sum_r g_r``. Instead of all-reducing everything after
    ``loss.backward()`` (Li et al. §3.2.1, the naive solution), start each parameter's all-reduce
    the moment autograd has accumulated its gradient, while backward goes on computing the
    earlier layers' (§3.2.3). DDP does this per bucket (exercise 1); here, one tensor at a time.

    ``Tensor.register_post_accumulate_grad_hook(hook)`` calls ``hook(param)`` right after
    ``param.grad`` has been written during backward, and returns a handle with ``.remove()``.

    **Your task:** register such a hook on every parameter that requires grad, so that when
    ``loss.backward()`` returns, each ``param.grad`` is the average over the ranks of ``group``;
    return the handles. Use ``comm.all_reduce`` (not ``dist.all_reduce``: the tests count calls
    with ``comm.meter()``), one call per parameter. Hints:

    - the world size is ``dist.get_world_size(group)``; dividing before or after the sum
      gives the same average;
    - the simplest correct hook all-reduces synchronously. Truly overlapping launches it with
      ``async_op=True`` and waits for all the launched works once backward is done: the first
      hook of a backward can queue that wait with
      ``torch.autograd.Variable._execution_engine.queue_callback(fn)`` (DDP and FSDP do the same).
    """
    if not dist.is_initialized():
        raise RuntimeError("install_gradient_averaging_hooks runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    # BEGIN SOLUTION
    n = dist.get_world_size(group)
    pending = []  # all-reduces launched in this backward and not yet waited for

    def wait_all():  # runs once the autograd engine has finished this backward
        for work in pending:
            work.wait()
        pending.clear()

    def average(param):
        if not pending:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(wait_all)
        param.grad.div_(n)
        pending.append(comm.all_reduce(param.grad, group=group, async_op=True))

    return [p.register_post_accumulate_grad_hook(average) for p in model.parameters() if p.requires_grad]
    # END SOLUTION


# --- 3. gradient accumulation with no_sync --------------------------------------------------------


def accumulate_gradients(model: nn.Module, loss_fn, micro_batches, no_sync: bool = True) -> float:
    """Kind: build

    Forward and backward over k micro-batches, accumulating the gradient of their mean loss.

    When the batch that converges well does not fit in memory, split it into k micro-batches
    and let ``.grad`` accumulate over k backward passes. Under DDP every backward all-reduces
    the gradients, k all-reduces for one optimizer step, although only the sum is needed.
    ``with model.no_sync():`` turns the all-reduce off for the forward and backward inside it;
    the gradients accumulate locally, and the next synchronised backward all-reduces the
    accumulated sum (Li et al. §3.2.4). So: the first k-1 micro-batches under ``no_sync()``,
    the last one without, and the gradients are communicated once.

    ``model`` is wrapped in ``torch.nn.parallel.DistributedDataParallel``; ``micro_batches`` is a
    sequence of ``(inputs, targets)`` of equal sizes; ``loss_fn(model(inputs), targets)`` is the
    mean loss of one micro-batch. With ``no_sync=False``, synchronise on every micro-batch
    instead (the same gradients, k times the communication: the baseline the tests compare with).

    **Your task:** run the k micro-batches, backpropagating each loss scaled by 1/k, so the
    accumulated gradient is that of the mean loss over all k micro-batches (and, after DDP's
    average, over all ranks: the global batch). Return the mean of the k losses as a float.
    Do not zero the gradients: the caller does, before. Hint: ``contextlib.nullcontext()``
    stands in for ``model.no_sync()`` where you want to synchronise.
    """
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    if no_sync and not hasattr(model, "no_sync"):
        raise TypeError(f"{type(model).__name__} has no no_sync(); wrap the model in "
                        "torch.nn.parallel.DistributedDataParallel (or pass no_sync=False)")
    # BEGIN SOLUTION
    k, total = len(micro_batches), 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        skip_sync = no_sync and i < k - 1  # only the last backward all-reduces
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets)
            (loss / k).backward()
        total += loss.item()
    return total / k
    # END SOLUTION


# --- 4. bucketed DDP with overlap -------------------------------------------------------------------


def install_bucketed_gradient_hooks(model: nn.Module, cap_bytes: int, first_cap_bytes: int | None = None,
                                    group=None) -> list:
    """Kind: build

    Data parallelism as DDP does it (Li et al. §3.2.2-3.2.3): gradients packed into buckets, each
    bucket all-reduced *asynchronously* the moment it is complete, while backward computes the
    rest; when backward returns, every ``param.grad`` is the average over the ranks of ``group``.

    Exercise 2 all-reduced every tensor alone (one latency each); here a whole bucket goes in one
    all-reduce. The pieces:

    - **The plan.** Take the parameters that require grad, in registration order
      (``model.parameters()``), and bucket them with your :func:`assign_buckets` on their gradient
      sizes in bytes (``p.numel() * p.element_size()``), caps ``cap_bytes`` and ``first_cap_bytes``:
      bucket 0 holds the last parameters, the ones whose gradients backward produces first.
    - **One flat buffer per bucket** (``torch.zeros`` of the bucket's total numel, the parameters'
      dtype): parameter k of the bucket owns a slice of it; ``flat[a:b].view_as(p)`` is a view you
      can write into and read from.
    - **A hook per parameter** (``register_post_accumulate_grad_hook``, as in exercise 2): copy
      ``p.grad / n`` into the parameter's slice and mark it ready. Then launch, in bucket order,
      every bucket that is complete and not yet launched: ``comm.all_reduce(flat, group=group,
      async_op=True)``, keeping the work. **Never launch bucket j + 1 before bucket j**, even when
      it is complete first: every rank must issue the same collectives in the same order, or the
      ring pairs one rank's bucket 1 with another's bucket 0.
    - **The end of backward.** The first hook of each backward queues a callback with
      ``torch.autograd.Variable._execution_engine.queue_callback(fn)``; it runs when backward has
      produced every gradient: wait for every launched work, copy each slice back into its
      ``p.grad`` (``p.grad.copy_(view)``), and reset the per-backward state (nothing ready, no
      bucket launched) so the next backward starts afresh.

    Return the hook handles (one per parameter that requires grad). Every parameter is assumed to
    get a gradient in every backward (no unused parameters), and all of them share one dtype.
    The tests compare the gradients and several SGD steps with a single process on the global
    batch and with ``torch.nn.parallel.DistributedDataParallel`` on 2 and 4 ranks, and count the
    all-reduces with ``comm.meter()``: one per bucket, each of the bucket's size, asynchronous, in
    bucket order, all but the last launched before backward reaches the first layer.
    """
    if not dist.is_initialized():
        raise RuntimeError("install_bucketed_gradient_hooks runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters with requires_grad=True: no gradients "
                         "to average")
    if len({(p.dtype, p.device) for p in params}) > 1:
        raise ValueError("all parameters must share one dtype and device (one flat buffer per bucket)")
    # BEGIN SOLUTION
    n = dist.get_world_size(group)
    plan = assign_buckets([p.numel() * p.element_size() for p in params], cap_bytes, first_cap_bytes)
    buckets = [[params[i] for i in b] for b in plan]
    flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in buckets]
    views, bucket_of = {}, {}
    for j, (b, flat) in enumerate(zip(buckets, flats)):
        offset = 0
        for p in b:
            views[id(p)], bucket_of[id(p)] = flat[offset:offset + p.numel()].view_as(p), j
            offset += p.numel()
    state = {"ready": [0] * len(buckets), "works": [], "started": False}

    def finish():  # the autograd engine calls it once backward has produced every gradient
        for work in state["works"]:
            work.wait()
        for p in params:
            p.grad.copy_(views[id(p)])
        state.update(ready=[0] * len(buckets), works=[], started=False)

    def on_grad(p):
        if not state["started"]:  # the first gradient of this backward
            state["started"] = True
            torch.autograd.Variable._execution_engine.queue_callback(finish)
        torch.div(p.grad, n, out=views[id(p)])
        state["ready"][bucket_of[id(p)]] += 1
        launched = len(state["works"])  # buckets 0 .. launched-1 are on their way
        while launched < len(buckets) and state["ready"][launched] == len(buckets[launched]):
            state["works"].append(comm.all_reduce(flats[launched], group=group, async_op=True))
            launched += 1

    return [p.register_post_accumulate_grad_hook(on_grad) for p in params]
    # END SOLUTION


# --- 5. predict, then count, the traffic of a DDP step -----------------------------------------------


def predict_and_meter_ddp_traffic(model: nn.Module, micro_batches, bucket_cap_mb: float,
                                  first_bucket_mb: float, no_sync: bool = True) -> dict:
    """Kind: measure

    Predict the all-reduces of one optimizer step of the course's DDP
    (``minitorch_dist.parallelism.data_parallel.DistributedDataParallel``) with gradient
    accumulation over k = ``len(micro_batches)`` micro-batches, then run the step and count them.
    Call it on every rank (inside ``launch``).

    ``model(x, y)`` returns ``(logits, loss)`` like the course GPT; ``micro_batches`` is this rank's
    list of ``(x, y)``. Return::

        {"predicted": {"all_reduce_bytes": [S_0, S_1, ...], "wire_bytes": w},
         "measured":  {"all_reduce_bytes": [...],           "wire_bytes": w'}}

    ``all_reduce_bytes`` lists the size S of each all-reduce of the step in the order they run,
    ``wire_bytes`` what this rank sends for them in all.

    **Predict** before running anything. DDP buckets the gradients of the parameters that require
    grad with the rule of :func:`assign_buckets` (your exercise 1), caps ``bucket_cap_mb`` and
    ``first_bucket_mb`` in MiB (``int(mb * 2**20)`` bytes, as torch's DDP counts them); each backward
    that synchronises all-reduces every bucket once, in bucket order. With ``no_sync=True`` only the
    last of the k backward passes synchronises (the first k-1 run under ``ddp.no_sync()``); with
    ``no_sync=False`` all k do. Each all-reduce of S bytes makes a rank send 2(n-1)/n * S (the ring's
    bus-bandwidth factor, chapter 00).

    **Measure**: wrap the model (``DistributedDataParallel(model, bucket_cap_mb=...,
    first_bucket_mb=...)``), then, inside ``with comm.meter() as m:``, run the k forward and backward
    passes (loss / k each, ``ddp.no_sync()`` around the first k-1 when ``no_sync``). The meter's
    all-reduce events (``e.op == "all_reduce"``) give each size (``e.nbytes``); their
    ``e.wire_bytes`` add up to what the rank sent.

    **How close.** Counted quantities: the sizes must match exactly, the wire bytes to 1e-9
    relative (a float sum). The tests run your function inside their own meter, so the measured
    numbers must be what really ran.
    """
    if not dist.is_initialized():
        raise RuntimeError("predict_and_meter_ddp_traffic runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    from minitorch_dist.parallelism.data_parallel import DistributedDataParallel

    n, k = dist.get_world_size(), len(micro_batches)
    # BEGIN SOLUTION
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    plan = assign_buckets(sizes, int(bucket_cap_mb * 2**20), int(first_bucket_mb * 2**20))
    per_backward = [sum(sizes[i] for i in b) for b in plan]
    synced = 1 if no_sync else k  # backward passes that all-reduce
    predicted = per_backward * synced
    out = {"predicted": {"all_reduce_bytes": predicted,
                         "wire_bytes": sum(2 * (n - 1) / n * S for S in predicted)}}

    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    with comm.meter() as m:
        for i, (x, y) in enumerate(micro_batches):
            with ddp.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext():
                _, loss = ddp(x, y)
                (loss / k).backward()
    reduces = [e for e in m.events if e.op == "all_reduce"]
    out["measured"] = {"all_reduce_bytes": [e.nbytes for e in reduces],
                       "wire_bytes": sum(e.wire_bytes for e in reduces)}
    return out
    # END SOLUTION
