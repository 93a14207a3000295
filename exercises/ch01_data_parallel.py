# generated from solutions/ch01_data_parallel.py by `make exercises`: fill in each NotImplementedError
# fingerprint 3c200f1a42328ae3 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 01 exercises: data parallelism — gradient buckets, overlapped all-reduce, no_sync.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch01``.

All three follow Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training" (VLDB), the design of ``torch.nn.parallel.DistributedDataParallel`` (DDP):

1. :func:`assign_buckets`: group gradients into all-reduce buckets, in the order backward
   produces them (§3.2.2 "Gradient Bucketing", §3.2.3 on the reverse order).
2. :func:`install_gradient_averaging_hooks`: all-reduce each gradient the moment backward
   produces it, so communication overlaps the rest of backward (§3.2.3 "Overlap Computation
   with Communication"), without buckets, summing 16-bit gradients in float32.
3. :func:`accumulate_gradients`: gradient accumulation over micro-batches of any sizes with DDP's
   ``no_sync()``, one all-reduce per k micro-batches (§3.2.4 "Gradient Accumulation").
4. :func:`install_bucketed_gradient_hooks`: the two ideas together — gradients packed into
   buckets whose all-reduces are launched during backward, in bucket order, the buckets rebuilt
   after the first backward in the order the gradients arrived (§3.2.2-3.2.3).
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
    """Kind: derive · about 25 minutes

    Group parameters into all-reduce buckets; return the parameter indices of each bucket.

    One all-reduce per gradient pays the latency alpha once per tensor (a GPT has hundreds);
    one all-reduce of everything cannot start until backward has finished. DDP takes the middle
    road (§3.2.2): gradients are packed into buckets of about ``cap_bytes`` (DDP's
    ``bucket_cap_mb``, 25 MB by default) and a bucket is all-reduced as soon as all its gradients
    are ready. Backward produces gradients roughly in *reverse* registration order (the last
    layer's first), so buckets are filled in that order (§3.2.3), and the first bucket may use a
    smaller cap, ``first_cap_bytes`` (DDP uses 1 MB), so the first all-reduce starts early.

    ``param_sizes_bytes[i]`` is the gradient size of parameter i, in registration order. The
    buckets are filled greedily in the order n-1, n-2, ..., 0: a parameter joins the open bucket
    unless the bucket already holds something and would then exceed its cap (bucket 0:
    ``first_cap_bytes`` when given; every later one: ``cap_bytes``).

    **Your task:** return the buckets, a list of lists of indices, in the order they fill. Work
    out the edge cases from the rule before you code: a parameter larger than the cap, a first
    cap larger than the rest, zero-byte parameters, no parameters. The tests check hand-worked
    layouts, the rule on random models (``costmodel.bucket_assignment`` is the library's), and
    PyTorch's own assignment where the two rules agree.
    """
    sizes = [int(s) for s in param_sizes_bytes]
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be > 0, got {cap_bytes}")
    if first_cap_bytes is not None and first_cap_bytes <= 0:
        raise ValueError("first_cap_bytes must be > 0 (or None for no special first bucket), got "
                         f"{first_cap_bytes}")
    if any(s < 0 for s in sizes):
        raise ValueError(f"parameter sizes must be >= 0 bytes, got {sizes}")
    raise NotImplementedError("exercise: assign_buckets — see chapters/01_data_parallel.md")


# --- 2. overlapping the all-reduce with backward ------------------------------------------------


def install_gradient_averaging_hooks(model: nn.Module, group=None) -> list:
    """Kind: build · about 45 minutes

    Make every backward of ``model`` average its gradients over the ranks, as they are produced,
    summing 16-bit gradients in float32.

    Data parallelism in its simplest overlapped form: each rank runs forward and backward on its
    slice of the global batch, and the gradient of the *global* mean loss is the mean over ranks
    of the local gradients, ``g = (1/n) sum_r g_r``. Start each parameter's all-reduce the moment
    autograd has accumulated its gradient, while backward goes on computing the earlier layers'
    (Li et al. 2020 §3.2.3), one tensor at a time (no buckets).

    A bfloat16 or float16 gradient summed in its own dtype rounds at every partial sum of the
    ring: on n ranks the average is rounded up to n times instead of once, and where the ranks'
    gradients cancel the error is large next to the result (Micikevicius et al. 2018 §3.2 keep
    reductions in fp32 for this reason). So here the reduction runs in float32 *at least*: a
    16-bit gradient is all-reduced as a float32 copy and rounded to its dtype once, at the end;
    float32 and float64 gradients are all-reduced in their own dtype.

    **Interface.** Register a hook on every parameter that requires grad (tied parameters once:
    ``model.parameters()`` lists them once) and return the handles, one per such parameter;
    ``handle.remove()`` on all of them makes backward local again. When ``loss.backward()``
    returns, each ``param.grad`` (in the parameter's dtype) is the average over the ranks of
    ``group``. Raises ``RuntimeError`` outside ranks.

    **What the tests check**, on 2 and 4 ranks: float64 gradients equal to one process on the
    global batch; bfloat16 gradients within one bfloat16 rounding (plus float32 reordering) of the
    exact average of the ranks' local gradients, which an all-reduce in bfloat16 misses; exactly
    one ``comm.all_reduce`` per parameter through ``comm`` (the tests meter it), of
    ``numel * max(element_size, 4)`` bytes; every all-reduce launched inside ``backward()``, all
    but the first layer's launched before backward reaches the first layer.

    ``Tensor.register_post_accumulate_grad_hook(hook)`` calls ``hook(param)`` right after
    ``param.grad`` has been written during backward. The chapter's exercise section has graded
    hints.

    Reference: ``minitorch_dist/parallelism/data_parallel.py`` (``DistributedDataParallel``
    hooks, buckets and waits in the gradient's own dtype; you go per tensor and sum 16-bit
    gradients in float32).
    """
    if not dist.is_initialized():
        raise RuntimeError("install_gradient_averaging_hooks runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    raise NotImplementedError("exercise: install_gradient_averaging_hooks — see chapters/01_data_parallel.md")


# --- 3. gradient accumulation with no_sync --------------------------------------------------------


def accumulate_gradients(model: nn.Module, loss_fn, micro_batches, no_sync: bool = True) -> float:
    """Kind: build · about 35 minutes

    Forward and backward over k micro-batches *of any sizes*, accumulating the gradient of the
    mean loss over all their rows, with one all-reduce for the k of them.

    When the batch that converges well does not fit in memory, split it into micro-batches and
    let ``.grad`` accumulate over k backward passes (Li et al. 2020 §3.2.4). Under DDP every
    backward all-reduces the gradients, although only the accumulated sum is needed:
    ``with model.no_sync():`` turns the all-reduce off for the forward and backward inside it,
    and the next synchronised backward all-reduces what has accumulated. The last micro-batch of
    a data loader is often short, so the micro-batches here may have different numbers of rows.

    ``model`` is wrapped in ``torch.nn.parallel.DistributedDataParallel``; ``micro_batches`` is a
    sequence of ``(inputs, targets)``, the rows along dim 0; ``loss_fn(model(inputs), targets)``
    is the *mean* loss over one micro-batch's rows. With ``no_sync=False``, synchronise on every
    micro-batch instead (the same gradients, k times the communication: the baseline).

    **Your task:** leave in ``.grad`` (added to whatever is there: the caller zeroes it) the
    gradient of the mean loss over *all rows* of the k micro-batches, averaged over the ranks by
    DDP; return that mean loss over all rows as a float. Each rank is assumed to hold the same
    number of rows in all, so DDP's average over ranks is the global batch's mean.

    **What the tests check**, on 2 and 4 ranks with micro-batches of 3, 1 and 2 rows (and equal
    ones): the gradients equal to one process on the global batch (float64); the returned loss;
    with ``no_sync=True`` no gradient communicated before the last micro-batch's forward and every
    gradient element all-reduced exactly once; with ``no_sync=False`` once per micro-batch.

    Reference: ``minitorch_dist/parallelism/data_parallel.py`` (``no_sync`` and what DDP does
    with an accumulated gradient; you weight unequal micro-batches).
    """
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    if no_sync and not hasattr(model, "no_sync"):
        raise TypeError(f"{type(model).__name__} has no no_sync(); wrap the model in "
                        "torch.nn.parallel.DistributedDataParallel (or pass no_sync=False)")
    raise NotImplementedError("exercise: accumulate_gradients — see chapters/01_data_parallel.md")


# --- 4. bucketed DDP with overlap -------------------------------------------------------------------


def install_bucketed_gradient_hooks(model: nn.Module, cap_bytes: int, first_cap_bytes: int | None = None,  # noqa: C901
                                    group=None) -> list:
    """Kind: build · about 90 minutes

    Bucketed data parallelism whose buckets follow the order gradients really arrive: DDP with
    overlap (Li et al. 2020 §3.2.2-3.2.3), plus the *bucket rebuild* of torch's DDP.

    Buckets are filled in the order gradients are expected to become ready. Reverse registration
    order is a guess, and a wrong one for a model whose modules are registered in another order
    than they run (a head registered first, an encoder built last, a parameter shared by two
    layers): bucket 0 then waits for a gradient that comes last, and no all-reduce overlaps
    backward at all. torch's DDP fixes this by recording the order gradients arrive in the first
    backward and rebuilding its buckets in that order (§3.2.3, "the order of ... can be different
    across iterations": it rebuilds once).

    **What it must do.** Every backward of ``model`` leaves in each ``param.grad`` the average over
    the ranks of ``group``, with the gradients packed into buckets, each bucket all-reduced
    asynchronously (``comm.all_reduce(..., async_op=True)``, one call per bucket) while backward
    goes on:

    - **The first backward** uses the buckets of :func:`assign_buckets` on the gradient sizes in
      bytes in registration order (``model.parameters()``, those that require grad), caps
      ``cap_bytes`` and ``first_cap_bytes``.
    - **After the first backward** (once, when its gradients are averaged), rebuild the buckets
      with the same rule and caps, filled in the order the gradients arrived in that backward
      *on group rank 0*: ranks may see other orders (branches run in a rank-dependent order), and
      every rank must bucket the same way. Send the order with exactly one ``comm.broadcast``.
      Every later backward uses the rebuilt buckets.
    - **Every rank issues the same collectives in the same order**: never launch bucket j + 1
      before bucket j, even when it is complete first, or the ring pairs one rank's bucket 1
      with another's bucket 0.
    - A backward ends when autograd has produced every gradient (not when some particular
      parameter's gradient arrives); each backward starts afresh.

    **Interface.** Return the hook handles, one per parameter that requires grad. Every such
    parameter gets a gradient in every backward (no unused parameters), and all share one dtype
    and device. Raises ``RuntimeError`` outside ranks and ``ValueError`` with no trainable
    parameter or mixed dtypes (the scaffolding below).

    **What the tests check**, on 2 and 4 ranks, in float64: the gradients and three SGD steps
    equal to one process on the global batch and to ``torch.nn.parallel.DistributedDataParallel``;
    with the comm meter, per backward: one async all-reduce per bucket, of the bucket's size, in
    bucket order, all but the last launched before backward reaches the first layer from the
    second backward on; the first backward's buckets in reverse registration order, then one
    broadcast; later backwards' buckets in the arrival order; on a model whose first-registered
    layer runs last, and on branches each rank runs in its own order.

    Reference: ``minitorch_dist/parallelism/data_parallel.py`` (``DistributedDataParallel``:
    buckets fixed at construction, launched in bucket order; you rebuild them after the first
    backward, as torch does).
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
    raise NotImplementedError("exercise: install_bucketed_gradient_hooks — see chapters/01_data_parallel.md")


# --- 5. predict, then count, the traffic of a DDP step -----------------------------------------------


def predict_and_meter_ddp_traffic(model: nn.Module, micro_batches, bucket_cap_mb: float,
                                  first_bucket_mb: float, no_sync: bool = True) -> dict:
    """Kind: measure · about 45 minutes

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

    **What the tests check**, on 2 ranks with the course GPT, with and without ``no_sync``: the
    predicted sizes exactly (against ``costmodel.bucket_assignment``), the wire bytes to 1e-9
    relative (a float sum); the measured sizes equal to the all-reduces the tests' own meter saw
    around your call (so a count computed from the prediction does not pass) and to the
    prediction.

    Reference: ``minitorch_dist/parallelism/data_parallel.py`` (the DDP you run: its buckets and
    ``no_sync``; you predict its traffic before you run it).
    """
    if not dist.is_initialized():
        raise RuntimeError("predict_and_meter_ddp_traffic runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    from minitorch_dist.parallelism.data_parallel import DistributedDataParallel

    n, k = dist.get_world_size(), len(micro_batches)
    raise NotImplementedError("exercise: predict_and_meter_ddp_traffic — see chapters/01_data_parallel.md")
