"""Wrong: writes log(exp(x - m) / d), the log of the softmax, instead of (x - m) - log d.

It is the definition read literally, and it agrees wherever the softmax is representable; but an
entry more than ~104 below the row's max underflows to 0 in fp32, and its log is -inf.
"""


@triton.jit
def online_log_softmax_kernel(x_ptr, y_ptr, x_row_stride, y_row_stride, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m = -float("inf")
    d = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.log(tl.exp(x - m) / d)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
