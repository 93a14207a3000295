"""Wrong: returns norm · q, forgetting the division by s.

The levels are integers in [−s, s]; without the 1/s every estimate is s times too large.
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
        return norm.to(dtype) * q.to(dtype)
    per_entry = norm.to(dtype).repeat_interleave(bucket)[: q.numel()].view(q.shape)
    return per_entry * q.to(dtype)
