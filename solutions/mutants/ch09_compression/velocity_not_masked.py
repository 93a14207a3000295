"""Wrong: keeps the velocity of the entries just sent (no momentum factor masking).

Momentum correction alone looks complete; but a sent entry's velocity goes on pushing the residual of
that entry with the momentum of gradients already sent, which is DGC's §3.2 staleness problem.
"""
import torch


def topk_with_error_feedback(grad: torch.Tensor, residual: torch.Tensor, k: int,
                             velocity: torch.Tensor | None = None, beta: float = 0.0,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    if residual.shape != grad.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} does not match gradient shape "
                         f"{tuple(grad.shape)}; start from torch.zeros_like(grad)")
    if velocity is not None and velocity.shape != grad.shape:
        raise ValueError(f"velocity shape {tuple(velocity.shape)} does not match gradient shape "
                         f"{tuple(grad.shape)}; start from None (zeros)")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= grad.numel():
        raise ValueError(f"k must be an int in [1, grad.numel() = {grad.numel()}], got {k!r}")
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1) (the momentum), got {beta!r}")
    u = grad.flatten() if velocity is None else beta * velocity.flatten() + grad.flatten()
    accumulated = residual.flatten() + u  # momentum correction: accumulate the velocity
    indices = accumulated.abs().topk(k, sorted=False).indices
    values = accumulated[indices]
    new_residual = accumulated.clone()
    new_residual[indices] = 0  # sent now: nothing left to carry
    new_velocity = u.clone()
    return values, indices, new_residual.view(grad.shape), new_velocity.view(grad.shape)
