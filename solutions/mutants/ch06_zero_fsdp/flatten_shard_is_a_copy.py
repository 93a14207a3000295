"""Wrong: returns the shard as a copy of its slice, not a view into the buffer.

Its values are right; but a rank that writes its updated shard (an optimizer step on the shard)
no longer writes into the flat buffer that is gathered and unflattened.
"""
import math

import torch


def flatten_and_partition(tensors: list[torch.Tensor], n: int, rank: int,
                          align: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Size]]]:
    tensors = list(tensors)
    if not tensors:
        raise ValueError("flatten_and_partition needs at least one tensor")
    if n < 1:
        raise ValueError(f"the world size n must be >= 1, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a world of n={n} ranks (0 <= rank < n)")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    if len({t.dtype for t in tensors}) != 1:
        raise ValueError("one flat buffer holds one dtype")
    layout, offset = [], 0
    for t in tensors:
        offset = math.ceil(offset / align) * align
        layout.append((offset, t.shape))
        offset += t.numel()
    s = math.ceil(offset / (n * align)) * align
    flat = torch.zeros(n * s, dtype=tensors[0].dtype, device=tensors[0].device)
    for t, (o, _) in zip(tensors, layout):
        flat[o:o + t.numel()].copy_(t.reshape(-1))
    return flat, flat[rank * s:(rank + 1) * s].clone(), layout
