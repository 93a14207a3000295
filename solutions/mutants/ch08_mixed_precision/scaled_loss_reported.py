"""Wrong: reports the scaled loss (loss / k * S, the tensor backward started from), times k.

It is the loss the code has at hand after scaler.scale(...).backward(), and without a scaler it is
right; with one, every reported loss is S times too large and jumps when S changes.
"""
import math

import torch
from torch import nn


def train_with_loss_scaling(model: nn.Module, steps, make_optimizer, scaler=None,
                            dtype: torch.dtype = torch.float16, loss_fn=None,
                            max_norm: float | None = None) -> dict:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "unscale_", "step", "update")):
        raise TypeError("scaler must have GradScaler's scale/unscale_/step/update, got "
                        f"{type(scaler).__name__}")
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and 0 < max_norm < math.inf):
        raise ValueError(f"max_norm must be None (no clipping) or a finite number > 0, got {max_norm!r}")
    steps = _checked_steps(steps)
    loss_fn = loss_fn or fp32_cross_entropy
    half = half_precision_copy(model, dtype)
    half_params = list(half.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    optimizer = make_optimizer(masters)
    losses, applied, grad_norms = [], [], []
    for step in steps:
        k, step_losses = len(step), []
        for x, y in step:
            loss = loss_fn(half, x, y)
            part = loss / k
            part = scaler.scale(part) if scaler is not None else part
            part.backward()
            for m, h in zip(masters, half_params):  # fold into fp32 now: never summed in half
                if h.grad is not None:
                    g = h.grad.float()
                    m.grad = g if m.grad is None else m.grad.add_(g)
                    h.grad = None
            step_losses.append(part.item() * k)
        # the scaler's verdict: it looks at these (scaled, fp32) gradients for inf and NaN
        finite = all(bool(torch.isfinite(m.grad).all()) for m in masters if m.grad is not None)
        if scaler is not None:
            scaler.unscale_(optimizer)  # the true gradients, before the clip reads them
        norm = None if max_norm is None else float(torch.nn.utils.clip_grad_norm_(masters, max_norm))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        with torch.no_grad():
            for m, h in zip(masters, half_params):
                h.copy_(m)  # the rounded master is what the next forward sees
                m.grad = None
        losses.append(sum(step_losses) / k)
        applied.append(finite or scaler is None)
        grad_norms.append(norm)
    return {"losses": losses, "applied": applied, "grad_norms": grad_norms, "masters": masters,
            "half_model": half}
