"""Wrong: an overflow shrinks the scale but leaves the count of clean steps where it was.

"Clean steps in a row" is easy to read as "clean steps so far": the scale then grows again soon after
a backoff, sooner than GradScaler's, and the scales drift apart from the first overflow on.
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
        return min(scale, max(_fp32(scale * backoff_factor), _fp32(min_scale))), growth_tracker
    clean = growth_tracker + 1
    if clean < growth_interval:
        return scale, clean
    grown = _fp32(scale * growth_factor)
    return (grown if math.isfinite(grown) else scale), 0
