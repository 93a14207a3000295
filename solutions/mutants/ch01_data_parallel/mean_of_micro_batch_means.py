"""Wrong: scales each micro-batch's loss by 1/k: the mean of the micro-batch means.

Right when the micro-batches are equal. With a short micro-batch (3, 1 and 2 rows) its single row
weighs as much as the 3 rows of the first: not the gradient of the mean over all rows.
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
            (loss / k).backward()
        total += loss.item() * len(inputs)
    return total / rows
