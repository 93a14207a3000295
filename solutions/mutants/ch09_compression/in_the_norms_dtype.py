"""Wrong: computes and returns in the norm's dtype, ignoring ``dtype``.

For a float32 norm and the default dtype it is right; asked for float64 it returns float32, rounded.
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
        return (norm * q.to(norm.dtype)) / levels
    per_entry = norm.to(dtype).repeat_interleave(bucket)[: q.numel()].view(q.shape)
    return (per_entry * q.to(dtype)) / levels
