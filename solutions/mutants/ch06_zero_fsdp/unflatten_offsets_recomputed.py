"""Wrong: recomputes each offset as the sum of the numels before it, ignoring the layout's offsets.

Right for the end-to-end layout (align = 1); with alignment gaps every tensor after the first is read
from the wrong place.
"""
import math

import torch


def unflatten(flat: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D buffer, got shape {tuple(flat.shape)}")
    for offset, shape in layout:
        if offset < 0 or offset + math.prod(shape) > flat.numel():
            raise ValueError("flat and layout come from different buffers")
    out, offset = [], 0
    for _, shape in layout:
        k = math.prod(shape)
        out.append(flat[offset:offset + k].view(shape))
        offset += k
    return out
