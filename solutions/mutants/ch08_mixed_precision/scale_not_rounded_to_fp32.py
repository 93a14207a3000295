"""Wrong: keeps the scale as a Python (float64) number instead of rounding every new scale to fp32.

With the default factors 2 and 0.5 nothing changes: powers of two are exact. With other factors
(GradScaler allows any) the float64 scale drifts away from GradScaler's fp32 one, a little per step.
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
        return min(scale, max(scale * backoff_factor, min_scale)), 0
    clean = growth_tracker + 1
    if clean < growth_interval:
        return scale, clean
    grown = scale * growth_factor
    return (grown if grown < 3.4028234663852886e38 else scale), 0
