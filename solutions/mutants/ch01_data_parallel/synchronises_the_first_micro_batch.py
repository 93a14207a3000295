"""Wrong: synchronises the first micro-batch and runs the rest under no_sync().

One all-reduce, as asked, but of the first micro-batch's gradient alone: the later micro-batches
accumulate locally after it, so each rank ends with a different gradient.
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
        skip_sync = no_sync and i > 0
        with model.no_sync() if skip_sync else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets)
            (loss * (len(inputs) / rows)).backward()  # its rows' share of the mean over all rows
        total += loss.item() * len(inputs)
    return total / rows
