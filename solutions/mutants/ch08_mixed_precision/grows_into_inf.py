"""Wrong: grows the scale whenever the interval is reached, even past fp32's largest number.

The guard looks unnecessary (who trains with a scale near 3.4e38?), but a run whose gradients are all
zero for a while does exactly that: the scale becomes inf, scaled losses become inf or NaN, and every
later step is skipped.
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
        return min(scale, max(_fp32(scale * backoff_factor), _fp32(min_scale))), 0
    clean = growth_tracker + 1
    if clean < growth_interval:
        return scale, clean
    return _fp32(scale * growth_factor), 0
