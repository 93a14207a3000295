"""Wrong: scales by the largest magnitude (the ∞-norm) instead of the 2-norm.

A legitimate design (TernGrad and QSGD's variants use it) with smaller variance; but it is another
quantiser: the levels and the norms sent are not QSGD's.
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
    norms = padded.view(n_buckets, d).abs().amax(dim=1)  # zeros never add to a norm
    per_entry = norms.repeat_interleave(d)[: flat.numel()]
    safe = torch.where(per_entry > 0, per_entry, torch.ones_like(per_entry))
    a = torch.where(per_entry > 0, flat.abs() / safe * levels, torch.zeros_like(flat))
    lower = a.floor()
    up = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype).reshape(-1) < (a - lower)
    level = (lower + up.to(v.dtype)).clamp_(max=levels)  # |v_i| <= its norm: a <= s up to rounding
    q = (torch.sign(flat) * level).to(qdtype).view(v.shape)
    return (norms[0] if bucket is None else norms), q
