"""Wrong: keeps LayerNorm's mean correction, dx = rstd·(g − (x̂·c1 + mean(g))), copied from its backward.

The two norms differ by the mean subtracted in the forward, and LayerNorm's backward is the one the
chapter (and the library) writes out; RMSNorm subtracts no mean, so its dx has no mean(g) term.
"""

@triton.jit
def rmsnorm_backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, partial_dw_ptr, row_stride, M, N,
                            rows_per_group, BLOCK: tl.constexpr):
    group = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    first = group * rows_per_group
    for row in range(first, tl.minimum(first + rows_per_group, M)):
        offs = row * row_stride + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        xhat = x * rstd
        g = dy * w
        c1 = tl.sum(xhat * g, axis=0) / N  # rstd's derivative: the only correction, no mean term
        c2 = tl.sum(g, axis=0) / N
        dx = (g - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    tl.store(partial_dw_ptr + group * N + cols, dw_acc, mask=mask)
