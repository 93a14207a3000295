"""Chapter 11 — fused softmax-cross-entropy: loss and gradient of each row of logits in one kernel.

Pattern: Triton tutorial 02 ("Fused Softmax") streamed with the online normaliser of Milakov &
Gimelshein 2018 ("Online normalizer calculation for softmax", Algorithm 3); computing the
gradient inside the forward as Liger-Kernel's cross-entropy kernel does (Hsu et al. 2024,
"Liger Kernel: Efficient Triton Kernels for LLM Training").

For a row of V logits x and its target class t, with lse = log sum_j exp(x_j):

    loss = lse - x_t,            d loss / d x_j = softmax(x)_j - [j = t] = exp(x_j - lse) - [j = t]

Averaged over the rows whose target is not ``ignore_index`` (n of them; ``reduction="mean"``,
as ``F.cross_entropy``), each gradient row is divided by n; ignored rows have loss 0 and
gradient 0. The kernel streams a row in blocks of the vocabulary twice: sweep 1 keeps a running
max and normaliser and gives lse without ever storing the softmax; sweep 2 writes the gradient
(scaled later by the upstream gradient, a scalar). Eager PyTorch materialises the M x V
log-probabilities in forward and reads them again in backward; for a GPT's vocabulary the
logits are the largest activation of the model, so that second M x V tensor is what fusion
saves (``costmodel.cross_entropy_bytes``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ._runtime import as_rows, check_device, row_block, tl, triton
from .softmax import online_max_sum

__all__ = ["cross_entropy", "cross_entropy_forward_backward", "cross_entropy_reference"]


def cross_entropy_reference(logits, targets, ignore_index: int = -100, reduction: str = "mean"):
    """PyTorch's cross-entropy over the last dimension of ``logits`` (``F.cross_entropy``)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                           ignore_index=ignore_index, reduction=reduction)


@triton.jit
def _cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, grad_ptr, scale_ptr, logits_row_stride,
                          grad_row_stride, V, ignore_index, COMPUTE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = logits_ptr + row * logits_row_stride
    target = tl.load(targets_ptr + row)
    valid = target != ignore_index
    # Sweep 1: lse = max + log Σ exp(x - max), streamed (the online softmax's first sweep).
    row_max, row_sum = online_max_sum(x_row, V, BLOCK)
    lse = row_max + tl.log(row_sum)
    x_target = tl.load(x_row + target, mask=valid, other=0.0).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - x_target, 0.0))
    if COMPUTE_GRAD:
        # Sweep 2: (softmax - onehot) * scale, scale = 1/n (mean) or 1 (sum), 0 for ignored rows.
        scale = tl.where(valid, tl.load(scale_ptr), 0.0)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < V
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(grad_ptr + row * grad_row_stride + cols, grad.to(grad_ptr.dtype.element_ty), mask=mask)


def cross_entropy_forward_backward(logits, targets, ignore_index: int = -100, reduction: str = "mean",
                                   compute_grad: bool = True, block_size: int | None = None):
    """``(loss, grad)``: the reduced loss (fp32 scalar) and d loss / d logits (``logits.dtype``, or
    None without ``compute_grad``). ``logits`` is ``(..., V)``, ``targets`` integer class indices of
    shape ``(...)``. ``block_size`` (a power of two) sets the vocabulary block the kernel streams."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    x2 = as_rows(logits, "logits")
    M, V = x2.shape
    if V == 0:
        raise ValueError(f"logits {tuple(logits.shape)} have no classes (last dimension 0)")
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.is_complex():
        raise TypeError(f"targets must be an integer tensor of class indices, got "
                        f"{targets.dtype if isinstance(targets, torch.Tensor) else type(targets).__name__}")
    if targets.numel() != M or tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets of shape {tuple(targets.shape)} do not match logits "
                         f"{tuple(logits.shape)}: want one class index per row, shape "
                         f"{tuple(logits.shape[:-1])}")
    t = targets.reshape(-1).contiguous()
    check_device(x2, t)
    counted = t != ignore_index
    bad = counted & ((t < 0) | (t >= V))
    if bad.any():  # the kernel would read outside the row; F.cross_entropy raises here too
        raise IndexError(f"target {t[bad][0].item()} is out of bounds for {V} classes "
                         f"(and is not ignore_index={ignore_index})")
    n = counted.sum().to(torch.float32)
    # Scale of the gradient rows, a device tensor so the count never syncs the host.
    scale = (1.0 / n if reduction == "mean" else torch.ones_like(n)).reshape(1)
    losses = torch.empty(M, dtype=torch.float32, device=x2.device)
    grad = torch.empty((M, V), dtype=logits.dtype, device=x2.device) if compute_grad else None
    if M:
        block = row_block(V, 4096, block_size)  # a vocabulary of 50k streams in ~13 blocks
        _cross_entropy_kernel[(M,)](x2, t, losses, grad if compute_grad else x2, scale, x2.stride(0),
                                    grad.stride(0) if compute_grad else 0, V, ignore_index,
                                    COMPUTE_GRAD=compute_grad, BLOCK=block,
                                    num_warps=8 if block >= 2048 else 4)
    loss = losses.sum() / n if reduction == "mean" else losses.sum()  # mean over 0 rows is nan, as in torch
    return loss, (grad.view(logits.shape) if compute_grad else None)


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ignore_index, reduction, block_size):
        loss, grad = cross_entropy_forward_backward(logits, targets, ignore_index, reduction,
                                                    compute_grad=ctx.needs_input_grad[0],
                                                    block_size=block_size)
        # the gradient, not the logits
        ctx.save_for_backward(grad if grad is not None else logits.new_empty(0))
        return loss

    @staticmethod
    @once_differentiable  # the kept gradient is a constant here: no second derivative through it
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss.to(grad.dtype), None, None, None, None


def cross_entropy(logits, targets, ignore_index: int = -100, reduction: str = "mean",
                  block_size: int | None = None):
    """Differentiable fused cross-entropy (``F.cross_entropy`` on ``(..., V)`` logits; mean or sum).
    The gradient is computed in forward and kept in place of the logits, so backward is one scale."""
    return _CrossEntropy.apply(logits, targets, ignore_index, reduction, block_size)
