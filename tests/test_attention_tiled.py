"""Chapter 11: FlashAttention-2 tile by tile in PyTorch (`kernels.attention_tiled`) and attention's cost.

Against `F.scaled_dot_product_attention` in float64 (outputs, the three gradients, the log-sum-exp) on
odd lengths, causal and not, query and key lengths that differ, grouped-query heads, several tile
sizes; the mechanism: no tensor the size of the score matrix is ever created, forward or backward (a
dispatch mode records every op's result); the backward takes an outside log-sum-exp (ring
attention's use); the costmodel's FLOP and byte counts against counts made here.

Tolerances (tests/_support.py's model: each operation exact times (1 + δ), |δ| <= u of the dtype it
runs in, a sum or dot product of n terms within γ_n of Σ|terms|). Each bound is computed element by
element in float64 from the inputs by ``_attention_bounds`` (first order), as in
``tests/test_flash_attention.py``: a score's dot product (γ_{d+3} of c |q|·|k|), the online softmax
over Sk keys in nt tiles (γ_{Sk + 7 nt + 10} plus u per unit of the row's score range, and twice the
row's largest score error for P / ℓ), O = P V (γ_{Sk + 2 nt + 4} of P|V|), lse (the same, absolutely,
and 8u of |lse| and log ℓ); backward P recomputed from lse, dP = dO V^T, D = rowsum(dO ∘ O), dS, and
the three sums over Sq or Sk (γ_{n+2}) with every error carried in. Against SDPA in float64 both
evaluations run in float64: twice the bound, with u = 2^-53 (~1e-14 of the values). Half and single
inputs accumulate in float32 (u = 2^-24) against float64: one evaluation, plus the rounding of the
outputs to the input dtype (u_half of the value, and of the smallest normal below). The Triton kernel
against this one: the sum of the two bounds (the kernel rounds P and dS to fp16 before its products).
A dropped rescaling, a wrong mask, a missing D or scale is off by far more than these bounds. The
costmodel's counts are integers (the tile counts divide evenly here): exact.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from minitorch_dist import costmodel as cm
from minitorch_dist.kernels import (
    tiled_attention,
    tiled_attention_backward,
    tiled_attention_delta,
    tiled_attention_forward,
)

from _support import attention_bounds as _attention_bounds
from _support import within

pytestmark = [pytest.mark.ch11, pytest.mark.timeout(120)]

CASES = [  # B, H, H_kv, Sq, Sk, d, causal, block_q, block_k
    (2, 3, 3, 37, 37, 16, True, 8, 16),
    (1, 4, 2, 20, 45, 24, True, 16, 8),
    (1, 4, 1, 45, 20, 32, False, 16, 16),
    (2, 2, 2, 50, 50, 8, False, 64, 64),
    (1, 2, 2, 45, 20, 16, True, 7, 5),
    (1, 2, 2, 1, 1, 16, True, 4, 4),
]


def _inputs(B, H, H_kv, Sq, Sk, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)
    return make(B, H, Sq, d), make(B, H_kv, Sk, d), make(B, H_kv, Sk, d), make(B, H, Sq, d)


def _reference(q, k, v, do, causal):
    """SDPA in float64 (GQA through enable_gqa): output, gradients, and the row log-sum-exp."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    grads = torch.autograd.grad(out, (q, k, v), do.double())
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ kk.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    return out.detach(), grads, torch.logsumexp(s, -1).detach()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}H{}kv{}q{}k{}d{}{}b{}x{}".format(
    *c[:6], "c" if c[6] else "", *c[7:]))
def test_equals_sdpa_in_float64(case):
    *shape, causal, bq, bk = case
    q, k, v, do = _inputs(*shape)
    want, want_grads, want_lse = _reference(q, k, v, do, causal)
    out, lse = tiled_attention_forward(q, k, v, causal, None, bq, bk)
    # two float64 evaluations (this one, SDPA's)
    bound = _attention_bounds(q, k, v, causal, do=do, acc=torch.float64, block_n=bk, evaluations=2)
    within(out, want, bound["o"], "o")
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float64
    within(lse, want_lse, bound["lse"], "lse")
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    grads = torch.autograd.grad(tiled_attention(q, k, v, causal, None, bq, bk), (q, k, v), do)
    for name, got, ref in zip("qkv", grads, want_grads):
        within(got, ref, bound["d" + name], "d" + name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_half_and_single_precision_accumulate_in_float32(dtype):
    q, k, v, do = _inputs(2, 4, 2, 33, 47, 32, dtype)
    want, want_grads, want_lse = _reference(q, k, v, do, causal=True)
    out, lse = tiled_attention_forward(q, k, v, True, None, 16, 16)
    assert out.dtype == dtype and lse.dtype == torch.float32
    bound = _attention_bounds(q, k, v, True, do=do, block_n=16)  # one float32 evaluation against float64
    within(out, want, bound["o"], "o")
    within(lse, want_lse, bound["lse"], "lse")
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    grads = torch.autograd.grad(tiled_attention(q, k, v, True, None, 16, 16), (q, k, v), do)
    for name, got, ref in zip("qkv", grads, want_grads):
        assert got.dtype == dtype
        within(got, ref, bound["d" + name], "d" + name)


class _Largest(TorchDispatchMode):
    """The element count of the largest tensor any op returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("causal", [False, True])
def test_no_score_matrix_is_ever_materialised(causal):
    B, H, S, d, tile = 1, 2, 256, 16, 32
    q, k, v, do = _inputs(B, H, H, S, S, d, torch.float32)
    with _Largest() as meter:
        out, lse = tiled_attention_forward(q, k, v, causal, None, tile, tile)
        delta = tiled_attention_delta(out, do)
        tiled_attention_backward(q, k, v, do, lse, delta, causal, None, tile, tile)
    scores = B * H * S * S
    # the largest tensors are the inputs' size (B·H·S·d) or one tile of scores (B·H·tile²), never S × S
    assert meter.largest <= max(B * H * S * d, B * H * tile * tile) < scores // 4, (meter.largest, scores)
    with _Largest() as standard:  # the check can fail: attention written out forms the scores
        (q @ k.transpose(-2, -1) * d ** -0.5).softmax(-1) @ v
    assert standard.largest >= scores


def test_the_backward_of_a_key_block_takes_the_whole_rows_lse():
    """Ring attention's use: keys in two blocks; each block's backward with the merged lse and delta;
    dq summed and dk, dv side by side equal the gradients of attention over all keys."""
    q, k, v, do = _inputs(1, 2, 2, 24, 40, 16)
    want, want_grads, _ = _reference(q, k, v, do, causal=False)
    halves = [(k[..., :17, :], v[..., :17, :]), (k[..., 17:, :], v[..., 17:, :])]
    (o_a, l_a), (o_b, l_b) = (tiled_attention_forward(q, kh, vh, False, None, 8, 8) for kh, vh in halves)
    lse = torch.logaddexp(l_a, l_b)
    out = torch.exp(l_a - lse)[..., None] * o_a + torch.exp(l_b - lse)[..., None] * o_b
    bound = _attention_bounds(q, k, v, False, do=do, acc=torch.float64, block_n=8, merged=True, evaluations=2)
    within(out, want, bound["o"], "merged o")
    delta = tiled_attention_delta(out, do)
    parts = [tiled_attention_backward(q, kh, vh, do, lse, delta, False, None, 8, 8) for kh, vh in halves]
    within(parts[0][0] + parts[1][0], want_grads[0], bound["dq"], "dq")  # (+ one add: in γ_{n+2})
    within(torch.cat([parts[0][1], parts[1][1]], -2), want_grads[1], bound["dk"], "dk")
    within(torch.cat([parts[0][2], parts[1][2]], -2), want_grads[2], bound["dv"], "dv")


def test_bad_input_names_the_fix():
    q, k, v, do = _inputs(1, 4, 4, 8, 8, 16)
    with pytest.raises(ValueError, match="batch, heads, seq, head_dim"):
        tiled_attention_forward(q[0], k, v)
    with pytest.raises(ValueError, match="n_head 4 is not divisible by n_kv_head 3"):
        tiled_attention_forward(q, k[:, :3], v[:, :3])
    with pytest.raises(ValueError, match="same shape"):
        tiled_attention_forward(q, k, v[..., :4, :])
    with pytest.raises(ValueError, match="share batch and head_dim"):
        tiled_attention_forward(q, k[..., :8], v[..., :8])
    with pytest.raises(TypeError, match="cast them to one"):
        tiled_attention_forward(q, k.float(), v)
    with pytest.raises(ValueError, match="tiled_attention_delta"):
        tiled_attention_backward(q, k, v, do, torch.zeros(1, 4, 7), torch.zeros(1, 4, 8))


# --- the cost model --------------------------------------------------------------------------------


@pytest.mark.parametrize("sq,sk", [(7, 7), (9, 4), (4, 9), (1, 5)])
def test_causal_pairs_are_the_visible_scores(sq, sk):
    visible = torch.ones(sq, sk, dtype=torch.bool).tril().sum().item()
    assert cm.attention_pairs(sq, sk, causal=True) == visible
    assert cm.attention_pairs(sq, sk) == sq * sk


def test_attention_flops_count_the_matmuls():
    B, H, S, d = 2, 3, 64, 16
    q, k, v, _ = _inputs(B, H, H, S, S, d, torch.float32)
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        s = q @ k.transpose(-2, -1)
        s.softmax(-1) @ v
    assert cm.attention_flops(B, H, S, S, d) == counter.get_total_flops()
    assert cm.attention_flops(B, H, S, S, d, backward=True, flash=True) == 10 * B * H * S * S * d
    assert cm.attention_flops(B, H, S, S, d, causal=True) == 4 * B * H * d * S * (S + 1) // 2


def test_standard_attention_moves_the_score_matrix_and_flash_does_not():
    B, H, S, d, e = 1, 1, 4096, 64, 2
    std = cm.standard_attention_bytes(B, H, S, S, d, e)
    assert std["written"] == (2 * S * S + S * d) * e  # S and P written, then O
    flash = cm.flash_attention_bytes(B, H, S, S, d, e, block_q=128)
    assert flash["read"] == (S * d + (S // 128) * 2 * S * d) * e and flash["written"] == S * d * e + S * 4
    assert sum(std.values()) > 3.5 * sum(flash.values())  # about 2·block_q / d = 4 here


def test_flash_bytes_follow_theorem_2():
    """Θ(N²d²/M): four times the bytes for twice the sequence, half for twice the on-chip memory."""
    d, e = 64, 2
    kv = lambda n, sram: cm.flash_attention_bytes(1, 1, n, n, d, e, sram_bytes=sram)["read"] - n * d * e
    # integers; the query tiles divide the sequences evenly here, so the scalings hold exactly
    assert kv(8192, 2**17) == 4 * kv(4096, 2**17)
    assert 2 * kv(8192, 2**18) == kv(8192, 2**17)
    rows = cm.flash_block_rows(2**17, d, e)
    assert rows == 2**17 // e // (4 * d)
    assert kv(8192, 2**17) == 8 * 8192 * 8192 * d * d // (2**17 // e) * e
    with pytest.raises(ValueError, match="exactly one"):
        cm.flash_attention_bytes(1, 1, 8, 8, d, e)
    assert math.isfinite(cm.flash_attention_bytes(1, 1, 8, 8, d, e, block_q=8)["read"])


def test_the_cpu_sweep_times_three_implementations_and_their_saved_bytes():
    from minitorch_dist.kernels import attention_bench as AB

    res = AB.cpu_sweep([64, 128], heads=2, head_dim=16, block=32, reps=1)
    std, tiled = res["impls"]["standard (SDPA math)"], res["impls"]["tiled FlashAttention-2 (PyTorch)"]
    assert all(t > 0 for r in res["impls"].values() for t in r["seconds"])
    # standard attention saves its S × S probabilities: more than linear in S; the tiled path saves
    # q, k, v, o (4·S·d floats) and the lse (S) per head: exactly linear
    assert std["saved_bytes"][1] > 2 * std["saved_bytes"][0]
    assert tiled["saved_bytes"] == [2 * (4 * s * 16 + s) * 4 for s in (64, 128)]


def test_the_gpu_benchmark_refuses_a_machine_without_cuda(tmp_path, capsys):
    from minitorch_dist.kernels import attention_bench as AB

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the benchmark would run")
    assert AB.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "CUDA GPU" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_triton_kernel_and_the_tiled_version_agree(dtype):
    """The two implementations of one algorithm, each other's second reference (the Triton kernel in the
    interpreter here): outputs, log-sum-exps and the three gradients."""
    from minitorch_dist.kernels import flash_attention, flash_attention_forward

    q, k, v, do = _inputs(1, 4, 2, 41, 29, 32, dtype, seed=3)
    o_t, l_t = tiled_attention_forward(q, k, v, causal=True)
    o_f, l_f = flash_attention_forward(q, k, v, causal=True)
    tiled = _attention_bounds(q, k, v, True, do=do, block_n=64)  # the defaults: tiles of 64 here,
    kernel = _attention_bounds(q, k, v, True, do=do, cast=True, block_n=32)  # 32 in the interpreter
    bound = {key: tiled[key] + kernel[key] for key in tiled}
    within(o_f, o_t, bound["o"], "o")
    within(l_f, l_t, bound["lse"], "lse")
    grads = []
    for fn in (tiled_attention, flash_attention):
        ins = [x.clone().requires_grad_(True) for x in (q, k, v)]
        grads.append(torch.autograd.grad(fn(*ins, causal=True), ins, do))
    for name, a, b in zip("qkv", *grads):
        within(a, b, bound["d" + name], "d" + name)
