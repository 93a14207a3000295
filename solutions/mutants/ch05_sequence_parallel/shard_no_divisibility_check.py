"""Wrong: slices ``rank::t`` without checking that t divides the sequence.

The stripes are right whenever they are even; for a ragged length the first ranks get one position
more than the others, and the ring's equal-shape messages break far from the cause.
"""
import torch


def striped_rank_shard(x: torch.Tensor, t: int, rank: int, dim: int = 1) -> torch.Tensor:
    if t < 1 or not 0 <= rank < t:
        raise ValueError(f"need t >= 1 and 0 <= rank < t, got t={t}, rank={rank}")
    seq = x.shape[dim]
    return x.index_select(dim, torch.arange(rank, seq, t))
