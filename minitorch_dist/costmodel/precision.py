"""Chapter 08 — number formats: fp32, fp16, bf16 and fp8 from their bit layout, and what a tensor
loses in each.

IEEE 754-2008 §3.3-3.4 (binary32 = fp32, binary16 = fp16); Kalamkar et al. 2019, "A Study of
BFLOAT16 for Deep Learning Training", §2 (bf16: fp32's 8 exponent bits, 7 mantissa bits);
Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §3 (E4M3 and E5M2). What the formats
mean for training: Micikevicius et al. 2018, "Mixed Precision Training", §3.1 (small updates
vanish in fp16: keep an fp32 master copy) and §3.2 (small gradients vanish: scale the loss).

A binary float with ``e`` exponent bits and ``m`` mantissa (fraction) bits stores a sign s, a
biased exponent E and a fraction f; with ``bias = 2^(e-1) - 1`` and ``emin = 1 - bias``::

    normal     (E >= 1):  (-1)^s * 2^(E - bias) * (1 + f / 2^m)
    subnormal  (E == 0):  (-1)^s * 2^emin       * (f / 2^m)

    min_normal    = 2^emin
    min_subnormal = 2^(emin - m)                   (the last step before zero)
    eps           = 2^-m                           (the gap after 1.0: machine epsilon)
    ulp(x)        = 2^(max(floor(log2|x|), emin) - m)

IEEE formats (fp32, fp16, bf16, E5M2) reserve the top exponent E = 2^e - 1 for inf and NaN, so
``emax = bias`` and ``max = (2 - 2^-m) * 2^emax`` (fp16: 65504; E5M2: 1.75 * 2^15 = 57344).
E4M3 has no infinities: E = 1111 is an ordinary binade except its all-ones fraction, which is
NaN, so ``emax = bias + 1`` and ``max = (2 - 2^(1-m)) * 2^emax = 1.75 * 2^8 = 448``.

Rounding is to nearest, ties to even (IEEE's default, and what ``tensor.to(dtype)`` does). A value
past ``max`` rounds to inf in the IEEE formats; torch's cast to ``float8_e4m3fn`` saturates to
±448 instead (inf included), and :func:`round_to_format` does the same.
Memory per parameter of mixed-precision training is :func:`.memory.model_state_bytes`.

Bytes of fp8 tensors with their scales (Micikevicius et al. 2022, §4, a scale per tensor; DeepSeek-AI
2024, "DeepSeek-V3 Technical Report", §3.3.2, a scale per 1×128 tile or 128×128 block):
:func:`quantized_bytes`, :func:`weight_bytes_per_param`, and the all-gather of FSDP in each format,
:func:`all_gather_buffer_bytes` (fp8: n(S + 4) against bf16's 2nS and fp32's 4nS).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..runtime.dtypes import short_name


class NumberFormat(NamedTuple):
    exponent_bits: int
    mantissa_bits: int
    ieee: bool  #: True: top exponent holds inf/NaN. False: E4M3's layout (no inf, NaN = S.1111.111)
    torch_name: str  #: the torch dtype of this layout (``getattr(torch, torch_name)``)


#: The formats of chapter 08, by the names the papers use.
FORMATS = {
    "fp32": NumberFormat(8, 23, True, "float32"),
    "fp16": NumberFormat(5, 10, True, "float16"),
    "bf16": NumberFormat(8, 7, True, "bfloat16"),
    "fp8_e4m3": NumberFormat(4, 3, False, "float8_e4m3fn"),
    "fp8_e5m2": NumberFormat(5, 2, True, "float8_e5m2"),
}


def format_name(name) -> str:
    """The canonical name (a key of :data:`FORMATS`) of ``name``: one of its keys, a torch dtype,
    or a torch dtype's name (``"bfloat16"``, ``torch.float8_e4m3fn``): any spelling that
    :func:`~minitorch_dist.runtime.dtypes.short_name` reads."""
    key = short_name(name, default=str(name).removeprefix("torch."))
    if key not in FORMATS:
        raise ValueError(f"unknown number format {name!r}; expected one of {sorted(FORMATS)} "
                         f"or a torch dtype among {sorted(f.torch_name for f in FORMATS.values())}")
    return key


def format_info(name) -> dict:
    """Range and precision of a format, derived from its bit layout (see the module docstring).

    Keys: ``name``, ``bits``, ``exponent_bits``, ``mantissa_bits``, ``bias``, ``emin``, ``emax``,
    ``max``, ``min_normal``, ``min_subnormal``, ``eps`` (2^-m), ``digits`` (decimal digits that
    always survive, floor(m*log10 2): torch.finfo's ``resolution`` is 10^-digits),
    ``significant_digits`` ((m+1)*log10 2, the precision in decimal digits, fractional) and
    ``binades`` (log2(max/min_subnormal): the dynamic range in powers of two)."""
    key = format_name(name)
    e, m, ieee, _ = FORMATS[key]
    bias = 2 ** (e - 1) - 1
    emin = 1 - bias
    if ieee:  # E = 2^e - 1 is inf/NaN: the largest finite number is 1.11..1 x 2^bias
        emax, top = bias, 2.0 - 2.0 ** -m
    else:  # E4M3: E = 1111 is normal, its fraction 111 is NaN, so the largest is 1.11..10 x 2^(bias+1)
        emax, top = bias + 1, 2.0 - 2.0 ** (1 - m)
    fmax = math.ldexp(top, emax)
    min_sub = math.ldexp(1.0, emin - m)
    return {
        "name": key, "bits": 1 + e + m, "exponent_bits": e, "mantissa_bits": m, "bias": bias,
        "emin": emin, "emax": emax, "max": fmax, "min_normal": math.ldexp(1.0, emin),
        "min_subnormal": min_sub, "eps": 2.0 ** -m, "digits": math.floor(m * math.log10(2)),
        "significant_digits": (m + 1) * math.log10(2), "binades": math.log2(fmax / min_sub),
    }


def _f64(values):
    """(float64 tensor, was it a Python scalar)."""
    scalar = isinstance(values, (int, float))
    return torch.as_tensor(values).to(torch.float64), scalar


def ulp(x, name):
    """The unit in the last place of ``x`` in a format: the gap from |x| to the next larger number,
    ``2^(max(floor(log2|x|), emin) - m)``; ``min_subnormal`` everywhere below ``min_normal``.
    At a power of two the gap below is half of it. ``x`` a number or a tensor (-> float64 tensor)."""
    info = format_info(name)
    t, scalar = _f64(x)
    out = _ulp(t, info)
    return float(out) if scalar else out


def _ulp(t, info):
    a = t.abs()
    # |x| = mant * 2^exp with mant in [0.5, 1), so floor(log2|x|) = exp - 1 exactly (log2 can round)
    _, exp = torch.frexp(torch.where(torch.isfinite(a), a, torch.zeros_like(a)))
    e = torch.where(a > 0, exp.to(torch.float64) - 1, float(info["emin"])).clamp(min=info["emin"])
    return torch.exp2(e - info["mantissa_bits"])


def _round_unbounded(t, info):
    """Round to nearest even onto the format's grid, as if its exponent had no upper limit."""
    q = _ulp(t, info)
    y = torch.round(t / q) * q  # t/q is exact (q is a power of two); torch.round ties to even
    return torch.where(torch.isfinite(t), y, t)


def round_to_format(values, name):
    """``values`` rounded to the nearest number of the format (ties to even), as float64: what
    ``values.to(dtype).double()`` gives, without needing the dtype. Past ``max``: ±inf in the IEEE
    formats, ±max in E4M3 (torch's saturating cast; inf too saturates). NaN stays NaN."""
    info = format_info(name)
    t, scalar = _f64(values)
    y = _round_unbounded(t, info)
    over = y.abs() > info["max"]
    limit = math.inf if FORMATS[info["name"]].ieee else info["max"]
    y = torch.where(over, torch.copysign(torch.full_like(y, limit), t), y)
    return float(y) if scalar else y


def underflow_fractions(values, name) -> dict:
    """Where the magnitudes of ``values`` (e.g. every gradient element) land in a format, as
    fractions that sum to 1 (the histogram of chapter 08):

    * ``zero``: exactly 0 already;
    * ``underflow``: nonzero but rounds to 0: |x| <= min_subnormal / 2 (the tie goes to 0, the even one);
    * ``subnormal``: rounds to a nonzero number below min_normal: fewer than m bits of precision left;
    * ``normal``: rounds into [min_normal, max]: full precision;
    * ``overflow``: rounds past max (inf in the IEEE formats; E4M3's cast saturates it to ±448).
    """
    info = format_info(name)
    t, _ = _f64(values)
    t = t.reshape(-1)
    if t.numel() == 0:
        raise ValueError("underflow_fractions needs at least one value, got an empty tensor")
    if torch.isnan(t).any():
        raise ValueError("values contain NaN; drop them first (e.g. values[~values.isnan()])")
    y = _round_unbounded(t, info).abs()
    counts = {
        "zero": t == 0,
        "underflow": (t != 0) & (y == 0),
        "subnormal": (y > 0) & (y < info["min_normal"]),
        "normal": (y >= info["min_normal"]) & (y <= info["max"]),
        "overflow": y > info["max"],  # inf inputs included
    }
    return {k: v.sum().item() / t.numel() for k, v in counts.items()}


def _smallest_k(x, target) -> int:
    """The smallest integer k with x * 2^k >= target (x, target > 0), exactly, from frexp."""
    (mx, ex), (mt, et) = math.frexp(x), math.frexp(target)
    return et - ex + (mx < mt)


def _largest_k(x, limit) -> int:
    """The largest integer k with x * 2^k <= limit (x, limit > 0), exactly."""
    (mx, ex), (ml, el) = math.frexp(x), math.frexp(limit)
    return el - ex - (mx > ml)


def loss_scale_range(values, name, quantile=0.0, floor="normal") -> tuple[float, float]:
    """The powers of two ``(lo, hi)`` that may multiply the loss so that, in the scaled gradients,
    the ``quantile`` of the nonzero |grad| reaches the floor and max |grad| stays <= max
    (Micikevicius et al. 2018 §3.2: the gradients are shifted up into the format's range; because
    the chain rule is linear, scaling the loss scales every gradient, and dividing the fp32
    gradients by the same power of two before the update undoes it exactly).

    ``quantile`` is taken among the nonzero |values| with "lower" interpolation (0.0: the smallest;
    0.01: 1% of them may stay below the floor). ``floor="normal"``: reach ``min_normal`` (keep all
    m bits of precision); ``floor="subnormal"``: reach ``min_subnormal`` (only not flushed to zero).
    Raises ValueError when lo > hi: the gradients span more binades than the format holds.
    A dynamic loss scaler keeps raising its scale until overflow, so it hovers near ``hi``."""
    info = format_info(name)
    if floor not in ("normal", "subnormal"):
        raise ValueError(f"floor must be 'normal' or 'subnormal', got {floor!r}")
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {quantile}")
    t, _ = _f64(values)
    a = t.abs().reshape(-1)
    if not torch.isfinite(a).all():
        raise ValueError("gradients contain inf or NaN: the step overflowed; lower the scale and skip it")
    a = a[a > 0]
    if a.numel() == 0:
        raise ValueError("all gradients are zero: no loss scale can lift them")
    q = torch.kthvalue(a, int(quantile * (a.numel() - 1)) + 1).values.item()
    big = a.max().item()
    target = info["min_normal"] if floor == "normal" else info["min_subnormal"]
    k_lo, k_hi = _smallest_k(q, target), _largest_k(big, info["max"])
    if k_lo > k_hi:
        raise ValueError(
            f"no power of two fits {info['name']}: lifting the {quantile} quantile of |grad| ({q:.3g}) to "
            f"min_{floor} ({target:.3g}) needs a scale >= 2^{k_lo}, but max |grad| ({big:.3g}) passes max "
            f"({info['max']:.6g}) above 2^{k_hi}; the gradients span {math.log2(big / q):.1f} binades; "
            f"use a larger quantile, floor='subnormal', or a format with more exponent bits (bf16)")
    return 2.0 ** k_lo, 2.0 ** k_hi


def loss_scale_needed(values, name, quantile=0.0, floor="normal") -> float:
    """The power of two closest to 1 inside :func:`loss_scale_range`: the smallest scale that
    lifts the ``quantile`` of |grad| to the floor (1.0 when nothing needs lifting; below 1 only
    when max |grad| already overflows the format, as can happen in fp8 E4M3)."""
    lo, hi = loss_scale_range(values, name, quantile, floor)
    return min(max(1.0, lo), hi)


def update_lost(weight, update, name):
    """True where ``weight + update`` rounds back to ``weight`` in the format: the update is lost.

    The rule (Micikevicius et al. 2018 §3.1): lost when |update| < ulp(weight) / 2. Exactly,
    since ties go to even and the gap below a power of two is half the gap above, this rounds
    ``weight + update`` (weight first rounded to the format) and compares. An fp16 weight of
    1.0 ignores every update in [-2^-12, 2^-11] (2^-11 ≈ 4.9e-4): lr * grad is often smaller, which is why the
    update is applied to an fp32 master copy.
    Returns a bool, or a bool tensor for tensor arguments (broadcast)."""
    w, scalar_w = _f64(weight)
    u, scalar_u = _f64(update)
    w = round_to_format(w, name)
    lost = round_to_format(w + u, name) == w
    return bool(lost) if scalar_w and scalar_u else lost


# --- fp8: bytes of a scaled tensor and of an fp8 all-gather (chapter 08, "FP8") -------------------------


def bytes_per_element(name) -> float:
    """Bytes of one number of the format: bits / 8 (fp32 4, fp16 and bf16 2, fp8 1)."""
    return format_info(name)["bits"] / 8


def quantized_bytes(shape, name, block=None, scale_bytes: int = 4) -> int:
    """Bytes of a tensor of ``shape`` stored in ``name`` with its scales: the values, plus one
    ``scale_bytes`` scale per ``block`` (rows, columns) of a 2-D shape, or one for the whole tensor
    when ``block`` is None and the format is fp8 (Micikevicius et al. 2022, §4: a scale per tensor;
    DeepSeek-V3 Technical Report 2024, §3.3.2: per 1×128 activation tile and 128×128 weight block).
    Partial blocks at the edges count as whole ones. The 16- and 32-bit formats carry no scale."""
    numel = math.prod(shape)
    values = int(numel * bytes_per_element(name))
    if not format_name(name).startswith("fp8"):
        return values
    if block is None:
        return values + scale_bytes
    if len(shape) != 2 or len(block) != 2:
        raise ValueError(f"a block scale needs a 2-D shape and a (rows, columns) block, "
                         f"got {shape} and {block}")
    scales = math.ceil(shape[0] / block[0]) * math.ceil(shape[1] / block[1])
    return values + scales * scale_bytes


def weight_bytes_per_param(name, block=None, scale_bytes: int = 4) -> float:
    """Bytes per parameter of a weight copy in ``name``, scales amortised: fp32 4, bf16 2, fp8 per
    tensor 1 (one scale for millions of values), fp8 in (r, c) blocks ``1 + scale_bytes / (r c)``
    (128×128: 1.00024; a 1×128 activation tile: 1.03125)."""
    if block is None or not format_name(name).startswith("fp8"):
        return bytes_per_element(name)
    return bytes_per_element(name) + scale_bytes / math.prod(block)


def all_gather_buffer_bytes(numel: int, n: int, name, scale_bytes_per_shard: int = 0) -> int:
    """The output of an FSDP all-gather of ``numel`` elements over ``n`` ranks (what the comm meter's
    ``bytes`` counts; the wire carries (n-1)/n of it): ``n·(S·b + scale_bytes_per_shard)``, S =
    ceil(numel / n), b the format's bytes. fp8 with a 4-byte scale per shard (chapter 08's
    ``fully_shard(..., fp8_all_gather=True)``; torchao's FSDP2 float8 all-gather, which sends one fp8
    tensor per weight): n(S + 4), about half of bf16's 2nS and a quarter of fp32's 4nS (Zhao et al.
    2023, "PyTorch FSDP", §3.3, for the all-gather; Micikevicius et al. 2022 for the bytes)."""
    if n < 1 or numel < 0:
        raise ValueError(f"need n >= 1 ranks and numel >= 0, got n={n}, numel={numel}")
    S = math.ceil(numel / n)
    return n * (int(S * bytes_per_element(name)) + scale_bytes_per_shard)
