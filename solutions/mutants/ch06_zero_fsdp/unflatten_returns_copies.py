"""Wrong: returns reshaped copies, not views into the buffer.

The round trip is exact, but an all-gather into the flat buffer no longer reaches the tensors.
"""
import math

import torch


def unflatten(flat: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D buffer, got shape {tuple(flat.shape)}")
    for offset, shape in layout:
        if offset < 0 or offset + math.prod(shape) > flat.numel():
            raise ValueError("flat and layout come from different buffers")
    return [flat[o:o + math.prod(shape)].reshape(shape).clone() for o, shape in layout]
