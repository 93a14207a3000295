"""Wrong: indexes the bias by the element's row (offs // N) instead of its column (offs % N).

The bias is "per row of the weight", which reads as per row of the activation; but a Linear's bias
has one entry per output feature, the last dimension, and is broadcast over the rows.
"""

@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, y_ptr, n_elements, N, BLOCK: tl.constexpr, APPROXIMATE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64: pid * BLOCK can pass 2**31 on big activations
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + (offs // N) % N, mask=mask, other=0.0).to(tl.float32)  # N floats: stays in cache
    z = x + b
    if APPROXIMATE:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        y = 0.5 * z * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
