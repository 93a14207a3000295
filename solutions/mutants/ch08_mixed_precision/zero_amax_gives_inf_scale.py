"""Wrong: computes the new scale from any amax, with no guard for an amax of 0 or not finite.

Early steps (an empty window) and all-zero tensors have amax 0: the scale becomes inf, and the next
cast multiplies by inf.
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
    new_scale = fresh
    new_history = torch.roll(history, -1, dims=0)  # along the slots; a new tensor: the input is untouched
    new_history[0] = 0.0
    return new_history, new_scale
