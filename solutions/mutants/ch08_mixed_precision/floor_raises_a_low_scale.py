"""Wrong: applies the floor as max(S * backoff, min_scale), which raises a scale already below the floor.

It is Megatron's one-liner, and for a scale at or above the floor it is right. But a scale that starts
below the floor (a small init_scale) jumps *up* on an overflow: the step that overflowed doubles, say,
the scale that was already too large.
"""
import torch


def scaler_update(scale: float, growth_tracker: int, found_inf: bool, growth_factor: float = 2.0,
                  backoff_factor: float = 0.5, growth_interval: int = 2000,
                  min_scale: float = 0.0) -> tuple[float, int]:
    if isinstance(found_inf, torch.Tensor):
        found_inf = bool(found_inf.item())
    scale, growth_factor, backoff_factor = float(scale), float(growth_factor), float(backoff_factor)
    growth_tracker, growth_interval, min_scale = int(growth_tracker), int(growth_interval), float(min_scale)
    if found_inf:
        return max(_fp32(scale * backoff_factor), _fp32(min_scale)), 0
    clean = growth_tracker + 1
    if clean < growth_interval:
        return scale, clean
    grown = _fp32(scale * growth_factor)
    return (grown if math.isfinite(grown) else scale), 0
