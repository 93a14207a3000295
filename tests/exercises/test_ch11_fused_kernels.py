"""Chapter 11 exercises, autograded: fused bias + GeLU, online softmax, LayerNorm backward reductions,
FlashAttention's forward, and the bytes of a softmax predicted, eager and fused.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). On a machine
without a CUDA GPU the kernels run in Triton's interpreter on CPU, so shapes stay small; they
still include columns that are not powers of two (masked tails), rows longer than one block, and
row counts that do not fill the last group. References are PyTorch in float64.

In the interpreter the tests also count the bytes each kernel loads and stores, per tensor, by
wrapping the interpreter's masked load and store: the online softmax must read each row exactly
twice and write it once, the LayerNorm backward must read ``x`` and ``dy`` exactly once. The
softmax forecast (exercise 6) is compared with two counts: the library's five eager ops under
``analysis.meters.ByteCounter`` (every op's tensor arguments and results), and the library's fused
softmax kernels (one block, and streamed) under the same interpreter hooks.
Checks of bad input first make a valid call, so a stub fails them too.

Tolerances (see tests/_support.py). Bytes are exact. Each kernel is one short fp32 computation (its
docstring: load, compute in fp32, cast on store), compared element by element with PyTorch in float64
on the same inputs, within a first-order bound of that computation (the ``_*_bound`` helpers): every
fp32 operation rounds by u = 2^-24 of its result, a sum of n terms by γ_n of Σ|terms| in any order
(Higham §4.2), an elementary function (exp, erf, sigmoid, log, rsqrt) by at most E = 4 ulp = 8u
(numpy's float32 functions, which the interpreter runs, and CUDA's libdevice stay within it), and an
error δa of a function's argument moves it by |f'(a)|·δa; a store to fp16 adds u_fp16 = 2^-11 of the
value (or 2^-25, half the subnormal spacing, below fp16's smallest normal). For GeLU that is the sum
z = x + b, the constant, erf (or the sigmoid of the tanh form) and the product 0.5·z·(1 + t). For the
online softmax a term exp(x - m) is computed against each running max and rescaled once per later
block: u|x - m| + u·(its max's climb) + (blocks + 1)·(E + u), the normaliser γ_{N+blocks} of itself
more, the division u. For LayerNorm's backward the given fp32
mean and rstd are themselves off the float64 statistics the reference recomputes: the mean by
γ_{N+1} of mean|x|, rstd by γ_{2N+4} + E of itself (a variance of N terms, eps, rsqrt); they enter
x̂ = (x - mean)·rstd, then the row sums c1, c2 (γ_{N+2}), dx, and the groups' sums of dy·x̂ and dy
(γ_R, then γ_G across groups). FlashAttention's forward is the online softmax of scores
q·kᵀ·scale (γ_{D+2} of |q|·|k|·scale) over key tiles, P·V summed over Sk keys, out = acc / l, lse = m
+ log l. The column sum is G terms in the kernel's block order: γ_{G-1}·Σ|a| (Higham eq. 4.4). A
formula of its own (the other GeLU) differs by far more than the bound somewhere; a forecast's
ratio of counts is exact up to one division (rel 1e-12), or a stated asymptote (rel 1e-3).
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _support import gamma, roundoff

pytestmark = [
    pytest.mark.ch11,
    # tanh-GeLU through sigmoid: exp(-2u) overflows to inf for very negative u, and 1 / (1 + inf) = 0 is right
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]


def _dev():
    from minitorch_dist.kernels import _runtime

    return _runtime.default_device()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype).to(_dev())


class _Traffic:
    """Addresses and element sizes of every element a kernel loaded or stored."""

    def __init__(self):
        self.loads: list[tuple[np.ndarray, int]] = []
        self.stores: list[tuple[np.ndarray, int]] = []

    @staticmethod
    def _in(records, t: torch.Tensor) -> int:
        lo = t.untyped_storage().data_ptr()
        hi = lo + t.untyped_storage().nbytes()
        return sum(int(((a >= lo) & (a < hi)).sum()) * size for a, size in records)

    def read(self, t=None) -> int:
        """Bytes loaded (from tensor ``t``'s storage, or from anywhere)."""
        return sum(a.size * s for a, s in self.loads) if t is None else self._in(self.loads, t)

    def written(self, t=None) -> int:
        return sum(a.size * s for a, s in self.stores) if t is None else self._in(self.stores, t)


@contextlib.contextmanager
def _count_traffic():
    from minitorch_dist.kernels import _runtime

    if not _runtime.INTERPRET:
        pytest.skip("bytes are counted in Triton's interpreter; this run compiles for CUDA")
    try:
        from triton.runtime.interpreter import InterpreterBuilder as B

        load0, store0 = B.create_masked_load, B.create_masked_store
    except (ImportError, AttributeError) as e:  # the interpreter's internals moved
        pytest.skip(f"this Triton's interpreter has no masked load/store hooks to count bytes: {e}")
    traffic = _Traffic()

    def load(self, ptrs, mask, other, cache_policy, is_volatile):
        out = load0(self, ptrs, mask, other, cache_policy, is_volatile)
        traffic.loads.append((np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)],
                              out.data.dtype.itemsize))
        return out

    def store(self, ptrs, value, mask, cache_policy):
        traffic.stores.append((np.asarray(ptrs.data)[np.asarray(mask.data, dtype=bool)],
                               value.data.dtype.itemsize))
        return store0(self, ptrs, value, mask, cache_policy)

    B.create_masked_load, B.create_masked_store = load, store
    try:
        yield traffic
    finally:
        B.create_masked_load, B.create_masked_store = load0, store0


# --- 1. bias_gelu_kernel --------------------------------------------------------------------------

U32, U16, U64 = roundoff(torch.float32), roundoff(torch.float16), roundoff(torch.float64)
E = 8 * U32  # an elementary function in fp32: within 4 ulp


def _g(n):
    return gamma(n, torch.float32)


def _stored(value, dtype):
    """The rounding of a store to ``dtype``: fp16 rounds by u_fp16 of the value, or by half its subnormal
    spacing, 2^-25, below 2^-14 (none for fp32: the kernels compute in fp32)."""
    if dtype != torch.float16:
        return torch.zeros_like(value)
    return U16 * value.abs() + 2.0 ** -25


def _within(got, want, bound, where):
    """|got - want| <= bound, element by element (bound: a tensor broadcast to want's shape)."""
    err = (got.double().cpu() - want.double().cpu()).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu().expand_as(err)
    ok = (err <= bound) | (err == 0)
    if not ok.all():
        worst = int(torch.where(ok, -math.inf, err - bound).flatten().argmax())
        raise AssertionError(f"{where}: off by {err.flatten()[worst].item():.3g} where "
                             f"{bound.flatten()[worst].item():.3g} is allowed (the module docstring's bound)")


def _gelu_ref(x, b, approximate):
    return F.gelu(x.double() + b.double(), approximate=approximate)


def _gelu_bound(x, b, approximate, dtype=torch.float32):
    """Elementwise: the fp32 kernel's GeLU of x + b against the float64 one (module docstring)."""
    z = x.double().cpu() + b.double().cpu()
    dz = U32 * z.abs()  # x + b rounded
    if approximate == "none":
        a = z * 2 ** -0.5
        t = torch.erf(a)
        dt = 2 / math.sqrt(math.pi) * torch.exp(-a * a) * (dz * 2 ** -0.5 + 2 * U32 * a.abs()) + E
    else:
        c = math.sqrt(2 / math.pi)
        a = c * (z + 0.044715 * z ** 3)
        da = c * (1 + 3 * 0.044715 * z * z) * dz + 7 * U32 * c * (z.abs() + 0.044715 * z.abs() ** 3)
        sig = torch.sigmoid(2 * a)
        t = 2 * sig - 1
        dt = 2 * (2 * sig * (1 - sig) * da + E * sig) + 2 * U32  # tanh = 2·sigmoid(2a) - 1
    y = 0.5 * z * (1 + t)
    dy = 0.5 * z.abs() * dt + 0.5 * (1 + t).abs() * dz + 3 * U32 * (y.abs() + 0.5 * z.abs() * (1 + t).abs())
    return dy + _stored(y, dtype) + 4 * U64 * y.abs()


def test_bias_gelu_kernel_masks_the_tail(ex):
    """Launched directly on an output that is the front of a NaN-filled buffer: the last block
    must leave everything past n_elements alone. First of its tests, so a kernel that forgets the
    mask fails here rather than writing past a tensor's end (which can crash the interpreter)."""
    from minitorch_dist.kernels._runtime import triton

    g = _gen(2)
    M, N, block = 5, 30, 64  # 150 elements: the third block has 22 live lanes of 64
    x, b = _randn(M, N, g=g), _randn(N, g=g)
    buf = torch.full((M * N + 100,), float("nan"), device=_dev())
    ex.bias_gelu_kernel[(triton.cdiv(M * N, block),)](x, b, buf, M * N, N, BLOCK=block, APPROXIMATE=0)
    _within(buf[: M * N].view(M, N), _gelu_ref(x, b, "none"), _gelu_bound(x, b, "none"), "the live lanes")
    assert torch.isnan(buf[M * N:]).all(), "the kernel wrote past the end of its output"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_kernel_matches_torch(ex, approximate):
    g = _gen(0)
    # (37, 99) = 3663 elements: the last of 15 blocks of 256 is partly masked; a 3-D input too
    for shape, block in (((37, 99), 256), ((2, 3, 40), 64), ((1, 1), 16)):
        x, b = _randn(*shape, g=g) * 3, _randn(shape[-1], g=g)
        y = ex.bias_gelu(x, b, approximate, block_size=block)
        assert y.shape == x.shape and y.dtype == x.dtype
        _within(y, _gelu_ref(x, b, approximate), _gelu_bound(x, b, approximate), f"gelu {shape}")
    # the two formulas differ by far more than the bound: the kernel must honour APPROXIMATE
    x, b = _randn(8, 64, g=g) * 3, _randn(64, g=g)
    other = "tanh" if approximate == "none" else "none"
    off = (ex.bias_gelu(x, b, approximate).double().cpu() - _gelu_ref(x, b, other).cpu()).abs()
    assert (off > _gelu_bound(x, b, other)).any()


def test_bias_gelu_kernel_random_shapes_and_fp16(ex):
    g = _gen(1)
    for _ in range(3):
        M, N = (int(v) for v in torch.randint(1, 50, (2,), generator=g))
        x, b = _randn(M, N, g=g, dtype=torch.float16), _randn(N, g=g, dtype=torch.float16)
        y = ex.bias_gelu(x, b, block_size=128)
        assert y.dtype == torch.float16
        _within(y, _gelu_ref(x, b, "none"), _gelu_bound(x, b, "none", torch.float16), f"fp16 ({M}, {N})")


def test_bias_gelu_kernel_rejects_bad_input(ex):
    x, b = _randn(4, 6, g=_gen(3)), _randn(6, g=_gen(4))
    ex.bias_gelu(x, b)  # a valid call first
    with pytest.raises(ValueError, match="bias must be 1-D"):
        ex.bias_gelu(x, _randn(5, g=_gen(5)))
    with pytest.raises(ValueError, match="approximate must be"):
        ex.bias_gelu(x, b, approximate="fast")
    with pytest.raises(ValueError, match="power of two"):
        ex.bias_gelu(x, b, block_size=100)


# --- 2. online_softmax_kernel ---------------------------------------------------------------------

def _softmax_bound(x, block, dtype=torch.float32):
    """Elementwise: an fp32 online softmax of x's rows in blocks of ``block`` columns against float64."""
    x = x.double().cpu()
    N = x.shape[-1]
    blocks = math.ceil(N / block)
    m = x.amax(-1, keepdim=True)
    first = x[..., :block].amax(-1, keepdim=True)  # the running max starts here and climbs to m
    term = U32 * (x - m).abs() + U32 * (m - first) + (blocks + 1) * (E + U32)  # exp(x - m), rescaled
    rel_d = term.amax(-1, keepdim=True) + _g(N + blocks)
    y = torch.softmax(x, -1)
    return y * (term + rel_d + U32) + _stored(y, dtype) + 4 * U64 * y


@pytest.mark.parametrize("M,N,block", [(13, 300, 32), (7, 64, 64), (4, 1000, 128), (3, 1, 16), (6, 17, 256)])
def test_online_softmax_kernel_matches_torch(ex, M, N, block):
    x = _randn(M, N, g=_gen(N), dtype=torch.float32) * 4
    y = ex.online_softmax(x, block_size=block)
    _within(y, torch.softmax(x.double(), -1), _softmax_bound(x, block), f"({M}, {N}), blocks of {block}")


def test_online_softmax_kernel_rescales_when_the_max_grows(ex):
    # each later block holds larger values, so d must be rescaled at every block; offsets of
    # thousands overflow exp without the max subtracted
    N = 200
    ramp = torch.linspace(0, 60, N)
    x = torch.stack([ramp, ramp.flip(0), ramp + 5000, torch.zeros(N), -ramp - 3000]).to(_dev())
    y = ex.online_softmax(x, block_size=16)
    assert torch.isfinite(y).all()
    bound = _softmax_bound(x, 16)
    _within(y, torch.softmax(x.double(), -1), bound, "rows whose max grows block by block")
    # each row sums to 1 up to its elements' bounds (and this float64 sum's own rounding)
    _within(y.double().sum(-1), torch.ones(5, dtype=torch.float64), bound.sum(-1) + gamma(N, torch.float64),
            "the rows' sums")


def test_online_softmax_kernel_fp16_and_strided_rows(ex):
    from minitorch_dist.kernels._runtime import triton

    g = _gen(6)
    x16 = _randn(9, 150, g=g, dtype=torch.float16) * 3
    y16 = ex.online_softmax(x16, block_size=64)
    assert y16.dtype == torch.float16
    _within(y16, torch.softmax(x16.double(), -1), _softmax_bound(x16, 64, torch.float16), "fp16 softmax")
    # rows with strides other than N, launched directly: the kernel must use both row strides
    M, N, block = 6, 45, 16
    xbig = _randn(M, N + 11, g=g)
    ybig = torch.full((M, N + 3), float("nan"), device=_dev())
    x, y = xbig[:, :N], ybig[:, :N]
    ex.online_softmax_kernel[(M,)](x, y, x.stride(0), y.stride(0), N, BLOCK=block)
    _within(y, torch.softmax(x.double(), -1), _softmax_bound(x, block), "strided rows")
    assert torch.isnan(ybig[:, N:]).all(), "the kernel wrote outside its N columns"
    assert triton.cdiv(N, block) == 3  # sanity: the row really spans several blocks


def test_online_softmax_kernel_reads_each_row_twice_and_writes_it_once(ex):
    M, N, block = 5, 100, 32
    x = _randn(M, N, g=_gen(7))
    with _count_traffic() as t:
        y = ex.online_softmax(x, block_size=block)
    # two fp32 softmaxes: the kernel's, in blocks, and torch's, in one
    _within(y, torch.softmax(x, -1), _softmax_bound(x, block) + _softmax_bound(x, N), "vs torch's fp32")
    e = x.element_size()
    assert t.read(x) == 2 * M * N * e, f"read {t.read(x) / (M * N * e):.2f} x the input: one sweep for " \
                                       "max and normaliser together, one to write"
    assert t.written(y) == M * N * e and t.read() == t.read(x) and t.written() == t.written(y), \
        "no intermediate may go through memory"


def test_online_softmax_kernel_rejects_bad_input(ex):
    x = _randn(3, 10, g=_gen(8))
    ex.online_softmax(x)  # a valid call first
    with pytest.raises(ValueError, match="power of two"):
        ex.online_softmax(x, block_size=48)
    with pytest.raises(TypeError, match="float64"):
        ex.online_softmax(x.double())


# --- 3. layernorm_backward_kernel -----------------------------------------------------------------

def _layernorm_case(M, N, g, dtype=torch.float32, eps=1e-5):
    """Inputs of a LayerNorm backward and PyTorch's gradients (float64) for them."""
    x, w, b = _randn(M, N, g=g, dtype=dtype) * 2 + 1, _randn(N, g=g, dtype=dtype), _randn(N, g=g, dtype=dtype)
    dy = _randn(M, N, g=g, dtype=dtype)
    x64, w64, b64 = (t.double().requires_grad_() for t in (x, w, b))
    y = F.layer_norm(x64, (N,), w64, b64, eps)
    dx, dw, db = torch.autograd.grad(y, (x64, w64, b64), dy.double())
    xf = x.float()
    mean = xf.mean(-1)
    rstd = torch.rsqrt(xf.var(-1, unbiased=False) + eps)
    xhat = (x.double() - mean.double()[:, None]) * rstd.double()[:, None]
    return (x, w, dy, mean, rstd), (dx, dw, db), xhat


def _layernorm_bounds(x, w, dy, mean, rstd, R, dtype=torch.float32):
    """Elementwise bounds of the fp32 LayerNorm backward with the given fp32 ``mean``/``rstd`` against the
    float64 references (module docstring): dx and the final dw, db against autograd (which recomputes the
    statistics exactly); a group's partial sums against Σ dy·x̂ with the given statistics. The given
    statistics' own deviation from the exact ones is computed here, not bounded."""
    X, W, DY = (t.double().cpu() for t in (x, w, dy))
    mu_hat, r_hat = mean.double().cpu()[:, None], rstd.double().cpu()[:, None]
    M, N = X.shape
    mu = X.mean(-1, keepdim=True)
    r = torch.rsqrt(X.var(-1, unbiased=False, keepdim=True) + 1e-5)
    d_mu, d_r = (mu_hat - mu).abs(), (r_hat - r).abs()
    xh = (X - mu_hat) * r_hat  # what the kernel computes, with the given statistics
    stat = d_mu * r_hat + (X - mu).abs() * d_r  # x̂ with the given statistics against the exact x̂,
    # and the float64 reference's own statistics (a mean of N terms; a variance, eps and rsqrt)
    stat = stat + gamma(N + 2, torch.float64) * X.abs().mean(-1, keepdim=True) * r \
        + (X - mu).abs() * (gamma(2 * N + 6, torch.float64) + 8 * U64) * r
    g = DY * W
    c1, c2 = (xh * g).sum(-1, keepdim=True) / N, g.sum(-1, keepdim=True) / N
    d_xh = 2 * U32 * xh.abs() + stat
    d_c1 = (_g(N + 5) * (xh * g).abs().sum(-1, keepdim=True) + (d_xh * g.abs()).sum(-1, keepdim=True)) / N
    d_c2 = _g(N + 2) * g.abs().sum(-1, keepdim=True) / N
    h = xh * c1 + c2
    inner = g - h
    d_dx = (r_hat * (U32 * g.abs() + d_xh * c1.abs() + xh.abs() * d_c1 + d_c2 + U32 * (xh * c1).abs()
                     + U32 * h.abs() + U32 * inner.abs()) + U32 * (inner * r_hat).abs() + inner.abs() * d_r
            + gamma(2 * N + 8, torch.float64) * r * (g.abs() + (xh * c1).abs() + c2.abs()))
    dx = inner * r_hat
    groups = [slice(k, min(k + R, M)) for k in range(0, M, R)]
    term = (DY * xh).abs()
    pdw = torch.stack([_g(R + 3) * term[rows].sum(0) for rows in groups])  # vs Σ dy·x̂ (given statistics)
    pdb = torch.stack([_g(R) * DY[rows].abs().sum(0) for rows in groups])
    G64 = gamma(M + len(groups), torch.float64)
    dw = pdw.sum(0) + (DY.abs() * stat).sum(0) + G64 * term.sum(0)  # vs autograd's dw (exact statistics)
    db = pdb.sum(0) + G64 * DY.abs().sum(0)
    return {"dx": d_dx + _stored(dx, dtype), "pdw": pdw, "pdb": pdb, "dw": dw, "db": db,
            "partials": (torch.stack([(DY * xh)[rows].sum(0) for rows in groups]),
                         torch.stack([DY[rows].sum(0) for rows in groups]))}


def _column_sum_bound(a, out_dtype=torch.float32):
    """The kernel's column sum of G fp32 rows against the float64 one: γ_{G-1}·Σ|a| (+ the store)."""
    a = a.double().cpu()
    G = a.shape[0]
    return (_g(G - 1) + gamma(G, torch.float64)) * a.abs().sum(0) + _stored(a.sum(0), out_dtype)


@pytest.mark.parametrize("M,N,R", [(45, 70, 4), (16, 128, 16), (9, 33, 2), (5, 1, 3)])
def test_layernorm_backward_kernel_dx_and_partial_sums(ex, M, N, R):
    (x, w, dy, mean, rstd), (dx_ref, dw_ref, db_ref), xhat = _layernorm_case(M, N, _gen(M * N))
    dx, pdw, pdb = ex.layernorm_backward_partials(dy, x, w, mean, rstd, rows_per_group=R)
    G = math.ceil(M / R)
    assert pdw.shape == pdb.shape == (G, N) and dx.shape == x.shape
    bound = _layernorm_bounds(x, w, dy, mean, rstd, R)
    _within(dx, dx_ref, bound["dx"], "dx")
    # each group's partial row is the sum over its own rows (the last group may be short)
    dyd = dy.double()
    for k in range(G):
        rows = slice(k * R, min((k + 1) * R, M))
        _within(pdw[k], (dyd[rows] * xhat[rows]).sum(0), bound["pdw"][k], f"group {k}'s partial dw")
        _within(pdb[k], dyd[rows].sum(0), bound["pdb"][k], f"group {k}'s partial db")
    _within(pdw.double().sum(0), dw_ref, bound["dw"], "the partial dw summed")
    _within(pdb.double().sum(0), db_ref, bound["db"], "the partial db summed")


def test_layernorm_backward_kernel_random_shapes_and_fp16(ex):
    g = _gen(9)
    for _ in range(2):
        M, N = int(torch.randint(2, 24, (1,), generator=g)), int(torch.randint(2, 200, (1,), generator=g))
        (x, w, dy, mean, rstd), (dx_ref, dw_ref, db_ref), _ = _layernorm_case(M, N, g, dtype=torch.float16)
        dx, dw, db = ex.layernorm_backward_reductions(dy, x, w, mean, rstd, rows_per_group=5)
        assert dx.dtype == dw.dtype == db.dtype == torch.float16
        bound = _layernorm_bounds(x, w, dy, mean, rstd, 5, torch.float16)
        pdw, pdb = bound["partials"]
        _within(dx, dx_ref, bound["dx"], f"fp16 dx ({M}, {N})")
        _within(dw, dw_ref, bound["dw"] + _column_sum_bound(pdw, torch.float16), f"fp16 dw ({M}, {N})")
        _within(db, db_ref, bound["db"] + _column_sum_bound(pdb, torch.float16), f"fp16 db ({M}, {N})")


def test_layernorm_backward_kernel_ignores_columns_past_n(ex):
    """x, dy and dx share a row stride wider than N whose padding holds NaN: a load or store
    without the column mask would show."""
    M, N, R = 7, 21, 3
    (x, w, dy, mean, rstd), (dx_ref, _, db_ref), _ = _layernorm_case(M, N, _gen(10))
    pad = 11
    xb, dyb, dxb = (torch.full((M, N + pad), float("nan"), device=_dev()) for _ in range(3))
    xb[:, :N], dyb[:, :N] = x, dy
    G = math.ceil(M / R)
    pdw, pdb = (torch.full((G, N), float("nan"), device=_dev()) for _ in range(2))
    ex.layernorm_backward_kernel[(G,)](dyb, xb, w, mean, rstd, dxb, pdw, pdb, N + pad, M, N, R, BLOCK=32)
    bound = _layernorm_bounds(x, w, dy, mean, rstd, R)
    _within(dxb[:, :N], dx_ref, bound["dx"], "dx of the first N columns")
    assert torch.isnan(dxb[:, N:]).all(), "the kernel wrote into the padding"
    _within(pdb.double().sum(0), db_ref, bound["db"], "the partial db summed")


def test_layernorm_backward_kernel_reads_x_and_dy_once(ex):
    M, N, R = 12, 40, 4
    (x, w, dy, mean, rstd), (dx_ref, _, _), _ = _layernorm_case(M, N, _gen(11))
    x, dy, w = x.contiguous(), dy.contiguous(), w.contiguous()
    with _count_traffic() as t:
        dx, pdw, pdb = ex.layernorm_backward_partials(dy, x, w, mean, rstd, rows_per_group=R)
    _within(dx, dx_ref, _layernorm_bounds(x, w, dy, mean, rstd, R)["dx"], "dx")
    e, G = x.element_size(), M // R
    assert t.read(x) == M * N * e and t.read(dy) == M * N * e, \
        f"x read {t.read(x) / (M * N * e):.2f}x, dy {t.read(dy) / (M * N * e):.2f}x: load each row once"
    assert t.read(mean) == M * 4 and t.read(rstd) == M * 4
    assert t.written(dx) == M * N * e and t.written(pdw) == t.written(pdb) == G * N * 4
    # w is read once per group (or per row): far less than the activations either way
    assert G * N * e <= t.read(w) <= M * N * e


def test_layernorm_backward_kernel_with_column_sum_gives_dw_db(ex):
    (x, w, dy, mean, rstd), (dx_ref, dw_ref, db_ref), _ = _layernorm_case(30, 50, _gen(12))
    dx, dw, db = ex.layernorm_backward_reductions(dy, x, w, mean, rstd, rows_per_group=7)
    bound = _layernorm_bounds(x, w, dy, mean, rstd, 7)
    pdw, pdb = bound["partials"]
    _within(dx, dx_ref, bound["dx"], "dx")
    _within(dw, dw_ref, bound["dw"] + _column_sum_bound(pdw), "dw")
    _within(db, db_ref, bound["db"] + _column_sum_bound(pdb), "db")


def test_layernorm_backward_kernel_rejects_bad_input(ex):
    (x, w, dy, mean, rstd), _, _ = _layernorm_case(6, 8, _gen(13))
    ex.layernorm_backward_partials(dy, x, w, mean, rstd)  # a valid call first
    with pytest.raises(ValueError, match="same shape"):
        ex.layernorm_backward_partials(dy[:5], x, w, mean, rstd)
    with pytest.raises(ValueError, match="weight must have shape"):
        ex.layernorm_backward_partials(dy, x, w[:7], mean, rstd)
    with pytest.raises(ValueError, match="one entry per row"):
        ex.layernorm_backward_partials(dy, x, w, mean[:5], rstd)
    with pytest.raises(ValueError, match="rows_per_group"):
        ex.layernorm_backward_partials(dy, x, w, mean, rstd, rows_per_group=-2)


# --- 4. column_sum_kernel -------------------------------------------------------------------------

@pytest.mark.parametrize("G,N,bg,bn", [(37, 300, 8, 64), (1, 5, 4, 8), (64, 128, 16, 128), (3, 200, 32, 16)])
def test_column_sum_kernel_matches_torch(ex, G, N, bg, bn):
    a = _randn(G, N, g=_gen(G + N))
    out = ex.column_sum(a, block_g=bg, block_n=bn)
    assert out.shape == (N,) and out.dtype == a.dtype
    # G float32 terms added in any order land within γ_{G-1}·Σ|a| of the exact sum (Higham eq. 4.4);
    # the kernel's block order is its own, so hold it to that bound (a row lost or counted twice is ~1)
    _within(out, a.double().sum(0), _column_sum_bound(a), "column sum")


def test_column_sum_kernel_strided_rows_and_fp16_output(ex):
    g = _gen(14)
    big = _randn(20, 90, g=g)
    a = big[:, :70]  # row stride 90
    out = ex.column_sum(a, out_dtype=torch.float16, block_g=8, block_n=32)
    assert out.dtype == torch.float16
    _within(out, a.double().sum(0), _column_sum_bound(a, torch.float16), "fp16 column sum")


def test_column_sum_kernel_finishes_layernorm_backward(ex):
    """The second stage alone: partials per group made by PyTorch, summed by the kernel, are
    LayerNorm's dw and db."""
    M, N, R = 20, 36, 6
    (x, w, dy, mean, rstd), (_, dw_ref, db_ref), xhat = _layernorm_case(M, N, _gen(15))
    dyd = dy.double()
    pdw = torch.stack([(dyd[k:k + R] * xhat[k:k + R]).sum(0) for k in range(0, M, R)]).float()
    pdb = torch.stack([dyd[k:k + R].sum(0) for k in range(0, M, R)]).float()
    # the partials: float64 sums with the given statistics, rounded to fp32 (u of each)
    bound = _layernorm_bounds(x, w, dy, mean, rstd, R)
    stat_dw = bound["dw"] - bound["pdw"].sum(0)  # the given statistics' part, and float64's
    stat_db = bound["db"] - bound["pdb"].sum(0)
    for name, partials, ref, stat in (("dw", pdw, dw_ref, stat_dw), ("db", pdb, db_ref, stat_db)):
        allowed = stat + U32 * partials.double().abs().sum(0) + _column_sum_bound(partials)
        _within(ex.column_sum(partials, block_g=2), ref, allowed, f"{name} from the partials")


def test_column_sum_kernel_rejects_bad_input(ex):
    a = _randn(4, 6, g=_gen(16))
    ex.column_sum(a)  # a valid call first
    with pytest.raises(ValueError, match="2-D"):
        ex.column_sum(a[0])
    with pytest.raises(ValueError, match="power of two"):
        ex.column_sum(a, block_n=24)


# --- 5. attention_forward_kernel --------------------------------------------------------------------

def _attention_case(B, H, Sq, Sk, D, g, dtype=torch.float32):
    return [_randn(B, H, s, D, g=g, dtype=dtype) for s in (Sq, Sk, Sk)]


def _attention_ref(q, k, v, causal):
    q, k, v = (x.double().cpu() for x in (q, k, v))
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).tril().logical_not(), float("-inf"))
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal), torch.logsumexp(s, -1)


def _attention_bound(q, k, v, causal, block_n=16, dtype=torch.float32):
    """Elementwise (out, lse) bounds of FlashAttention's fp32 forward, key tiles of ``block_n``, against
    float64 (module docstring): the online softmax of the scores, P·V over Sk keys, acc / l, m + log l."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    Sq, Sk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scale, tiles = D ** -0.5, math.ceil(Sk / block_n)
    s = scale * q @ k.transpose(-2, -1)
    allowed = torch.ones(Sq, Sk, dtype=torch.bool)
    allowed = allowed.tril() if causal else allowed
    masked = s.masked_fill(~allowed, float("-inf"))
    m = masked.amax(-1, keepdim=True)
    first = masked[..., :block_n].amax(-1, keepdim=True)  # the running max starts at the first tile's
    d_s = _g(D + 2) * scale * q.abs() @ k.abs().transpose(-2, -1)
    term = (d_s + U32 * (s - m).abs() + U32 * (m - first) + (tiles + 1) * (E + U32)).masked_fill(~allowed, 0)
    rel_l = term.amax(-1, keepdim=True) + _g(Sk + tiles)
    p = torch.softmax(masked, -1)
    out = p @ v
    lse = torch.logsumexp(masked, -1)
    log_l = (lse[..., None] - m).abs()
    f64 = gamma(Sk + D + 8, torch.float64)
    d_out = ((p * (term + _g(Sk + tiles) + U32)) @ v.abs() + out.abs() * (rel_l + U32)
             + f64 * (p @ v.abs() + out.abs()) + _stored(out, dtype))
    lse_ = lse[..., None]
    d_lse = (d_s.masked_fill(~allowed, 0).amax(-1, keepdim=True) + rel_l + E * log_l + U32 * lse_.abs()
             + f64 * (lse_.abs() + m.abs()))
    return d_out, d_lse[..., 0]


@pytest.mark.parametrize("B,H,Sq,Sk,D,causal,bm,bn", [
    (1, 2, 37, 37, 16, True, 16, 16),  # ragged last tile
    (2, 1, 20, 45, 32, True, 16, 16),  # fewer queries than keys
    (1, 2, 45, 20, 16, False, 16, 16),  # more queries than keys
    (1, 1, 50, 50, 64, True, 32, 16),  # tiles of different shapes
    (1, 1, 16, 16, 16, False, 16, 16),  # one tile each
])
def test_attention_forward_kernel_matches_sdpa(ex, B, H, Sq, Sk, D, causal, bm, bn):
    q, k, v = _attention_case(B, H, Sq, Sk, D, _gen(11))
    o, lse = ex.attention_forward(q, k, v, causal, bm, bn)
    want, want_lse = _attention_ref(q, k, v, causal)
    b_out, b_lse = _attention_bound(q, k, v, causal, bn)
    _within(o, want, b_out, "the output")
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32, "lse: one float32 per query row"
    _within(lse, want_lse, b_lse, "the log-sum-exp")


def test_attention_forward_kernel_fp16(ex):
    q, k, v = _attention_case(2, 2, 33, 40, 32, _gen(12), torch.float16)
    o, lse = ex.attention_forward(q, k, v, causal=True)
    assert o.dtype == torch.float16
    want, want_lse = _attention_ref(q, k, v, True)
    b_out, b_lse = _attention_bound(q, k, v, True, 16, torch.float16)  # the launcher's default tiles: 16
    _within(o, want, b_out, "the fp16 output")
    _within(lse, want_lse, b_lse, "the log-sum-exp of fp16 inputs")


def test_attention_forward_kernel_never_writes_a_score(ex):
    """Q read once, O and L written once, K and V read once per query tile: nothing else in memory."""
    from minitorch_dist.kernels._runtime import triton

    B, H, Sq, Sk, D, bm = 1, 2, 40, 48, 16, 16
    q, k, v = _attention_case(B, H, Sq, Sk, D, _gen(13))
    with _count_traffic() as t:
        o, lse = ex.attention_forward(q, k, v, False, bm, 16)
    _within(o, _attention_ref(q, k, v, False)[0], _attention_bound(q, k, v, False, 16)[0], "the output")
    e, tiles = q.element_size(), triton.cdiv(Sq, bm)
    assert t.read(q) == q.numel() * e, "load each query tile once and keep it"
    assert t.read(k) == tiles * k.numel() * e and t.read(v) == tiles * v.numel() * e, \
        "every query tile reads each key and value once"
    assert t.written(o) == o.numel() * e and t.written(lse) == lse.numel() * 4
    assert t.read() == t.read(q) + t.read(k) + t.read(v) and t.written() == t.written(o) + t.written(lse), \
        "no score or probability may go through memory"
    with _count_traffic() as c:
        ex.attention_forward(q, k, v, True, bm, 16)
    assert c.read(k) < t.read(k) / 2 + k.numel() * e, "causal: skip the key tiles after the query tile"


def test_attention_forward_kernel_rejects_bad_input(ex):
    q, k, v = _attention_case(1, 2, 8, 8, 16, _gen(14))
    ex.attention_forward(q, k, v)  # a valid call first
    with pytest.raises(ValueError, match="power of two"):
        ex.attention_forward(q[..., :12], k[..., :12], v[..., :12])
    with pytest.raises(ValueError, match="must agree"):
        ex.attention_forward(q, k, v[..., :4, :])
    with pytest.raises(ValueError, match="power of two"):
        ex.attention_forward(q, k, v, block_m=24)


# --- 6. softmax_traffic_forecast ----------------------------------------------------------------------


def test_softmax_traffic_forecast_by_hand(ex):
    got = ex.softmax_traffic_forecast(1, 1)  # one element: 7 read and 5 written eager, 1 and 1 fused
    assert got["eager"] == 12 * 4 and got["fused"] == 2 * 4 and got["ratio"] == pytest.approx(6.0)
    big = ex.softmax_traffic_forecast(4096, 4096, 2)
    assert big["ratio"] == pytest.approx(4.0, rel=1e-3), "wide rows in one block: about 4x"
    streamed = ex.softmax_traffic_forecast(4096, 4096, 2, block=1024)
    assert streamed["eager"] == big["eager"] and streamed["ratio"] == pytest.approx(8 / 3, rel=1e-3), \
        "streamed rows are read twice: 3 MN moved instead of 2 MN"
    assert ex.softmax_traffic_forecast(8, 100, block=128) == ex.softmax_traffic_forecast(8, 100), \
        "a block as wide as the row is one block"


@pytest.mark.parametrize("M,N,block,dtype", [(6, 100, None, torch.float32), (6, 100, 32, torch.float32),
                                             (5, 64, 16, torch.float16)])
def test_softmax_traffic_forecast_matches_the_counts(ex, M, N, block, dtype):
    from minitorch_dist.analysis.meters import ByteCounter
    from minitorch_dist.kernels.softmax import softmax_forward, softmax_reference

    x = _randn(M, N, g=_gen(M * N), dtype=dtype)
    got = ex.softmax_traffic_forecast(M, N, x.element_size(), block)
    with ByteCounter() as c:
        softmax_reference(x)
    assert got["eager"] == c.read + c.written, \
        f"eager: predicted {got['eager']} bytes, the ops moved {c.read} read + {c.written} written"
    with _count_traffic() as t:
        y = softmax_forward(x, block_size=block)
    assert got["fused"] == t.read() + t.written(), \
        f"fused: predicted {got['fused']} bytes, the kernel loaded {t.read()} and stored {t.written()}"
    assert t.written() == t.written(y)
    assert got["ratio"] == pytest.approx((c.read + c.written) / (t.read() + t.written()), rel=1e-12)


def test_softmax_traffic_forecast_rejects_bad_input(ex):
    ex.softmax_traffic_forecast(4, 8)  # a valid call first
    with pytest.raises(ValueError, match="M must be"):
        ex.softmax_traffic_forecast(0, 8)
    with pytest.raises(ValueError, match="power of two"):
        ex.softmax_traffic_forecast(4, 8, block=24)
