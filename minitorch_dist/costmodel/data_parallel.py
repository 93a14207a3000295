"""Chapter 01 — data parallelism: gradient buckets and the overlapped all-reduce schedule of DDP.
"""
from __future__ import annotations

from .collectives import allreduce_time

# --- data parallelism (ch01) ----------------------------------------------------------------
#
# Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
# (VLDB): §3.2.2 gradient bucketing, §3.2.3 overlapping the all-reduces with backward.


def bucket_assignment(param_bytes, cap_bytes, first_cap_bytes=None, keys=None) -> list[list[int]]:
    """Cut a sequence of parameters into gradient buckets; return each bucket's indices.

    ``param_bytes`` lists the parameters' gradient sizes *in the order their gradients are
    expected to become ready* -- for DDP, reverse registration order (Li et al. 2020 §3.2.2-3.2.3:
    backward visits layers roughly in the reverse of the forward). The rule, greedy in one pass:

    * bucket 0 may hold ``first_cap_bytes`` (default ``cap_bytes``), every later one ``cap_bytes``;
    * a parameter joins the open bucket unless the bucket is non-empty and adding it would push
      the bucket past its cap (or its ``keys`` entry, e.g. its dtype, differs from the bucket's):
      then the open bucket closes and the parameter starts the next one;
    * so a parameter bigger than the cap gets a bucket of its own, and no bucket with two or more
      parameters exceeds its cap.

    (torch's ``_compute_bucket_assignment_by_size`` closes a bucket *after* it reaches the cap,
    so its buckets overshoot by up to one parameter, and keeps one open bucket per dtype.)
    ZeRO stage 2 cuts its buckets by another rule,
    :func:`~minitorch_dist.memory.zero.partition.bucket_ranges`: equal element ranges of the flat
    buffer, multiples of the world size that cut through parameters, because a reduce-scatter hands
    each rank one n-th of every bucket; an all-reduce needs no such cut, so here parameters stay whole.
    Returns ``[[i, ...], ...]``, indices into ``param_bytes``, in bucket order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if first_cap_bytes <= 0:
        raise ValueError(f"first bucket cap must be > 0 bytes, got {first_cap_bytes}")
    keys = [None] * len(param_bytes) if keys is None else list(keys)
    if len(keys) != len(param_bytes):
        raise ValueError(f"{len(param_bytes)} parameter sizes but {len(keys)} keys; "
                         "pass one key per parameter")
    buckets: list[list[int]] = []
    open_, open_bytes, open_key = [], 0, None
    for i, (nbytes, key) in enumerate(zip(param_bytes, keys)):
        if nbytes < 0:
            raise ValueError(f"parameter {i} has a negative size {nbytes}")
        cap = first_cap_bytes if not buckets else cap_bytes
        if open_ and (key != open_key or open_bytes + nbytes > cap):
            buckets.append(open_)
            open_, open_bytes = [], 0
        open_.append(i)
        open_bytes += nbytes
        open_key = key
    if open_:
        buckets.append(open_)
    return buckets


def bucket_sizes(param_bytes_in_reverse_order, cap_bytes, first_cap_bytes=None, keys=None) -> list[int]:
    """Bytes of each gradient bucket under the rule of :func:`bucket_assignment`.

    E.g. 4-byte parameters ``[4, 4, 4, 4]`` with a 4-byte first bucket and an 8-byte cap give
    ``[4, 8, 4]``. The number of all-reduces per step is ``len(bucket_sizes(...))``.
    """
    idx = bucket_assignment(param_bytes_in_reverse_order, cap_bytes, first_cap_bytes, keys)
    return [sum(param_bytes_in_reverse_order[i] for i in b) for b in idx]


def ddp_allreduce_schedule(t_forward, t_backward, bucket_bytes, n, alpha, beta) -> list[tuple]:
    """When each bucket's all-reduce becomes ready, starts and ends, overlapped with backward.

    Model (Li et al. 2020 §3.2.3; all-reduce cost :func:`allreduce_time`, ring alpha-beta):

    * backward produces gradient bytes at a constant rate, so bucket i is ready when the
      cumulative bytes of buckets 0..i have been produced:
      ``ready_i = t_f + t_b * (B_0 + ... + B_i) / (B_0 + ... + B_last)``  (an assumption: real
      layers differ in FLOPs per byte);
    * all-reduces run one at a time in bucket order (every rank must issue them in the same
      order), so ``start_i = max(ready_i, end_(i-1))`` and ``end_i = start_i + allreduce_time(B_i)``;
    * communication and computation do not slow each other down (separate engines/links).

    Returns ``[(ready_i, start_i, end_i), ...]`` in seconds from the start of forward.
    """
    if t_forward < 0 or t_backward < 0:
        raise ValueError(f"need t_forward, t_backward >= 0, got {t_forward}, {t_backward}")
    if any(b < 0 for b in bucket_bytes):
        raise ValueError("bucket sizes must be >= 0 bytes")
    total = float(sum(bucket_bytes))
    out, cum, prev_end = [], 0.0, 0.0
    for b in bucket_bytes:
        cum += b
        ready = t_forward + t_backward * (cum / total if total > 0 else 1.0)
        start = max(ready, prev_end)
        prev_end = start + allreduce_time(b, n, alpha, beta)
        out.append((ready, start, prev_end))
    return out


def ddp_step_time(t_forward, t_backward, bucket_bytes, n, alpha, beta, overlap=True) -> float:
    """Modelled time of one DDP step (forward + backward + gradient all-reduce), Li et al. 2020 §3.2.3.

    * ``overlap=True``: buckets are all-reduced during backward as they fill
      (:func:`ddp_allreduce_schedule`): ``T = max(t_f + t_b, end of the last all-reduce)``.
      Only the communication that outlasts backward is exposed; the last bucket's is always.
    * ``overlap=False`` (all-reduce after backward, bucket by bucket):
      ``T = t_f + t_b + sum_i allreduce_time(B_i)``.

    Fewer, larger buckets pay fewer alphas but start later: the bucket-size trade-off of the
    paper's §3.2.2 and its evaluation (§5).
    """
    if not overlap:
        if t_forward < 0 or t_backward < 0:
            raise ValueError(f"need t_forward, t_backward >= 0, got {t_forward}, {t_backward}")
        return t_forward + t_backward + sum(allreduce_time(b, n, alpha, beta) for b in bucket_bytes)
    sched = ddp_allreduce_schedule(t_forward, t_backward, bucket_bytes, n, alpha, beta)
    return max([t_forward + t_backward] + [end for _, _, end in sched])
