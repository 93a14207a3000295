"""Chapter 11, held-out: GeLU at saturated and zero inputs (|z| up to 80, where a tanh written through exp
overflows), a log-softmax whose max sits in the masked last block beside entries 200 below it, rows of one
column and a constant row, RMSNorm's backward on binary-exact rows in groups that do not divide the rows,
segment sums in tiles of 4 x 2 with empty and one-row segments, windowed attention with a window of one key
(query tiles wider than key tiles, fewer queries than keys) and with every key holding the same value, and
the softmax forecast on seeded random sizes against the cost model.

Expected values are exact where the inputs make them so, else derived as in the visible tests (their module
docstring): u = 2^-24 per fp32 operation, E = 8u for an elementary function (exp, erf, sigmoid, log).

* GeLU: for |z| >= 8 the erf (or the tanh) is within 1e-14 of ±1, so the kernel's t is ±1 within E + 2u,
  and 0.5·z·(1 + t) adds three roundings: |y - gelu(z)| <= |z|·(E + 5u), far below the error of a sign or
  a NaN. At z = 0 every form gives 0 exactly.
* Log-softmax: [-200]*6 + [0] in blocks of 4: exp(-200) underflows to 0 in fp32, so the normaliser is 1
  and y = x exactly (the float64 value rounds to the same). A row of one column is 0 exactly. A constant row
  of N = 7: x - m = 0 and d = 7 exactly, so y = -log 7 within one log (E) and one rounding (u) of itself.
* RMSNorm: rows of ±1 or ±2 (rstd 1 or 1/2), weights and dy multiples of 1/2, N = 4: every fp32 operation of
  any arrangement of the backward is exact, so the kernel's values are the exact ones (and the same with a
  block of 8); autograd in float64 is within a few float64 roundings of them (16·u64 of the largest entry).
* Segment sums of small integers are exact in any order, fp16 output included.
* Attention with a window of one key: the softmax of one score is exp(0) = 1, so o = v exactly (a row
  that sees no key in a tile adds exactly 0 there); the row log-sum-exp is that score, a D-term fp32 dot
  and the scale: γ_{D+1}·scale·Σ|q_c·k_c|. With every key's value row the same, o is that row within
  2γ_{Sk + tiles} + 2u of it (acc and l sum the same weights, rescaled alike).
"""
import math
import random

import pytest
import torch
import torch.nn.functional as F

from minitorch_dist import costmodel as cm

from _support import gamma, roundoff

pytestmark = [
    pytest.mark.ch11,
    # tanh-GeLU through sigmoid: exp(-2u) overflows to inf for very negative u, and 1 / (1 + inf) = 0 is right
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    # a row that sees no key in a tile computes 0/0 and log(0) for lanes never stored
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
]

U32, U64 = roundoff(torch.float32), roundoff(torch.float64)
E = 8 * U32


def _dev():
    from minitorch_dist.kernels import _runtime

    return _runtime.default_device()


# --- 1. bias_gelu_kernel --------------------------------------------------------------------------


def test_bias_gelu_kernel_held_out_saturated_and_zero(ex):
    z = torch.tensor([[-80.0, -30.0, -8.0, 0.0, 8.0, 30.0, 80.0]] * 3)
    b = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.5, 2.0, 0.25])
    x = (z - b).to(_dev())  # x + b = z exactly: every value here is a short binary fraction
    bound = z.double().abs() * (E + 5 * U32)
    for approximate in ("none", "tanh"):
        y = ex.bias_gelu(x, b.to(_dev()), approximate, block_size=32)  # 21 elements, one block of 32
        y = y.double().cpu()
        assert torch.isfinite(y).all(), f"{approximate}: a finite input's GeLU is finite, got {y[0].tolist()}"
        assert (y[:, 3] == 0).all(), "gelu(0) = 0 exactly"
        want = F.gelu(z.double(), approximate=approximate)
        assert ((y - want).abs() <= bound).all(), f"{approximate}: {y[0].tolist()}, want {want[0].tolist()}"


# --- 2. online_log_softmax_kernel -----------------------------------------------------------------


def test_online_log_softmax_kernel_held_out_exact_rows(ex):
    x = torch.tensor([[-200.0] * 6 + [0.0], [3.5] * 7], device=_dev())
    y = ex.online_log_softmax(x, block_size=4).cpu()  # two blocks, the second with 3 live columns of 4
    assert torch.equal(y[0], x[0].cpu()), f"max in the masked last block: got {y[0].tolist()}"
    log7 = math.log(7)
    assert ((y[1].double() + log7).abs() <= (E + U32) * log7).all(), f"a constant row: got {y[1].tolist()}"
    single = torch.randn(3, 1, generator=torch.Generator().manual_seed(3)).to(_dev()) * 50
    assert torch.equal(ex.online_log_softmax(single, block_size=1).cpu(), torch.zeros(3, 1)), \
        "a row of one column has log-softmax 0"


# --- 3. rmsnorm_backward_kernel ---------------------------------------------------------------------


def test_rmsnorm_backward_kernel_held_out_exact_rows_in_uneven_groups(ex):
    x = torch.tensor([[1.0, -1.0, 1.0, 1.0],
                      [2.0, 2.0, -2.0, 2.0],
                      [-1.0, -1.0, 1.0, -1.0],
                      [-2.0, 2.0, 2.0, -2.0],
                      [1.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    w = torch.tensor([0.5, -1.5, 2.0, 1.0], dtype=torch.float64)
    dy = torch.tensor([[1.0, 0.5, -1.0, 2.0],
                       [-0.5, 1.5, 1.0, 0.5],
                       [2.0, -1.0, 0.5, 1.0],
                       [0.5, 0.5, -1.5, -2.0],
                       [-1.0, 2.0, 1.0, 0.5]], dtype=torch.float64)
    rstd = torch.rsqrt((x * x).mean(-1))  # 1 or 1/2, exactly
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    (xr * torch.rsqrt((xr * xr).mean(-1, keepdim=True)) * wr * dy).sum().backward()
    dev = _dev()
    dx, partial = ex.rmsnorm_backward_partials(dy.float().to(dev), x.float().to(dev), w.float().to(dev),
                                               rstd.float().to(dev), rows_per_group=3)
    assert partial.shape == (2, 4), "5 rows in groups of 3: two groups, the last with 2 rows"
    # launched directly with a block of 8 for the 4 columns: the row's mean is over N, not the block
    dx8, partial8 = torch.empty_like(dx), torch.empty_like(partial)
    ex.rmsnorm_backward_kernel[(2,)](dy.float().to(dev), x.float().to(dev), w.float().to(dev),
                                     rstd.float().to(dev), dx8, partial8, 4, 5, 4, 3, BLOCK=8)
    assert torch.equal(dx8, dx) and torch.equal(partial8, partial), "a block wider than the row: the same"
    xhat = x * rstd[:, None]
    want_partial = torch.stack([(dy[:3] * xhat[:3]).sum(0), (dy[3:] * xhat[3:]).sum(0)])
    for got, want, what in ((dx, xr.grad, "dx"), (partial, want_partial, "the groups' partial dw"),
                            (partial.sum(0), wr.grad, "dw")):
        bound = 16 * U64 * want.abs().max().item()
        assert ((got.double().cpu() - want).abs() <= bound).all(), \
            f"{what}: got {got.tolist()}, want {want.tolist()}"


# --- 4. segment_column_sum_kernel --------------------------------------------------------------------


def test_segment_column_sum_kernel_held_out_small_tiles_empty_and_one_row_segments(ex):
    a = (torch.arange(9 * 5, dtype=torch.float32).reshape(9, 5) % 7 - 3).to(_dev())
    offsets = [0, 0, 1, 1, 6, 9, 9]  # empty, one row, empty, five rows (tiles of 4 and 1), three, empty
    out = ex.segment_column_sum(a, offsets, out_dtype=torch.float16, block_g=4, block_n=2)
    assert out.shape == (6, 5) and out.dtype == torch.float16
    a = a.cpu()
    want = torch.stack([a[lo:hi].sum(0) for lo, hi in zip(offsets, offsets[1:])]).half()
    assert torch.equal(out.cpu(), want), f"got {out.tolist()}, want {want.tolist()}"


# --- 5. attention_window_kernel ---------------------------------------------------------------------


def test_attention_window_kernel_held_out_one_key_and_equal_values(ex):
    g = torch.Generator().manual_seed(21)
    B, H, Sq, Sk, D = 1, 2, 37, 45, 16
    q, k, v = (torch.randn(B, H, s, D, generator=g).to(_dev()) for s in (Sq, Sk, Sk))
    # query tiles of 32, key tiles of 16: rows 16-31 see nothing in the first key tile they visit
    o, lse = ex.attention_window(q, k, v, 1, block_m=32, block_n=16)
    assert torch.equal(o.cpu(), v[:, :, :Sq].cpu()), "a query that sees one key gets that key's value"
    q64, k64 = q.double().cpu(), k.double().cpu()[:, :, :Sq]
    scale = D ** -0.5
    want = scale * (q64 * k64).sum(-1)
    bound = gamma(D + 1, torch.float32) * scale * (q64 * k64).abs().sum(-1)
    assert ((lse.double().cpu() - want).abs() <= bound).all(), "the log-sum-exp of one score is the score"
    # every key with the same value row: the output is that row whatever the window, acc and l being sums
    # of the same weights (each within γ_{Sk + tiles} of its own value, rescales included)
    same = v[:, :, :1].expand(B, H, Sk, D).contiguous()
    o, _ = ex.attention_window(q, k, same, 20, block_m=16, block_n=16)
    bound = (2 * gamma(Sk + 3, torch.float32) + 2 * U32) * same[:, :, :Sq].double().abs().cpu()
    assert ((o.double().cpu() - same[:, :, :Sq].double().cpu()).abs() <= bound).all(), \
        "keys that all hold one value give that value, over several key tiles"


# --- 6. softmax_traffic_forecast ---------------------------------------------------------------------


def test_softmax_traffic_forecast_held_out_against_the_cost_model(ex):
    # the cost model's eager and fused bytes; a row streamed in several blocks is read twice (exercise 2)
    rng = random.Random(1111)
    for i in range(40):
        M, N, e = rng.randint(1, 4096), rng.randint(1, 5000), rng.choice([1, 2, 4, 8])
        block = rng.choice([None, 2 ** max(0, math.ceil(math.log2(N)) + rng.choice([-1, 0, 1]))])
        got = ex.softmax_traffic_forecast(M, N, e, block)
        eager, fused = cm.softmax_bytes(M, N, e, fused=False), cm.softmax_bytes(M, N, e, fused=True)
        sweeps = 1 if block is None or block >= N else 2
        want_eager = eager["read"] + eager["written"]
        want_fused = sweeps * fused["read"] + fused["written"]
        where = f"draw {i}: M={M}, N={N}, {e}-byte elements, block {block}"
        assert got["eager"] == want_eager and got["fused"] == want_fused, f"{where}: got {got}"
        assert got["ratio"] == pytest.approx(want_eager / want_fused, rel=1e-12), where
