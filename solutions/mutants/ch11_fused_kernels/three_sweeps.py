"""Wrong: finds the max in one sweep, the normaliser in a second and writes in a third: three reads a row.

The safe softmax by the book (max, then sum, then divide), streamed block by block; the values are
right, but each row is read three times where the online normaliser needs two.
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
        m = tl.maximum(m, tl.max(x, axis=0))
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        d = d + tl.sum(tl.exp(x - m), axis=0)
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = (x - m) - tl.log(d)
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
