"""Wrong: divides the row sum c1 by BLOCK, the padded width, instead of N.

``tl.sum`` runs over the whole block, so dividing by the block's width looks like a mean; the
masked columns added nothing, and the mean is over the N real columns.
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
        c1 = tl.sum(xhat * g, axis=0) / BLOCK  # rstd's derivative: the only correction, no mean term
        dx = (g - xhat * c1) * rstd
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
    tl.store(partial_dw_ptr + group * N + cols, dw_acc, mask=mask)
