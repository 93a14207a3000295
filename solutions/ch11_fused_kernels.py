"""Chapter 11 exercises: fused kernels in Triton — bias + GeLU, online softmax, LayerNorm backward
reductions, FlashAttention's forward; and the bytes a softmax moves, eager and fused, predicted.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch11_fused_kernels.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (the launchers that check
their input, allocate the output and pick the grid) is scaffolding the student keeps and reads:
it shows how a kernel is called. Tests: ``pytest -m ch11 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

The kernels compile for a CUDA GPU when there is one; otherwise importing
:mod:`minitorch_dist.kernels._runtime` (first, below) sets ``TRITON_INTERPRET=1`` and they run
in Triton's interpreter on CPU tensors: slow, but loads, masks and reductions behave as on the GPU.
Compute in fp32 whatever the input dtype (load, ``.to(tl.float32)``, compute, cast on store):
the interpreter cannot do arithmetic on bf16 values, and fp16 sums lose digits anyway.

1. :func:`bias_gelu_kernel`: ``y = gelu(x + bias)`` in one pass (Hendrycks & Gimpel 2016,
   "Gaussian Error Linear Units (GELUs)", §2; the fusion is Megatron-LM's ``bias_gelu``). Eager
   PyTorch writes ``x + bias`` to memory and reads it back for the GeLU: 2 reads and 2 writes of
   the activation where the fused kernel does 1 and 1.
2. :func:`online_softmax_kernel`: a row softmax for rows of any length, streamed in column
   blocks: one sweep keeps the running max ``m`` and normaliser ``d`` (Milakov & Gimelshein 2018,
   "Online normalizer calculation for softmax", Algorithm 3), a second writes the output. Reads
   each row twice, writes it once, and never holds more than one block.
3. :func:`layernorm_backward_kernel`: LayerNorm's backward (Ba et al. 2016, eq. 4) for a group of
   rows: ``dx`` row by row, and the group's partial sums of ``dw`` and ``db`` (Triton tutorial 05,
   "Layer Normalization": partial sums per group instead of atomics on one row).
4. :func:`column_sum_kernel`: the second stage, summing the ``G`` partial rows column block by
   column block into the final ``dw`` and ``db``.
5. :func:`attention_forward_kernel`: FlashAttention-2's forward (Dao 2023, Algorithm 1) for one
   tile of query rows: sweep the key/value tiles with an online softmax, never writing a score to
   memory; store the output and the row log-sum-exp. Graded against PyTorch's attention.
6. :func:`softmax_traffic_forecast`: before counting them, predict the bytes a row softmax moves
   through memory as five eager PyTorch ops and as one fused kernel (a row in one block, or streamed
   in several), with the cost model; the tests count both.
"""
from __future__ import annotations

import torch

# first: chooses compiled CUDA or the interpreter before any @triton.jit below runs
from minitorch_dist.kernels._runtime import as_rows, check_device, tl, triton  # isort: skip
from minitorch_dist import costmodel as cm

_GELU_APPROXIMATIONS = ("none", "tanh")


def _pow2(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two (tl.arange needs one), got {value!r}")
    return value


# --- 1. fused bias + GeLU ---------------------------------------------------------------------------


@triton.jit
def bias_gelu_kernel(x_ptr, bias_ptr, y_ptr, n_elements, N, BLOCK: tl.constexpr, APPROXIMATE: tl.constexpr):
    """Kind: build

    ``y = gelu(x + bias)`` over a contiguous ``x`` of ``n_elements`` whose last dimension is ``N``.

    Program ``p`` handles the flat elements ``[p * BLOCK, (p + 1) * BLOCK)``; the last block is
    partly past the end, so mask its loads and stores. Element ``i`` adds ``bias[i % N]``.
    With ``z = x + bias`` (in fp32)::

        APPROXIMATE == 0 (exact):  gelu(z) = z * Phi(z) = 0.5 z (1 + erf(z / sqrt(2)))
        APPROXIMATE == 1 (tanh):   gelu(z) = 0.5 z (1 + tanh(sqrt(2 / pi) (z + 0.044715 z^3)))

    ``tl.math.erf`` exists; Triton has no tanh, but ``tanh(u) = 2 sigmoid(2u) - 1`` and
    ``tl.sigmoid`` does. Constants must be written inline (a kernel cannot read Python globals):
    ``1/sqrt(2) = 0.7071067811865476``, ``sqrt(2/pi) = 0.7978845608028654``. Store ``y`` in the
    output's dtype (``y_ptr.dtype.element_ty``).
    """
    # BEGIN SOLUTION
    pid = tl.program_id(0).to(tl.int64)  # int64: pid * BLOCK can pass 2**31 on big activations
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)  # N floats: stays in cache
    z = x + b
    if APPROXIMATE:
        u = 0.7978845608028654 * (z + 0.044715 * z * z * z)
        y = 0.5 * z * (1.0 + (2.0 * tl.sigmoid(2.0 * u) - 1.0))
    else:
        y = 0.5 * z * (1.0 + tl.math.erf(z * 0.7071067811865476))
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    # END SOLUTION


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none",
              block_size: int = 1024) -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` with :func:`bias_gelu_kernel`: one read of
    ``x``, one write of ``y`` (``bias`` has ``x.shape[-1]`` entries, broadcast over the rest)."""
    if approximate not in _GELU_APPROXIMATIONS:
        raise ValueError(f"approximate must be one of {_GELU_APPROXIMATIONS} "
                         f"(as in F.gelu), got {approximate!r}")
    x2 = as_rows(x, "bias_gelu input")
    if bias.dim() != 1 or bias.shape[0] != x2.shape[1]:
        raise ValueError(f"bias must be 1-D with x.shape[-1] = {x2.shape[1]} entries, got shape "
                         f"{tuple(bias.shape)}")
    block = _pow2("block_size", block_size)
    x2, bias = x2.contiguous(), as_rows(bias, "bias").contiguous()  # flat indexing needs dense rows
    check_device(x2, bias)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    n = y.numel()
    if n:
        bias_gelu_kernel[(triton.cdiv(n, block),)](x2, bias, y, n, x2.shape[1], BLOCK=block,
                                                  APPROXIMATE=int(approximate == "tanh"))
    return y.view(x.shape)


# --- 2. online softmax ------------------------------------------------------------------------------


@triton.jit
def online_softmax_kernel(x_ptr, y_ptr, x_row_stride, y_row_stride, N, BLOCK: tl.constexpr):
    """Kind: build

    Softmax of row ``r = program_id(0)`` of ``x`` (``N`` columns, row ``r`` starts at
    ``x_ptr + r * x_row_stride``) into ``y``, for any ``N``, ``BLOCK`` columns at a time.

    Sweep 1, over the column blocks ``B_1, B_2, ...``: keep two fp32 numbers, the running max
    ``m`` and the running normaliser ``d = sum exp(x_k - m)`` over the columns seen so far
    (Milakov & Gimelshein 2018, Algorithm 3). A block whose max raises ``m`` rescales ``d``::

        m_new = max(m, max(B_j))
        d     = d * exp(m - m_new) + sum_{k in B_j} exp(x_k - m_new)
        m     = m_new                                    (start: m = -inf, d = 0)

    Sweep 2: write ``y_k = exp(x_k - m) / d`` block by block. Load masked columns as ``-inf``:
    they never win the max and ``exp(-inf) = 0`` adds nothing. Exactly one read of each element in
    each sweep (the test counts): 2N read and N written per row, with no intermediate in memory.
    """
    # BEGIN SOLUTION
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_row_stride
    m = -float("inf")
    d = 0.0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N, other=-float("inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)  # old terms rescaled to the new max
        m = m_new
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        y = tl.exp(x - m) / d
        tl.store(y_ptr + row * y_row_stride + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    # END SOLUTION


def online_softmax(x: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """``torch.softmax(x, -1)`` with :func:`online_softmax_kernel`, one program per row.
    ``block_size`` (a power of two; default the row rounded up to a power of two, at most 1024)
    sets the column block: smaller than the row, the kernel streams it in several blocks."""
    x2 = as_rows(x, "softmax input")
    check_device(x2)
    M, N = x2.shape
    block = min(triton.next_power_of_2(N), 1024) if block_size is None else _pow2("block_size", block_size)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if y.numel():
        online_softmax_kernel[(M,)](x2, y, x2.stride(0), y.stride(0), N, BLOCK=block)
    return y.view(x.shape)


# --- 3. LayerNorm backward: dx and the per-group partial sums ---------------------------------------


@triton.jit
def layernorm_backward_kernel(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, partial_dw_ptr,
                              partial_db_ptr, row_stride, M, N, rows_per_group, BLOCK: tl.constexpr):
    """Kind: build

    LayerNorm backward for group ``g = program_id(0)``: rows ``[g R, min((g + 1) R, M))`` with
    ``R = rows_per_group``. ``dy``, ``x``, ``dx`` are ``M x N`` with row stride ``row_stride``;
    ``w`` has ``N`` entries; ``mean``, ``rstd`` (fp32, ``M``) were saved by the forward;
    ``partial_dw``, ``partial_db`` are fp32 ``G x N``, contiguous. A whole row fits one block
    (``BLOCK >= N``): load each row of ``x`` and ``dy`` once (the test counts).

    For one row, with ``xhat = (x - mean) * rstd`` and ``g = dy * w``::

        dx = rstd * (g - (xhat * c1 + c2)),   c1 = sum(xhat * g) / N,   c2 = sum(g) / N

    and the row adds ``dy * xhat`` to the group's ``dw`` and ``dy`` to its ``db``. After its rows,
    the program stores the two fp32 sums as row ``g`` of ``partial_dw`` and ``partial_db``
    (``dw = sum over rows of dy * xhat`` and ``db = sum of dy`` are then column sums of the
    partials: :func:`column_sum_kernel`). Masked columns (``>= N``) must add nothing to ``c1``,
    ``c2`` or the sums: load ``dy`` (and ``w``) as 0 there, so ``g`` is 0 and every term vanishes.
    """
    # BEGIN SOLUTION
    group = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK], dtype=tl.float32)
    first = group * rows_per_group
    for row in range(first, tl.minimum(first + rows_per_group, M)):
        offs = row * row_stride + cols
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        xhat = (x - mean) * rstd  # not 0 in the masked tail, but only ever multiplied by dy or g, which are
        g = dy * w
        c1 = tl.sum(xhat * g, axis=0) / N
        c2 = tl.sum(g, axis=0) / N
        dx = (g - (xhat * c1 + c2)) * rstd
        tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(partial_dw_ptr + group * N + cols, dw_acc, mask=mask)
    tl.store(partial_db_ptr + group * N + cols, db_acc, mask=mask)
    # END SOLUTION


# --- 4. the second stage: column sums of the partials -----------------------------------------------


@triton.jit
def column_sum_kernel(a_ptr, out_ptr, G, N, a_row_stride, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr):
    """Kind: build

    ``out[j] = sum_i a[i, j]`` for the ``BLOCK_N`` columns of program ``program_id(0)``, over
    all ``G`` rows of ``a`` (fp32, row stride ``a_row_stride``), ``BLOCK_G`` rows at a time.

    Load ``BLOCK_G x BLOCK_N`` tiles (``rows[:, None]`` and ``cols[None, :]`` broadcast to a 2-D
    block of pointers; mask rows ``>= G`` and columns ``>= N``), add them into a fp32 2-D
    accumulator, and reduce it over axis 0 once at the end; store in ``out``'s dtype.
    """
    # BEGIN SOLUTION
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    for start in range(0, G, BLOCK_G):
        rows = start + tl.arange(0, BLOCK_G)
        mask = (rows[:, None] < G) & (cols[None, :] < N)
        acc += tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)
    # END SOLUTION


def column_sum(a: torch.Tensor, out_dtype: torch.dtype | None = None, block_g: int = 32,
               block_n: int = 128) -> torch.Tensor:
    """``a.sum(0)`` of a 2-D tensor with :func:`column_sum_kernel`, accumulated in fp32."""
    if a.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor (groups x columns), got {a.dim()}-D")
    a2 = as_rows(a, "partial sums")
    check_device(a2)
    G, N = a2.shape
    out = torch.empty(N, dtype=out_dtype or a.dtype, device=a.device)
    if out.numel():
        block_n = _pow2("block_n", block_n)
        column_sum_kernel[(triton.cdiv(N, block_n),)](a2, out, G, N, a2.stride(0),
                                                      BLOCK_G=_pow2("block_g", block_g), BLOCK_N=block_n)
    return out


def layernorm_backward_partials(dy, x, weight, mean, rstd, rows_per_group: int | None = None):
    """``(dx, partial_dw, partial_db)``: :func:`layernorm_backward_kernel` over groups of
    ``rows_per_group`` rows (default: about 32 groups). ``x``, ``dy``: ``(..., N)``; ``mean``,
    ``rstd``: one per row, as the forward saved them."""
    if dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} must have the same shape")
    x2 = as_rows(x, "x").contiguous()
    dy2 = as_rows(dy, "dy").contiguous()
    M, N = x2.shape
    if weight.shape != (N,):
        raise ValueError(f"weight must have shape ({N},) = x.shape[-1:], got {tuple(weight.shape)}")
    if mean.numel() != M or rstd.numel() != M:
        raise ValueError(f"mean and rstd need one entry per row ({M}), got {mean.numel()} and {rstd.numel()}")
    mean, rstd = mean.reshape(M).float().contiguous(), rstd.reshape(M).float().contiguous()
    weight = weight.contiguous()
    check_device(x2, dy2, weight, mean, rstd)
    R = rows_per_group or max(1, triton.cdiv(M, 32))
    if isinstance(R, bool) or not isinstance(R, int) or R < 1:
        raise ValueError(f"rows_per_group must be an int >= 1, got {rows_per_group!r}")
    G = triton.cdiv(M, R)
    dx = torch.empty_like(x2)
    partial_dw = torch.empty((G, N), dtype=torch.float32, device=x.device)
    partial_db = torch.empty((G, N), dtype=torch.float32, device=x.device)
    if M:
        layernorm_backward_kernel[(G,)](dy2, x2, weight, mean, rstd, dx, partial_dw, partial_db,
                                        x2.stride(0), M, N, R, BLOCK=triton.next_power_of_2(N))
    return dx.view(x.shape), partial_dw, partial_db


def layernorm_backward_reductions(dy, x, weight, mean, rstd, rows_per_group: int | None = None):
    """``(dx, dw, db)`` of LayerNorm: the partials of :func:`layernorm_backward_partials`, then
    their column sums (:func:`column_sum`), cast to ``weight``'s dtype."""
    dx, partial_dw, partial_db = layernorm_backward_partials(dy, x, weight, mean, rstd, rows_per_group)
    return dx, column_sum(partial_dw, weight.dtype), column_sum(partial_db, weight.dtype)


# --- 5. FlashAttention-2's forward ------------------------------------------------------------------


@triton.jit
def attention_forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, Sq, Sk, scale,
                             stride_bh_q, stride_s_q, stride_bh_k, stride_s_k, stride_bh_o, stride_s_o,
                             CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             D: tl.constexpr):
    """Kind: build

    Attention of query rows ``[i0, i0 + BLOCK_M)``, ``i0 = program_id(0) * BLOCK_M``, of the
    (batch, head) pair ``program_id(1)`` to all the keys: FlashAttention-2's forward (Dao 2023,
    Algorithm 1; chapter 11, "FlashAttention").

    Element ``[s, c]`` of this pair's q is at ``q_ptr + bh * stride_bh_q + s * stride_s_q + c``
    (likewise k, v with ``stride_*_k``, the output with ``stride_*_o``; lse at ``lse_ptr + bh * Sq + s``).
    Load the query tile once (rows past ``Sq`` masked to 0). Then for each key tile
    ``[j0, j0 + BLOCK_N)`` (keys past ``Sk`` masked), keeping per row a running max ``m`` (start
    -inf), sum ``l`` (start 0) and unnormalised output ``acc`` (start 0), all fp32::

        s     = (q_tile @ k_tileᵀ) * scale          (BLOCK_M, BLOCK_N); -inf where the key is past Sk,
                                                    and, when CAUSAL, where key j > query i
        m_new = max(m, rowmax(s))
        p     = exp(s - m_new)
        alpha = exp(m - m_new)
        l     = alpha * l + rowsum(p)
        acc   = alpha * acc + p @ v_tile
        m     = m_new

    Finally ``o = acc / l`` and ``lse = m + log(l)``; store them for the rows below ``Sq``. With
    CAUSAL, stop the sweep at the key tile holding the tile's last query (later keys are never
    seen). ``tl.dot`` multiplies tiles (cast the operands to fp32 first); ``tl.trans`` transposes.
    """
    # BEGIN SOLUTION
    i0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    rows = i0 + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + bh * stride_bh_q + rows[:, None] * stride_s_q + cols[None, :],
                mask=rows[:, None] < Sq, other=0.0).to(tl.float32)
    m = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    stop = tl.minimum(Sk, i0 + BLOCK_M) if CAUSAL else Sk
    for j0 in range(0, stop, BLOCK_N):
        keys = j0 + tl.arange(0, BLOCK_N)
        kv_off = bh * stride_bh_k + keys[:, None] * stride_s_k + cols[None, :]
        k = tl.load(k_ptr + kv_off, mask=keys[:, None] < Sk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + kv_off, mask=keys[:, None] < Sk, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k)) * scale
        visible = keys[None, :] < Sk
        if CAUSAL:
            visible = visible & (keys[None, :] <= rows[:, None])
        s = tl.where(visible, s, -float("inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = alpha * l + tl.sum(p, axis=1)
        acc = alpha[:, None] * acc + tl.dot(p, v)
        m = m_new
    o = acc / l[:, None]
    tl.store(o_ptr + bh * stride_bh_o + rows[:, None] * stride_s_o + cols[None, :],
             o.to(o_ptr.dtype.element_ty), mask=rows[:, None] < Sq)
    tl.store(lse_ptr + bh * Sq + rows, m + tl.log(l), mask=rows < Sq)
    # END SOLUTION


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      block_m: int = 16, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: ``F.scaled_dot_product_attention(q, k, v, is_causal=causal)`` and the row
    log-sum-exp (fp32), with :func:`attention_forward_kernel`. q (B, H, Sq, D), k and v (B, H, Sk, D),
    D a power of two from 16 to 128; one program per (query tile, batch × head)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] \
            or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (B, H, Sq, D) and k, v (B, H, Sk, D) must agree; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Sq, D = q.shape
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head_dim {D} must be a power of two from 16 to 128 "
                         f"(tl.arange and tl.dot need one)")
    check_device(q, k, v)
    q, k, v = (x.contiguous() for x in (q, k, v))
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if o.numel():
        grid = (triton.cdiv(Sq, _pow2("block_m", block_m)), B * H)
        attention_forward_kernel[grid](q, k, v, o, lse, Sq, k.shape[2], D ** -0.5,
                                       Sq * D, D, k.shape[2] * D, D, Sq * D, D, CAUSAL=bool(causal),
                                       BLOCK_M=block_m, BLOCK_N=_pow2("block_n", block_n), D=D)
    return o, lse


# --- 6. the bytes a softmax moves, predicted -----------------------------------------------------------


def softmax_traffic_forecast(M: int, N: int, dtype_bytes: int = 4, block: int | None = None) -> dict:
    """Kind: measure

    Predict, before anything runs, the bytes a row softmax of an ``M x N`` matrix (elements of
    ``dtype_bytes`` bytes) moves to and from memory, read and written together:

    * ``"eager"``: as the five PyTorch ops ``amax``, subtract, ``exp``, ``sum``, divide, each a kernel
      that reads its tensor operands from memory and writes its result there (the row maxima and
      sums are tensors of M elements; views move nothing);
    * ``"fused"``: as one Triton kernel, one program per row, that loads ``block`` columns at a time
      (``block=None``: the whole row in one block). A row that fits its block is read once and its
      output written once; a longer row is streamed twice (the online softmax: one sweep for the max
      and the normaliser, one to write the output) and written once. Nothing else goes to memory;
    * ``"ratio"``: eager over fused, the speed-up a memory-bound kernel gets from fusion.

    ``costmodel`` has the eager and the one-block counts; the streamed kernel is yours to adjust.
    The tests count both exactly: the eager ops under a dispatch mode that adds up every op's tensor
    arguments and results, the fused kernels in Triton's interpreter by wrapping its loads and
    stores. Your numbers must equal the counts (to the byte).
    """
    for name, v in (("M", M), ("N", N), ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if block is not None:
        _pow2("block", block)
    # BEGIN SOLUTION
    eager = cm.softmax_bytes(M, N, dtype_bytes, fused=False)
    fused = cm.softmax_bytes(M, N, dtype_bytes, fused=True)
    sweeps = 1 if block is None or block >= N else 2  # a streamed row is read once per sweep
    eager_total = eager["read"] + eager["written"]
    fused_total = sweeps * fused["read"] + fused["written"]
    return {"eager": eager_total, "fused": fused_total, "ratio": eager_total / fused_total}
    # END SOLUTION
