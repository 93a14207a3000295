"""Wrong: folds the ragged tail into the last full bucket (floor(n / d) buckets), not a bucket of its own.

Avoiding a tiny last bucket looks tidy and saves a float; but the receiver, which cuts ceil(n / d)
buckets as the format says, reads one norm too few, and the last bucket is quantised against a norm
that is not the one the format promises.
"""
import torch


def qsgd_quantize(v: torch.Tensor, levels: int, generator: torch.Generator | None = None,
                  bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    flat = v.reshape(-1)
    qdtype = torch.int8 if levels <= 127 else torch.int32
    d = flat.numel() if bucket is None else bucket
    n_buckets = max(1, flat.numel() // d)
    sizes = [d] * (n_buckets - 1) + [flat.numel() - d * (n_buckets - 1)]
    norms = torch.stack([torch.linalg.vector_norm(part) for part in flat.split(sizes)])
    per_entry = norms.repeat_interleave(torch.tensor(sizes))
    safe = torch.where(per_entry > 0, per_entry, torch.ones_like(per_entry))
    a = torch.where(per_entry > 0, flat.abs() / safe * levels, torch.zeros_like(flat))
    lower = a.floor()
    up = torch.rand(v.shape, generator=generator, device=v.device, dtype=v.dtype).reshape(-1) < (a - lower)
    level = (lower + up.to(v.dtype)).clamp_(max=levels)
    q = (torch.sign(flat) * level).to(qdtype).view(v.shape)
    return (norms[0] if bucket is None else norms), q
