"""Wrong: accumulates in the output's dtype (fp16 for an fp16 output) instead of fp32.

Keeping the accumulator in the dtype it will be stored in saves a cast; in fp16 every addition
rounds to 11 bits, far past what an fp32 sum cast once at the end loses.
"""

@triton.jit
def segment_column_sum_kernel(a_ptr, offsets_ptr, out_ptr, N, a_row_stride, BLOCK_G: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.program_id(1).to(tl.int64)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=out_ptr.dtype.element_ty)
    for first in range(start, end, BLOCK_G):
        rows = first + tl.arange(0, BLOCK_G)
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        acc += tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask,
                       other=0.0).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + seg * N + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
