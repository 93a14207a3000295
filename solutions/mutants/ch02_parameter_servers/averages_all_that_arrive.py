"""Wrong: averages every gradient that arrives, not the first k.

Equal to the first k whenever exactly k arrive; with more arrivals than k the stragglers the
backup workers were meant to cut are averaged in after all.
"""
import math

import torch


def backup_workers_aggregate(grads_with_arrival_times, k: int) -> tuple[torch.Tensor, list[int]]:

    items = list(grads_with_arrival_times)
    n = len(items)
    if n == 0:
        raise ValueError("no gradients: pass one (gradient, arrival_time) pair per worker")
    if int(k) != k or not 1 <= k <= n:
        raise ValueError(f"k must be a whole number in 1..{n} (the number of gradients to average), got {k}")
    grads = [g for g, _ in items]
    if any(g.shape != grads[0].shape for g in grads):
        raise ValueError(f"all gradients must have one shape, got {sorted({tuple(g.shape) for g in grads})}")
    times = [float(t) for _, t in items]
    if any(t != t for t in times):
        raise ValueError("an arrival time is NaN")
    arrived = sum(t < math.inf for t in times)
    if arrived < k:
        raise RuntimeError(f"only {arrived} of {n} gradients arrive but k={k} are needed: "
                           "the step cannot complete (lower k or add backup workers)")
    order = sorted(range(n), key=lambda w: (times[w], w))
    used = [w for w in order if times[w] < math.inf]
    mean = torch.stack([grads[w] for w in used]).mean(dim=0)
    return mean, sorted(order[k:])
