"""Wrong: aligns every tensor but not the shards: S = ceil(end / n).

Each tensor starts on a multiple of align, so the layout looks right, and with align = 1 it is; but a
shard of ceil(end/n) elements leaves every shard after the first starting off the alignment.
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
    s = math.ceil(offset / n)  # equal shards, but not a multiple of align
    flat = torch.zeros(n * s, dtype=tensors[0].dtype, device=tensors[0].device)
    for t, (o, _) in zip(tensors, layout):
        flat[o:o + t.numel()].copy_(t.reshape(-1))
    return flat, flat[rank * s:(rank + 1) * s], layout
