"""Chapter 11 — LayerNorm forward and backward in Triton, as an autograd.Function and an nn.LayerNorm
drop-in.

Layer normalisation: Ba, Kiros & Hinton 2016, "Layer Normalization", §3, eqs. (3)-(4). Kernels follow
Triton tutorial 05, "Layer Normalization" (triton-lang.org), itself after Apex's fused LayerNorm.

Forward, for each row x of N features, weight w, bias b:

    mu = (1/N) sum_j x_j,    sigma^2 = (1/N) sum_j (x_j - mu)^2,    rstd = 1 / sqrt(sigma^2 + eps)
    xhat_j = (x_j - mu) rstd,    y_j = w_j xhat_j + b_j

The kernel streams the row in blocks: one sweep for mu, one for sigma^2, one writing y. When the
row fits one block (the usual case) the second and third sweeps re-read it from cache, so memory
sees MN read and MN written plus the M means and M rstds kept for backward.

Backward, with g = w * dy (elementwise) and the saved mu, rstd:

    dx_j = rstd (g_j - (xhat_j c1 + c2)),     c1 = (1/N) sum_k xhat_k g_k,     c2 = (1/N) sum_k g_k
    dw_j = sum_rows dy_j xhat_j,              db_j = sum_rows dy_j

dx is per row; dw and db are sums over all M rows. Letting every row add into one dw with
atomics serialises the adds; instead the rows are cut into G groups, each program sums its
group's rows into a private partial row (``partial_dw[g, :]``), and a second kernel sums the
G partial rows column block by column block. Deterministic, and the partials are G x N, not M x N.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable

from ._runtime import INTERPRET, as_rows, check_device, max_block, row_block, tl, triton

__all__ = ["LayerNorm", "layer_norm", "layernorm_backward", "layernorm_forward", "layernorm_reference",
           "replace_layernorms"]


def layernorm_reference(x, weight, bias=None, eps: float = 1e-5):
    """PyTorch's LayerNorm over the last dimension (``F.layer_norm``)."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@triton.jit
def _layernorm_fwd_kernel(x_ptr, y_ptr, w_ptr, b_ptr, mean_ptr, rstd_ptr, x_row_stride, y_row_stride, N, eps,
                          HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    # Sweep 1: mean. Accumulate per lane in fp32, reduce once.
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        acc += tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / N
    # Sweep 2: variance around the mean (two-pass: no cancellation of sum x^2 - N mu^2).
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        xc = tl.where(cols < N, x - mean, 0.0)  # the masked tail must not add mean^2
        acc += xc * xc
    rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / N + eps)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)
    # Sweep 3: normalise, scale, shift.
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = (x - mean) * rstd * w
        if HAS_BIAS:
            y += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _layernorm_bwd_dx_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, partial_dw_ptr, partial_db_ptr,
                             dy_row_stride, x_row_stride, dx_row_stride, M, N, rows_per_group,
                             HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """Program g: dx for rows [g R, (g+1) R) and their dw, db partial sums. The row is one block."""
    group = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK], tl.float32)
    db = tl.zeros([BLOCK], tl.float32)
    first = group.to(tl.int64) * rows_per_group  # int64 loop index: row * stride can pass 2**31
    for row in range(first, tl.minimum(first + rows_per_group, M)):
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = w * dy  # zero in the masked tail, since w and dy load as 0 there
        c1 = tl.sum(xhat * g, axis=0) / N
        c2 = tl.sum(g, axis=0) / N
        dx = (g - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + row * dx_row_stride + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw += dy * xhat
        if HAS_BIAS:
            db += dy
    tl.store(partial_dw_ptr + group * N + cols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(partial_db_ptr + group * N + cols, db, mask=mask)


@triton.jit
def _layernorm_bwd_dwdb_kernel(partial_dw_ptr, partial_db_ptr, dw_ptr, db_ptr, G, N,
                               HAS_BIAS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program c: dw, db for columns [c BLOCK_N, (c+1) BLOCK_N), summing the G partial rows."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    dw = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_G, BLOCK_N], tl.float32)
    for start in range(0, G, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        mask = (rows[:, None] < G) & (cols[None, :] < N)
        offsets = rows[:, None] * N + cols[None, :]
        dw += tl.load(partial_dw_ptr + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            db += tl.load(partial_db_ptr + offsets, mask=mask, other=0.0)
    tl.store(dw_ptr + cols, tl.sum(dw, axis=0).to(dw_ptr.dtype.element_ty), mask=cols < N)
    if HAS_BIAS:
        tl.store(db_ptr + cols, tl.sum(db, axis=0).to(db_ptr.dtype.element_ty), mask=cols < N)


def _check_params(N: int, weight, bias):
    if weight is None:
        raise ValueError("the fused LayerNorm needs a weight (nn.LayerNorm with elementwise_affine=True)")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and tuple(p.shape) != (N,):
            raise ValueError(f"LayerNorm {name} has shape {tuple(p.shape)} but the input's last dimension is "
                             f"{N}")


def layernorm_forward(x, weight, bias=None, eps: float = 1e-5, block_size: int | None = None):
    """``(y, mean, rstd)``: LayerNorm of ``x`` over its last dimension, and the per-row fp32
    statistics backward needs. ``block_size`` (a power of two) forces the column block width;
    narrower than the row, the kernel loops over column blocks."""
    x2 = as_rows(x, "LayerNorm input")
    M, N = x2.shape
    _check_params(N, weight, bias)
    check_device(x2, weight, *([bias] if bias is not None else []))
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    mean = torch.empty(M, dtype=torch.float32, device=x.device)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    if y.numel() > 0:
        block = row_block(N, max_block(x.dtype), block_size)
        _layernorm_fwd_kernel[(M,)](x2, y, weight, bias if bias is not None else weight, mean, rstd,
                                    x2.stride(0), y.stride(0), N, eps, HAS_BIAS=bias is not None, BLOCK=block,
                                    num_warps=min(max(block // 256, 1), 8))
    return y.view(x.shape), mean, rstd


def _default_groups(M: int, device: torch.device) -> int:
    if INTERPRET or device.type != "cuda":
        return min(M, 4)  # the interpreter runs programs one by one: few groups, long loops
    # Enough groups to fill the GPU (Liger-Kernel uses one per SM), few enough that the
    # G x N partials stay small next to the M x N rows.
    return min(M, 2 * torch.cuda.get_device_properties(device).multi_processor_count)


def layernorm_backward(dy, x, weight, mean, rstd, has_bias: bool = True, groups: int | None = None):
    """``(dx, dw, db)`` for upstream gradient ``dy``, from the input ``x`` and the ``mean``, ``rstd``
    that `layernorm_forward` returned (``db`` is None without a bias). The rows are split into
    ``groups`` contiguous groups for the dw / db partial sums (default: a few per SM)."""
    x2, dy2 = as_rows(x, "LayerNorm input"), as_rows(dy, "LayerNorm output gradient")
    M, N = x2.shape
    if dy2.shape != x2.shape:
        raise ValueError(f"LayerNorm gradient {tuple(dy.shape)} does not match the input {tuple(x.shape)}")
    _check_params(N, weight, None)
    check_device(x2, dy2, weight, mean, rstd)
    block = triton.next_power_of_2(N)
    if block > max_block(x.dtype):
        raise ValueError(f"LayerNorm backward keeps a row in one block of at most {max_block(x.dtype)} "
                         f"{x.dtype} elements; N = {N} is wider: use torch.nn.LayerNorm for such rows")
    dx = torch.empty((M, N), dtype=x.dtype, device=x.device)
    dw = torch.zeros(N, dtype=weight.dtype, device=x.device)
    db = torch.zeros(N, dtype=weight.dtype, device=x.device) if has_bias else None
    if M == 0:
        return dx.view(x.shape), dw, db
    G = groups if groups is not None else _default_groups(M, x.device)
    if not 1 <= G <= M:
        raise ValueError(f"groups must be in [1, {M}] (the number of rows), got {G}")
    rows_per_group = triton.cdiv(M, G)
    G = triton.cdiv(M, rows_per_group)  # drop groups that would get no row
    partial_dw = torch.empty((G, N), dtype=torch.float32, device=x.device)
    partial_db = torch.empty((G, N), dtype=torch.float32, device=x.device) if has_bias else partial_dw
    _layernorm_bwd_dx_kernel[(G,)](dy2, x2, weight, mean, rstd, dx, partial_dw, partial_db,
                                   dy2.stride(0), x2.stride(0), dx.stride(0), M, N, rows_per_group,
                                   HAS_BIAS=has_bias, BLOCK=block, num_warps=min(max(block // 256, 1), 8))
    block_n = min(block, 128)
    _layernorm_bwd_dwdb_kernel[(triton.cdiv(N, block_n),)](partial_dw, partial_db, dw, db if has_bias else dw,
                                                           G, N,
                                                         HAS_BIAS=has_bias, BLOCK_G=32, BLOCK_N=block_n)
    return dx.view(x.shape), dw, db


class LayerNormFunction(torch.autograd.Function):
    """``y = LayerNorm(x; w, b)`` with the Triton forward and backward kernels."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, block_size=None):
        y, mean, rstd = layernorm_forward(x, weight, bias, eps, block_size)
        ctx.save_for_backward(x, weight, mean, rstd)  # 2 floats per row besides x: no xhat kept
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    @once_differentiable  # the backward kernel has no backward of its own
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = layernorm_backward(dy, x, weight, mean, rstd, ctx.has_bias)
        return dx, dw, db, None, None


def layer_norm(x, weight, bias=None, eps: float = 1e-5, block_size: int | None = None):
    """Differentiable fused LayerNorm over the last dimension (``F.layer_norm(x, (N,), w, b, eps)``)."""
    return LayerNormFunction.apply(x, weight, bias, eps, block_size)


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` over the last dimension whose forward runs the Triton kernels.

    Same parameters, same ``state_dict``: ``LayerNorm(n).load_state_dict(nn.LayerNorm(n).state_dict())``
    works, and `replace_layernorms` swaps it into a model in place.
    """

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None):
        super().__init__(normalized_shape, eps, elementwise_affine, bias, device, dtype)
        if len(self.normalized_shape) != 1:
            raise ValueError(f"the fused LayerNorm normalises the last dimension only; normalized_shape "
                             f"{tuple(self.normalized_shape)} has {len(self.normalized_shape)} dimensions")
        if not elementwise_affine:
            raise ValueError("the fused LayerNorm needs elementwise_affine=True (it always has a weight)")

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.eps)


def replace_layernorms(model: nn.Module) -> nn.Module:
    """Swap every 1-D affine ``nn.LayerNorm`` in ``model`` for the fused `LayerNorm`, keeping its
    parameters (the same Parameter objects, so optimizers built before the swap still see them)."""
    for child in model.children():
        if type(child) is nn.LayerNorm and len(child.normalized_shape) == 1 and child.elementwise_affine:
            child.__class__ = LayerNorm  # same object: its Parameters, hooks and eps stay, forward changes
        else:
            replace_layernorms(child)
    return model
