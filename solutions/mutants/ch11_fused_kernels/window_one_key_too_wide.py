"""Wrong: lets query i see keys i - window <= j <= i: window + 1 keys, one too many.

Off by one at the window's far edge: "the last ``window`` positions" read as a distance of at most
``window``; every row then averages one extra, older value.
"""

@triton.jit
def attention_window_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, Sq, Sk, scale, window,
                            stride_bh_q, stride_s_q, stride_bh_k, stride_s_k, stride_bh_o, stride_s_o,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    i0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    rows = i0 + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + bh * stride_bh_q + rows[:, None] * stride_s_q + cols[None, :],
                mask=rows[:, None] < Sq, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    lo = tl.maximum(i0 - window + 1, 0) // BLOCK_N * BLOCK_N  # the tile of the first key any row sees
    stop = tl.minimum(Sk, i0 + BLOCK_M)  # past the tile's last query: never seen
    for j0 in range(lo, stop, BLOCK_N):
        keys = j0 + tl.arange(0, BLOCK_N)
        kv_off = bh * stride_bh_k + keys[:, None] * stride_s_k + cols[None, :]
        k = tl.load(k_ptr + kv_off, mask=keys[:, None] < Sk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=keys[:, None] < Sk, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = (keys[None, :] < Sk) & (keys[None, :] <= rows[:, None]) \
            & (keys[None, :] >= rows[:, None] - window)
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        l = alpha * l + tl.sum(p, axis=1)
        acc = alpha[:, None] * acc + tl.dot(p, v)
        m = m_new
    o = acc / l[:, None]
    tl.store(o_ptr + bh * stride_bh_o + rows[:, None] * stride_s_o + cols[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rows[:, None] < Sq)
    tl.store(lse_ptr + bh * Sq + rows, m + tl.log(l), mask=rows < Sq)
