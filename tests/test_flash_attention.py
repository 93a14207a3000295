"""Chapter 11: FlashAttention-2 in Triton equals attention computed in float64, forward and backward.

The reference is ``F.scaled_dot_product_attention`` (and ``torch.logsumexp`` of the scaled scores)
in float64 on the same inputs, so the only error measured is the kernels' own. Without a GPU the
kernels run in Triton's interpreter on CPU tensors, one program after another, so shapes stay small;
tiles of 16 force several tiles, lengths such as 37 and 50 leave ragged ones, and Sq != Sk checks the
causal top-left alignment. The interpreter's default tiles are 32 (the autograd path uses them).
One test compiles every kernel for an H100 without one; the `gpu` test runs long sequences in
fp16 / bf16 and skips with a reason on CPU machines.

Tolerances (tests/_support.py's model: each fp32 operation exact times (1 + δ), |δ| <= u = 2^-24, a
sum or dot product of n terms within γ_n of Σ|terms|). The kernels take fp32 or fp16 (no float64)
and accumulate in fp32; the reference is float64 (its own error, ~2^-53 of the same sums, is far below
these bounds), so each bound is one fp32 evaluation's, computed element by element in float64 from
the inputs (``_attention_bounds``, first order):

* a score s = c q·k: γ_{D+3} of c |q|·|k| (the dot, the scale rounded and applied, base 2); E is a
  row's largest such error, which moves every exp(s - m) and the normaliser alike;
* the online softmax over Sk keys in nt tiles of block_n: the row sum, a rescaling (exp, multiply)
  and an add per tile, the rounding of s - m (u of the row's range R of scores per rescaling chain):
  γ_{Sk + 7 nt + 10} + 3u·R relative, and 2E for P / ℓ; fp16 inputs round P to fp16 for P V (u_16);
* O = Σ P v / ℓ: (P|v|)·(that + γ_{Sk + 2 nt + 4}); lse = m + log ℓ: E + the sum's relative error +
  8u (|lse| + |log ℓ|) (the log, the base changes);
* backward: P recomputed from q, k and lse (their errors, the exp, the fp16 cast), dP = dO·v (γ_D),
  D = rowsum(dO ∘ O) (the kernel's O error, γ_D), dS = P (dP - D); dV = P^T dO, dQ = c dS K and
  dK = c dS^T Q sum Sq or Sk terms (γ_{n+2}), with every error above carried in; grouped-query heads
  add their group's sums.

An fp16 output adds its rounding, u_16 (|value| + its error) and u_16 times the smallest normal below.
Where the same kernel reads the same values in the same order (a transposed view against its
contiguous copy) the result is bitwise equal. A kernel that drops a rescaling, masks the wrong keys,
or forgets D or the scale is off by far more than these bounds, at most ~1e-5 of the values.
"""
import importlib.util
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:  # find, not import: the package must import triton first
    pytest.skip("chapter 11 needs Triton: pip install triton", allow_module_level=True)

from minitorch_dist.kernels import _runtime
from minitorch_dist.kernels.flash_attention import (
    flash_attention,
    flash_attention_backward,
    flash_attention_delta,
    flash_attention_forward,
)

from _support import attention_bounds, gamma, roundoff, within

pytestmark = [pytest.mark.ch11, pytest.mark.timeout(120)]
DEV = _runtime.default_device()
U = roundoff(torch.float32)
DEFAULT_TILE = 32  # the interpreter's default block_m, block_n (the autograd path uses them)


def _attention_bounds(q, k, v, causal, scale=None, do=None, **kw):
    """``_support.attention_bounds`` for this kernel: P and dS rounded to the inputs' dtype (cast=True)."""
    return attention_bounds(q, k, v, causal, scale, do, **{"cast": True, "block_n": DEFAULT_TILE, **kw})


def qkv(seed, B, H, Sq, Sk, D, H_kv=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, Sq, D), (B, H_kv or H, Sk, D), (B, H_kv or H, Sk, D)]
    return [torch.randn(*s, generator=g).to(DEV, dtype) for s in shapes]


def reference(q, k, v, causal=False, scale=None, do=None):
    """(o, lse, grads) of attention in float64 on the same inputs; k, v repeated per query head for
    GQA. grads is None without ``do``."""
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kr, vr = kd.repeat_interleave(group, dim=1), vd.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(qd, kr, vr, is_causal=causal, scale=scale)
    s = (qd @ kr.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if causal:  # top-left alignment, as is_causal: query i sees key j iff j <= i
        visible = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    grads = torch.autograd.grad(o, (qd, kd, vd), do.double()) if do is not None else None
    return o.detach(), lse.detach(), grads


def g32(k):
    return gamma(k, torch.float32)


def max_err(a, b):
    return (a.double() - b.double()).abs().max().item()


# (B, H, Sq, Sk, D, block_m, block_n): odd lengths, Sq != Sk both ways, one tile and several.
SHAPES = [
    (1, 2, 37, 37, 32, 16, 16),
    (2, 1, 50, 50, 24, None, None),
    (1, 2, 20, 45, 16, 16, 16),
    (1, 2, 45, 20, 64, 16, 16),
    (1, 1, 80, 80, 32, 32, 16),
    (2, 3, 9, 13, 16, None, None),
]


# --- forward ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_fp32_equals_sdpa_and_logsumexp(shape, causal):
    B, H, Sq, Sk, D, bm, bn = shape
    q, k, v = qkv(1, B, H, Sq, Sk, D)
    o, lse = flash_attention_forward(q, k, v, causal=causal, block_m=bm, block_n=bn)
    ref_o, ref_lse, _ = reference(q, k, v, causal)
    assert o.shape == q.shape and o.dtype == q.dtype
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32
    bound = _attention_bounds(q, k, v, causal, block_n=bn or DEFAULT_TILE)
    within(o, ref_o, bound["o"], "o")
    within(lse, ref_lse, bound["lse"], "lse")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[2], SHAPES[3]])
def test_forward_fp16_equals_sdpa_of_the_fp16_inputs(shape, causal):
    B, H, Sq, Sk, D, bm, bn = shape
    q, k, v = qkv(2, B, H, Sq, Sk, D, dtype=torch.float16)
    o, lse = flash_attention_forward(q, k, v, causal=causal, block_m=bm, block_n=bn)
    ref_o, ref_lse, _ = reference(q, k, v, causal)
    assert o.dtype == torch.float16 and lse.dtype == torch.float32
    bound = _attention_bounds(q, k, v, causal, block_n=bn or DEFAULT_TILE)
    within(o, ref_o, bound["o"], "o")
    within(lse, ref_lse, bound["lse"], "lse")


def test_scale_argument_replaces_the_default():
    q, k, v = qkv(3, 1, 2, 20, 30, 32)
    o, lse = flash_attention_forward(q, k, v, causal=True, scale=0.3)
    ref_o, ref_lse, _ = reference(q, k, v, causal=True, scale=0.3)
    bound = _attention_bounds(q, k, v, True, scale=0.3)
    within(o, ref_o, bound["o"], "o")
    within(lse, ref_lse, bound["lse"], "lse")


def test_rows_that_see_no_key_get_zero_output_and_minus_infinity_lse():
    # With top-left alignment every query sees key 0, so only an empty key sequence leaves a row blind.
    q, k, v = qkv(4, 1, 2, 20, 0, 16)
    o, lse = flash_attention_forward(q, k, v, causal=True)
    assert torch.equal(o, torch.zeros_like(o)) and bool((lse == float("-inf")).all())
    do = torch.randn_like(q)
    dq, dk, dv = flash_attention_backward(q, k, v, do, lse, flash_attention_delta(o, do), causal=True)
    assert torch.equal(dq, torch.zeros_like(q)) and dk.shape == k.shape and dv.shape == v.shape


# --- backward --------------------------------------------------------------------------------------


def _grads(q, k, v, causal, do_seed=9):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    o = flash_attention(q, k, v, causal=causal)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(do_seed)).to(DEV, o.dtype)
    return o, do, torch.autograd.grad(o, (q, k, v), do)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(2, 3, 37, 37, 32), (1, 2, 20, 45, 24), (1, 2, 45, 20, 64),
                                   (1, 1, 70, 70, 16)])
def test_gradients_through_autograd_equal_sdpa(shape, dtype, causal):
    q, k, v = qkv(5, *shape, dtype=dtype)
    o, do, grads = _grads(q, k, v, causal)
    ref_o, _, ref_grads = reference(q, k, v, causal, do=do)
    bound = _attention_bounds(q, k, v, causal, do=do)
    within(o, ref_o, bound["o"], "o")
    for name, got, want in zip("qkv", grads, ref_grads):
        assert got.dtype == dtype, name
        within(got, want, bound["d" + name], "d" + name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_m, block_n", [(16, 16), (16, 32), (32, 16)])
def test_backward_with_forced_tiles(block_m, block_n, causal):
    # Unequal tiles exercise where the causal dK/dV loop starts (the query tile holding the key tile's
    # first row) and where the dQ loop stops.
    q, k, v = qkv(6, 1, 2, 50, 37, 32)
    o, lse = flash_attention_forward(q, k, v, causal, block_m=block_m, block_n=block_n)
    do = torch.randn_like(o)
    delta = flash_attention_delta(o, do)
    terms = do.double() * o.double()
    within(delta, terms.sum(-1), g32(o.shape[-1]) * terms.abs().sum(-1), "delta")  # the same o: its sum only
    grads = flash_attention_backward(q, k, v, do, lse, delta, causal, block_m=block_m, block_n=block_n)
    _, _, ref_grads = reference(q, k, v, causal, do=do)
    bound = _attention_bounds(q, k, v, causal, do=do, block_n=block_n)
    for name, got, want in zip("qkv", grads, ref_grads):
        within(got, want, bound["d" + name], "d" + name)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("H_kv", [2, 1])
def test_grouped_query_attention_equals_repeated_kv(H_kv, causal):
    q, k, v = qkv(7, 2, 4, 33, 40, 16, H_kv=H_kv)
    o, do, grads = _grads(q, k, v, causal)
    _, lse = flash_attention_forward(q, k, v, causal)
    ref_o, ref_lse, ref_grads = reference(q, k, v, causal, do=do)
    bound = _attention_bounds(q, k, v, causal, do=do)
    within(o, ref_o, bound["o"], "o")
    within(lse, ref_lse, bound["lse"], "lse")
    assert grads[1].shape == k.shape and grads[2].shape == v.shape  # summed over each group's query heads
    for name, got, want in zip("qkv", grads, ref_grads):
        within(got, want, bound["d" + name], "d" + name)


def test_transposed_and_strided_inputs_are_read_in_place():
    # (B, S, H, D) storage seen as (B, H, S, D) through transpose(1, 2): no copy, same answer.
    g = torch.Generator().manual_seed(8)
    q_bshd, k_bshd, v_bshd = (torch.randn(2, 29, 3, 32, generator=g).to(DEV) for _ in range(3))
    q, k, v = (x.transpose(1, 2) for x in (q_bshd, k_bshd, v_bshd))
    assert not q.is_contiguous()
    o_t, do, grads_t = _grads(q, k, v, causal=True)
    o_c, _, grads_c = _grads(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(o_t, o_c)  # the same values, read in the same order: bitwise
    for a, b in zip(grads_t, grads_c):
        assert torch.equal(a, b)
    # A head dimension with stride 2 (every other column of a wider tensor) works too.
    wide = torch.randn(1, 2, 21, 64, generator=g).to(DEV)
    o, _ = flash_attention_forward(wide[..., ::2], wide[..., ::2], wide[..., 1::2])
    ref, _, _ = reference(wide[..., ::2], wide[..., ::2], wide[..., 1::2])
    within(o, ref, _attention_bounds(wide[..., ::2], wide[..., ::2], wide[..., 1::2], False)["o"], "o")


# --- backward with an external lse and delta: how ring attention uses it ---------------------------


def _merge(parts):
    """Merge (o_i, lse_i) of disjoint key blocks: lse = logaddexp of all, o = sum exp(lse_i - lse) o_i."""
    lse = parts[0][1]
    for _, lse_i in parts[1:]:
        lse = torch.logaddexp(lse, lse_i)
    o = sum(torch.exp(lse_i - lse)[..., None] * o_i for o_i, lse_i in parts)
    return o, lse


@pytest.mark.parametrize("causal", [False, True])
def test_backward_with_merged_lse_and_delta_gives_each_blocks_share(causal):
    # Sequence in two chunks (a 2-device ring): query chunk i attends key chunk j for j < i without a
    # mask and for j == i causally (non-causal: every chunk pair, unmasked). Each block's backward,
    # given the merged lse and delta of its query chunk, gives its share: dq sums over key chunks,
    # dk and dv over query chunks, and the pieces put together are the full gradients.
    q, k, v = qkv(10, 1, 2, 48, 48, 32)
    n = 24
    chunks = [slice(0, n), slice(n, 2 * n)]
    blocks = [(i, j, causal and i == j) for i in range(2) for j in range(2) if not causal or j <= i]
    fwd = {(i, j): flash_attention_forward(q[:, :, chunks[i]], k[:, :, chunks[j]], v[:, :, chunks[j]], c,
                                           block_m=16, block_n=16) for i, j, c in blocks}
    merged = [_merge([fwd[i, j] for j in range(2) if (i, j) in fwd]) for i in range(2)]
    o = torch.cat([m[0] for m in merged], dim=2)
    ref_o, ref_lse, _ = reference(q, k, v, causal)
    do = torch.randn_like(o)
    bound = _attention_bounds(q, k, v, causal, do=do, block_n=16, merged=True)
    within(o, ref_o, bound["o"], "merged o")
    within(torch.cat([m[1] for m in merged], dim=2), ref_lse, bound["lse"], "merged lse")
    _, _, ref_grads = reference(q, k, v, causal, do=do)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for i, j, c in blocks:
        qi, kj, vj, doi = q[:, :, chunks[i]], k[:, :, chunks[j]], v[:, :, chunks[j]], do[:, :, chunks[i]]
        delta = flash_attention_delta(merged[i][0], doi)  # rowsum(dO ∘ O) of the merged output
        gq, gk, gv = flash_attention_backward(qi, kj, vj, doi, merged[i][1], delta, c, block_m=16, block_n=16)
        dq[:, :, chunks[i]] += gq
        dk[:, :, chunks[j]] += gk
        dv[:, :, chunks[j]] += gv
    for name, got, want in zip("qkv", (dq, dk, dv), ref_grads):  # (+ one add per block: in γ_{n+2})
        within(got, want, bound["d" + name], "d" + name)


# --- bad input is refused with the fix -------------------------------------------------------------


def _t(*shape, dtype=torch.float32):
    return torch.zeros(*shape, dtype=dtype, device=DEV)


BAD_FORWARD = [
    ((_t(2, 16, 32), _t(2, 16, 32), _t(2, 16, 32)), ValueError, r"4-D \(batch, heads, seq, head_dim\)"),
    ((_t(2, 2, 8, 32), _t(3, 2, 8, 32), _t(3, 2, 8, 32)), ValueError,
     "batch sizes differ: q has 2, k and v have 3"),
    ((_t(1, 2, 8, 32), _t(1, 2, 8, 16), _t(1, 2, 8, 16)), ValueError, "head dims differ.*project them"),
    ((_t(1, 2, 8, 32), _t(1, 2, 8, 32), _t(1, 2, 9, 32)), ValueError,
     "k .* and v .* must have the same shape"),
    ((_t(1, 6, 8, 32), _t(1, 4, 8, 32), _t(1, 4, 8, 32)), ValueError,
     "n_head 6 is not divisible by n_kv_head 4"),
    ((_t(1, 2, 8, 8), _t(1, 2, 8, 8), _t(1, 2, 8, 8)), ValueError,
     r"head_dim 8 is not supported: use 16\.\.128, or the tiled PyTorch path kernels\.attention_tiled"),
    ((_t(1, 2, 8, 160), _t(1, 2, 8, 160), _t(1, 2, 8, 160)), ValueError, "head_dim 160 is not supported"),
    ((_t(1, 2, 8, 32, dtype=torch.float64),) * 3, TypeError, r"got torch.float64: cast with \.float\(\)"),
    ((_t(1, 2, 8, 32, dtype=torch.int32),) * 3, TypeError, r"got torch.int32: cast with \.float\(\)"),
    ((_t(1, 2, 8, 32), _t(1, 2, 8, 32, dtype=torch.float16), _t(1, 2, 8, 32)), TypeError, "cast them to one"),
]


@pytest.mark.parametrize("args, error, match", BAD_FORWARD)
def test_bad_inputs_are_refused_with_the_fix(args, error, match):
    with pytest.raises(error, match=match):
        flash_attention_forward(*args)
    with pytest.raises(error, match=match):
        flash_attention(*args)


@pytest.mark.parametrize("block_m, block_n, match", [(24, None, "block_m must be a power of two >= 16"),
                                                     (None, 8, "block_n must be a power of two >= 16")])
def test_tile_sizes_must_be_powers_of_two_of_at_least_16(block_m, block_n, match):
    q = _t(1, 1, 8, 16)
    with pytest.raises(ValueError, match=match):
        flash_attention_forward(q, q, q, block_m=block_m, block_n=block_n)


def test_backward_refuses_lse_delta_and_do_of_the_wrong_shape():
    q = _t(1, 2, 8, 16)
    rows, bad = _t(1, 2, 8), _t(1, 2, 9)
    with pytest.raises(ValueError, match=r"lse must have shape \(B, H, Sq\) = \(1, 2, 8\), got \(1, 2, 9\)"):
        flash_attention_backward(q, q, q, q, bad, rows)
    with pytest.raises(ValueError, match=r"delta must have shape \(B, H, Sq\) = \(1, 2, 8\)"):
        flash_attention_backward(q, q, q, q, rows, bad)
    with pytest.raises(ValueError, match="do must have q's shape"):
        flash_attention_backward(q, q, q, _t(1, 2, 7, 16), rows, rows)
    with pytest.raises(ValueError, match="o .* and its gradient do .* must have the same shape"):
        flash_attention_delta(q, _t(1, 2, 7, 16))


@pytest.mark.skipif(not _runtime.INTERPRET, reason="concerns the interpreter only")
def test_bf16_in_the_interpreter_is_refused_with_the_fix():
    q = _t(1, 1, 16, 16, dtype=torch.bfloat16)
    fix = "bf16 needs a CUDA GPU; in the interpreter cast to float16 or float32"
    with pytest.raises(TypeError, match=fix):
        flash_attention(q, q, q)


# --- the compiled path -----------------------------------------------------------------------------


def test_kernels_compile_for_an_h100_without_one(tmp_path):
    # The interpreter runs the kernels' Python; the GPU path goes through Triton's compiler, which checks
    # what the interpreter lets pass (loop-carried types, tl.dot shapes, shared memory). Compile each
    # kernel to PTX for sm_90, in a process where TRITON_INTERPRET=0, each in one of the default
    # configurations, and each configuration once: fp16 / bf16 / fp32, tf32 and ieee dots, causal or not.
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
fa = importlib.import_module("minitorch_dist.kernels.flash_attention")  # the module, not the function
i32 = lambda n: ["i32"] * n
def ptrs(dt, n): return ["*" + dt] * n
sigs = {
    fa._fwd_kernel: lambda dt: ptrs(dt, 4) + ["*fp32"] + i32(21) + ["fp32"],
    fa._bwd_dkdv_kernel: lambda dt: ptrs(dt, 4) + ["*fp32"] * 2 + ptrs(dt, 2) + i32(30) + ["fp32"] * 2,
    fa._bwd_dq_kernel: lambda dt: ptrs(dt, 4) + ["*fp32"] * 2 + ptrs(dt, 1) + i32(25) + ["fp32"] * 2,
}
configs = [("fp16", 64, (64, 64), "tf32", False), ("bf16", 128, (64, 64), "tf32", True),
           ("fp32", 128, (32, 32), "ieee", True)]  # the defaults of _config for these dtypes and D
for (fn, sig), (dt, D, blocks, prec, causal) in zip(sigs.items(), configs, strict=True):
    consts = [causal, prec, *blocks, D]
    args = fn.arg_names
    types = sig(dt) + ["constexpr"] * len(consts)
    assert len(types) == len(args), fn
    src = ASTSource(fn, dict(zip(args, types)), {(len(args) - 5 + i,): c for i, c in enumerate(consts)})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
    assert ".target sm_90" in ptx
src = ASTSource(fa._delta_kernel, dict(zip(fa._delta_kernel.arg_names, ["*fp16", "*fp16", "*fp32"] + i32(11)
                + ["constexpr"] * 2)), {(14,): 64, (15,): 128})
assert ".target sm_90" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
"""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_long_sequences_on_the_gpu_are_as_accurate_as_sdpa(dtype, D, causal):
    # At S = 1024 in fp16 / bf16 the rounding of the inputs' precision dominates: as in the
    # FlashAttention repository's tests, the kernels' error against float64 must stay within twice
    # that of PyTorch's own SDPA in the same dtype, plus one rounding of the result to the dtype
    # (u·max|exact|: where SDPA's own error happens to be smaller than the output's rounding).
    q, k, v = qkv(11, 2, 4, 1024, 1024, D, dtype=dtype)
    o, do, grads = _grads(q, k, v, causal)
    ref_o, _, ref_grads = reference(q, k, v, causal, do=do)
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    sdpa_o = F.scaled_dot_product_attention(ql, kl, vl, is_causal=causal)
    sdpa_grads = torch.autograd.grad(sdpa_o, (ql, kl, vl), do)
    for name, ours, theirs, exact in zip(["o", "dq", "dk", "dv"], (o, *grads), (sdpa_o, *sdpa_grads),
                                         (ref_o, *ref_grads)):
        floor = roundoff(dtype) * exact.abs().max().item()
        assert max_err(ours, exact) <= 2 * max_err(theirs, exact) + floor, name
