"""Wrong: sums the rows offsets[s] to offsets[s + 1] inclusive: each segment takes the next one's first row.

Off by one at the boundary: offsets read as the first and last row of a segment rather than as
its start and the next segment's start (the convention of every CSR offsets array).
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
    for first in range(start, end + 1, BLOCK_G):
        rows = first + tl.arange(0, BLOCK_G)
        total = tl.load(offsets_ptr + tl.num_programs(1))  # G: never past the last row
        mask = (rows[:, None] <= end) & (rows[:, None] < total) & (cols[None, :] < N)
        acc += tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + seg * N + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
