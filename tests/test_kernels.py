"""Chapter 11: every Triton kernel equals its PyTorch reference, forward and backward.

Without a GPU the kernels run in Triton's interpreter on CPU tensors (minitorch_dist.kernels sets
TRITON_INTERPRET=1 before defining them); with one they run compiled on CUDA tensors. Shapes are
drawn at random (seeded) and include widths that are not powers of two, so every kernel's masked
tail is exercised, and narrow blocks that make the kernels loop over column / vocabulary blocks.
The interpreter runs programs one after another, so shapes stay small. The `gpu` tests check the
chapter's bandwidth claim and skip with a reason on CPU machines.

Tolerances (tests/_support.py's model: every fp32 operation is exact times (1 + δ), |δ| <= u = 2^-24,
and a sum of n terms in any order is within γ_n of Σ|terms|). Each kernel is one operation, computed
in fp32 like its PyTorch reference but in another order; the kernels take fp32, fp16 and bf16 only
(no float64), so every comparison is of one operation in fp32 against torch's in fp32, and the bound
is the sum of the two evaluations' error bounds, computed element by element in float64 from the
inputs (the helpers below; first order):

* softmax: the sum of N exponentials (γ_{N+6}: the sum, exp within 2 ulps, the division), and the
  rounding of x - max, u·R of the exponent (R the row's range); the online kernel adds, per lane,
  a rescaling (exp, multiply) and an add per block, the merge of the lanes and u·R per rescaling
  chain: γ_{10 nb + BLOCK + 10} + 4u·R. Times y. Backward: y·(|dy| + Σ y|dy|)·(2 r + γ_{N+2}) per
  evaluation, r the forward's relative bound.
* LayerNorm: the mean (γ_{N+1} of mean|x|), x - mean, the variance (squares and a sum, γ_{N+2} of
  var + mean x^2: torch's one-pass moments have the same first-order bound), rstd (γ_4 and half the
  variance's relative error), y (γ_3); backward the two row means of dx, and dw, db summed over the M
  rows (γ_{M+1}), each with the forward's errors of xhat carried in.
* cross-entropy: log of the online sum (its relative bound, absolutely), the log and the adds (4u of
  each term), the mean over the kept rows (γ_{M+1}); the gradient exp(x - lse) with lse's error.
* AdamW: no reduction; each step's elementwise operations (γ_2 ... γ_5 of their terms) and the
  carried errors of p, m, v, tracked over the steps in float64 (``_adamw_error``).

A half-precision output adds its own rounding, u_half·|value| (and u_half times the smallest normal
below it; for bf16 a whole ulp, 2u, as Triton's interpreter truncates fp32 to bf16). Where the same
operations run on the same values in the same order (a gradient added to itself, a view written
through, the GPT whose LayerNorm outputs are swapped for the kernel's), the comparison is exact. A
wrong kernel (a lost rescaling, a masked tail counted, a missing term of the backward, a wrong bias
correction) is off by far more than these bounds, which sit at 1e-7 to 1e-4 of the values.
"""
import copy
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:  # find, not import: the package must import triton first
    pytest.skip("chapter 11 needs Triton: pip install triton", allow_module_level=True)

from minitorch_dist import kernels as K
from minitorch_dist.kernels import _runtime
from minitorch_dist.models.gpt import GPT, GPTConfig

from _support import gamma, roundoff

pytestmark = pytest.mark.ch11
DEV = K.default_device()


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(DEV, dtype)


def random_shapes(seed, k, max_rows=16, max_cols=700):
    """k (rows, cols) drawn at random; the fixed ones add a single column, an exact power of two
    and one past it."""
    g = gen(seed)
    drawn = [(int(torch.randint(1, max_rows + 1, (), generator=g)),
              int(torch.randint(1, max_cols + 1, (), generator=g))) for _ in range(k)]
    return drawn + [(3, 1), (4, 256), (2, 257)]


# --- the bounds (see the module docstring) ------------------------------------------------------------

U = roundoff(torch.float32)
TINY = torch.finfo(torch.float32).tiny  # below it (subnormals) an fp32 result errs by up to u·TINY


def g32(k):
    """Higham's γ_k in fp32."""
    return gamma(k, torch.float32)


def within(got, want, bound, where=""):
    """|got - want| <= bound, element by element (bound a tensor or a float); equal infinities agree."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu()
    diff = torch.where(got == want, 0.0, (got - want).abs())
    bad = ~(diff <= bound)  # NaN counts as outside
    if bad.any():
        excess = (diff - bound)[bad]
        raise AssertionError(f"{where}: {int(bad.sum())} of {got.numel()} elements beyond the bound; worst "
                             f"by {excess.max().item():.3g} (derived in the module docstring)")


def half_rounding(value, dtype):
    """What rounding an fp32 result to ``dtype`` adds: u·|value|, and u·(smallest normal) below it. For
    bf16 a whole ulp, 2u: Triton's interpreter casts fp32 to bf16 by truncation (compiled, it rounds to
    nearest)."""
    if dtype == torch.float32:
        return 0.0
    u = roundoff(dtype) * (2 if dtype == torch.bfloat16 else 1)
    return u * (value.abs() + torch.finfo(dtype).smallest_normal)


def _row_range(x):
    """max - min of each row's finite entries (0 for a row with none), float64, kept as (..., 1)."""
    x = x.detach().double().cpu()
    finite = torch.isfinite(x)
    hi = torch.where(finite, x, -torch.inf).amax(-1, keepdim=True)
    lo = torch.where(finite, x, torch.inf).amin(-1, keepdim=True)
    return torch.where(finite.any(-1, keepdim=True), hi - lo, torch.zeros_like(hi))


def _softmax_rel(x, block=None):
    """Relative error bound of one fp32 softmax of the rows of ``x`` (per row): torch's and the
    one-block kernel (block >= N), or the online kernel (blocks of ``block``)."""
    n, r = x.shape[-1], _row_range(x)
    if block is None or block >= n:
        return g32(n + 6) + U * r
    nb = -(-n // block)
    return g32(10 * nb + block + 10) + 4 * U * r


def _softmax_bound(x, block=None, dtype=torch.float32):
    """|kernel - torch.softmax| of the rows of x, element by element."""
    y = torch.softmax(x.detach().double().cpu(), dim=-1)
    err = y * (_softmax_rel(x, block) + _softmax_rel(x)) + 2 * U * TINY
    return err + half_rounding(y, dtype)


def _softmax_backward_bound(x, dy, block=None):
    y, dy = torch.softmax(x.detach().double().cpu(), dim=-1), dy.detach().double().cpu()
    n, t = x.shape[-1], (y * dy.abs()).sum(-1, keepdim=True)
    rel = 2 * (_softmax_rel(x, block) + _softmax_rel(x)) + 2 * g32(n + 2)
    return y * (dy.abs() + t) * rel + 2 * U * TINY


def _ln_forward_error(x, w, b, eps):
    """One fp32 LayerNorm of the rows of x: the exact (float64) statistics and the error bounds of the
    mean, rstd (relative), xhat and y, element by element."""
    x, w = x.detach().double().cpu(), w.detach().double().cpu()
    b = b.detach().double().cpu() if b is not None else torch.zeros_like(w)
    n = x.shape[-1]
    mu = x.mean(-1, keepdim=True)
    d = x - mu
    var = (d * d).mean(-1, keepdim=True)
    rstd = (var + eps).rsqrt()
    e_mu = g32(n + 1) * x.abs().mean(-1, keepdim=True)
    e_d = e_mu + U * d.abs()
    e_var = 2 * (d.abs() * e_d).mean(-1, keepdim=True) + g32(n + 2) * (var + (x * x).mean(-1, keepdim=True))
    rel_r = e_var / (2 * (var + eps)) + g32(4)
    xhat = d * rstd
    e_xhat = rstd * (e_d + d.abs() * (rel_r + g32(1)))
    e_y = w.abs() * rstd * (e_d + d.abs() * (rel_r + g32(3))) + g32(1) * b.abs()
    return dict(mu=mu, rstd=rstd, xhat=xhat, y=xhat * w + b, e_mu=e_mu, rel_r=rel_r, e_xhat=e_xhat, e_y=e_y)


def _ln_backward_error(x, w, b, eps, dy, e_dy=0.0):
    """One fp32 LayerNorm backward (dx per row; dw, db summed over all rows) at upstream gradient dy,
    itself known to within ``e_dy``: error bounds of dx, dw, db."""
    f = _ln_forward_error(x, w, b, eps)
    w, dy = w.detach().double().cpu(), dy.detach().double().cpu()
    n = x.shape[-1]
    rows = dy.reshape(-1, n).shape[0]
    g = w * dy
    e_g = U * g.abs() + w.abs() * e_dy
    xhat, e_xhat, rstd = f["xhat"], f["e_xhat"], f["rstd"]
    c1, c2 = (xhat * g).mean(-1, keepdim=True), g.mean(-1, keepdim=True)
    e_c1 = (e_xhat * g.abs() + xhat.abs() * e_g).mean(-1, keepdim=True) + g32(n + 2) * (xhat * g).abs().mean(
        -1, keepdim=True)
    e_c2 = e_g.mean(-1, keepdim=True) + g32(n + 1) * g.abs().mean(-1, keepdim=True)
    a = g.abs() + xhat.abs() * c1.abs() + c2.abs()
    e_dx = rstd * (e_g + e_xhat * c1.abs() + xhat.abs() * e_c1 + e_c2 + a * (g32(4) + f["rel_r"]))
    e_dy = torch.as_tensor(e_dy, dtype=torch.float64).expand_as(dy)
    flat = lambda t: t.reshape(-1, n)
    e_dw = (flat(e_dy) * flat(xhat).abs() + flat(dy).abs() * flat(e_xhat)).sum(0) + g32(rows + 1) * (
        flat(dy) * flat(xhat)).abs().sum(0)
    e_db = flat(e_dy).sum(0) + g32(rows) * flat(dy).abs().sum(0)
    return dict(e_dx=e_dx, e_dw=e_dw, e_db=e_db, dx=rstd * (g - (xhat * c1 + c2)),
                dw=flat(dy * xhat).sum(0), db=flat(dy).sum(0))


def _cross_entropy_bounds(logits, targets, ignore_index=-100, reduction="mean", block=None, upstream=1.0):
    """|kernel - F.cross_entropy| of the loss, and of the gradient element by element (two fp32
    evaluations: the online sum, lse, the kept rows' mean; exp(x - lse) with lse's error)."""
    x = logits.detach().double().cpu().reshape(-1, logits.shape[-1])
    t = targets.detach().cpu().reshape(-1)
    kept = t != ignore_index
    v, count = x.shape[-1], int(kept.sum())
    if block is None:
        block = min(1 << (v - 1).bit_length(), 4096)
    rel_s = _softmax_rel(x, block)  # the online sum, relatively (bounds torch's one pass as well)
    lse = torch.logsumexp(x, -1, keepdim=True)
    log_s = lse - x.amax(-1, keepdim=True).clamp(min=-1e300)
    x_t = x.gather(1, t.clamp(min=0)[:, None])
    loss_rows = (lse - x_t)[:, 0]
    e_lse = rel_s + 4 * U * (log_s.abs() + lse.abs())
    e_row = (e_lse[:, 0] + 4 * U * (lse - x_t).abs()[:, 0])[kept]
    scale = 1.0 / count if reduction == "mean" else 1.0
    e_loss = 2 * scale * (e_row.sum() + g32(count + 1) * loss_rows[kept].abs().sum()).item()
    y = torch.exp(x - lse)
    onehot = torch.nn.functional.one_hot(t.clamp(min=0), v).double()
    finite = torch.where(torch.isfinite(x), (x - lse).abs(), torch.zeros_like(x))
    e_grad = 2 * abs(upstream) * scale * (y * (e_lse + U * finite + 4 * U) + 4 * U * (y - onehot).abs())
    e_grad = torch.where(kept[:, None], e_grad + 2 * U * TINY, torch.zeros_like(e_grad))
    return e_loss, e_grad.reshape(logits.shape)


def _adamw_error(p, grads, *, lr, beta1, beta2, eps, weight_decay):
    """The error bound of one fp32 AdamW implementation after ``len(grads)`` steps from p (moments 0),
    element by element, for p, m and v: each step's elementwise operations (their constants rounded to
    fp32 too) and the errors carried from the step before; the exact trajectory in float64."""
    p = p.detach().double().cpu()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    ep, em, ev = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    decay = 1 - lr * weight_decay
    for step, g in enumerate(grads, start=1):
        g = g.detach().double().cpu()
        ep = ep * decay + g32(2) * (p * decay).abs()
        p = p * decay
        em = em * (1 - (1 - beta1)) + g32(4) * (m.abs() + (1 - beta1) * (g.abs() + m.abs()))
        m = m + (1 - beta1) * (g - m)
        ev = ev * beta2 + g32(5) * (beta2 * v.abs() + (1 - beta2) * g * g)
        v = beta2 * v + (1 - beta2) * g * g
        bc2, step_size = math.sqrt(1 - beta2 ** step), lr / (1 - beta1 ** step)
        root = v.sqrt()
        e_root = torch.minimum(ev / root.clamp(min=1e-300), ev.sqrt())
        denom = root / bc2 + eps
        e_denom = e_root / bc2 + g32(4) * denom
        low = (denom - e_denom).clamp(min=eps / 2)
        update = step_size * m / denom
        e_update = step_size * (em / low + m.abs() * e_denom / (low * denom)) + g32(4) * update.abs()
        ep = ep + e_update + g32(1) * (p.abs() + update.abs())
        p = p - update
    return ep, em, ev


# --- where the kernels run ------------------------------------------------------------------------


def test_backend_follows_the_machine():
    user_set = os.environ.get("TRITON_INTERPRET") not in (None, "", "0")
    if torch.cuda.is_available() and not user_set:
        assert K.backend() == "cuda" and DEV.type == "cuda"
    else:
        assert K.backend() == "interpreter" and DEV.type == "cpu"
        assert os.environ["TRITON_INTERPRET"] == "1"


# Each kernel's signature for an ahead-of-time compile: pointer dtypes, int / float scalars, constexprs.
_COMPILE = {
    "softmax._softmax_fwd_kernel": ("*fp32 *fp32 i32 i32 i32", [1024]),
    "softmax._softmax_fwd_online_kernel": ("*fp16 *fp16 i32 i32 i32", [1024]),
    "softmax._softmax_bwd_kernel": ("*bf16 *bf16 *bf16 i32 i32 i32 i32", [1024]),
    "layernorm._layernorm_fwd_kernel": ("*fp16 *fp16 *fp32 *fp32 *fp32 *fp32 i32 i32 i32 fp32", [True, 1024]),
    "layernorm._layernorm_bwd_dx_kernel": ("*fp32 " * 8 + "i32 i32 i32 i32 i32 i32", [False, 1024]),
    "layernorm._layernorm_bwd_dwdb_kernel": ("*fp32 *fp32 *fp32 *fp32 i32 i32", [True, 32, 128]),
    "adamw._adamw_kernel": ("*fp32 *fp32 *fp32 *fp32 i32" + " fp32" * 7, [1024]),
    "cross_entropy._cross_entropy_kernel": ("*fp16 *i64 *fp32 *fp16 *fp32 i32 i32 i32 i32", [True, 4096]),
}


def test_every_kernel_compiles_for_an_h100_without_one(tmp_path):
    # The interpreter runs the Python of a kernel; the GPU path goes through Triton's compiler, which
    # rejects things the interpreter lets pass (loop-carried types, int64 loop bounds...). Compile each
    # kernel to PTX for sm_90 (ptxas ships with triton), in a process where TRITON_INTERPRET=0.
    code = f"""
import importlib, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for name, (sig, consts) in {_COMPILE!r}.items():
    module, kernel = name.split(".")
    fn = getattr(importlib.import_module("minitorch_dist.kernels." + module), kernel)
    args = fn.arg_names
    types = sig.split() + ["constexpr"] * len(consts)
    src = ASTSource(fn, dict(zip(args, types)),
                    {{(len(args) - len(consts) + i,): c for i, c in enumerate(consts)}})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={{"num_warps": 4}}).asm["ptx"]
    assert ".target sm_90" in ptx, name
"""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(not _runtime.INTERPRET, reason="concerns the interpreter only")
def test_interpreter_repairs_a_triton_imported_before_it(monkeypatch):
    # `import triton` before TRITON_INTERPRET=1 (torch.compile does it) builds tl.max & co. for the
    # GPU; recreate that state, then check _runtime rebuilds them so interpreted kernels still run.
    from triton.runtime.jit import JITFunction

    tl = _runtime.tl
    for module in (tl, tl.standard):
        for name in ("max", "sum"):
            monkeypatch.setattr(module, name, JITFunction(getattr(tl.standard, name).fn))
    x = randn(gen(0), 3, 50)
    with pytest.raises(Exception, match="outside of the scope of a kernel"):
        K.softmax(x)
    _runtime._interpret_triton_library()
    within(K.softmax(x), torch.softmax(x, dim=-1), _softmax_bound(x), "softmax")


def test_compiled_backend_rejects_cpu_tensors_with_the_fix(monkeypatch):
    monkeypatch.setattr(_runtime, "INTERPRET", False)
    with pytest.raises(ValueError, match=r"compiled for CUDA.*\.cuda\(\).*TRITON_INTERPRET=1"):
        _runtime.check_device(torch.zeros(3))


# --- softmax --------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", random_shapes(0, 4) + [(2, 3, 17)])
def test_softmax_forward_equals_reference(shape):
    x = randn(gen(1), *shape, scale=3.0)
    y = K.softmax(x)
    within(y, K.softmax_reference(x), _softmax_bound(x), "softmax vs reference")
    within(y, torch.softmax(x, dim=-1), _softmax_bound(x), "softmax vs torch")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_half_precision_computes_in_fp32(dtype):
    x = randn(gen(2), 5, 333, dtype=dtype, scale=4.0)
    y = K.softmax(x)
    assert y.dtype == dtype
    within(y, torch.softmax(x.float(), dim=-1), _softmax_bound(x, dtype=dtype), f"softmax {dtype}")


@pytest.mark.parametrize("N", [1, 64, 65, 1000])
def test_online_softmax_streams_long_rows_in_blocks(N):
    x = randn(gen(3), 3, N, scale=5.0)
    x[0, : min(N - 1, 130)] = -float("inf")  # a leading block of only -inf: the rescaling guard
    within(K.softmax_forward(x, block_size=64), torch.softmax(x, dim=-1), _softmax_bound(x, 64), "online")


def test_softmax_is_stable_for_large_logits_and_masks():
    x = randn(gen(4), 4, 200, scale=1e4)
    x[:, 100:] = -float("inf")  # masked-attention style rows
    y = K.softmax(x)
    assert torch.isfinite(y).all()
    within(y, torch.softmax(x, dim=-1), _softmax_bound(x), "large logits")


@pytest.mark.parametrize("block_size", [None, 32])
@pytest.mark.parametrize("shape", random_shapes(5, 2, max_rows=8, max_cols=300))
def test_softmax_backward_equals_autograd(shape, block_size):
    g = gen(6)
    x, dy = randn(g, *shape, scale=2.0).requires_grad_(), randn(g, *shape)
    (dx,) = torch.autograd.grad(K.softmax(x, block_size=block_size), x, dy)
    (ref,) = torch.autograd.grad(torch.softmax(x, dim=-1), x, dy)
    within(dx, ref, _softmax_backward_bound(x, dy, block_size), "softmax backward")


def test_softmax_takes_strided_inputs():
    base = randn(gen(7), 6, 300)
    rows = base[:, :250]  # row stride 300: used in place
    assert _runtime.as_rows(rows).data_ptr() == rows.data_ptr()
    within(K.softmax(rows), torch.softmax(rows, dim=-1), _softmax_bound(rows), "row-strided")
    cols = base.t()  # strided last dimension: copied once
    within(K.softmax(cols), torch.softmax(cols, dim=-1), _softmax_bound(cols), "column-strided")
    assert K.softmax(randn(gen(7), 0, 5)).shape == (0, 5)


def test_softmax_rejects_bad_input_clearly():
    with pytest.raises(TypeError, match="floating"):
        K.softmax(torch.ones(2, 3, dtype=torch.int64, device=DEV))
    with pytest.raises(ValueError, match="0-dim"):
        K.softmax(torch.tensor(1.0, device=DEV))
    with pytest.raises(TypeError, match=r"float64.*\.float\(\)"):
        K.softmax(torch.ones(2, 3, dtype=torch.float64, device=DEV))
    with pytest.raises(ValueError, match="power of two"):
        K.softmax_forward(torch.ones(2, 3, device=DEV), block_size=48)
    with pytest.raises(ValueError, match="differ in shape"):
        K.softmax_backward(torch.ones(2, 3, device=DEV), torch.ones(2, 4, device=DEV))


# --- LayerNorm ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", random_shapes(10, 3))
def test_layernorm_forward_equals_reference(shape, bias):
    g = gen(11)
    x, w = randn(g, *shape, scale=3.0) + 1.0, randn(g, shape[-1])
    b = randn(g, shape[-1]) if bias else None
    y, mean, rstd = K.layernorm_forward(x, w, b, eps=1e-5)
    f = _ln_forward_error(x, w, b, 1e-5)
    within(y, K.layernorm_reference(x, w, b, 1e-5), 2 * f["e_y"], "y")
    var, mu = torch.var_mean(x, dim=-1, unbiased=False)
    within(mean, mu, 2 * f["e_mu"][..., 0], "mean")
    # torch.rsqrt(var + eps) here: the same bound, and one more rounding each of its own
    within(rstd, torch.rsqrt(var + 1e-5), 2 * (f["rel_r"] + g32(2))[..., 0] * f["rstd"][..., 0], "rstd")


@pytest.mark.parametrize("N", [64, 300, 1000])
def test_layernorm_forward_loops_over_column_blocks(N):
    g = gen(12)
    x, w, b = randn(g, 3, 2, N, scale=2.0), randn(g, N), randn(g, N)
    y, _, _ = K.layernorm_forward(x, w, b, block_size=64)
    within(y, F.layer_norm(x, (N,), w, b), 2 * _ln_forward_error(x, w, b, 1e-5)["e_y"], "y")


def test_layernorm_fp16_computes_in_fp32():
    g = gen(13)
    x, w, b = (randn(g, 6, 333, dtype=torch.float16, scale=3.0), randn(g, 333, dtype=torch.float16),
               randn(g, 333, dtype=torch.float16))
    y = K.layer_norm(x, w, b)
    assert y.dtype == torch.float16
    f = _ln_forward_error(x, w, b, 1e-5)
    bound = 2 * f["e_y"] + half_rounding(f["y"].abs() + 2 * f["e_y"], torch.float16)
    within(y, F.layer_norm(x.float(), (333,), w.float(), b.float()), bound, "fp16 y")


@pytest.mark.parametrize("groups", [1, 3, "one row each", None])
@pytest.mark.parametrize("shape, bias", [((13, 257), True), ((7, 96), False), ((1, 5), True)])
def test_layernorm_backward_equals_autograd(shape, bias, groups):
    g = gen(14)
    x, dy = randn(g, *shape, scale=2.0), randn(g, *shape)
    w, b = randn(g, shape[-1]), (randn(g, shape[-1]) if bias else None)
    _, mean, rstd = K.layernorm_forward(x, w, b)
    groups = {1: 1, 3: min(3, shape[0]), "one row each": shape[0], None: None}[groups]  # None: the default
    dx, dw, db = K.layernorm_backward(dy, x, w, mean, rstd, has_bias=bias, groups=groups)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = b.clone().requires_grad_() if bias else None
    F.layer_norm(xr, (shape[-1],), wr, br).backward(dy)
    e = _ln_backward_error(x, w, b, 1e-5, dy)
    within(dx, xr.grad, 2 * e["e_dx"], "dx")
    within(dw, wr.grad, 2 * e["e_dw"], "dw")
    if bias:
        within(db, br.grad, 2 * e["e_db"], "db")
    else:
        assert db is None


def test_layer_norm_autograd_function_3d_fp16():
    g = gen(15)
    x = randn(g, 2, 5, 130, dtype=torch.float16).requires_grad_()
    w = randn(g, 130, dtype=torch.float16).requires_grad_()
    b = randn(g, 130, dtype=torch.float16).requires_grad_()
    dy = randn(g, 2, 5, 130, dtype=torch.float16)
    ours = torch.autograd.grad(K.layer_norm(x, w, b), (x, w, b), dy)
    leaves = [t.detach().float().requires_grad_() for t in (x, w, b)]
    ref = torch.autograd.grad(F.layer_norm(leaves[0], (130,), leaves[1], leaves[2]), leaves, dy.float())
    e = _ln_backward_error(x, w, b, 1e-5, dy)
    for name, a, r in zip(("dx", "dw", "db"), ours, ref):
        assert a.dtype == torch.float16
        bound = 2 * e["e_" + name] + half_rounding(e[name].abs() + 2 * e["e_" + name], torch.float16)
        within(a, r, bound, f"fp16 {name}")


def test_layernorm_module_is_a_drop_in_for_nn_layernorm():
    g = gen(16)
    ref = torch.nn.LayerNorm(70).to(DEV)
    with torch.no_grad():
        ref.weight.copy_(randn(g, 70))
        ref.bias.copy_(randn(g, 70))
    ours = K.LayerNorm(70).to(DEV)
    ours.load_state_dict(ref.state_dict())
    x = randn(g, 4, 70)
    f = _ln_forward_error(x, ref.weight, ref.bias, ref.eps)
    within(ours(x), ref(x), 2 * f["e_y"], "y")
    ours(x).square().sum().backward()
    ref(x).square().sum().backward()
    # the upstream gradient 2y is each implementation's own: within 2 e_y of the exact one
    e = _ln_backward_error(x, ref.weight, ref.bias, ref.eps, 2 * f["y"], e_dy=2 * f["e_y"])
    within(ours.weight.grad, ref.weight.grad, 2 * e["e_dw"], "dw")
    within(ours.bias.grad, ref.bias.grad, 2 * e["e_db"], "db")


def test_replace_layernorms_in_a_gpt_keeps_loss_and_gradients():
    """The swap changes the LayerNorm operations and nothing else. Two checks, each exact or single-op:
    the GPT with its LayerNorms replaced equals, bitwise, the original GPT whose nn.LayerNorm outputs are
    swapped (by forward hooks) for the kernel's on the same input (so the modules sit where they were,
    with the same parameters and eps, and the rest of the model is untouched); and every kernel
    LayerNorm, forward and backward, on the very tensors the GPT gives it, equals F.layer_norm within
    the single-op bounds. (The kernels run in fp32 only: a whole-GPT comparison of the two LayerNorms
    would need a float64 model.)"""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, block_size=8, n_layer=1, n_head=2, n_embd=24)
    ref = GPT(cfg).to(DEV)
    model = copy.deepcopy(ref)
    params_before = [id(p) for p in model.parameters()]
    K.replace_layernorms(model)
    assert [id(p) for p in model.parameters()] == params_before
    assert sum(isinstance(m, K.LayerNorm) for m in model.modules()) == 3  # ln_1, ln_2, ln_f
    for m in ref.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.register_forward_hook(lambda mod, inp, out: K.layer_norm(inp[0], mod.weight, mod.bias, mod.eps))
    seen = []  # (module, input, output gradient) of every kernel LayerNorm in the GPT
    for m in model.modules():
        if isinstance(m, K.LayerNorm):
            m.register_forward_hook(lambda mod, inp, out: seen.append([mod, inp[0].detach()]))
            m.register_full_backward_hook(lambda mod, gin, gout: next(
                s for s in seen if s[0] is mod and len(s) == 2).append(gout[0].detach()))
    idx = torch.randint(0, 50, (2, 8), generator=gen(17)).to(DEV)
    _, loss = model(idx, idx)
    _, ref_loss = ref(idx, idx)
    assert torch.equal(loss, ref_loss)
    loss.backward()
    ref_loss.backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    assert len(seen) == 3 and all(len(s) == 3 for s in seen)
    for mod, x, dy in seen:
        w, b = mod.weight.detach(), mod.bias.detach()
        f, e = _ln_forward_error(x, w, b, mod.eps), _ln_backward_error(x, w, b, mod.eps, dy)
        shape = (x.shape[-1],)
        within(K.layer_norm(x, w, b, mod.eps), F.layer_norm(x, shape, w, b, mod.eps), 2 * f["e_y"], "y")
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        ours = torch.autograd.grad(K.layer_norm(*leaves, mod.eps), leaves, dy)
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        theirs = torch.autograd.grad(F.layer_norm(leaves[0], shape, *leaves[1:], mod.eps), leaves, dy)
        for name, a, r in zip(("dx", "dw", "db"), ours, theirs):
            within(a, r, 2 * e["e_" + name], name)


def test_layernorm_rejects_bad_input_clearly():
    x, w = torch.ones(2, 8, device=DEV), torch.ones(8, device=DEV)
    with pytest.raises(ValueError, match=r"weight has shape \(7,\).*last dimension is 8"):
        K.layer_norm(x, torch.ones(7, device=DEV))
    with pytest.raises(ValueError, match="needs a weight"):
        K.layer_norm(x, None)
    with pytest.raises(ValueError, match="groups must be in"):
        _, mean, rstd = K.layernorm_forward(x, w)
        K.layernorm_backward(x, x, w, mean, rstd, groups=3)
    wide = torch.ones(1, 16385, device=DEV)
    _, mean, rstd = K.layernorm_forward(wide, torch.ones(16385, device=DEV))
    with pytest.raises(ValueError, match="N = 16385 is wider.*torch.nn.LayerNorm"):
        K.layernorm_backward(wide, wide, torch.ones(16385, device=DEV), mean, rstd)
    with pytest.raises(ValueError, match="last dimension only"):
        K.LayerNorm((4, 8))
    with pytest.raises(ValueError, match="elementwise_affine=True"):
        K.LayerNorm(8, elementwise_affine=False)


# --- AdamW ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n, weight_decay", [(1, 0.0), (1000, 0.1), (4097, 0.01)])
def test_fused_adamw_step_equals_reference(n, weight_decay):
    g = gen(20)
    p = randn(g, n)
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    hyper = dict(lr=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=weight_decay)
    grads = []
    for step in range(1, 4):
        grad = randn(g, n)
        grads.append(grad)
        K.fused_adamw_step(p, grad, m, v, step=step, **hyper)
        K.adamw_reference(p_ref, grad, m_ref, v_ref, step=step, **hyper)
    e_p, e_m, e_v = _adamw_error(randn(gen(20), n), grads, **hyper)
    within(p, p_ref, 2 * e_p, "p")
    within(m, m_ref, 2 * e_m, "m")
    within(v, v_ref, 2 * e_v, "v")
    assert not torch.equal(p, randn(gen(20), n))  # it moved


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_fused_adamw_equals_torch_adamw_on_a_model(weight_decay):
    """Five steps on a model's gradients; both optimizers get the gradients the fused model computes
    (each step an elementwise update: ``_adamw_error``'s bound; the kernels have no float64, so a
    training comparison where the two models' gradients drift apart has no derived bound)."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(10, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3)).to(DEV)
    twin = copy.deepcopy(model)
    start = [p.detach().clone() for p in model.parameters()]
    hyper = dict(lr=1e-2, beta1=0.85, beta2=0.98, eps=1e-7, weight_decay=weight_decay)
    fused = K.FusedAdamW(model, lr=1e-2, betas=(0.85, 0.98), eps=1e-7, weight_decay=weight_decay)
    eager = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.85, 0.98), eps=1e-7,
                              weight_decay=weight_decay, foreach=False)
    g = gen(21)
    grads = [[] for _ in start]
    for _ in range(5):
        x = randn(g, 8, 10)
        fused.zero_grad()
        model(x).square().mean().backward()
        eager.zero_grad()
        for p, q, seq in zip(model.parameters(), twin.parameters(), grads):
            q.grad = p.grad.detach().clone()
            seq.append(q.grad.clone())
        fused.step()
        eager.step()
    errors = [_adamw_error(p0, seq, **hyper) for p0, seq in zip(start, grads)]
    for (e_p, _, _), p, q in zip(errors, model.parameters(), twin.parameters()):
        within(p, q, 2 * e_p, "p")
    offset = 0  # the moments live in one flat buffer, parameter after parameter
    for (_, e_m, e_v), p, q in zip(errors, model.parameters(), twin.parameters()):
        k = p.numel()
        state = eager.state[q]
        within(fused.exp_avg[offset:offset + k], state["exp_avg"].reshape(-1), 2 * e_m.reshape(-1), "m")
        within(fused.exp_avg_sq[offset:offset + k], state["exp_avg_sq"].reshape(-1), 2 * e_v.reshape(-1), "v")
        offset += k


def test_flat_parameters_are_views_that_backward_fills():
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Linear(5, 2)).to(DEV)
    before = [p.detach().clone() for p in model.parameters()]
    flat = K.FlatParameters(model.parameters())
    assert flat.param.numel() == sum(p.numel() for p in model.parameters())
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.detach(), b)  # copied into the flat buffer
        assert p.untyped_storage().data_ptr() == flat.param.untyped_storage().data_ptr()
    x = randn(gen(22), 3, 4)
    model(x).sum().backward()
    first = flat.grad.clone()
    assert first.abs().sum() > 0
    model(x).sum().backward()  # accumulates into the same buffer: the same gradient added to itself, exact
    assert torch.equal(flat.grad, 2 * first)
    flat.param.add_(1.0)  # writes through to the model
    assert torch.equal(next(model.parameters()).detach(), before[0] + 1)
    flat.zero_grad()
    assert flat.grad.abs().sum() == 0
    next(model.parameters()).grad = None
    with pytest.raises(RuntimeError, match="no longer a view.*FlatParameters.zero_grad"):
        flat.check_views()


def test_adamw_rejects_bad_input_clearly():
    f = torch.zeros(8, device=DEV)
    with pytest.raises(TypeError, match="fp32.*chapter 08"):
        K.fused_adamw_step(f.half(), f, f, f, step=1)
    with pytest.raises(ValueError, match="flat contiguous 1-D"):
        K.fused_adamw_step(f.view(2, 4), f, f, f, step=1)
    with pytest.raises(ValueError, match="grad has 7 elements"):
        K.fused_adamw_step(f, f[:7], f, f, step=1)
    with pytest.raises(ValueError, match="step counts from 1"):
        K.fused_adamw_step(f, f, f, f, step=0)
    with pytest.raises(ValueError, match="betas"):
        K.FusedAdamW(torch.nn.Linear(2, 2), betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="float16.*fp32"):
        K.FlatParameters(torch.nn.Linear(2, 2).half().parameters())


# --- cross-entropy --------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("shape", random_shapes(30, 3, max_cols=1000))
def test_cross_entropy_equals_reference(shape, reduction):
    M, V = shape
    g = gen(31)
    logits = randn(g, M, V, scale=3.0).requires_grad_()
    targets = torch.randint(0, V, (M,), generator=g).to(DEV)
    targets[1::3] = -100  # ignored rows
    loss = K.cross_entropy(logits, targets, reduction=reduction)
    ref = F.cross_entropy(logits, targets, reduction=reduction)
    e_loss, e_grad = _cross_entropy_bounds(logits, targets, reduction=reduction)
    within(loss, ref, e_loss, "loss")
    within(torch.autograd.grad(loss, logits)[0], torch.autograd.grad(ref, logits)[0], e_grad, "grad")


@pytest.mark.parametrize("V", [1, 64, 65, 1000])
def test_cross_entropy_streams_the_vocabulary_in_blocks(V):
    g = gen(32)
    logits = randn(g, 5, V, scale=20.0)
    logits[0, : min(V - 1, 100)] = -float("inf")  # a leading block of only -inf
    targets = torch.randint(0, V, (5,), generator=g).to(DEV)
    targets[0] = V - 1
    loss, grad = K.cross_entropy_forward_backward(logits, targets, block_size=64)
    x = logits.clone().requires_grad_()
    ref = F.cross_entropy(x, targets)
    ref.backward()
    e_loss, e_grad = _cross_entropy_bounds(logits, targets, block=64)
    within(loss, ref, e_loss, "loss")
    within(grad, x.grad, e_grad, "grad")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cross_entropy_half_precision_logits(dtype):
    g = gen(33)
    logits = randn(g, 6, 300, dtype=dtype, scale=3.0).requires_grad_()
    targets = torch.randint(0, 300, (6,), generator=g).to(DEV)
    loss = K.cross_entropy(logits, targets)
    (grad,) = torch.autograd.grad(loss, logits)
    x = logits.detach().float().requires_grad_()
    ref = F.cross_entropy(x, targets)
    ref.backward()
    assert grad.dtype == dtype and loss.dtype == torch.float32  # the loss stays fp32, the gradient is rounded
    e_loss, e_grad = _cross_entropy_bounds(logits, targets)
    y = torch.softmax(logits.detach().double().cpu(), -1) - torch.nn.functional.one_hot(targets.cpu(), 300)
    within(loss, ref, e_loss, "loss")
    within(grad, x.grad, e_grad + half_rounding(y.abs() / 6 + e_grad, dtype), "grad")


def test_cross_entropy_batched_logits_ignore_index_and_upstream_scale():
    g = gen(34)
    logits = randn(g, 2, 5, 40, scale=2.0).requires_grad_()
    targets = torch.randint(0, 40, (2, 5), generator=g).to(DEV)
    targets[0, 0] = 7
    loss = K.cross_entropy(logits, targets, ignore_index=7)
    (grad,) = torch.autograd.grad(3.0 * loss, logits)  # backward scales the kept gradient
    x = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(x.reshape(-1, 40), targets.reshape(-1), ignore_index=7)
    (3.0 * ref).backward()
    e_loss, e_grad = _cross_entropy_bounds(logits, targets, ignore_index=7, upstream=3.0)
    within(loss, ref, e_loss, "loss")
    within(grad, x.grad, e_grad, "grad")
    all_ignored = torch.full((2, 5), -100, device=DEV)
    loss = K.cross_entropy(logits, all_ignored)  # torch: nan loss, zero gradient
    (grad,) = torch.autograd.grad(loss, logits)
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.reshape(-1, 40), all_ignored.reshape(-1)))
    assert grad.abs().sum() == 0
    no_grad_loss, no_grad = K.cross_entropy_forward_backward(logits.detach(), targets, compute_grad=False)
    within(no_grad_loss, F.cross_entropy(logits.detach().reshape(-1, 40), targets.reshape(-1)),
           _cross_entropy_bounds(logits, targets)[0], "loss without gradient")
    assert no_grad is None


def test_cross_entropy_rejects_bad_input_clearly():
    logits = torch.zeros(3, 5, device=DEV)
    with pytest.raises(IndexError, match="target 5 is out of bounds for 5 classes"):
        K.cross_entropy(logits, torch.tensor([0, 5, 1], device=DEV))
    with pytest.raises(TypeError, match="integer tensor of class indices"):
        K.cross_entropy(logits, torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match=r"targets of shape \(4,\).*shape \(3,\)"):
        K.cross_entropy(logits, torch.zeros(4, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="no classes"):
        K.cross_entropy(torch.zeros(3, 0, device=DEV), torch.zeros(3, dtype=torch.long, device=DEV))
    with pytest.raises(ValueError, match="'mean' or 'sum'"):
        K.cross_entropy(logits, torch.zeros(3, dtype=torch.long, device=DEV), reduction="none")


# --- benchmark -----------------------------------------------------------------------------------


def test_bench_eager_sequences_move_what_the_cost_model_counts():
    """The benchmark's "eager" baselines are the op sequences costmodel's eager counts describe, so
    its GB/s sit on the same bytes as the notebook's model."""
    from minitorch_dist import costmodel
    from minitorch_dist.analysis.meters import ByteCounter
    from minitorch_dist.kernels import bench

    M, N = 6, 37
    x, w, b = torch.randn(M, N), torch.randn(N), torch.randn(N)
    for name, args, want in (("softmax", (x,), costmodel.softmax_bytes(M, N)),
                             ("layernorm", (x, w, b), costmodel.layernorm_bytes(M, N))):
        eager = bench.KERNELS[name][1]["eager"]
        with ByteCounter() as c:
            eager(*args)
        assert {"read": c.read, "written": c.written} == want, name


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on machines without a GPU")
def test_bench_refuses_on_cpu_with_a_clear_message(tmp_path, capsys):
    from minitorch_dist.kernels import bench

    out = tmp_path / "results.json"
    assert bench.main(["--out", str(out), "--smoke"]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["softmax", "layernorm"])
def test_fused_kernel_reaches_80_percent_of_copy_bandwidth(kernel):
    from minitorch_dist.kernels import bench

    row = bench.measure(kernel, M=8192, N=8192, dtype=torch.float32, impls=("triton",))
    assert row["triton"] >= 0.8 * row["copy"], row


@pytest.mark.gpu
def test_bench_writes_results_with_the_gpu_name(tmp_path):
    from minitorch_dist.kernels import bench

    out = tmp_path / "results.json"
    assert bench.main(["--out", str(out), "--smoke"]) == 0
    results = json.loads(out.read_text())
    assert results["gpu"] == torch.cuda.get_device_name(0) and results["triton"] and results["torch"]
    for k in ("softmax", "layernorm"):
        rows = results["kernels"][k]
        assert [r["N"] for r in rows] == bench.SMOKE_SIZES
        assert all(r[c] > 0 for r in rows for c in ("eager", "torch", "compile", "triton", "copy"))
