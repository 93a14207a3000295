"""Wrong: rounds each |v_i| / ||v|| · s to the nearest level, deterministically.

Less noise per step, which is tempting; but it is biased (small entries always round to 0), so the
estimate's mean is not v and SGD on it does not converge to the same point.
"""
import torch


def qsgd_quantize(v: torch.Tensor, levels: int, generator: torch.Generator | None = None,
                  bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise ValueError(f"levels must be an int >= 1 (s in the paper), got {levels!r}")
    if not v.is_floating_point():
        raise TypeError(f"v must be a floating-point tensor, got {v.dtype}")
    if bucket is not None and (isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1):
        raise ValueError(f"bucket must be an int >= 1 (d in the paper) or None (one bucket), got {bucket!r}")
    qdtype = torch.int8 if levels <= 127 else torch.int32
    flat = v.reshape(-1)
    d = flat.numel() if bucket is None else bucket
    n_buckets = max(1, -(-flat.numel() // d))
    padded = flat.new_zeros(n_buckets * d)
    padded[: flat.numel()] = flat
    norms = torch.linalg.vector_norm(padded.view(n_buckets, d), dim=1)  # zeros never add to a norm
    per_entry = norms.repeat_interleave(d)[: flat.numel()]
    safe = torch.where(per_entry > 0, per_entry, torch.ones_like(per_entry))
    a = torch.where(per_entry > 0, flat.abs() / safe * levels, torch.zeros_like(flat))
    lower = a.floor()
    up = (a - lower) >= 0.5
    level = (lower + up.to(v.dtype)).clamp_(max=levels)  # |v_i| <= its norm: a <= s up to rounding
    q = (torch.sign(flat) * level).to(qdtype).view(v.shape)
    return (norms[0] if bucket is None else norms), q
