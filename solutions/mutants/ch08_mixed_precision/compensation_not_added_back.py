"""Wrong: records what each step loses but never adds the compensation back into the next update.

The compensation looks right after one step; but the weight itself behaves like plain bf16, so tiny
updates still vanish and the lost pieces are never paid in.
"""
import torch


def kahan_bf16_update(weight: torch.Tensor, compensation: torch.Tensor,
                      update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    for name, t in (("weight", weight), ("compensation", compensation), ("update", update)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if weight.dtype != torch.bfloat16 or compensation.dtype != torch.bfloat16:
        raise TypeError(f"weight ({weight.dtype}) and compensation ({compensation.dtype}) must be bfloat16; "
                        "start the compensation as torch.zeros_like(weight)")
    if not update.is_floating_point():
        raise TypeError(f"update must be a floating-point tensor, got {update.dtype}")
    if compensation.shape != weight.shape:
        raise ValueError(f"compensation shape {tuple(compensation.shape)} does not match weight shape "
                         f"{tuple(weight.shape)}: one compensation per weight")
    if update.shape != weight.shape:
        raise ValueError(f"update shape {tuple(update.shape)} does not match weight shape "
                         f"{tuple(weight.shape)}")
    update = update.float()
    w = weight.float()
    y = update
    new_w = (w + y).to(weight.dtype)
    new_c = (y - (new_w.float() - w)).to(compensation.dtype)  # what this step lost
    return new_w, new_c
