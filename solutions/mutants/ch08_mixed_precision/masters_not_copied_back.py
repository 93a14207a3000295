"""Wrong: steps the fp32 masters but never rounds them back into the half model.

The optimizer's state and the masters move, but every forward runs on the first step's half weights:
the loss does not follow the masters at all.
"""
import torch
from torch import nn

from minitorch_dist.memory.mixed_precision import fp32_cross_entropy, half_precision_copy


def train_with_loss_scaling(model: nn.Module, batches, make_optimizer, scaler=None,
                            dtype: torch.dtype = torch.float16, loss_fn=None) -> dict:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "step", "update", "get_scale")):
        raise TypeError("scaler must have GradScaler's scale/step/update/get_scale, got "
                        f"{type(scaler).__name__}")
    loss_fn = loss_fn or fp32_cross_entropy
    half = half_precision_copy(model, dtype)
    half_params = list(half.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    optimizer = make_optimizer(masters)
    losses, applied = [], []
    for x, y in batches:
        loss = loss_fn(half, x, y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        for m, h in zip(masters, half_params):  # the half gradients, in fp32, on the masters
            m.grad = None if h.grad is None else h.grad.float()
            h.grad = None
        if scaler is None:
            optimizer.step()
            applied.append(True)
        else:
            before = scaler.get_scale()
            scaler.step(optimizer)
            scaler.update()
            applied.append(scaler.get_scale() >= before)
        for m in masters:
            m.grad = None
        losses.append(loss.item())
