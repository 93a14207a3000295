"""Chapter 08 — FP8: 8-bit numbers that work only with a scale, per tensor or per tile.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §3-4: two 8-bit formats, E4M3 (max 448,
3 mantissa bits) for weights and activations and E5M2 (max 57344, 2 mantissa bits) for gradients,
the *hybrid* recipe; every tensor is multiplied by a scale before the cast, so that its values use
the format's few binades (17.8 in E4M3), and divided by it after. Two ways to choose the scale:

**Per-tensor delayed scaling** (NVIDIA Transformer Engine's ``DelayedScaling``). Each tensor keeps
a window of its last L amaxes (largest |x|). The cast of step k uses the scale of the history up to
step k-1, so no extra pass over the tensor is needed before the cast::

    q_k      = sat(x_k * s_k)                           sat: clamp to [-max, max], then round
    hist[0]  = amax(x_k)                                recorded while casting
    s_{k+1}  = (fp8_max / 2^margin) / max(hist)         (TE: "max"; "most_recent" takes hist[0])
    hist     = roll(hist, -1);  hist[0] = 0             the window slides by one step

(TE's ``_default_get_amax_and_update_history`` and ``_default_sf_compute``; an amax of 0 or inf
keeps the old scale.) A value larger than any in the window *saturates* to ±max on the step it
arrives; the next step's scale has seen it. TE starts from s = 1; here the first cast of a tensor
calibrates on its own amax (``calibrate=True``), which TE does with ``fp8_autocast(calibrating=True)``.

**Fine-grained scaling** (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2). One scale per
1×128 *tile* of an activation (a token's 128 channels) and per 128×128 *block* of a weight, each
from its own amax at the moment of the cast ("online")::

    s_tile = fp8_max / amax(tile)                       an outlier spoils only its own tile

and "increasing accumulation precision": H800 tensor cores keep only ~14 bits of the running sum of
an fp8 GEMM, so every N_C = 128 elements of the reduction dimension K the partial result is promoted
to fp32 CUDA-core registers, multiplied by the two scales of that K-block and added there. Here
:func:`fp8_gemm` does the same on any device: per K-block, a matmul of the fp8 values (in fp32), times
the scales, summed in fp32.

**Emulation.** On a CPU nothing here is fast: the fp8 bytes are real (``torch.float8_e4m3fn`` /
``torch.float8_e5m2``), the GEMMs run in fp32 on the dequantised values. The numerics are those of
fp8 training; the speed comes only from Hopper-class tensor cores (H100: 1979 dense fp8 TFLOP/s
against 989.5 in bf16, ``costmodel.DEVICES["h100-sxm"]``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..costmodel.precision import format_info

#: The two fp8 formats, by the papers' names, and torch's dtypes for them.
FP8_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_BY_DTYPE = {d: k for k, d in FP8_FORMATS.items()}
#: Transformer Engine's ``Format``: the (forward, backward) formats of a recipe.
RECIPE_FORMATS = {"hybrid": ("e4m3", "e5m2"), "e4m3": ("e4m3", "e4m3")}


def fp8_format(fmt) -> str:
    """``'e4m3'`` or ``'e5m2'`` from a name (``'e4m3'``, ``'fp8_e4m3'``) or a torch fp8 dtype."""
    if isinstance(fmt, torch.dtype) and fmt in _BY_DTYPE:
        return _BY_DTYPE[fmt]
    key = str(fmt).lower().removeprefix("fp8_")
    if key not in FP8_FORMATS:
        raise ValueError(f"unknown fp8 format {fmt!r}: use 'e4m3' or 'e5m2'")
    return key


def fp8_max(fmt) -> float:
    """The largest finite number of the format (448 for E4M3, 57344 for E5M2), from its bit layout."""
    return format_info("fp8_" + fp8_format(fmt))["max"]


def scale_from_amax(amax: torch.Tensor, fmt, margin: int = 0, previous: torch.Tensor | None = None):
    """``(fp8_max / amax) / 2^margin`` in fp32; where amax is 0 or not finite, ``previous`` (default 1)."""
    amax = amax.float()
    keep = torch.ones_like(amax) if previous is None else previous.float().expand_as(amax)
    s = torch.full_like(amax, fp8_max(fmt)) / amax / 2.0 ** margin  # a true division (448 / t is 448 * (1/t))
    return torch.where((amax > 0) & torch.isfinite(amax), s, keep)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, fmt) -> torch.Tensor:
    """``x * scale`` rounded to the fp8 format with saturation: beyond ±max (inf included) gives ±max,
    in both formats (torch's own cast overflows E5M2 to inf); NaN stays NaN."""
    top = fp8_max(fmt)
    return (x.float() * scale).clamp(-top, top).to(FP8_FORMATS[fp8_format(fmt)])


@dataclass
class FP8Tensor:
    """fp8 values and the fp32 scales that dequantise them: ``x ≈ data / scale``.

    ``block`` is the (rows, columns) one scale covers, with ``scale`` of shape
    ``(ceil(R / rows), ceil(C / columns))`` for a 2-D ``data`` of shape (R, C); ``None`` means one
    scale (0-dim) for the whole tensor. The last tile of a row or column may be partial.
    """

    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] | None = None

    @property
    def fmt(self) -> str:
        return fp8_format(self.data.dtype)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def expanded_scale(self) -> torch.Tensor:
        """The scale of every element (0-dim for a per-tensor scale)."""
        return self.scale if self.block is None else expand_scale(self.scale, self.block, self.data.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() / self.expanded_scale()).to(dtype)

    def t(self) -> FP8Tensor:
        """The transpose: the same bytes and scales, read the other way (a 128×128 block stays one)."""
        if self.data.dim() != 2:
            raise ValueError(f"t() needs a 2-D FP8Tensor, got shape {tuple(self.data.shape)}")
        if self.block is None:
            return FP8Tensor(self.data.t(), self.scale, None)
        return FP8Tensor(self.data.t(), self.scale.t(), self.block[::-1])

    @property
    def nbytes(self) -> int:
        """Bytes of the fp8 values plus the fp32 scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()


def quantize_per_tensor(x: torch.Tensor, fmt="e4m3", scale: torch.Tensor | None = None,
                        margin: int = 0) -> FP8Tensor:
    """One scale for all of ``x``: the given ``scale`` (delayed scaling) or, by default, the current
    one, ``scale_from_amax(amax(x))`` ("just-in-time" scaling: one extra pass over x)."""
    if scale is None:
        scale = scale_from_amax(x.detach().abs().amax(), fmt, margin)
    scale = scale.to(device=x.device, dtype=torch.float32)
    return FP8Tensor(cast_to_fp8(x, scale, fmt), scale, None)


def _check_block(x: torch.Tensor, block) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"blockwise quantisation takes a 2-D tensor (tokens x channels, or out x in), got "
                         f"shape {tuple(x.shape)}; reshape it with x.reshape(-1, x.shape[-1])")
    if (not isinstance(block, (tuple, list)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in block)):
        raise ValueError(f"block must be (rows, columns) of positive ints, e.g. (1, 128) for activation "
                         f"tiles or (128, 128) for weight blocks, got {block!r}")
    return int(block[0]), int(block[1])


def expand_scale(scale: torch.Tensor, block, shape) -> torch.Tensor:
    """Per-block scales (ceil(R/rows), ceil(C/columns)) repeated to every element of an (R, C) tensor."""
    (br, bc), (R, C) = block, shape
    return scale.repeat_interleave(br, 0)[:R].repeat_interleave(bc, 1)[:, :C]


def block_amax(x: torch.Tensor, block) -> torch.Tensor:
    """amax of every (rows × columns) block of a 2-D ``x``: shape (ceil(R/rows), ceil(C/columns)).
    A partial block at the end is padded with zeros, which never raise an amax."""
    br, bc = _check_block(x, block)
    R, C = x.shape
    nr, nc = -(-R // br), -(-C // bc)
    padded = x.new_zeros(nr * br, nc * bc, dtype=torch.float32)
    padded[:R, :C] = x.detach().float().abs()
    return padded.view(nr, br, nc, bc).amax(dim=(1, 3))


def quantize_blockwise(x: torch.Tensor, block=(1, 128), fmt="e4m3") -> FP8Tensor:
    """DeepSeek-V3's fine-grained quantisation (§3.3.2): one scale per block, from the block's amax.

    ``block=(1, 128)``: a tile of 128 channels of one token (activations, output gradients);
    ``(128, 128)``: a weight block; ``(128, 1)``: the column tiles the weight-gradient GEMM needs.
    """
    block = _check_block(x, block)
    scale = scale_from_amax(block_amax(x, block), fmt)
    return FP8Tensor(cast_to_fp8(x, expand_scale(scale, block, x.shape), fmt), scale, block)


def _k_block_scales(t: FP8Tensor, k_block: int) -> torch.Tensor:
    """(rows, ceil(K / k_block)) scales of ``t`` (rows × K), one per row and K-block."""
    rows, K = t.data.shape
    nk = -(-K // k_block)
    if t.block is None:
        return t.scale.expand(rows, nk)
    br, bc = t.block
    if bc != k_block:
        raise ValueError(f"the two operands of an fp8 GEMM must share the K-block size: got {bc} and "
                         f"{k_block}; quantise both with one block width along K, e.g. (1, 128), (128, 128)")
    return t.scale.repeat_interleave(br, 0)[:rows]


def fp8_gemm(a: FP8Tensor, b: FP8Tensor) -> torch.Tensor:
    """``a @ b.T`` in fp32 from fp8 operands: a (M, K), b (N, K), as ``y = x W^T`` of a Linear.

    Per-tensor scales: one matmul of the fp8 values, divided by ``s_a * s_b``. Blockwise scales
    (DeepSeek-V3 §3.3.2, "increasing accumulation precision"): for each K-block j of width N_C,
    ``P_j = a[:, j] @ b[:, j].T`` (the tensor cores' part), then ``y += P_j / (s_a[:, j] s_b[:, j]^T)``
    in fp32 (the promotion to CUDA cores). Computed in fp32 on any device: an emulation of the numerics.
    """
    if a.data.dim() != 2 or b.data.dim() != 2 or a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"fp8_gemm computes a @ b.T with a (M, K) and b (N, K), got {tuple(a.shape)} "
                         f"and {tuple(b.shape)}")
    if a.block is None and b.block is None:
        return (a.data.float() @ b.data.float().t()) / (a.scale * b.scale)
    k_block = (a.block or b.block)[1]
    sa, sb = _k_block_scales(a, k_block), _k_block_scales(b, k_block)
    K = a.data.shape[1]
    out = a.data.new_zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32)
    for j, k0 in enumerate(range(0, K, k_block)):
        partial = a.data[:, k0:k0 + k_block].float() @ b.data[:, k0:k0 + k_block].float().t()
        out += partial / (sa[:, j, None] * sb[None, :, j])  # promoted: scaled and summed in fp32
    return out


def accumulate_with_limited_precision(a: torch.Tensor, b: torch.Tensor, mantissa_bits: int = 13,
                                      promote_every: int | None = None) -> torch.Tensor:
    """``a @ b.T`` summed one product at a time in an accumulator that keeps ``mantissa_bits``
    bits (DeepSeek-V3 §3.3.2: H800's fp8 tensor cores retain "around 14 bits", i.e. 13 after the
    leading one), promoted to an fp32 sum every ``promote_every`` products (None: never).

    Shows why promotion matters: with K = 4096 the unpromoted sum loses its low bits as it grows.
    Sequential over K (slow): for small M, N only.
    """
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"needs a (M, K) and b (N, K), got {tuple(a.shape)} and {tuple(b.shape)}")

    def keep(v):  # round to `mantissa_bits` bits after the leading one
        m, e = torch.frexp(v)
        return torch.ldexp(torch.round(m * 2.0 ** (mantissa_bits + 1)), e - (mantissa_bits + 1))

    a, b = a.float(), b.float()
    total = a.new_zeros(a.shape[0], b.shape[0])
    acc = torch.zeros_like(total)
    for k in range(a.shape[1]):
        acc = keep(acc + a[:, k, None] * b[None, :, k])
        if promote_every and (k + 1) % promote_every == 0:
            total, acc = total + acc, torch.zeros_like(acc)
    return total + acc


class DelayedScaler:
    """One tensor's delayed scaling state (Transformer Engine's): an amax history and a scale.

    ``quantize(x)`` casts with the current scale, records ``amax(x)`` in ``amax_history[0]`` and
    calls ``update()``: the next scale from the window, then the window rolled (module docstring).
    So one call is one step of this tensor. ``calibrate``: the very first call scales by its own
    amax instead of starting from 1. The history lives on the device of the first tensor cast.
    """

    def __init__(self, fmt="e4m3", history_len: int = 16, margin: int = 0, algo: str = "max",
                 calibrate: bool = True):
        self.fmt = fp8_format(fmt)
        if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive int (steps of amax kept), got {history_len!r}")
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be an int >= 0 (the scale is divided by 2^margin), got {margin!r}")
        if algo not in ("max", "most_recent"):
            raise ValueError(f"algo must be 'max' or 'most_recent' (TE's amax_compute_algo), got {algo!r}")
        self.history_len, self.margin, self.algo, self.calibrate = history_len, margin, algo, calibrate
        self.amax_history: torch.Tensor | None = None  # (history_len,), slot 0 = this step
        self.scale: torch.Tensor | None = None
        self.steps = 0

    def _ensure(self, device) -> None:
        if self.amax_history is None:
            self.amax_history = torch.zeros(self.history_len, device=device)
            self.scale = torch.ones((), device=device)

    def record(self, amax: torch.Tensor) -> None:
        """Fold this step's amax into slot 0 (the max, if the tensor is cast more than once a step)."""
        self._ensure(amax.device)
        self.amax_history[0] = torch.maximum(self.amax_history[0], amax.detach().float())

    def update(self) -> None:
        """The scale for the next step from the window, then roll the window by one step."""
        h = self.amax_history
        amax = h.max() if self.algo == "max" else h[0]
        self.scale = scale_from_amax(amax, self.fmt, self.margin, previous=self.scale)
        self.amax_history = torch.roll(h, -1, 0)
        self.amax_history[0] = 0.0
        self.steps += 1

    def quantize(self, x: torch.Tensor) -> FP8Tensor:
        """Cast ``x`` with the scale of past steps (saturating), then record its amax and update."""
        self._ensure(x.device)
        amax = x.detach().abs().amax().float()
        if self.steps == 0 and self.calibrate:
            self.scale = scale_from_amax(amax, self.fmt, self.margin, previous=self.scale)
        q = quantize_per_tensor(x, self.fmt, scale=self.scale)
        self.record(amax)
        self.update()
        return q

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history, "scale": self.scale, "steps": self.steps}
