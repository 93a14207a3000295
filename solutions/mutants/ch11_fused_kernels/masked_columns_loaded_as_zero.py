"""Wrong: loads the masked columns past N as 0.0 in the first sweep instead of -inf.

``other=0.0`` is the usual default of a masked load; but a 0 competes for the max (a row of negative
values gets max 0) and adds exp(0 - m) to the normaliser for every padded column.
"""

@triton.jit
def online_log_softmax_kernel(x_ptr, y_ptr, x_row_stride, y_row_stride, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m = -float("inf")
    d = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)  # old terms rescaled to the new max
        m = m_new
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = (x - m) - tl.log(d)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
