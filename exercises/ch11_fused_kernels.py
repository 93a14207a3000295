# generated from solutions/ch11_fused_kernels.py by `make exercises`: fill in each NotImplementedError
# fingerprint 7e37cccc1c567a93 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 11 exercises: fused kernels in Triton — bias + GeLU, online log-softmax, RMSNorm backward
reductions, FlashAttention's forward with a sliding window; and the bytes a softmax moves, eager and
fused, predicted and measured.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch11``.

The kernels compile for a CUDA GPU when there is one; otherwise importing
:mod:`minitorch_dist.kernels._runtime` (first, below) sets ``TRITON_INTERPRET=1`` and they run
in Triton's interpreter on CPU tensors: slow, but loads, masks and reductions behave as on the GPU.
Compute in fp32 whatever the input dtype (load, ``.to(tl.float32)``, compute, cast on store):
the interpreter cannot do arithmetic on bf16 values, and fp16 sums lose digits anyway.

1. :func:`bias_gelu_kernel`: ``y = gelu(x + bias)`` in one pass (Hendrycks & Gimpel 2016,
   "Gaussian Error Linear Units (GELUs)", §2; the fusion is Megatron-LM's ``bias_gelu``). Eager
   PyTorch writes ``x + bias`` to memory and reads it back for the GeLU: 2 reads and 2 writes of
   the activation where the fused kernel does 1 and 1.
2. :func:`online_log_softmax_kernel`: a row log-softmax for rows of any length, streamed in
   column blocks with the online normaliser (Milakov & Gimelshein 2018, Algorithm 3). Reads each
   row twice, writes it once, and never holds more than one block.
3. :func:`rmsnorm_backward_kernel`: RMSNorm's backward (Zhang & Sennrich 2019) for a group of
   rows: ``dx`` row by row, and the group's partial sums of ``dw`` (Triton tutorial 05, "Layer
   Normalization": partial sums per group instead of atomics on one row).
4. :func:`segment_column_sum_kernel`: the second stage of a grouped reduction, summing the rows of
   each segment column block by column block (one segment: a norm's final ``dw``; one per expert:
   an MoE layer's weight gradients).
5. :func:`attention_window_kernel`: FlashAttention-2's forward (Dao 2023, Algorithm 1) for one
   tile of query rows of sliding-window causal attention (Longformer §3.1): sweep only the key tiles
   that meet the window with an online softmax, never writing a score to memory; store the output
   and the row log-sum-exp.
6. :func:`softmax_traffic_forecast`: predict the bytes a row softmax moves through memory as five
   eager PyTorch ops and as one fused kernel (a row in one block, or streamed in several).
7. :func:`softmax_traffic_measured`: run the five eager ops under the byte meter and set what they
   moved beside the forecast.
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
    """Kind: build · about 30 minutes

    ``y = gelu(x + bias)`` over a contiguous ``x`` of ``n_elements`` whose last dimension is ``N``,
    in one pass (Hendrycks & Gimpel 2016, §2; the fusion is Megatron-LM's ``bias_gelu``).

    Interface: program ``p`` owns the flat elements ``[p * BLOCK, (p + 1) * BLOCK)``; ``bias`` has
    ``N`` entries, broadcast over the rows; ``APPROXIMATE`` is 0 for the exact GeLU (``F.gelu``'s
    ``"none"``) and 1 for its tanh form (``"tanh"``); store ``y`` in the output's dtype
    (``y_ptr.dtype.element_ty``). Compute in fp32 whatever the input dtype. Triton has
    ``tl.math.erf`` and ``tl.sigmoid`` but no tanh; a kernel cannot read Python globals (write
    constants inline).

    The tests check both forms against ``F.gelu`` in float64 within the rounding of the fp32
    computation, on random shapes with a partial last block, in fp16, and that nothing is written
    past the end of the output (a NaN-filled buffer around it must stay NaN).

    Reference: ``minitorch_dist/kernels/softmax.py`` (how a kernel masks its last block and is
    launched; the library has no fused bias-GeLU: this one is yours).
    """
    raise NotImplementedError("exercise: bias_gelu_kernel — see chapters/11_fused_kernels.md")


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


# --- 2. online log-softmax ------------------------------------------------------------------------------


@triton.jit
def online_log_softmax_kernel(x_ptr, y_ptr, x_row_stride, y_row_stride, N, BLOCK: tl.constexpr):
    """Kind: build · about 45 minutes

    Log-softmax of row ``r = program_id(0)`` of ``x`` (``N`` columns, row ``r`` starts at
    ``x_ptr + r * x_row_stride``) into ``y`` (row stride ``y_row_stride``), for any ``N``,
    holding only ``BLOCK`` columns at a time: ``y_k = log(exp(x_k) / sum_j exp(x_j))``, what a
    cross-entropy loss needs, streamed with the online normaliser (Milakov & Gimelshein 2018,
    "Online normalizer calculation for softmax", Algorithm 3).

    Properties the tests check: equal to ``torch.log_softmax`` in float64 within the rounding of the
    fp32 computation, for rows of one and of many blocks, a row whose maximum appears only in a late
    block, rows whose values span hundreds (where a softmax's small entries underflow to 0 in fp32
    and their log would be -inf), fp16 and strided rows; and, counting the interpreter's loads and
    stores, each row read exactly twice and written once, nothing else going through memory.
    Compute in fp32.

    Reference: ``minitorch_dist/kernels/softmax.py`` (the library's online *softmax*; its output
    is not the log-softmax, and taking the log of it loses the small entries).
    """
    raise NotImplementedError("exercise: online_log_softmax_kernel — see chapters/11_fused_kernels.md")


def online_log_softmax(x: torch.Tensor, block_size: int | None = None) -> torch.Tensor:
    """``torch.log_softmax(x, -1)`` with :func:`online_log_softmax_kernel`, one program per row.
    ``block_size`` (a power of two; default the row rounded up to a power of two, at most 1024)
    sets the column block: smaller than the row, the kernel streams it in several blocks."""
    x2 = as_rows(x, "softmax input")
    check_device(x2)
    M, N = x2.shape
    block = min(triton.next_power_of_2(N), 1024) if block_size is None else _pow2("block_size", block_size)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if y.numel():
        online_log_softmax_kernel[(M,)](x2, y, x2.stride(0), y.stride(0), N, BLOCK=block)
    return y.view(x.shape)


# --- 3. RMSNorm backward: dx and the per-group partial sums ----------------------------------------


@triton.jit
def rmsnorm_backward_kernel(dy_ptr, x_ptr, w_ptr, rstd_ptr, dx_ptr, partial_dw_ptr, row_stride, M, N,
                            rows_per_group, BLOCK: tl.constexpr):
    """Kind: build · about 60 minutes

    RMSNorm's backward (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization", §3-4; the norm
    of Llama and T5) for group ``g = program_id(0)``: rows ``[g R, min((g + 1) R, M))`` with
    ``R = rows_per_group``. The forward was ``y = x * rstd * w``, ``rstd = 1 / sqrt(mean(x²) + eps)``
    over the row (no mean subtracted, no bias). ``dy``, ``x``, ``dx`` are ``M x N`` with row stride
    ``row_stride``; ``w`` has ``N`` entries; ``rstd`` (fp32, ``M``) is what the forward saved;
    ``partial_dw`` is fp32 ``G x N``, contiguous. A whole row fits one block (``BLOCK >= N``).

    What it must store: each row's input gradient ``dx`` (in ``dx``'s dtype; derive it: ``rstd``
    depends on the whole row), and, as row ``g`` of ``partial_dw``, the group's fp32 sum of the rows'
    contributions to the weight gradient (Triton tutorial 05's partial sums per group;
    :func:`segment_column_sum_kernel` adds the groups up).

    Properties the tests check: ``dx`` and every group's partial against autograd of RMSNorm in
    float64 within the rounding of the fp32 computation (random shapes, groups that do not divide M,
    fp16); columns past ``N`` filled with NaN in memory neither leak into a sum nor get written; and,
    counting the interpreter's loads, each row of ``x`` and ``dy`` read exactly once.

    Reference: ``minitorch_dist/kernels/layernorm.py`` (LayerNorm's backward: its mean and bias terms
    have no place here, and copying them gives a wrong dx).
    """
    raise NotImplementedError("exercise: rmsnorm_backward_kernel — see chapters/11_fused_kernels.md")


# --- 4. the second stage: column sums of the partials -----------------------------------------------


@triton.jit
def segment_column_sum_kernel(a_ptr, offsets_ptr, out_ptr, N, a_row_stride, BLOCK_G: tl.constexpr,
                              BLOCK_N: tl.constexpr):
    """Kind: build · about 40 minutes

    Column sums of the rows of ``a`` segment by segment: ``out[s, j] = sum of a[i, j]`` over the rows
    ``offsets[s] <= i < offsets[s + 1]``, for the ``BLOCK_N`` columns of program ``program_id(0)`` and
    the segment ``s = program_id(1)``. ``a`` is fp32 with row stride ``a_row_stride``; ``offsets``
    (int64, S + 1 entries, non-decreasing) cut its rows into S consecutive segments, some possibly
    empty; ``out`` is ``S x N``, contiguous. This is the second stage of a grouped reduction: the
    per-group partials of a norm's backward (one segment), or the partial weight gradients of an MoE
    layer's experts, each expert's rows a segment (MegaBlocks, Gale et al. 2023, §5).

    Handle ``BLOCK_G x BLOCK_N`` tiles at a time, accumulate in fp32, store in ``out``'s dtype; an
    empty segment's sums are 0.

    Properties the tests check: equal to ``a[segment].sum(0)`` within the rounding fp32 addition
    allows, for segments of every length (empty, one row, not a multiple of the tile, all rows), G
    and N that are not multiples of the blocks, strided rows and an fp16 output; an empty segment
    written as 0 into a buffer full of NaN; as one segment, LayerNorm's dw and db from partials made
    by PyTorch and RMSNorm's whole backward with the previous exercise.

    Reference: ``minitorch_dist/kernels/layernorm.py`` (``_layernorm_bwd_dwdb_kernel`` sums all the
    rows into one output; here each segment is an output of its own).
    """
    raise NotImplementedError("exercise: segment_column_sum_kernel — see chapters/11_fused_kernels.md")


def segment_column_sum(a: torch.Tensor, offsets, out_dtype: torch.dtype | None = None, block_g: int = 32,
                       block_n: int = 128) -> torch.Tensor:
    """``[a[offsets[s]:offsets[s+1]].sum(0) for s]`` as an ``S x N`` tensor, with
    :func:`segment_column_sum_kernel`, accumulated in fp32."""
    if a.dim() != 2:
        raise ValueError(f"segment_column_sum takes a 2-D tensor (rows x columns), got {a.dim()}-D")
    a2 = as_rows(a, "partial sums")
    G, N = a2.shape
    offsets = torch.as_tensor(offsets, dtype=torch.int64, device=a.device).reshape(-1)
    if offsets.numel() < 2 or int(offsets[0]) != 0 or int(offsets[-1]) != G \
            or bool((offsets[1:] < offsets[:-1]).any()):
        raise ValueError(f"offsets must be non-decreasing from 0 to the {G} rows (S + 1 entries), got "
                         f"{offsets.tolist()}")
    check_device(a2)
    S = offsets.numel() - 1
    out = torch.empty((S, N), dtype=out_dtype or a.dtype, device=a.device)
    if out.numel():
        block_n = _pow2("block_n", block_n)
        segment_column_sum_kernel[(triton.cdiv(N, block_n), S)](a2, offsets, out, N, a2.stride(0),
                                                                BLOCK_G=_pow2("block_g", block_g),
                                                                BLOCK_N=block_n)
    return out


def column_sum(a: torch.Tensor, out_dtype: torch.dtype | None = None, block_g: int = 32,
               block_n: int = 128) -> torch.Tensor:
    """``a.sum(0)`` of a 2-D tensor: :func:`segment_column_sum` with one segment, all the rows."""
    if a.dim() != 2:
        raise ValueError(f"column_sum takes a 2-D tensor (groups x columns), got {a.dim()}-D")
    return segment_column_sum(a, [0, a.shape[0]], out_dtype, block_g, block_n)[0]


def rmsnorm_backward_partials(dy, x, weight, rstd, rows_per_group: int | None = None):
    """``(dx, partial_dw)``: :func:`rmsnorm_backward_kernel` over groups of ``rows_per_group`` rows
    (default: about 32 groups). ``x``, ``dy``: ``(..., N)``; ``rstd``: one per row, as the forward
    saved it."""
    if dy.shape != x.shape:
        raise ValueError(f"dy {tuple(dy.shape)} and x {tuple(x.shape)} must have the same shape")
    x2 = as_rows(x, "x").contiguous()
    dy2 = as_rows(dy, "dy").contiguous()
    M, N = x2.shape
    if weight.shape != (N,):
        raise ValueError(f"weight must have shape ({N},) = x.shape[-1:], got {tuple(weight.shape)}")
    if rstd.numel() != M:
        raise ValueError(f"rstd needs one entry per row ({M}), got {rstd.numel()}")
    rstd = rstd.reshape(M).float().contiguous()
    weight = weight.contiguous()
    check_device(x2, dy2, weight, rstd)
    R = rows_per_group or max(1, triton.cdiv(M, 32))
    if isinstance(R, bool) or not isinstance(R, int) or R < 1:
        raise ValueError(f"rows_per_group must be an int >= 1, got {rows_per_group!r}")
    G = triton.cdiv(M, R)
    dx = torch.empty_like(x2)
    partial_dw = torch.empty((G, N), dtype=torch.float32, device=x.device)
    if M:
        rmsnorm_backward_kernel[(G,)](dy2, x2, weight, rstd, dx, partial_dw, x2.stride(0), M, N, R,
                                      BLOCK=triton.next_power_of_2(N))
    return dx.view(x.shape), partial_dw


def rmsnorm_backward_reductions(dy, x, weight, rstd, rows_per_group: int | None = None):
    """``(dx, dw)`` of RMSNorm: the partials of :func:`rmsnorm_backward_partials`, then their column
    sums (:func:`column_sum`), cast to ``weight``'s dtype."""
    dx, partial_dw = rmsnorm_backward_partials(dy, x, weight, rstd, rows_per_group)
    return dx, column_sum(partial_dw, weight.dtype)


# --- 5. FlashAttention-2's forward, with a sliding window ------------------------------------


@triton.jit
def attention_window_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, Sq, Sk, scale, window,
                            stride_bh_q, stride_s_q, stride_bh_k, stride_s_k, stride_bh_o, stride_s_o,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """Kind: build · about 90 minutes

    Sliding-window causal attention of query rows ``[i0, i0 + BLOCK_M)``, ``i0 = program_id(0) *
    BLOCK_M``, of the (batch, head) pair ``program_id(1)``: query i sees the ``window`` keys
    ``i - window < j <= i`` (Beltagy et al. 2020, "Longformer", §3.1; Mistral 7B's sliding window),
    computed as FlashAttention-2's forward (Dao 2023, Algorithm 1; chapter 11, "FlashAttention").

    Interface: element ``[s, c]`` of this pair's q is at ``q_ptr + bh * stride_bh_q + s * stride_s_q
    + c`` (likewise k, v with ``stride_*_k``, the output with ``stride_*_o``); the row log-sum-exp of
    the scaled visible scores goes to ``lse_ptr + bh * Sq + s`` (fp32). ``scale`` multiplies
    ``q·kᵀ``. Keep all statistics in fp32 (``tl.dot`` of fp32 tiles with ``input_precision="ieee"``: on a
    GPU its default is TF32, 10 mantissa bits; ``tl.trans`` transposes);
    store only the rows below ``Sq`` (``Sq <= Sk``).

    Properties the tests check: outputs and log-sum-exp against attention with the window's mask in
    float64 within the rounding of the fp32 computation, for windows narrower than a tile, not a
    multiple of it, wider than the sequence (then it is causal attention: ``F.scaled_dot_product_
    attention(is_causal=True)``), ragged tiles and fp16; and, counting the interpreter's loads and
    stores, no score ever written to memory and K and V read only for the key tiles that meet the
    query tile's window: a query tile loads no key tile that all of its rows are blind to.

    Reference: ``minitorch_dist/kernels/flash_attention.py`` (``_fwd_kernel`` sweeps every key tile
    up to the diagonal; a window also skips the tiles before it, and some rows see nothing in the
    first tile it visits).
    """
    raise NotImplementedError("exercise: attention_window_kernel — see chapters/11_fused_kernels.md")


def attention_window(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                     block_m: int = 16, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o, lse)``: causal attention in which query i sees keys ``i - window < j <= i``, and the row
    log-sum-exp (fp32), with :func:`attention_window_kernel`. q (B, H, Sq, D), k and v (B, H, Sk, D)
    with ``Sq <= Sk``, D a power of two from 16 to 128; one program per (query tile, batch × head)."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[:2] != k.shape[:2] \
            or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q (B, H, Sq, D) and k, v (B, H, Sk, D) must agree; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    B, H, Sq, D = q.shape
    if D not in (16, 32, 64, 128):
        raise ValueError(f"head_dim {D} must be a power of two from 16 to 128 "
                         f"(tl.arange and tl.dot need one)")
    if Sq > k.shape[2]:
        raise ValueError(f"Sq = {Sq} > Sk = {k.shape[2]}: the last queries would see no key; "
                         f"give at least as many keys as queries")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (the keys a query sees, itself included), "
                         f"got {window!r}")
    check_device(q, k, v)
    q, k, v = (x.contiguous() for x in (q, k, v))
    o = torch.empty_like(q)
    lse = torch.empty((B, H, Sq), dtype=torch.float32, device=q.device)
    if o.numel():
        grid = (triton.cdiv(Sq, _pow2("block_m", block_m)), B * H)
        attention_window_kernel[grid](q, k, v, o, lse, Sq, k.shape[2], D ** -0.5, window,
                                      Sq * D, D, k.shape[2] * D, D, Sq * D, D,
                                      BLOCK_M=block_m, BLOCK_N=_pow2("block_n", block_n), D=D)
    return o, lse


# --- 6. the bytes a softmax moves, predicted -----------------------------------------------------------


def softmax_traffic_forecast(M: int, N: int, dtype_bytes: int = 4, block: int | None = None) -> dict:
    """Kind: derive · about 30 minutes

    Predict, before anything runs, the bytes a row softmax of an ``M x N`` matrix (elements of
    ``dtype_bytes`` bytes) moves to and from memory, read and written together:

    * ``"eager"``: as the five PyTorch ops ``amax``, subtract, ``exp``, ``sum``, divide, each a kernel
      that reads its tensor operands from memory and writes its result there (views move nothing);
    * ``"fused"``: as one Triton kernel, one program per row, that loads ``block`` columns at a time
      (``block=None``: the whole row in one block): a row in one block needs one read, a longer row
      the online normaliser of exercise 2; its output is written once and nothing else goes to memory;
    * ``"ratio"``: eager over fused, the speed-up a memory-bound kernel gets from fusion.

    The tests compare with counts worked by hand and with the counts of real runs, to the byte: the
    eager ops under ``analysis.meters.ByteCounter``, the library's fused kernels in Triton's
    interpreter with their loads and stores counted.
    """
    for name, v in (("M", M), ("N", N), ("dtype_bytes", dtype_bytes)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if block is not None:
        _pow2("block", block)
    raise NotImplementedError("exercise: softmax_traffic_forecast — see chapters/11_fused_kernels.md")


# --- 7. the bytes of the eager softmax, measured ----------------------------------------------------------


def softmax_traffic_measured(x: torch.Tensor, block: int | None = None) -> dict:
    """Kind: measure · about 25 minutes

    Measure what the eager softmax of ``x`` (``M x N``, any float dtype) moves through memory, and set
    your forecast beside it. Run the library's five-op softmax (``kernels.softmax.softmax_reference``)
    on ``x`` under ``analysis.meters.ByteCounter`` (a dispatch mode that adds up each ATen op's tensor
    arguments and results) and return::

        {"read": bytes read, "written": bytes written, "ops": the ATen ops counted, in order,
         "predicted": softmax_traffic_forecast(M, N, x's element size, block)}

    Meter exactly the softmax of ``x`` as given: nothing before or after it, no copy or cast of
    ``x``. The tests compare your numbers with the same run metered by the tests (exactly, the op
    list included), in fp32 and fp16, and your forecast with the measurement.

    Reference: ``minitorch_dist/analysis/meters.py`` (``ByteCounter``: what it counts and skips).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be M x N (rows to softmax), got shape {tuple(x.shape)}")
    raise NotImplementedError("exercise: softmax_traffic_measured — see chapters/11_fused_kernels.md")
