"""Chapter 08's number formats, checked against torch: the ranges derived from the bit layout
against torch.finfo and against every bit pattern of the 16- and 8-bit formats; rounding,
underflow fractions and lost updates against torch's own casts and fp16 / bf16 arithmetic; the
loss scale of Micikevicius et al. 2018 §3.2 against what casting the scaled gradients does.

Tolerances: format constants and casts are compared exactly (they are exact binary numbers); fractions
of counted elements are ratios of integers, equal up to the division's rounding (abs 1e-12)."""
import math

import pytest
import torch

from minitorch_dist import costmodel as cm

pytestmark = pytest.mark.ch08

NAMES = list(cm.FORMATS)
SMALL = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]  # few enough bit patterns to enumerate


def _dtype(name):
    dt = getattr(torch, cm.FORMATS[name].torch_name, None)
    if dt is None:
        pytest.skip(f"this torch has no {cm.FORMATS[name].torch_name}")
    return dt


def _all_positive_finite(name):
    """Every positive finite number of a format, ascending, from its bit patterns (via torch)."""
    dt = _dtype(name)
    bits = cm.FORMATS[name].exponent_bits + cm.FORMATS[name].mantissa_bits + 1
    int_dt = {16: torch.int16, 8: torch.uint8}[bits]
    x = torch.arange(1, 2 ** (bits - 1), dtype=torch.int32).to(int_dt).view(dt).double()
    return x[torch.isfinite(x)]


@pytest.mark.parametrize("name", NAMES)
def test_format_info_matches_torch_finfo(name):
    fi, info = torch.finfo(_dtype(name)), cm.format_info(name)
    assert info["bits"] == fi.bits
    assert info["max"] == fi.max
    assert info["min_normal"] == fi.smallest_normal
    assert info["eps"] == fi.eps
    assert 10.0 ** -info["digits"] == pytest.approx(fi.resolution)


def test_paper_values():
    """The numbers the papers print (IEEE 754; Kalamkar et al. 2019 §2; Micikevicius et al. 2022 Table 1)."""
    f = cm.format_info
    assert f("fp16")["max"] == 65504 and f("fp16")["min_subnormal"] == 2.0 ** -24
    assert f("bf16")["min_normal"] == f("fp32")["min_normal"] == 2.0 ** -126  # bf16 keeps fp32's range
    assert f("fp8_e4m3")["max"] == 448 and f("fp8_e4m3")["min_subnormal"] == 2.0 ** -9
    assert f("fp8_e5m2")["max"] == 57344 and f("fp8_e5m2")["min_subnormal"] == 2.0 ** -16
    assert f("fp32")["min_subnormal"] == 2.0 ** -149
    assert f(torch.bfloat16)["name"] == f("bfloat16")["name"] == "bf16"
    with pytest.raises(ValueError, match="unknown number format 'fp12'.*expected one of"):
        cm.format_info("fp12")


@pytest.mark.parametrize("name", SMALL)
def test_ranges_and_ulp_against_every_bit_pattern(name):
    x, info = _all_positive_finite(name), cm.format_info(name)
    m = info["mantissa_bits"]
    assert x[-1].item() == info["max"]
    assert x[0].item() == info["min_subnormal"]
    assert x[2 ** m - 1].item() == info["min_normal"]  # the first pattern with exponent field 1
    assert torch.equal(cm.ulp(x[:-1], name), x[1:] - x[:-1])  # ulp = gap to the next number
    assert cm.ulp(0.0, name) == info["min_subnormal"]
    assert torch.equal(cm.round_to_format(x, name), x)  # representable numbers are fixed points


@pytest.mark.parametrize("name", SMALL)
def test_rounding_matches_torch_cast_at_midpoints_and_past_max(name):
    """Midpoints are the hardest case (ties to even); beyond max, inf (IEEE) or saturation (E4M3)."""
    dt, x, info = _dtype(name), _all_positive_finite(name), cm.format_info(name)
    gap = cm.ulp(info["max"], name)
    mids = (x[:-1] + x[1:]) / 2
    probe = torch.cat([mids, mids * (1 + 2.0 ** -20), mids * (1 - 2.0 ** -20), x[:1] / 2, x[:1] / 3,
                       torch.tensor([info["max"] + gap / 2, info["max"] + gap, 4 * info["max"], math.inf])])
    probe = torch.cat([probe, -probe]).float()  # float32 holds all of these exactly: one rounding only
    assert torch.equal(cm.round_to_format(probe, name), probe.to(dt).double())


def test_fp32_rounding_and_ulp_against_torch():
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 0x7F7FFFFF, (20000,), generator=g, dtype=torch.int32)
    x = bits.view(torch.float32)
    assert torch.equal(cm.ulp(x, "fp32"), (torch.nextafter(x, torch.tensor(math.inf)) - x).double())
    y = x.double() * (1 + torch.rand(20000, generator=g, dtype=torch.float64) * 2.0 ** -20)
    assert torch.equal(cm.round_to_format(y, "fp32"), y.float().double())


@pytest.mark.parametrize("name", NAMES)
def test_underflow_fractions_match_a_real_cast(name):
    dt, info = _dtype(name), cm.format_info(name)
    g = torch.Generator().manual_seed(1)
    lo, hi = math.log2(info["min_subnormal"]) - 4, math.log2(info["max"]) + 3
    x = (torch.exp2(lo + (hi - lo) * torch.rand(40000, generator=g, dtype=torch.float64))
         * torch.randn(40000, generator=g).sign())
    ms, mn, top = info["min_subnormal"], info["min_normal"], info["max"]
    edges = torch.tensor([ms / 2, mn - ms / 2, top + cm.ulp(top, name) / 2], dtype=torch.float64)  # the ties
    x = torch.cat([x, torch.zeros(500), edges.repeat(100), -edges.repeat(100)]).double()
    if name != "fp32":  # float32 holds these exactly, and torch casts float32 -> dt with one rounding
        x = x.float()
    y = x.to(dt).double().abs()
    n = x.numel()
    if cm.FORMATS[name].ieee:
        overflow = torch.isinf(y)
    else:  # the saturating cast hides overflow: it is whatever lands on max from beyond the rounding range
        overflow = (y == info["max"]) & (x.double().abs() > info["max"] + cm.ulp(info["max"], name) / 2)
    want = {
        "zero": (x == 0).sum().item() / n,
        "underflow": ((x != 0) & (y == 0)).sum().item() / n,
        "subnormal": ((y > 0) & (y < info["min_normal"])).sum().item() / n,
        "normal": ((y >= info["min_normal"]) & ~overflow & torch.isfinite(y)).sum().item() / n,
        "overflow": overflow.sum().item() / n,
    }
    got = cm.underflow_fractions(x, name)
    assert got == pytest.approx(want, abs=1e-12)
    assert sum(got.values()) == pytest.approx(1.0)
    assert min(got["underflow"], got["subnormal"], got["normal"], got["overflow"]) > 0  # the test covers each
    with pytest.raises(ValueError, match="NaN"):
        cm.underflow_fractions(torch.tensor([1.0, math.nan]), name)


def _fake_gradients(n=50000, seed=2, center=-24.0, spread=3.0):
    """|grad| log-normal around 2^center, like the activation gradients of Micikevicius 2018 Fig. 3."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp2(center + spread * torch.randn(n, generator=g)) * torch.randn(n, generator=g).sign()


@pytest.mark.parametrize("quantile", [0.0, 0.01, 0.1])
def test_loss_scale_lifts_the_quantile_into_fp16s_normal_range(quantile):
    grads = _fake_gradients().float()
    a = grads.abs().double()
    info = cm.format_info("fp16")
    s = cm.loss_scale_needed(grads, "fp16", quantile=quantile)
    assert math.log2(s) == int(math.log2(s)) and s > 1
    k = int(quantile * (a.numel() - 1))
    below = lambda scale: ((grads * scale).half().double().abs() < info["min_normal"]).sum().item()
    assert below(s) <= k < below(s / 2)  # s lifts all but k of them, s/2 does not
    assert below(1.0) > 0.5 * a.numel()  # unscaled, most of these gradients are lost or subnormal in fp16
    lo, hi = cm.loss_scale_range(grads, "fp16", quantile=quantile)
    assert lo == s
    assert (grads * hi).double().abs().max() <= info["max"] < (grads * 2 * hi).double().abs().max()
    assert torch.isfinite((grads * hi).half()).all()
    # subnormal floor: reach min_subnormal, the smallest number fp16 holds (so none is flushed to 0)
    s_sub = cm.loss_scale_needed(grads, "fp16", quantile=quantile, floor="subnormal")
    short = lambda scale: (a * scale < info["min_subnormal"]).sum().item()
    assert s_sub < s and short(s_sub) <= k < short(s_sub / 2)
    assert ((grads * s_sub).half() == 0).sum().item() <= k


def test_loss_scale_edges():
    assert cm.loss_scale_needed(torch.tensor([0.5, -3.0, 100.0]), "fp16") == 1.0  # nothing to lift
    assert cm.loss_scale_needed(_fake_gradients(center=-24), "bf16") == 1.0  # bf16 has fp32's range
    big = torch.tensor([1000.0, 0.5])  # over E4M3's 448: scale down, by a power of two
    s = cm.loss_scale_needed(big, "fp8_e4m3")
    assert s == 0.25 and 1000 * s <= 448 < 1000 * 2 * s
    with pytest.raises(ValueError, match="span .* binades"):
        cm.loss_scale_needed(torch.tensor([2.0 ** -30, 2.0 ** 20]), "fp16")
    with pytest.raises(ValueError, match="inf or NaN"):
        cm.loss_scale_needed(torch.tensor([1.0, math.inf]), "fp16")
    with pytest.raises(ValueError, match="all gradients are zero"):
        cm.loss_scale_needed(torch.zeros(3), "fp16")


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_update_lost_matches_half_precision_arithmetic(name):
    """Against torch's own fp16 / bf16 addition: w + u computed in the format, u ranging around
    ulp(w)/2, ties included; plus the rule of thumb |u| < ulp(w)/2 where no tie is involved."""
    dt = _dtype(name)
    g = torch.Generator().manual_seed(3)
    w = (torch.exp2(-4 + 8 * torch.rand(20000, generator=g)) * torch.randn(20000, generator=g).sign()).to(dt)
    gap = cm.ulp(w.double(), name)
    u = (gap * torch.exp2(-2 + 4 * torch.rand(20000, generator=g, dtype=torch.float64))
         * torch.randn(20000, generator=g).sign()).to(dt)
    ties = torch.cat([gap / 2, -gap / 2, -gap / 4]).to(dt)  # -gap/4: the tie below a power of two
    w, u = torch.cat([w, w, w, w]), torch.cat([u, ties])
    lost = cm.update_lost(w.double(), u.double(), name)
    assert torch.equal(lost, (w + u) == w)
    assert 0.2 < lost.float().mean() < 0.8
    rule = u.double().abs() < cm.ulp(w.double(), name) / 2
    is_pow2 = torch.frexp(w.double())[0].abs() == 0.5
    away = torch.sign(u) == torch.sign(w)
    clear = (u.double().abs() != cm.ulp(w.double(), name) / 2) & (away | ~is_pow2)
    assert torch.equal(lost[clear], rule[clear])


def test_update_lost_is_why_master_weights_are_fp32():
    """Micikevicius et al. 2018 §3.1: 1000 updates of 2^-12 on a weight of 1.0 (each under half of
    fp16's ulp(1) = 2^-10) leave an fp16 weight at 1.0 but move an fp32 copy by 1000 * 2^-12."""
    u = 2.0 ** -12
    assert cm.update_lost(1.0, u, "fp16") and not cm.update_lost(1.0, u, "fp32")
    w16, w32 = torch.tensor(1.0, dtype=torch.float16), torch.tensor(1.0)
    for _ in range(1000):
        w16, w32 = w16 + u, w32 + u
    assert w16.item() == 1.0 and w32.item() == pytest.approx(1 + 1000 * u)
    # bf16 loses far more: ulp(1) = 2^-7
    assert cm.update_lost(1.0, 2.0 ** -9, "bf16") and not cm.update_lost(1.0, 2.0 ** -9, "fp16")


def test_update_lost_matches_fp32_arithmetic():
    g = torch.Generator().manual_seed(4)
    w = torch.randn(20000, generator=g)
    u = (cm.ulp(w.double(), "fp32") * torch.exp2(-3 + 5 * torch.rand(20000, generator=g, dtype=torch.float64))
         ).float() * torch.randn(20000, generator=g).sign()
    lost = cm.update_lost(w.double(), u.double(), "fp32")
    assert torch.equal(lost, (w + u) == w)
    assert 0.1 < lost.float().mean() < 0.9
