"""Chapter 11 — a fused AdamW step: one kernel over one flat fp32 buffer of parameters, gradients and
moments.

AdamW: Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", Algorithm 2, with
Adam's bias correction (Kingma & Ba 2015, Algorithm 1). Fusion as in Apex's FusedAdam and
``torch.optim.AdamW(fused=True)``; kernel pattern from Triton tutorial 01, "Vector Addition".

At step t (counting from 1), elementwise, with learning rate lr and weight decay lambda:

    p <- p (1 - lr lambda)                        decoupled decay: not mixed into the gradient
    m <- beta1 m + (1 - beta1) g                  first moment
    v <- beta2 v + (1 - beta2) g^2                second moment
    p <- p - (lr / (1 - beta1^t)) m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

The order and grouping are those of ``torch.optim.AdamW(foreach=False)`` (its
``_single_tensor_adam``), so the two agree to fp32 rounding. Eager PyTorch runs these lines as
separate kernels per parameter tensor, re-reading p, m, v between them (``foreach`` batches the
tensors but not the lines). The fused kernel reads p, g, m, v once and writes p, m, v once:
16 bytes in and 12 out per parameter (``costmodel.adamw_bytes``). One launch covers the whole
model because every parameter lives in one flat buffer (`FlatParameters`), the layout ZeRO and
FSDP also use (chapter 06).
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ._runtime import check_device, tl, triton

__all__ = ["FlatParameters", "FusedAdamW", "adamw_reference", "fused_adamw_step"]


@triton.jit
def _adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, beta2, one_minus_beta1, one_minus_beta2, eps, decay,
                  step_size, bias_correction2_sqrt, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n  # the last block runs past n unless BLOCK divides it
    p = tl.load(p_ptr + offsets, mask=mask)
    g = tl.load(g_ptr + offsets, mask=mask)
    m = tl.load(m_ptr + offsets, mask=mask)
    v = tl.load(v_ptr + offsets, mask=mask)
    p = p * decay  # decay = 1 - lr * weight_decay
    m = m + one_minus_beta1 * (g - m)  # = beta1 m + (1 - beta1) g, as torch's lerp_ computes it
    v = v * beta2 + one_minus_beta2 * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * m / denom
    tl.store(p_ptr + offsets, p, mask=mask)
    tl.store(m_ptr + offsets, m, mask=mask)
    tl.store(v_ptr + offsets, v, mask=mask)


def _hyper(step: int, lr: float, beta1: float, beta2: float, weight_decay: float) -> dict:
    """The kernel's scalars, computed on the host in float64 as torch does (then rounded to fp32)."""
    if step < 1:
        raise ValueError(f"step counts from 1 (the first update), got {step}")
    return dict(beta2=beta2, one_minus_beta1=1 - beta1, one_minus_beta2=1 - beta2,
                decay=1 - lr * weight_decay, step_size=lr / (1 - beta1 ** step),
                bias_correction2_sqrt=math.sqrt(1 - beta2 ** step))


def adamw_reference(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float = 1e-3, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
    """One AdamW step in place with eager PyTorch ops, line by line as
    ``torch.optim.AdamW(foreach=False)``."""
    h = _hyper(step, lr, beta1, beta2, weight_decay)
    param.mul_(h["decay"])
    exp_avg.lerp_(grad, h["one_minus_beta1"])
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=h["one_minus_beta2"])
    denom = (exp_avg_sq.sqrt() / h["bias_correction2_sqrt"]).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-h["step_size"])


def fused_adamw_step(param, grad, exp_avg, exp_avg_sq, *, step: int, lr: float = 1e-3, beta1: float = 0.9,
                     beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                     block: int = 1024) -> None:
    """One AdamW step in place on four flat, contiguous fp32 buffers of equal length."""
    named = dict(param=param, grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    for name, t in named.items():
        if t.dtype != torch.float32:
            raise TypeError(f"fused AdamW works on fp32 buffers; {name} is {t.dtype} "
                            f"(keep fp32 master weights and moments, chapter 08)")
        if t.dim() != 1 or not t.is_contiguous():
            raise ValueError(f"fused AdamW wants flat contiguous 1-D buffers; {name} has shape "
                             f"{tuple(t.shape)}{'' if t.is_contiguous() else ' and is not contiguous'} "
                             "(see FlatParameters)")
        if t.numel() != param.numel():
            raise ValueError(f"{name} has {t.numel()} elements but param has {param.numel()}")
    check_device(*named.values())
    h = _hyper(step, lr, beta1, beta2, weight_decay)
    n = param.numel()
    if n:
        _adamw_kernel[(triton.cdiv(n, block),)](param, grad, exp_avg, exp_avg_sq, n, eps=eps, **h,
                                                BLOCK=block)


class FlatParameters:
    """A model's parameters as views into one flat fp32 buffer, and their gradients into another.

    After ``flat = FlatParameters(model.parameters())`` each ``p.data`` is a view of ``flat.param``
    and each ``p.grad`` a view of ``flat.grad``: the forward pass reads the buffer, backward
    accumulates into it in place (autograd adds into an existing ``.grad``), and one kernel can
    update every parameter. Zero gradients with `zero_grad` (``optimizer.zero_grad()`` would set
    them to None and cut the views).
    """

    def __init__(self, params):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no parameters that require grad to flatten")
        for i, p in enumerate(self.params):
            if p.dtype != torch.float32:
                raise TypeError(f"parameter {i} {tuple(p.shape)} is {p.dtype}; the flat buffer is fp32")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"parameters are on several devices {sorted(map(str, devices))}")
        if len({id(p) for p in self.params}) != len(self.params):
            raise ValueError("a parameter appears twice (tied weights?): pass each Parameter once")
        n = sum(p.numel() for p in self.params)
        self.param = torch.empty(n, dtype=torch.float32, device=self.params[0].device)
        self.grad = torch.zeros_like(self.param)
        offset = 0
        for p in self.params:
            k = p.numel()
            self.param[offset:offset + k].copy_(p.detach().reshape(-1))
            p.data = self.param[offset:offset + k].view_as(p)
            if p.grad is not None:
                self.grad[offset:offset + k].copy_(p.grad.reshape(-1))
            p.grad = self.grad[offset:offset + k].view_as(p)
            offset += k

    def zero_grad(self) -> None:
        self.grad.zero_()

    def check_views(self) -> None:
        """Raise if some ``p.grad`` stopped being a view of the flat buffer (e.g. set to None)."""
        start = self.grad.data_ptr()
        end = start + self.grad.numel() * self.grad.element_size()
        for i, p in enumerate(self.params):
            if p.grad is None or not start <= p.grad.data_ptr() < end:
                raise RuntimeError(f"parameter {i}'s .grad is no longer a view of the flat buffer; "
                                   "zero gradients with FlatParameters.zero_grad(), not "
                                   "zero_grad(set_to_none=True)")


class FusedAdamW:
    """AdamW over a `FlatParameters` buffer, one kernel launch per step.

    Matches ``torch.optim.AdamW(params, lr, betas, eps, weight_decay, foreach=False)`` when every
    parameter has a gradient (torch skips parameters whose ``.grad`` is None; here every parameter
    always has one, zero if backward did not reach it). No amsgrad, no maximize.
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2):
        if not lr >= 0 or not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"lr, eps and weight_decay must be >= 0, got {lr}, {eps}, {weight_decay}")
        if not all(0 <= b < 1 for b in betas):
            raise ValueError(f"betas must lie in [0, 1), got {betas}")
        if isinstance(params, nn.Module):
            params = params.parameters()
        self.flat = params if isinstance(params, FlatParameters) else FlatParameters(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        self.exp_avg = torch.zeros_like(self.flat.param)
        self.exp_avg_sq = torch.zeros_like(self.flat.param)
        self.steps = 0

    @torch.no_grad()
    def step(self) -> None:
        self.flat.check_views()
        self.steps += 1
        fused_adamw_step(self.flat.param, self.flat.grad, self.exp_avg, self.exp_avg_sq, step=self.steps,
                         lr=self.lr, beta1=self.betas[0], beta2=self.betas[1], eps=self.eps,
                         weight_decay=self.weight_decay)

    def zero_grad(self) -> None:
        self.flat.zero_grad()
