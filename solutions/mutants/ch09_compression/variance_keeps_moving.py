"""Wrong: keeps updating v after the warm-up.

Adam updates v every step, so it is natural to leave that line outside the branch; but 1-bit Adam's
point is a *frozen* preconditioner: with v moving, the compressed momentum is preconditioned by a
different 1/sqrt(v) each step and the error feedback no longer cancels.
"""
import torch


def onebit_adam_step(param: torch.Tensor, grad: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                     error: torch.Tensor, step: int, warmup_steps: int, lr: float,
                     betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    for name, t in (("grad", grad), ("m", m), ("v", v), ("error", error)):
        if t.shape != param.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match param shape "
                             f"{tuple(param.shape)}; start m, v and error from torch.zeros_like(param)")
    for name, n in (("step", step), ("warmup_steps", warmup_steps)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"{name} must be an int >= 0, got {n!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr!r}")
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it keeps 1 / sqrt(v) finite), got {eps!r}")
    beta1, beta2 = betas
    new_m = beta1 * m + (1 - beta1) * grad
    if step < warmup_steps:
        new_v = beta2 * v + (1 - beta2) * grad * grad
        sent, new_error = new_m, error.clone()
    else:
        new_v = beta2 * v + (1 - beta2) * grad * grad
        corrected = new_m + error
        scale = corrected.abs().mean()
        sent = torch.where(corrected >= 0, scale, -scale)  # 1 bit per entry + one float
        new_error = corrected - sent
    new_param = param - lr * sent / (new_v.sqrt() + eps)
    return new_param, new_m, new_v, new_error, sent
