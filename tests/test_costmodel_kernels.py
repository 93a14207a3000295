"""Chapter 11's bytes-moved model, checked by running the ops it describes.

Each eager count is compared with a dispatch mode that adds up the bytes of every ATen op's
tensor arguments (read) and of its results and mutated arguments (written), while the eager op
sequence really runs (and is checked to compute softmax, LayerNorm, AdamW or cross-entropy).
Fused counts are compared with the bytes of the inputs and outputs a fused kernel must touch
once each. The roofline against the datasheet numbers, typed here from the datasheets.

Tolerances. Byte counts are integers: exact. Ratios of eager to fused bytes approach their limits up
to the per-row statistics, O(1/N): (8N + 4)/(2N) = 4 + 2/N is within 1e-4 of 4 at N = 65536, and the
LayerNorm and softmax ratios at N = 4096 within 1e-3 (4/N). Formulas against formulas in float64:
pytest.approx's default rel 1e-6 >> k·u. The H100 ridge point 989.5e12 / 3.35e12 = 295.37 against
295.4 written to 0.1. The eager softmax (each op rounding its result to the input dtype; torch
accumulates a half-precision sum in fp32) against torch.softmax in fp32: per element y·(u_dtype·(|x -
max| + 4) + 2 (γ_{N+6} + u_32·R)), R the row's range (``_softmax_bound``).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minitorch_dist import costmodel as cm
from minitorch_dist.analysis.meters import ByteCounter

from _support import gamma, roundoff

pytestmark = pytest.mark.ch11



def _counted(fn, *args):
    with ByteCounter() as c:
        out = fn(*args)
    return out, c


# --- softmax ---------------------------------------------------------------------------------------

def _naive_softmax(x):
    """The Triton tutorial's eager softmax, one kernel per line."""
    x_max = x.amax(dim=1)
    z = x - x_max[:, None]
    numerator = torch.exp(z)
    denominator = numerator.sum(dim=1)
    return numerator / denominator[:, None]


def _softmax_bound(x):
    """How far the eager softmax in x's dtype can be from torch.softmax in fp32, element by element: the
    eager ops' roundings to x's dtype (x - max, exp, the fp32-accumulated sum, the division: u of each
    result, the first carried into exp as u·|x - max|), and both evaluations' fp32 bounds."""
    x64 = x.double()
    z = (x64 - x64.amax(1, keepdim=True)).abs()
    y = torch.softmax(x64, 1)
    n, u32 = x.shape[1], roundoff(torch.float32)
    fp32 = gamma(n + 6, torch.float32) + u32 * z.amax(1, keepdim=True)
    u = roundoff(x.dtype)
    return y * (u * (z + 4) + 2 * fp32) + u * torch.finfo(x.dtype).smallest_normal


@pytest.mark.parametrize("M,N,dtype",
                         [(3, 5, torch.float32), (17, 129, torch.float32), (8, 100, torch.float16)])
def test_softmax_bytes_eager_counts_what_the_ops_move(M, N, dtype):
    x = torch.randn(M, N).to(dtype)
    y, c = _counted(_naive_softmax, x)
    diff = (y.double() - torch.softmax(x.float(), dim=1).double()).abs()
    assert (diff <= _softmax_bound(x)).all(), (diff - _softmax_bound(x)).max()
    assert c.ops == ["amax", "sub", "exp", "sum", "div"]
    want = cm.softmax_bytes(M, N, dtype_bytes=dtype, fused=False)
    assert (c.read, c.written) == (want["read"], want["written"])
    e = x.element_size()
    assert want == {"read": (5 * M * N + 2 * M) * e, "written": (3 * M * N + 2 * M) * e}  # the count


def test_softmax_bytes_fused_touches_input_and_output_once_and_eager_is_4x():
    x = torch.randn(6, 50)
    assert cm.softmax_bytes(6, 50, fused=True) == {"read": x.nbytes, "written": torch.softmax(x, 1).nbytes}
    # torch.softmax is one kernel already: the counter sees it move exactly the fused bytes
    _, c = _counted(torch.softmax, x, 1)
    assert (c.read, c.written) == (x.nbytes, x.nbytes)
    ratios = []
    for n in (16, 256, 4096, 65536):
        eager, fused = cm.softmax_bytes(64, n), cm.softmax_bytes(64, n, fused=True)
        ratios.append(sum(eager.values()) / sum(fused.values()))
    assert ratios == sorted(ratios, reverse=True) and ratios[-1] == pytest.approx(4, rel=1e-4)
    assert ratios[0] == pytest.approx((8 * 16 + 4) / (2 * 16))


# --- LayerNorm ---------------------------------------------------------------------------------------

def _naive_layernorm(x, w, b, eps=1e-5):
    mu = x.mean(-1, keepdim=True)
    xc = x - mu
    sq = xc ** 2
    var = sq.mean(-1, keepdim=True)
    rstd = torch.rsqrt(var + eps)
    xhat = xc * rstd
    return xhat * w + b, xhat, rstd


def _naive_layernorm_backward(dy, xhat, rstd, w):
    dw = (dy * xhat).sum(0)
    db = dy.sum(0)
    g = dy * w
    c1 = (g * xhat).mean(-1, keepdim=True)
    c2 = g.mean(-1, keepdim=True)
    dx = (g - c2 - xhat * c1) * rstd
    return dx, dw, db


@pytest.mark.parametrize("M,N", [(4, 7), (33, 96)])
def test_layernorm_bytes_eager_forward_and_backward_count_the_ops(M, N):
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, N, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(N, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(N, generator=g, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(M, N, generator=g, dtype=torch.float64)
    with torch.no_grad():
        (y, xhat, rstd), c = _counted(_naive_layernorm, x, w, b)
    ref = F.layer_norm(x, (N,), w, b, 1e-5)
    torch.testing.assert_close(y, ref)
    want = cm.layernorm_bytes(M, N, dtype_bytes=8)
    assert (c.read, c.written) == (want["read"], want["written"])

    (dx, dw, db), c = _counted(_naive_layernorm_backward, dy, xhat, rstd, w.detach())
    ref_dx, ref_dw, ref_db = torch.autograd.grad(ref, (x, w, b), dy)  # the formula is LayerNorm's gradient
    torch.testing.assert_close(dx, ref_dx)
    torch.testing.assert_close(dw, ref_dw)
    torch.testing.assert_close(db, ref_db)
    want = cm.layernorm_bytes(M, N, dtype_bytes=8, backward=True)
    assert (c.read, c.written) == (want["read"], want["written"])


def test_layernorm_bytes_fused_is_inputs_and_outputs_once():
    M, N = 10, 48
    bf16 = torch.bfloat16
    x, w, b = torch.randn(M, N, dtype=bf16), torch.randn(N, dtype=bf16), torch.randn(N, dtype=bf16)
    stats = torch.empty(2, M, dtype=torch.float32)  # mean and rstd, fp32
    fwd = cm.layernorm_bytes(M, N, dtype_bytes=torch.bfloat16, fused=True)
    assert fwd == {"read": x.nbytes + w.nbytes + b.nbytes, "written": x.nbytes + stats.nbytes}
    bwd = cm.layernorm_bytes(M, N, dtype_bytes=2, fused=True, backward=True)
    assert bwd == {"read": 2 * x.nbytes + w.nbytes + stats.nbytes, "written": x.nbytes + w.nbytes + b.nbytes}
    for backward in (False, True):
        eager = cm.layernorm_bytes(4096, 4096, backward=backward)
        fused = cm.layernorm_bytes(4096, 4096, fused=True, backward=backward)
        ratio = sum(eager.values()) / sum(fused.values())
        assert ratio == pytest.approx(12 / 2 if not backward else 21 / 3, rel=1e-3)


# --- AdamW ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("weight_decay", [0.01, 0.0])
def test_adamw_bytes_eager_counts_torch_foreach_adamw(weight_decay):
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g, requires_grad=True) for s in ((7, 5), (13,), (3, 4, 2))]
    n = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=weight_decay, foreach=True)
    ref = [p.detach().clone() for p in params]
    ref_opt = torch.optim.AdamW(ref, lr=1e-3, weight_decay=weight_decay, foreach=False)
    for step in range(2):  # the first step creates m and v; count the second
        for p, r in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=g)
            r.grad = p.grad.clone()
        ref_opt.step()
        if step == 0:
            opt.step()
            continue
        with ByteCounter() as c:
            opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p.detach(), r)
    want = cm.adamw_bytes(n, weight_decay=weight_decay != 0)
    assert (c.read, c.written) == (want["read"], want["written"]), c.ops
    assert want == {"read": (13 if weight_decay else 12) * 4 * n,
                    "written": (8 if weight_decay else 7) * 4 * n}


def test_adamw_bytes_fused_reads_four_writes_three_buffers():
    n = 1000
    p, g, m, v = (torch.zeros(n) for _ in range(4))
    assert cm.adamw_bytes(n, fused=True) == {"read": p.nbytes + g.nbytes + m.nbytes + v.nbytes,
                                             "written": p.nbytes + m.nbytes + v.nbytes}
    eager = cm.adamw_bytes(n)
    assert sum(eager.values()) / sum(cm.adamw_bytes(n, fused=True).values()) == pytest.approx(3.0)


# --- cross-entropy -----------------------------------------------------------------------------------

@pytest.mark.parametrize("M,V", [(5, 11), (16, 300)])
def test_cross_entropy_bytes_eager_counts_forward_and_backward(M, V):
    g = torch.Generator().manual_seed(V)
    logits = torch.randn(M, V, generator=g, requires_grad=True)
    y = torch.randint(0, V, (M,), generator=g)
    with ByteCounter() as c:
        loss = F.cross_entropy(logits, y)
        loss.backward()
    assert [op for op in c.ops if op != "ones_like"] == [
        "_log_softmax", "nll_loss_forward", "nll_loss_backward", "_log_softmax_backward_data"]
    want = cm.cross_entropy_bytes(M, V)
    assert (c.read, c.written) == (want["read"], want["written"])
    # what a fused kernel computes per row, and so the bytes it must move
    p = torch.softmax(logits.detach(), 1)
    torch.testing.assert_close(logits.grad, (p - F.one_hot(y, V)) / M)
    fused = cm.cross_entropy_bytes(M, V, fused=True)
    assert fused == {"read": logits.nbytes + y.nbytes, "written": logits.grad.nbytes + M * 4}
    assert cm.cross_entropy_bytes(M, V, fused=True, fused_passes=2)["read"] == 2 * logits.nbytes + y.nbytes


# --- intensity, devices, roofline -------------------------------------------------------------------

def test_devices_match_the_datasheets():
    # datasheet "with sparsity" tensor-core figures, halved to dense
    h100, a100, h200 = cm.device_spec("h100"), cm.device_spec("a100"), cm.device_spec("h200-sxm")
    assert h100.memory_bandwidth == 3.35e12 and h100.peak_flops["bf16"] == 1979e12 / 2
    assert h100.peak_flops["fp32"] == 67e12 and h100.peak_flops["fp8"] == 3958e12 / 2
    assert a100.memory_bandwidth == 2.039e12 and a100.peak_flops["bf16"] == 624e12 / 2
    assert a100.peak_flops["fp32"] == 19.5e12 and a100.peak_flops["tf32"] == 312e12 / 2
    assert h200.memory_bandwidth == 4.8e12 and h200.peak_flops == h100.peak_flops
    assert h200.memory_bytes == 141e9
    for spec in cm.DEVICES.values():
        assert spec.source and spec.peak_flops["fp32"] < spec.peak_flops["bf16"]


def test_ridge_point_and_roofline_time():
    assert cm.ridge_point("h100") == pytest.approx(295.4, abs=0.1)
    assert cm.ridge_point("h100", torch.float32) == pytest.approx(20.0)
    assert cm.ridge_point("a100", "bfloat16") == pytest.approx(312 / 2.039)
    spec = cm.device_spec("h100")
    for intensity in (0.1, 1.0, 100.0, 295.0, 296.0, 1e4):
        nbytes = 1e9
        flops = intensity * nbytes
        t = cm.roofline_time(flops, nbytes, "h100")
        memory_bound = intensity < cm.ridge_point("h100")
        assert t == pytest.approx(nbytes / spec.memory_bandwidth if memory_bound
                                  else flops / spec.peak_flops["bf16"])
        assert t >= nbytes / spec.memory_bandwidth and t >= flops / spec.peak_flops["bf16"]
    # at the ridge both bounds are equal
    r = cm.ridge_point("h200", "fp32")
    assert cm.roofline_time(r * 1e6, 1e6, "h200", "fp32") == pytest.approx(1e6 / 4.8e12)
    # a fused softmax is memory-bound by two orders of magnitude; its time is its bytes over bandwidth
    M, N = 4096, 4096
    nbytes = cm.softmax_bytes(M, N, dtype_bytes=2, fused=True)
    ai = cm.arithmetic_intensity(cm.softmax_flops(M, N), nbytes)
    assert ai == pytest.approx(5 / 4) and ai < cm.ridge_point("h100") / 100
    assert cm.roofline_time(cm.softmax_flops(M, N), nbytes, "h100") == pytest.approx(2 * M * N * 2 / 3.35e12)
    eager = cm.roofline_time(cm.softmax_flops(M, N), cm.softmax_bytes(M, N, 2), "h100")
    assert eager / cm.roofline_time(cm.softmax_flops(M, N), nbytes, "h100") == pytest.approx(4, rel=1e-3)
    assert cm.arithmetic_intensity(cm.layernorm_flops(M, N), cm.layernorm_bytes(M, N, fused=True)) < 1
    # a measured bandwidth replaces the datasheet's
    slow = spec._replace(memory_bandwidth=spec.memory_bandwidth / 2)
    assert cm.roofline_time(0, 1e9, slow) == pytest.approx(2 * cm.roofline_time(0, 1e9, spec))


def test_bad_input_is_rejected_with_the_fix():
    with pytest.raises(ValueError, match="unknown device 'tpu'.*h100-sxm"):
        cm.roofline_time(1, 1, "tpu")
    with pytest.raises(ValueError, match="no peak for dtype 'fp8'.*bf16"):
        cm.ridge_point("a100", "fp8")
    with pytest.raises(ValueError, match="N must be an int >= 1"):
        cm.softmax_bytes(4, 0)
    with pytest.raises(ValueError, match="M must be an int >= 1"):
        cm.layernorm_bytes(2.5, 4)
    with pytest.raises(ValueError, match="dtype_bytes must be"):
        cm.adamw_bytes(10, dtype_bytes=0)
    with pytest.raises(ValueError, match="fused_passes"):
        cm.cross_entropy_bytes(4, 10, fused=True, fused_passes=3)
    with pytest.raises(ValueError, match="bytes must be > 0"):
        cm.arithmetic_intensity(10, 0)
    with pytest.raises(ValueError, match="must be >= 0"):
        cm.roofline_time(-1, 10, "h100")
    assert math.isclose(cm.arithmetic_intensity(10, {"read": 3, "written": 2}), 2.0)
