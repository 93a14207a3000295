"""Wrong: predicts with checkpoint_last=True (every segment checkpointed), the cost model's default.

The library's policy runs the last segment normally; the prediction then counts its input instead of
its layers and one segment too many recomputed.
"""
from collections.abc import Callable

import torch
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.memory.checkpointing import apply_recompute, count_forwards


def meter_recompute(make_model: Callable[[int], nn.Module], n_layers: int, segments: int,
                    idx: torch.Tensor, targets: torch.Tensor) -> dict:
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n_layers:
        raise ValueError(f"segments must be an int in [1, n_layers={n_layers}], got {segments!r}")
    if n_layers % segments:
        raise ValueError(f"segments={segments} does not divide n_layers={n_layers}: use equal segments here "
                         "(with unequal ones the peak can fall in an earlier segment, after the head has "
                         "freed its part)")
    one, two = (_peak_activations(make_model(n), idx, targets) for n in (1, 2))
    L, model = two - one, make_model(1)
    rest = one - L
    b = idx.numel() * model.cfg.n_embd * 4  # the fp32 hidden state entering a block
    sizes = costmodel.segment_sizes(n_layers, segments)
    chain = costmodel.checkpoint_saved_bytes(n_layers, L, b, segments)
    predicted = {"peak": rest + chain, "recomputed": n_layers}
    model = apply_recompute(make_model(n_layers), "sqrt", segments)
    with count_forwards(model.blocks) as runs:
        peak = _peak_activations(model, idx, targets)
    measured = {"peak": peak, "recomputed": sum(runs.values()) - n_layers}
    return {"L": L, "b": b, "rest": rest, "predicted": predicted, "measured": measured}
