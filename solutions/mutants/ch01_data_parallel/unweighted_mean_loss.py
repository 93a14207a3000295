"""Wrong: returns the mean of the micro-batch losses, unweighted.

The gradients are right; the loss it reports is the mean of the k means, which differs from the
mean over all rows as soon as the micro-batches differ in size.
"""
import contextlib

from torch import nn


def accumulate_gradients(model: nn.Module, loss_fn, micro_batches, no_sync: bool = True) -> float:

    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    if no_sync and not hasattr(model, "no_sync"):
        raise TypeError(f"{type(model).__name__} has no no_sync(); wrap the model in "
                        "torch.nn.parallel.DistributedDataParallel (or pass no_sync=False)")
    k = len(micro_batches)
    rows = sum(len(inputs) for inputs, _ in micro_batches)
    total = 0.0
    for i, (inputs, targets) in enumerate(micro_batches):
        skip_sync = no_sync and i < k - 1  # only the last backward all-reduces
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets)
            (loss * (len(inputs) / rows)).backward()  # its rows' share of the mean over all rows
        total += loss.item()
    return total / k
