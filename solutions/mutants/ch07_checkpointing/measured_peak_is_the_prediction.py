"""Wrong: reports the cost model's prediction as the measurement: a formula dressed as a measurement.

For equal segments Chen's chain, calibrated on plain models, is exact to the byte here, so a check that
compares numbers only cannot tell. But the checkpointed model never ran: the "measurement" cannot
disagree with the model, which is what a measurement is for.
"""
from collections.abc import Callable

import torch
from torch import nn

from minitorch_dist import costmodel


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
    chain = costmodel.checkpoint_saved_bytes(n_layers, L, b, segments, checkpoint_last=False)
    predicted = {"peak": rest + chain, "recomputed": n_layers - sizes[-1]}
    measured = dict(predicted)
    return {"L": L, "b": b, "rest": rest, "predicted": predicted, "measured": measured}
