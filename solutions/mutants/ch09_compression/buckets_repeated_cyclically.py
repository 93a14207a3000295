"""Wrong: spreads the bucket norms with repeat (cyclically), not repeat_interleave.

``norm.repeat(...)`` gives norms [a, b, a, b, ...] where each bucket needs [a, a, a, ..., b, b, b]: the
shapes agree and one bucket is right, every other entry is scaled by the wrong bucket's norm.
"""
import torch


def qsgd_dequantize(norm: torch.Tensor, q: torch.Tensor, levels: int,
                    dtype: torch.dtype = torch.float32, bucket: int | None = None) -> torch.Tensor:
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    if bucket is not None and norm.numel() != -(-q.numel() // bucket):
        raise ValueError(f"{norm.numel()} norms for {q.numel()} levels in buckets of {bucket}: expected "
                         f"ceil({q.numel()} / {bucket}); pass the bucket used to quantise")
    if bucket is None:
        return (norm.to(dtype) * q.to(dtype)) / levels
    per_entry = norm.to(dtype).repeat(bucket)[: q.numel()].view(q.shape)
    return (per_entry * q.to(dtype)) / levels
