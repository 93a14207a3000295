"""Wrong: takes the views through ``flat.data``, out of autograd's sight.

The views share the storage, so writes show in both directions; but the gradient of a parameter
never reaches the flat buffer's gradient, the one the reduce-scatter sends.
"""
import math

import torch


def unflatten(flat: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D buffer, got shape {tuple(flat.shape)}")
    for offset, shape in layout:
        if offset < 0 or offset + math.prod(shape) > flat.numel():
            raise ValueError("flat and layout come from different buffers")
    return [flat.data[o:o + math.prod(shape)].view(shape) for o, shape in layout]
