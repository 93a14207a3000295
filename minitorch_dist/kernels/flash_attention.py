"""Chapter 11 — FlashAttention-2 in Triton: exact attention that never writes the Sq x Sk score matrix,
forward and backward.

Papers: Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning"
(Algorithm 1 forward, Algorithm 2 backward); Dao, Fu, Ermon, Rudra & Ré 2022, "FlashAttention: Fast and
Memory-Efficient Exact Attention with IO-Awareness". Kernel layout after Triton tutorial 06, "Fused
Attention" (triton-lang.org). The same algorithm written with PyTorch ops on tiles, to read side by
side with this file, is :mod:`minitorch_dist.kernels.attention_tiled` (``tiled_attention_forward``,
``tiled_attention_backward``, ``tiled_attention``: same signatures as the functions here).

For one head with Q (Sq x D), K, V (Sk x D) and scale c (default D^-1/2):

    S = c Q K^T,      P = softmax(S) (row-wise),      O = P V

Eager attention writes S and P to memory and reads them back in the backward: Sq Sk numbers per
head, which outgrow D by far. Here a program owns a tile of BLOCK_M query rows and streams K, V in
tiles of BLOCK_N rows, carrying per row a running max m and running sum ℓ (the online softmax of
Milakov & Gimelshein 2018, see :mod:`.softmax`):

    S_j   = c Q_i K_j^T
    m'    = max(m, rowmax(S_j)),       P_j = exp(S_j - m')
    ℓ     = ℓ exp(m - m') + rowsum(P_j)
    O     = O exp(m - m') + P_j V_j,   m = m'          (O is rescaled, not yet divided by ℓ)
  after the last tile:  O = O / ℓ,   L = m + log ℓ     (the row's log-sum-exp, the one thing saved)

FlashAttention-2's changes to FlashAttention: divide by ℓ once at the end, save L instead of m and
ℓ, and give every query tile its own program (grid = (Sq / BLOCK_M, B H)), so a program owns its
rows of O outright. The kernels use exp2: exp(x) = 2^(x log2 e), with log2 e folded into the scale.

Backward (Algorithm 2). With dO given and L saved, P is recomputed tile by tile instead of stored:

    D  = rowsum(dO ∘ O)            (a preprocess kernel; equals rowsum(P ∘ dP))
    P  = exp(S - L),   dV = P^T dO,   dP = dO V^T,   dS = P ∘ (dP - D)
    dQ = c dS K,       dK = c dS^T Q

dK, dV are sums over query rows and dQ over key rows. Algorithm 2 runs one program per key tile and
adds into dQ with atomics; here two kernels do without them (deterministic, at the price of
recomputing P once more): `_bwd_dkdv_kernel`, a grid over key tiles looping over query tiles, and
`_bwd_dq_kernel`, a grid over query tiles looping over key tiles. `flash_attention_backward` takes L
and D from its caller and never recomputes them: ring attention (chapter 05) passes the L and D of
the whole attention and gets the gradient share of one block of keys.

Conventions. Tensors are (batch, heads, seq, head_dim). Grouped-query attention (Ainslie et al.
2023): k, v may have H_kv heads with H % H_kv == 0; query head h reads kv head h // (H / H_kv), and
the dK/dV program loops over its group's query heads, so no reduction follows. ``causal=True`` is
the top-left alignment of ``F.scaled_dot_product_attention(is_causal=True)``: query i sees key j iff
j <= i, also when Sq != Sk; key tiles wholly above the diagonal are skipped by the loop bound. A row
that sees no key (only when Sk = 0) gets L = -inf and O = 0. Ragged tiles are masked: masked scores
are -inf, masked loads 0. Head dims 16..128 are loaded as a power-of-two BLOCK_D with a mask.

Non-contiguous inputs are read in place, never copied: every tensor's four strides go to the
kernels, so ``x.transpose(1, 2)`` of a (B, S, H, D) tensor is a valid q, k, v or dO. Outputs are
``torch.empty_like`` their input: the same strides when it is dense (a transposed view), else contiguous.

Dtypes: fp32 (dots in IEEE fp32, not TF32, to match PyTorch's default), fp16 (fp16 dots with fp32
accumulation); bf16 only when compiled for CUDA: Triton 3.9's interpreter computes ``tl.dot`` on bf16
wrongly (measured), so on CPU bf16 is refused with a TypeError.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from . import _runtime
from ._runtime import check_device, tl, triton

__all__ = ["flash_attention", "flash_attention_backward", "flash_attention_delta", "flash_attention_forward"]

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 128
LOG2E = 1.4426950408889634  # exp(x) = exp2(x log2 e)
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
_INF = tl.constexpr(float("inf"))


@triton.jit
def _load_tile(base, rows, cols, stride_r, stride_c, n_rows, n_cols):
    """The tile base[rows, cols] of an n_rows x n_cols matrix with strides (stride_r, stride_c); 0 outside."""
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    return tl.load(base + rows[:, None] * stride_r + cols[None, :] * stride_c, mask=mask, other=0.0)


@triton.jit
def _store_tile(base, x, rows, cols, stride_r, stride_c, n_rows, n_cols):
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    ptrs = base + rows[:, None] * stride_r + cols[None, :] * stride_c
    tl.store(ptrs, x.to(base.dtype.element_ty), mask=mask)


@triton.jit
def _visible(rows, cols, Sk, CAUSAL: tl.constexpr):
    """Which (query row, key col) scores of a tile count: the key exists, and key <= query if causal."""
    keep = cols[None, :] < Sk
    if CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    return keep


@triton.jit
def _probs(q, k, lse2, rows, cols, Sk, qk_scale, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """P = exp(S - L) of a tile, recomputed from q, k and the saved L (in base 2: lse2 = L log2 e).
    Masked entries are 0 (tl.where also drops the inf that exp2(s + inf) gives where L = -inf).
    Query rows past Sq have q = 0, dO = 0 and L = D = 0 (masked loads), so P = 1 there but
    dS = P (dP - D) = 0 and dO = 0: they add nothing to dK, dV."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    return tl.where(_visible(rows, cols, Sk, CAUSAL), tl.exp2(s - lse2[:, None]), 0.0)


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                sob, soh, som, sod, H, GROUP, Sq, Sk, D, qk_scale,
                CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Algorithm 1 for query tile program_id(0) of (batch, head) program_id(1)."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # int64: b * stride can pass 2**31 for big inputs
    b, h = bh // H, bh % H
    kvh = h // GROUP  # grouped-query attention: GROUP query heads share a k/v head
    k_base, v_base = K + b * skb + kvh * skh, V + b * svb + kvh * svh
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh, rows, dims, sqm, sqd, Sq, D)
    m = tl.full([BLOCK_M], -_INF, tl.float32)  # running max of the scores, base-2 units
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)  # running P V, not yet divided by l
    # Causal: the tile's last query row is start_m + BLOCK_M - 1, so every key tile from
    # start_m + BLOCK_M on lies wholly above the diagonal. Stop the loop there rather than load and
    # mask those tiles: for Sq = Sk this skips about half of all tiles (half the work).
    hi = tl.minimum(Sk, start_m + BLOCK_M) if CAUSAL else Sk
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, cols, dims, skn, skd, Sk, D)
        v = _load_tile(v_base, cols, dims, svn, svd, Sk, D)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(_visible(rows, cols, Sk, CAUSAL), s, -_INF)
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # A row that has seen only -inf would compute exp2(-inf - -inf) = nan: shift it by 0 instead.
        shift = tl.where(m_new == -_INF, 0.0, m_new)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(m - shift)  # rescales what was accumulated under the old max
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new
    empty = l == 0.0  # a row that saw no key: O = 0, L = -inf
    o = acc / tl.where(empty, 1.0, l)[:, None]
    lse = tl.where(empty, -_INF, (m + tl.log2(tl.where(empty, 1.0, l))) * _LN2)
    _store_tile(O + b * sob + h * soh, o, rows, dims, som, sod, Sq, D)
    tl.store(LSE + bh * Sq + rows, lse, mask=rows < Sq)


@triton.jit
def _delta_kernel(O, DO, DELTA, sob, soh, som, sod, sdb, sdh, sdm, sdd, H, Sq, D,
                  BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """D = rowsum(dO ∘ O) for query tile program_id(0) of (batch, head) program_id(1)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    dims = tl.arange(0, BLOCK_D)
    o = _load_tile(O + b * sob + h * soh, rows, dims, som, sod, Sq, D).to(tl.float32)
    do = _load_tile(DO + b * sdb + h * sdh, rows, dims, sdm, sdd, Sq, D).to(tl.float32)
    tl.store(DELTA + bh * Sq + rows, tl.sum(o * do, axis=1), mask=rows < Sq)


@triton.jit
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                     svb, svh, svn, svd, sdb, sdh, sdm, sdd, sdkb, sdkh, sdkn, sdkd, sdvb, sdvh, sdvn, sdvd,
                     H, H_KV, GROUP, Sq, Sk, D, qk_scale, scale,
                     CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dK, dV for key tile program_id(0) of (batch, kv head) program_id(1): loops over the query
    tiles of every query head in the kv head's group, so the GQA sum happens here."""
    start_n = tl.program_id(0) * BLOCK_N
    bkv = tl.program_id(1).to(tl.int64)
    b, kvh = bkv // H_KV, bkv % H_KV
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    k = _load_tile(K + b * skb + kvh * skh, cols, dims, skn, skd, Sk, D)
    v = _load_tile(V + b * svb + kvh * svh, cols, dims, svn, svd, Sk, D)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # Causal: query rows below start_n see none of this tile's keys; start at the query tile that
    # holds row start_n instead of masking the tiles wholly above the diagonal (half the work).
    lo = (start_n // BLOCK_M) * BLOCK_M if CAUSAL else 0
    for g in range(0, GROUP):
        h = kvh * GROUP + g
        q_base, do_base = Q + b * sqb + h * sqh, DO + b * sdb + h * sdh
        row_base = (b * H + h) * Sq  # LSE and DELTA are contiguous (B, H, Sq)
        for start_m in range(lo, Sq, BLOCK_M):
            rows = start_m + tl.arange(0, BLOCK_M)
            q = _load_tile(q_base, rows, dims, sqm, sqd, Sq, D)
            do = _load_tile(do_base, rows, dims, sdm, sdd, Sq, D)
            lse2 = tl.load(LSE + row_base + rows, mask=rows < Sq, other=0.0) * _LOG2E
            delta = tl.load(DELTA + row_base + rows, mask=rows < Sq, other=0.0)
            p = _probs(q, k, lse2, rows, cols, Sk, qk_scale, CAUSAL, PRECISION)  # [BLOCK_M, BLOCK_N]
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    _store_tile(DK + b * sdkb + kvh * sdkh, dk * scale, cols, dims, sdkn, sdkd, Sk, D)
    _store_tile(DV + b * sdvb + kvh * sdvh, dv, cols, dims, sdvn, sdvd, Sk, D)


@triton.jit
def _bwd_dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, sqb, sqh, sqm, sqd, skb, skh, skn, skd,
                   svb, svh, svn, svd, sdb, sdh, sdm, sdd, sdqb, sdqh, sdqm, sdqd,
                   H, GROUP, Sq, Sk, D, qk_scale, scale,
                   CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ for query tile program_id(0) of (batch, head) program_id(1), looping over key tiles."""
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    b, h = bh // H, bh % H
    kvh = h // GROUP
    k_base, v_base = K + b * skb + kvh * skh, V + b * svb + kvh * svh
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    q = _load_tile(Q + b * sqb + h * sqh, rows, dims, sqm, sqd, Sq, D)
    do = _load_tile(DO + b * sdb + h * sdh, rows, dims, sdm, sdd, Sq, D)
    lse2 = tl.load(LSE + bh * Sq + rows, mask=rows < Sq, other=0.0) * _LOG2E
    delta = tl.load(DELTA + bh * Sq + rows, mask=rows < Sq, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = tl.minimum(Sk, start_m + BLOCK_M) if CAUSAL else Sk  # skip tiles above the diagonal, as forward
    for start_n in range(0, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        k = _load_tile(k_base, cols, dims, skn, skd, Sk, D)
        v = _load_tile(v_base, cols, dims, svn, svd, Sk, D)
        p = _probs(q, k, lse2, rows, cols, Sk, qk_scale, CAUSAL, PRECISION)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    _store_tile(DQ + b * sdqb + h * sdqh, dq * scale, rows, dims, sdqm, sdqd, Sq, D)


# --- Python side ----------------------------------------------------------------------------------


def _check_dtypes(*named: tuple[str, torch.Tensor]) -> None:
    dtypes = {t.dtype for _, t in named}
    if len(dtypes) > 1:
        listing = ", ".join(f"{n} {t.dtype}" for n, t in named)
        raise TypeError(f"{listing}: flash attention needs one dtype for all of them; cast them to one")
    (dtype,) = dtypes
    if dtype == torch.bfloat16 and _runtime.INTERPRET:
        raise TypeError("bf16 needs a CUDA GPU; in the interpreter cast to float16 or float32 (Triton's "
                        "interpreter computes tl.dot on bf16 wrongly)")
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"flash attention takes float32, float16 or bfloat16 tensors, got {dtype}: cast "
                        "with .float() (or .half() / .bfloat16() on a GPU)")


def _check_qkv(q, k, v) -> tuple[int, int, int, int, int, int]:
    """Validate q (B, H, Sq, D) and k, v (B, H_kv, Sk, D); return (B, H, H_kv, Sq, Sk, D)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; flash attention takes 4-D (batch, heads, "
                             "seq, head_dim) tensors (for (batch, seq, heads, head_dim) pass "
                             "x.transpose(1, 2))")
    B, H, Sq, D = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    Bk, H_kv, Sk, Dk = k.shape
    if Bk != B:
        raise ValueError(f"batch sizes differ: q has {B}, k and v have {Bk}; give them the same batch")
    if Dk != D:
        raise ValueError(f"head dims differ: q has head_dim {D}, k and v have {Dk}; project them to one")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"n_head {H} is not divisible by n_kv_head {H_kv}: grouped-query attention needs "
                         "every k/v head shared by the same number of query heads")
    if not MIN_HEAD_DIM <= D <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {D} is not supported: use {MIN_HEAD_DIM}..{MAX_HEAD_DIM}, or the tiled "
                         "PyTorch path kernels.attention_tiled")
    _check_dtypes(("q", q), ("k", k), ("v", v))
    check_device(q, k, v)
    return B, H, H_kv, Sq, Sk, D


def _config(D: int, dtype: torch.dtype, block_m: int | None, block_n: int | None):
    """(BLOCK_M, BLOCK_N, BLOCK_D, num_warps, dot precision) for head dim D."""
    for name, blk in (("block_m", block_m), ("block_n", block_n)):
        if blk is not None and (not isinstance(blk, int) or blk < 16 or blk & (blk - 1)):
            raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs tiles of at least 16), "
                             f"got {blk}")
    if _runtime.INTERPRET:
        # The interpreter runs programs one by one, each op as NumPy on a whole tile: its time grows
        # with programs x loop steps, so wider tiles are faster (32: ~2.5x quicker than 16 at S = 80)
        # and still give several tiles, and ragged ones, for the test lengths.
        bm, bn = 32, 32
    else:
        # A program keeps q, k, v tiles (and dO, dK, dV in backward) in shared memory, several
        # pipeline stages deep. Compiled for sm_80/sm_90 (triton 3.9), 64 x 64 tiles need at most
        # 116 KB; fp32 with D = 128 would need 173 KB at 64 x 32 (past an A100's 164 KB), 103 KB at 32 x 32.
        bm, bn = (32, 32) if D > 64 and dtype == torch.float32 else (64, 64)
    precision = "ieee" if dtype == torch.float32 else "tf32"  # "tf32" is ignored for fp16/bf16 operands
    return block_m or bm, block_n or bn, triton.next_power_of_2(D), (4 if D <= 64 else 8), precision


def _scale(scale: float | None, D: int) -> float:
    return D ** -0.5 if scale is None else float(scale)


def flash_attention_forward(q, k, v, causal: bool = False, scale: float | None = None,
                            block_m: int | None = None, block_n: int | None = None):
    """``(o, lse)``: attention of q (B, H, Sq, D) over k, v (B, H_kv, Sk, D), in q's dtype and layout,
    and the fp32 natural-log log-sum-exp (B, H, Sq) of each row of scaled, masked scores."""
    B, H, H_kv, Sq, Sk, D = _check_qkv(q, k, v)
    BM, BN, BD, warps, precision = _config(D, q.dtype, block_m, block_n)
    c = _scale(scale, D)
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if o.numel() == 0:
        return o, lse
    _fwd_kernel[(triton.cdiv(Sq, BM), B * H)](
        q, k, v, o, lse, *q.stride(), *k.stride(), *v.stride(), *o.stride(), H, H // H_kv, Sq, Sk, D,
        c * LOG2E, CAUSAL=bool(causal), PRECISION=precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
        num_warps=warps)
    return o, lse


def flash_attention_delta(o, do):
    """D = rowsum(dO ∘ O): (B, H, Sq) float32 from the output o and its gradient do (B, H, Sq, D)."""
    for name, t in (("o", o), ("do", do)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D (batch, heads, seq, head_dim) tensor")
    if o.shape != do.shape:
        raise ValueError(f"o {tuple(o.shape)} and its gradient do {tuple(do.shape)} must have the same shape")
    _check_dtypes(("o", o), ("do", do))
    check_device(o, do)
    B, H, Sq, D = o.shape
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=o.device)
    if delta.numel() == 0 or D == 0:
        return delta.zero_()
    BM = 32 if _runtime.INTERPRET else 64
    _delta_kernel[(triton.cdiv(Sq, BM), B * H)](o, do, delta, *o.stride(), *do.stride(), H, Sq, D,
                                                BLOCK_M=BM, BLOCK_D=triton.next_power_of_2(D))
    return delta


def _row_stats(name: str, x, shape: tuple[int, int, int], device) -> torch.Tensor:
    """lse / delta as contiguous fp32 (B, H, Sq), the layout the backward kernels index."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
        got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape (B, H, Sq) = {shape}, got {got}: pass the {name} "
                         f"that flash_attention_forward / flash_attention_delta returned")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}; move it to {device}")
    return x.to(torch.float32).contiguous()


def flash_attention_backward(q, k, v, do, lse, delta, causal: bool = False, scale: float | None = None,
                             block_m: int | None = None, block_n: int | None = None):
    """``(dq, dk, dv)`` for output gradient ``do``, from the saved ``lse`` (flash_attention_forward)
    and ``delta`` (flash_attention_delta). Both are used as given, so the lse and delta of a larger
    attention (all of ring attention's key blocks) give this block's share of the gradients. For
    GQA, dk and dv sum over each group's query heads."""
    B, H, H_kv, Sq, Sk, D = _check_qkv(q, k, v)
    if not isinstance(do, torch.Tensor) or do.shape != q.shape:
        got = tuple(do.shape) if isinstance(do, torch.Tensor) else type(do).__name__
        raise ValueError(f"do must have q's shape {tuple(q.shape)}, got {got}")
    _check_dtypes(("q", q), ("do", do))
    check_device(q, do)
    lse = _row_stats("lse", lse, (B, H, Sq), q.device)
    delta = _row_stats("delta", delta, (B, H, Sq), q.device)
    BM, BN, BD, warps, precision = _config(D, q.dtype, block_m, block_n)
    c = _scale(scale, D)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if Sq == 0 or Sk == 0 or B * H == 0:  # nothing attends to anything: every gradient is 0
        return dq.zero_(), dk.zero_(), dv.zero_()
    common = dict(CAUSAL=bool(causal), PRECISION=precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD,
                  num_warps=warps)
    strides = (*q.stride(), *k.stride(), *v.stride(), *do.stride())
    _bwd_dkdv_kernel[(triton.cdiv(Sk, BN), B * H_kv)](
        q, k, v, do, lse, delta, dk, dv, *strides, *dk.stride(), *dv.stride(),
        H, H_kv, H // H_kv, Sq, Sk, D, c * LOG2E, c, **common)
    _bwd_dq_kernel[(triton.cdiv(Sq, BM), B * H)](
        q, k, v, do, lse, delta, dq, *strides, *dq.stride(), H, H // H_kv, Sq, Sk, D,
        c * LOG2E, c, **common)
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """``o = softmax(c q k^T [+ causal mask]) v`` with the FlashAttention-2 kernels."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        o, lse = flash_attention_forward(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, o, lse)  # O(S D) per head: no S x S matrix is kept
        ctx.causal, ctx.scale = causal, scale
        return o

    @staticmethod
    @once_differentiable  # the backward kernels have no backward of their own
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        do = do.to(o.dtype)
        delta = flash_attention_delta(o, do)
        dq, dk, dv = flash_attention_backward(q, k, v, do, lse, delta, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


def flash_attention(q, k, v, causal: bool = False, scale: float | None = None):
    """Differentiable FlashAttention-2: ``F.scaled_dot_product_attention(q, k, v, is_causal=causal,
    scale=scale)`` for q (B, H, Sq, D) and k, v (B, H_kv, Sk, D) with H % H_kv == 0 (GQA)."""
    return FlashAttentionFunction.apply(q, k, v, causal, scale)
