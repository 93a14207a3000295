"""Wrong: rolls with torch.roll(h, -1) and no dims, as for one tensor's window.

For a 1-D window it is right. For the (L, T) layout torch.roll without dims flattens the tensor: the
amaxes move across columns, one tensor's amax turning up in its neighbour's window.
"""
import torch


def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int = 0,
                           algo: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(amax_history, torch.Tensor) or amax_history.dim() not in (1, 2) \
            or amax_history.shape[0] < 1:
        raise ValueError("amax_history must be a 1-D (L,) or 2-D (L, T) tensor with at least one slot, got "
                         f"{getattr(amax_history, 'shape', type(amax_history).__name__)}")
    if not isinstance(scale, torch.Tensor) or scale.shape != amax_history.shape[1:]:
        raise ValueError(f"scale must have shape {tuple(amax_history.shape[1:])}, one per column of "
                         f"amax_history (a 0-dim tensor for a 1-D history), got {scale!r}")
    if not (isinstance(fp8_max, (int, float)) and fp8_max > 0):
        raise ValueError(f"fp8_max must be a positive number (448 for E4M3, 57344 for E5M2), got {fp8_max!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    history, scale = amax_history.float(), scale.float()
    amax = history.max(dim=0).values if algo == "max" else history[0]  # per column (NaN propagates)
    fresh = torch.full_like(amax, fp8_max) / amax / 2.0 ** margin
    new_scale = torch.where((amax > 0) & torch.isfinite(amax), fresh, scale)
    new_history = torch.roll(history, -1)  # along the slots; a new tensor: the input is untouched
    new_history[0] = 0.0
    return new_history, new_scale
