"""Wrong: divides by the second moment, not by its square root.

Adam's update is m / sqrt(v); dropping the root still shrinks large gradients and grows small ones,
so training runs — with an update of the wrong scale (1/|G| instead of sign-like).
"""
import torch


def adafactor_update(grad: torch.Tensor, row_avg: torch.Tensor, col_avg: torch.Tensor, beta2: float,
                     eps: float = 1e-30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if grad.dim() < 2:
        raise ValueError("adafactor_update factors a gradient of 2 or more dimensions, got shape "
                         f"{tuple(grad.shape)}; vectors keep an unfactored second moment")
    by_size = sorted(range(grad.dim()), key=lambda d: (grad.shape[d], d))
    r, c = sorted(by_size[-2:])
    row_shape = tuple(grad.shape[:c]) + tuple(grad.shape[c + 1:])
    col_shape = tuple(grad.shape[:r]) + tuple(grad.shape[r + 1:])
    if tuple(row_avg.shape) != row_shape:
        raise ValueError(f"row_avg must have shape {row_shape}, got {tuple(row_avg.shape)}")
    if tuple(col_avg.shape) != col_shape:
        raise ValueError(f"col_avg must have shape {col_shape}, got {tuple(col_avg.shape)}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must lie in [0, 1), got {beta2}")
    sq = grad * grad + eps
    new_row = beta2 * row_avg + (1 - beta2) * sq.mean(dim=c)
    new_col = beta2 * col_avg + (1 - beta2) * sq.mean(dim=r)
    v_hat = new_row.unsqueeze(c) * new_col.unsqueeze(r) / new_row.mean(dim=r, keepdim=True).unsqueeze(c)
    return grad / v_hat, new_row, new_col
