"""Wrong: does the whole update in bf16 arithmetic (w + y and y - (w' - w) rounded to bf16 at each step).

Everything is bf16 anyway, so why go through fp32? Because y = u + c rounded to bf16 loses the small
part of u again before it ever reaches the weight, and the lost piece is measured wrongly.
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
    w = weight
    y = update.to(torch.bfloat16) + compensation
    new_w = (w + y).to(weight.dtype)
    new_c = (y - (new_w - w)).to(compensation.dtype)
    return new_w, new_c
