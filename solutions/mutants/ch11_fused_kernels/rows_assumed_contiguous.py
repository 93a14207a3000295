"""Wrong: steps from row to row by N elements, assuming the rows are contiguous, not by the row stride.

The partials a norm's kernel writes are contiguous, so N and the stride agree there; a view with
padded rows (or a slice of a larger buffer) has a longer stride, and the sum reads across rows.
"""

@triton.jit
def segment_column_sum_kernel(a_ptr, offsets_ptr, out_ptr, N, a_row_stride, BLOCK_G: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    seg = tl.program_id(1).to(tl.int64)
    start = tl.load(offsets_ptr + seg)
    end = tl.load(offsets_ptr + seg + 1)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for first in range(start, end, BLOCK_G):
        rows = first + tl.arange(0, BLOCK_G)
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        acc += tl.load(a_ptr + rows[:, None] * N + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + seg * N + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
