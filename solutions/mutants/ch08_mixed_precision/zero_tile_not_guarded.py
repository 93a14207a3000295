"""Wrong: divides by the tile's amax without guarding all-zero tiles.

Real activations are rarely all zero, so the guard looks like decoration; a zero tile (padding, a dead
channel group) gets scale inf, 0 * inf is NaN, and the tile comes back NaN.
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
    amax = padded.view(M, n_tiles, tile).amax(dim=-1)
    scales = torch.full_like(amax, E4M3_MAX) / amax
    if power_of_two:
        _, exponent = torch.frexp(scales)
        scales = torch.ldexp(torch.ones_like(scales), exponent - 1)
    per_element = scales.repeat_interleave(tile, dim=1)[:, :K]
    q = (x.float() * per_element).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales
