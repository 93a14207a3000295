"""Wrong: one scale per row (per token), not per 1 x tile tile.

Per-token scaling is the usual step up from per-tensor, and it is exact when a row has one tile; with
longer rows an outlier still squeezes every other channel of its token.
"""
import torch


def quantize_tiles_1x128(x: torch.Tensor, tile: int = 128,
                         power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens x channels), got shape {tuple(x.shape)}; "
                         f"reshape it with x.reshape(-1, x.shape[-1])")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int (DeepSeek-V3 uses 128), got {tile!r}")
    M, K = x.shape
    n_tiles = -(-K // tile)
    padded = x.new_zeros(M, n_tiles * tile, dtype=torch.float32)
    padded[:, :K] = x.float().abs()
    amax = padded.amax(dim=-1, keepdim=True).expand(M, n_tiles).contiguous()
    scales = torch.where(amax > 0, torch.full_like(amax, E4M3_MAX) / amax, torch.ones_like(amax))
    if power_of_two:
        _, exponent = torch.frexp(scales)
        scales = torch.ldexp(torch.ones_like(scales), exponent - 1)
    per_element = scales.repeat_interleave(tile, dim=1)[:, :K]
    q = (x.float() * per_element).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales
