"""Wrong: computes the tanh approximation whatever APPROXIMATE asks for.

The tanh form is the GeLU most code uses (GPT-2, Megatron-LM), so it is the one a student knows by
heart; but ``F.gelu``'s default is the exact erf form, and the two differ by up to ~1e-3.
"""

@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, y_ptr, n_elements, N, BLOCK: tl.constexpr, APPROXIMATE: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64: pid * BLOCK can pass 2**31 on big activations
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)  # N floats: stays in cache
    z = x + b
    if True:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        y = 0.5 * z * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
