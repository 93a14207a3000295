"""Wrong: counts every unmoved element as lost, including those whose update was exactly zero.

An element with a zero gradient does not move, but nothing was lost: the step asked for nothing. For
a GPT the embedding rows of tokens absent from the batch are many, so the counts are inflated.
"""
import torch
from torch import nn

from minitorch_dist.costmodel.precision import update_lost
from minitorch_dist.memory.mixed_precision import fp32_cross_entropy


def count_lost_bf16_updates(model: nn.Module, x, y, lr: float, loss_fn=None) -> dict:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        raise TypeError("model must be entirely bf16 (model.to(torch.bfloat16)): no fp32 master here")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    loss_fn = loss_fn or fp32_cross_entropy
    model.zero_grad(set_to_none=True)
    loss_fn(model, x, y).backward()
    predicted = measured = updated = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        u = -lr * p.grad.float()
        moved = u != 0
        before = p.detach().clone()
        predicted += update_lost(before.double(), u.double(), "bf16").sum().item()
        with torch.no_grad():
            p.add_(p.grad, alpha=-lr)
        measured += (p.detach() == before).sum().item()
        updated += p.numel()
    return {"predicted": int(predicted), "measured": int(measured), "updated": int(updated)}
