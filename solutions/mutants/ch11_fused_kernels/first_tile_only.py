"""Wrong: sums only the first BLOCK_G rows of each segment: the loop over row tiles is missing.

With segments shorter than a tile (a few experts' rows, 32 partial rows and a tile of 32) one tile
is the whole segment; a longer segment loses every row past its first tile.
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
    for _ in range(1):
        rows = start + tl.arange(0, BLOCK_G)
        mask = (rows[:, None] < end) & (cols[None, :] < N)
        acc += tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + seg * N + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
