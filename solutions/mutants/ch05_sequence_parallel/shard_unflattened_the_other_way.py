"""Wrong: unflattens the sequence as (t, S/t) and picks row ``rank``: a contiguous piece, not a stripe.

The reshape-and-select idea is right and the shape is right; but position j*t + r sits at (j, r) of
an (S/t, t) view, not of a (t, S/t) one.
"""
import torch


def striped_rank_shard(x: torch.Tensor, t: int, rank: int, dim: int = 1) -> torch.Tensor:
    if t < 1 or not 0 <= rank < t:
        raise ValueError(f"need t >= 1 and 0 <= rank < t, got t={t}, rank={rank}")
    seq = x.shape[dim]
    if seq % t:
        raise ValueError(f"sequence length {seq} is not divisible by t={t} (striping deals it out evenly); "
                         "pad it")
    dim = dim % x.dim()
    return x.unflatten(dim, (t, seq // t)).select(dim, rank).contiguous()
