"""Wrong: strides along dimension 1 whatever ``dim`` says.

The default dim is 1, so the hand-worked case and every (B, S, ...) tensor pass; a sequence along
another dimension is sliced along the wrong one.
"""
import torch


def striped_rank_shard(x: torch.Tensor, t: int, rank: int, dim: int = 1) -> torch.Tensor:
    if t < 1 or not 0 <= rank < t:
        raise ValueError(f"need t >= 1 and 0 <= rank < t, got t={t}, rank={rank}")
    seq = x.shape[dim]
    if seq % t:
        raise ValueError(f"sequence length {seq} is not divisible by t={t} (striping deals it out evenly); "
                         "pad it")
    return x[:, rank::t].contiguous()
