"""Wrong: takes ceil(x / n) as x // n + 1.

The same on every ragged size, so most cases pass; when the elements divide evenly every shard gets
one element too many and the buffer n elements of padding it should not have.
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
    s = (offset // (n * align) + 1) * align  # "round up"
    flat = torch.zeros(n * s, dtype=tensors[0].dtype, device=tensors[0].device)
    for t, (o, _) in zip(tensors, layout):
        flat[o:o + t.numel()].copy_(t.reshape(-1))
    return flat, flat[rank * s:(rank + 1) * s], layout
