"""Chapter 11 exercises, autograded: fused bias + GeLU, online log-softmax, RMSNorm backward reductions,
FlashAttention's forward with a sliding window, and the bytes of a softmax predicted (eager and fused)
and measured.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). On a machine
without a CUDA GPU the kernels run in Triton's interpreter on CPU, so shapes stay small; they
still include columns that are not powers of two (masked tails), rows longer than one block, and
row counts that do not fill the last group. References are PyTorch in float64.

In the interpreter the tests also count the bytes each kernel loads and stores, per tensor, by
wrapping the interpreter's masked load and store: the online log-softmax must read each row exactly
twice and write it once, the RMSNorm backward must read ``x`` and ``dy`` exactly once, the windowed
attention must load only the key tiles that meet each query tile's window. The
softmax forecast (exercise 6) is compared with two counts: the library's five eager ops under
``analysis.meters.ByteCounter`` (every op's tensor arguments and results), and the library's fused
softmax kernels (one block, and streamed) under the same interpreter hooks. The measurement
(exercise 7) must equal the same eager run metered here, op by op.
Checks of bad input first make a valid call, so a stub fails them too.

Tolerances (see tests/_support.py). Bytes are exact. Each kernel is one short fp32 computation (its
docstring: load, compute in fp32, cast on store), compared element by element with PyTorch in float64 on
the same inputs, within a first-order bound of that computation (the ``_*_bound`` helpers): every fp32
operation rounds by u = 2^-24 of its result, a sum of n terms by γ_n of Σ|terms| in any order (Higham
§4.2), an elementary function (exp, erf, sigmoid, log, rsqrt) by at most E = 4 ulp = 8u (numpy's float32
functions, which the interpreter runs, and CUDA's libdevice stay within it), and an error δa of a
function's argument moves it by |f'(a)|·δa; a store to fp16 adds u_fp16 = 2^-11 of the value (or 2^-25,
half the subnormal spacing, below fp16's smallest normal). For GeLU that is the sum z = x + b, the
constant, erf (or the sigmoid of the tanh form) and the product 0.5·z·(1 + t). For the online log-softmax
a term exp(x - m) is computed against each running max and rescaled once per later block: u|x - m| +
u·(its max's climb) + (blocks + 1)·(E + u), the normaliser γ_{N+blocks} of itself more, which the log
turns into an absolute error, plus log's E of |log d| and u of |x - m| and of |y|. For RMSNorm's backward
the given fp32 rstd is itself off the float64 statistic the reference recomputes (a mean of N squares,
eps, rsqrt: γ_{N+4} + 8u64 of x̂, and its computed deviation), which enters x̂ = x·rstd, the row sum c1
(γ_{N+3}), dx and the groups' sums of dy·x̂ (γ_{R+2}); for LayerNorm's (the column-sum exercise's
partials) the given fp32 mean and rstd are themselves off the float64 statistics the reference recomputes:
the mean by γ_{N+1} of mean|x|, rstd by γ_{2N+4} + E of itself (a variance of N terms, eps, rsqrt); they
enter x̂ = (x - mean)·rstd, then the row sums c1, c2 (γ_{N+2}), dx, and the groups' sums of dy·x̂ and dy
(γ_R, then γ_G across groups). FlashAttention's forward is the online softmax of scores q·kᵀ·scale
(γ_{D+2} of |q|·|k|·scale) over key tiles, P·V summed over Sk keys, out = acc / l, lse = m + log l; under
a sliding window the running max climbs at most from the row's least visible score to its max, over at
most ⌈Sk / BLOCK_N⌉ tiles. The column sum is G terms in the kernel's block order: γ_{G-1}·Σ|a| (Higham eq.
4.4). A formula of its own (the other GeLU) differs by far more than the bound somewhere; a forecast's
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
    # sliding-window attention: a row past Sq in the last query tile may see no key; its 0/0 and log(0)
    # are computed and never stored
    pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
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


# --- 2. online_log_softmax_kernel -----------------------------------------------------------------

def _log_softmax_bound(x, block, dtype=torch.float32):
    """Elementwise, absolute: an fp32 online log-softmax of x's rows in blocks of ``block`` columns
    against float64. y = (x - m) - log d: the subtraction x - m (u|x - m|), the normaliser d off by a
    relative rel_d (each term exp(x - m) computed against each running max and rescaled once per later
    block, then summed: as for the softmax), which log turns into an absolute rel_d; log's own E of
    |log d|; the last subtraction u|y|; the store; the float64 reference."""
    x = x.double().cpu()
    N = x.shape[-1]
    blocks = math.ceil(N / block)
    m = x.amax(-1, keepdim=True)
    first = x[..., :block].amax(-1, keepdim=True)  # the running max starts here and climbs to m
    term = U32 * (x - m).abs() + U32 * (m - first) + (blocks + 1) * (E + U32)  # exp(x - m), rescaled
    rel_d = term.amax(-1, keepdim=True) + _g(N + blocks)
    log_d = torch.logsumexp(x, -1, keepdim=True) - m
    y = torch.log_softmax(x, -1)
    return (U32 * (x - m).abs() + rel_d + E * log_d.abs() + U32 * y.abs() + _stored(y, dtype)
            + 4 * U64 * y.abs())


@pytest.mark.parametrize("M,N,block", [(13, 300, 32), (7, 64, 64), (4, 1000, 128), (3, 1, 16), (6, 17, 256)])
def test_online_log_softmax_kernel_matches_torch(ex, M, N, block):
    x = _randn(M, N, g=_gen(N), dtype=torch.float32) * 4
    y = ex.online_log_softmax(x, block_size=block)
    _within(y, torch.log_softmax(x.double(), -1), _log_softmax_bound(x, block),
            f"({M}, {N}), blocks of {block}")


def test_online_log_softmax_kernel_rescales_when_the_max_grows(ex):
    # each later block holds larger values, so d must be rescaled at every block; offsets of
    # thousands overflow exp without the max subtracted
    N = 200
    ramp = torch.linspace(0, 60, N)
    x = torch.stack([ramp, ramp.flip(0), ramp + 5000, torch.zeros(N), -ramp - 3000]).to(_dev())
    y = ex.online_log_softmax(x, block_size=16)
    assert torch.isfinite(y).all()
    _within(y, torch.log_softmax(x.double(), -1), _log_softmax_bound(x, 16),
            "rows whose max grows block by block")


def test_online_log_softmax_kernel_keeps_the_small_entries(ex):
    # values spanning 300: exp(x - m) underflows to 0 in fp32 below -104, its log would be -inf
    N = 120
    x = torch.stack([torch.linspace(-300, 0, N), torch.linspace(0, -300, N), torch.linspace(-150, 150, N)])
    x = x.to(_dev())
    y = ex.online_log_softmax(x, block_size=32)
    assert torch.isfinite(y).all(), "a log-softmax of finite inputs is finite: never take the log of an exp"
    _within(y, torch.log_softmax(x.double(), -1), _log_softmax_bound(x, 32), "rows spanning 300")


def test_online_log_softmax_kernel_fp16_and_strided_rows(ex):
    from minitorch_dist.kernels._runtime import triton

    g = _gen(6)
    x16 = _randn(9, 150, g=g, dtype=torch.float16) * 3
    y16 = ex.online_log_softmax(x16, block_size=64)
    assert y16.dtype == torch.float16
    _within(y16, torch.log_softmax(x16.double(), -1), _log_softmax_bound(x16, 64, torch.float16),
            "fp16 log-softmax")
    # rows with strides other than N, launched directly: the kernel must use both row strides
    M, N, block = 6, 45, 16
    xbig = _randn(M, N + 11, g=g)
    ybig = torch.full((M, N + 3), float("nan"), device=_dev())
    x, y = xbig[:, :N], ybig[:, :N]
    ex.online_log_softmax_kernel[(M,)](x, y, x.stride(0), y.stride(0), N, BLOCK=block)
    _within(y, torch.log_softmax(x.double(), -1), _log_softmax_bound(x, block), "strided rows")
    assert torch.isnan(ybig[:, N:]).all(), "the kernel wrote outside its N columns"
    assert triton.cdiv(N, block) == 3  # sanity: the row really spans several blocks


def test_online_log_softmax_kernel_reads_each_row_twice_and_writes_it_once(ex):
    M, N, block = 5, 100, 32
    x = _randn(M, N, g=_gen(7))
    with _count_traffic() as t:
        y = ex.online_log_softmax(x, block_size=block)
    _within(y, torch.log_softmax(x.double(), -1), _log_softmax_bound(x, block), "in blocks")
    e = x.element_size()
    assert t.read(x) == 2 * M * N * e, f"read {t.read(x) / (M * N * e):.2f} x the input: one sweep for " \
                                       "max and normaliser together, one to write"
    assert t.written(y) == M * N * e and t.read() == t.read(x) and t.written() == t.written(y), \
        "no intermediate may go through memory"


def test_online_log_softmax_kernel_rejects_bad_input(ex):
    x = _randn(3, 10, g=_gen(8))
    ex.online_log_softmax(x)  # a valid call first
    with pytest.raises(ValueError, match="power of two"):
        ex.online_log_softmax(x, block_size=48)
    with pytest.raises(TypeError, match="float64"):
        ex.online_log_softmax(x.double())


# --- 3. rmsnorm_backward_kernel -----------------------------------------------------------------

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


def _rmsnorm_case(M, N, g, dtype=torch.float32, eps=1e-5):
    """Inputs of an RMSNorm backward and autograd's gradients (float64) for them; the fp32 rstd the
    forward saved, and x̂ = x·rstd with it."""
    x, w = _randn(M, N, g=g, dtype=dtype) * 2 + 1, _randn(N, g=g, dtype=dtype)
    dy = _randn(M, N, g=g, dtype=dtype)
    x64, w64 = (t.double().requires_grad_() for t in (x, w))
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    dx, dw = torch.autograd.grad(y, (x64, w64), dy.double())
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    xhat = x.double() * rstd.double()[:, None]
    return (x, w, dy, rstd), (dx, dw), xhat


def _rmsnorm_bounds(x, w, dy, rstd, R, dtype=torch.float32):
    """Elementwise bounds of the fp32 RMSNorm backward with the given fp32 ``rstd`` against float64:
    x̂ = x·rstd (u), g = dy·w (u), c1 = Σ x̂·g / N (γ_{N+3} of Σ|x̂·g|, plus x̂'s error carried),
    dx = (g - x̂·c1)·rstd (a product, a difference, a product: u each, and the errors of its parts).
    The given rstd's deviation d_r from the exact one is computed here, not bounded; the float64
    reference's own statistics (a mean of N squares, eps, rsqrt) add γ_{N+4} + 8u64 of x̂. A group's
    partial dw is R products summed: γ_{R+2} of Σ|dy·x̂|."""
    X, W, DY = (t.double().cpu() for t in (x, w, dy))
    r_hat = rstd.double().cpu()[:, None]
    M, N = X.shape
    r = torch.rsqrt(X.pow(2).mean(-1, keepdim=True) + 1e-5)
    d_r = (r_hat - r).abs()
    xh = X * r_hat
    stat = X.abs() * d_r + (gamma(N + 4, torch.float64) + 8 * U64) * X.abs() * r
    g = DY * W
    c1 = (xh * g).sum(-1, keepdim=True) / N
    d_xh = U32 * xh.abs() + stat
    d_c1 = (_g(N + 3) * (xh * g).abs().sum(-1, keepdim=True) + (d_xh * g.abs()).sum(-1, keepdim=True)) / N
    h = xh * c1
    inner = g - h
    d_dx = (r_hat * (U32 * g.abs() + d_xh * c1.abs() + xh.abs() * d_c1 + U32 * h.abs() + U32 * inner.abs())
            + U32 * (inner * r_hat).abs() + inner.abs() * d_r
            + gamma(2 * N + 8, torch.float64) * r * (g.abs() + h.abs()))
    dx = inner * r_hat
    groups = [slice(k, min(k + R, M)) for k in range(0, M, R)]
    term = (DY * xh).abs()
    pdw = torch.stack([_g(R + 2) * term[rows].sum(0) for rows in groups])  # vs Σ dy·x̂ (given rstd)
    G64 = gamma(M + len(groups), torch.float64)
    dw = pdw.sum(0) + (DY.abs() * stat).sum(0) + G64 * term.sum(0)  # vs autograd's dw (exact rstd)
    return {"dx": d_dx + _stored(dx, dtype), "pdw": pdw, "dw": dw,
            "partials": torch.stack([(DY * xh)[rows].sum(0) for rows in groups])}


@pytest.mark.parametrize("M,N,R", [(45, 70, 4), (16, 128, 16), (9, 33, 2), (5, 1, 3)])
def test_rmsnorm_backward_kernel_dx_and_partial_sums(ex, M, N, R):
    (x, w, dy, rstd), (dx_ref, dw_ref), xhat = _rmsnorm_case(M, N, _gen(M * N))
    dx, pdw = ex.rmsnorm_backward_partials(dy, x, w, rstd, rows_per_group=R)
    G = math.ceil(M / R)
    assert pdw.shape == (G, N) and dx.shape == x.shape
    bound = _rmsnorm_bounds(x, w, dy, rstd, R)
    _within(dx, dx_ref, bound["dx"], "dx")
    dyd = dy.double()
    for k in range(G):
        rows = slice(k * R, min((k + 1) * R, M))
        _within(pdw[k], (dyd[rows] * xhat[rows]).sum(0), bound["pdw"][k], f"group {k}'s partial dw")
    _within(pdw.double().sum(0), dw_ref, bound["dw"], "the partial dw summed")


def test_rmsnorm_backward_kernel_random_shapes_and_fp16(ex):
    g = _gen(9)
    for _ in range(2):
        M, N = int(torch.randint(2, 24, (1,), generator=g)), int(torch.randint(2, 200, (1,), generator=g))
        (x, w, dy, rstd), (dx_ref, dw_ref), _ = _rmsnorm_case(M, N, g, dtype=torch.float16)
        dx, dw = ex.rmsnorm_backward_reductions(dy, x, w, rstd, rows_per_group=5)
        assert dx.dtype == dw.dtype == torch.float16
        bound = _rmsnorm_bounds(x, w, dy, rstd, 5, torch.float16)
        _within(dx, dx_ref, bound["dx"], f"fp16 dx ({M}, {N})")
        _within(dw, dw_ref, bound["dw"] + _column_sum_bound(bound["partials"], torch.float16),
                f"fp16 dw ({M}, {N})")


def test_rmsnorm_backward_kernel_ignores_columns_past_n(ex):
    """x, dy and dx share a row stride wider than N whose padding holds NaN: a load or store
    without the column mask would show."""
    M, N, R = 7, 21, 3
    (x, w, dy, rstd), (dx_ref, dw_ref), _ = _rmsnorm_case(M, N, _gen(10))
    pad = 11
    xb, dyb, dxb = (torch.full((M, N + pad), float("nan"), device=_dev()) for _ in range(3))
    xb[:, :N], dyb[:, :N] = x, dy
    G = math.ceil(M / R)
    pdw = torch.full((G, N), float("nan"), device=_dev())
    ex.rmsnorm_backward_kernel[(G,)](dyb, xb, w, rstd, dxb, pdw, N + pad, M, N, R, BLOCK=32)
    bound = _rmsnorm_bounds(x, w, dy, rstd, R)
    _within(dxb[:, :N], dx_ref, bound["dx"], "dx of the first N columns")
    assert torch.isnan(dxb[:, N:]).all(), "the kernel wrote into the padding"
    _within(pdw.double().sum(0), dw_ref, bound["dw"], "the partial dw summed")


def test_rmsnorm_backward_kernel_reads_x_and_dy_once(ex):
    M, N, R = 12, 40, 4
    (x, w, dy, rstd), (dx_ref, _), _ = _rmsnorm_case(M, N, _gen(11))
    x, dy, w = x.contiguous(), dy.contiguous(), w.contiguous()
    with _count_traffic() as t:
        dx, pdw = ex.rmsnorm_backward_partials(dy, x, w, rstd, rows_per_group=R)
    _within(dx, dx_ref, _rmsnorm_bounds(x, w, dy, rstd, R)["dx"], "dx")
    e, G = x.element_size(), M // R
    assert t.read(x) == M * N * e and t.read(dy) == M * N * e, \
        f"x read {t.read(x) / (M * N * e):.2f}x, dy {t.read(dy) / (M * N * e):.2f}x: load each row once"
    assert t.read(rstd) == M * 4
    assert t.written(dx) == M * N * e and t.written(pdw) == G * N * 4
    # w is read once per group (or per row): far less than the activations either way
    assert G * N * e <= t.read(w) <= M * N * e


def test_rmsnorm_backward_kernel_with_column_sum_gives_dw(ex):
    (x, w, dy, rstd), (dx_ref, dw_ref), _ = _rmsnorm_case(30, 50, _gen(12))
    dx, dw = ex.rmsnorm_backward_reductions(dy, x, w, rstd, rows_per_group=7)
    bound = _rmsnorm_bounds(x, w, dy, rstd, 7)
    _within(dx, dx_ref, bound["dx"], "dx")
    _within(dw, dw_ref, bound["dw"] + _column_sum_bound(bound["partials"]), "dw")


def test_rmsnorm_backward_kernel_rejects_bad_input(ex):
    (x, w, dy, rstd), _, _ = _rmsnorm_case(6, 8, _gen(13))
    ex.rmsnorm_backward_partials(dy, x, w, rstd)  # a valid call first
    with pytest.raises(ValueError, match="same shape"):
        ex.rmsnorm_backward_partials(dy[:5], x, w, rstd)
    with pytest.raises(ValueError, match="weight must have shape"):
        ex.rmsnorm_backward_partials(dy, x, w[:7], rstd)
    with pytest.raises(ValueError, match="one entry per row"):
        ex.rmsnorm_backward_partials(dy, x, w, rstd[:5])
    with pytest.raises(ValueError, match="rows_per_group"):
        ex.rmsnorm_backward_partials(dy, x, w, rstd, rows_per_group=-2)


# --- 4. segment_column_sum_kernel -------------------------------------------------------------------------

@pytest.mark.parametrize("G,N,bg,bn", [(37, 300, 8, 64), (1, 5, 4, 8), (64, 128, 16, 128), (3, 200, 32, 16)])
def test_segment_column_sum_kernel_matches_torch(ex, G, N, bg, bn):
    a = _randn(G, N, g=_gen(G + N))
    out = ex.column_sum(a, block_g=bg, block_n=bn)
    assert out.shape == (N,) and out.dtype == a.dtype
    # G float32 terms added in any order land within γ_{G-1}·Σ|a| of the exact sum (Higham eq. 4.4);
    # the kernel's block order is its own, so hold it to that bound (a row lost or counted twice is ~1)
    _within(out, a.double().sum(0), _column_sum_bound(a), "column sum")


def test_segment_column_sum_kernel_strided_rows_and_fp16_output(ex):
    g = _gen(14)
    big = _randn(20, 90, g=g)
    a = big[:, :70]  # row stride 90
    out = ex.column_sum(a, out_dtype=torch.float16, block_g=8, block_n=32)
    assert out.dtype == torch.float16
    _within(out, a.double().sum(0), _column_sum_bound(a, torch.float16), "fp16 column sum")


def test_segment_column_sum_kernel_finishes_layernorm_backward(ex):
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


def _segments(G, g):
    """Random cut points of G rows into segments: some empty, one row, longer than a tile."""
    cuts = sorted(int(c) for c in torch.randint(0, G + 1, (5,), generator=g))
    return [0, *cuts, cuts[-1], G]  # cuts[-1] twice: an empty segment, always


@pytest.mark.parametrize("G,N,bg,bn", [(37, 300, 8, 64), (64, 128, 16, 128), (9, 20, 4, 8), (50, 33, 8, 16)])
def test_segment_column_sum_kernel_segments_match_torch(ex, G, N, bg, bn):
    g = _gen(G * N)
    a = _randn(G, N, g=g)
    for offsets in ([0, G], [0, 0, G, G], _segments(G, g), _segments(G, g), list(range(G + 1))):
        out = ex.segment_column_sum(a, offsets, block_g=bg, block_n=bn)
        assert out.shape == (len(offsets) - 1, N) and out.dtype == a.dtype
        for k, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            seg = a[lo:hi]
            if hi == lo:
                assert torch.equal(out[k].cpu(), torch.zeros(N)), f"segment {k} is empty: its sums are 0"
                continue
            _within(out[k], seg.double().sum(0), _column_sum_bound(seg), f"segment {k}, rows {lo}:{hi}")


def test_segment_column_sum_kernel_writes_an_empty_segment_as_zero(ex):
    a = _randn(12, 40, g=_gen(17))
    offsets = torch.tensor([0, 5, 5, 12, 12], device=_dev())
    out = torch.full((4, 40), float("nan"), device=_dev())
    ex.segment_column_sum_kernel[(3, 4)](a, offsets, out, 40, a.stride(0), BLOCK_G=4, BLOCK_N=16)
    assert torch.equal(out[1].cpu(), torch.zeros(40)) and torch.equal(out[3].cpu(), torch.zeros(40)), \
        "an empty segment must be stored as 0, not skipped"
    _within(out[0], a[:5].double().sum(0), _column_sum_bound(a[:5]), "rows 0:5")
    _within(out[2], a[5:].double().sum(0), _column_sum_bound(a[5:]), "rows 5:12")


def test_segment_column_sum_kernel_rejects_bad_input(ex):
    a = _randn(4, 6, g=_gen(16))
    ex.column_sum(a)  # valid calls first
    ex.segment_column_sum(a, [0, 2, 4])
    with pytest.raises(ValueError, match="2-D"):
        ex.column_sum(a[0])
    with pytest.raises(ValueError, match="power of two"):
        ex.column_sum(a, block_n=24)
    with pytest.raises(ValueError, match="non-decreasing"):
        ex.segment_column_sum(a, [0, 3, 2, 4])
    with pytest.raises(ValueError, match="non-decreasing"):
        ex.segment_column_sum(a, [0, 2, 3])


# --- 5. attention_window_kernel ------------------------------------------------------------------------

def _attention_case(B, H, Sq, Sk, D, g, dtype=torch.float32):
    return [_randn(B, H, s, D, g=g, dtype=dtype) for s in (Sq, Sk, Sk)]


def _allowed(Sq, Sk, window):
    """Query i sees keys i - window < j <= i."""
    i, j = torch.arange(Sq)[:, None], torch.arange(Sk)[None, :]
    return (j <= i) & (j > i - window)


def _attention_ref(q, k, v, window):
    """The windowed attention in float64, written out: (output, row log-sum-exp)."""
    q, k, v = (x.double().cpu() for x in (q, k, v))
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = s.masked_fill(~_allowed(q.shape[-2], k.shape[-2], window), float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _attention_bound(q, k, v, window, block_n=16, dtype=torch.float32):
    """Elementwise (out, lse) bounds of FlashAttention's fp32 forward, key tiles of ``block_n``, against
    float64 (module docstring): the online softmax of the scores, P·V over Sk keys, acc / l, m + log l.
    The running max climbs from a row's first visible score at most to m: m - (its least visible score)
    bounds the climb; at most ceil(Sk / block_n) tiles rescale."""
    q, k, v = (t.double().cpu() for t in (q, k, v))
    Sq, Sk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    scale, tiles = D ** -0.5, math.ceil(Sk / block_n)
    s = scale * q @ k.transpose(-2, -1)
    allowed = _allowed(Sq, Sk, window)
    masked = s.masked_fill(~allowed, float("-inf"))
    m = masked.amax(-1, keepdim=True)
    first = s.masked_fill(~allowed, float("inf")).amin(-1, keepdim=True)
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


def _check_attention(ex, q, k, v, window, bm, bn, dtype=torch.float32, where=""):
    o, lse = ex.attention_window(q, k, v, window, bm, bn)
    want, want_lse = _attention_ref(q, k, v, window)
    b_out, b_lse = _attention_bound(q, k, v, window, bn, dtype)
    assert o.dtype == q.dtype
    _within(o, want, b_out, f"{where} the output")
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32, "lse: one float32 per query row"
    _within(lse, want_lse, b_lse, f"{where} the log-sum-exp")
    return o, lse


@pytest.mark.parametrize("B,H,Sq,Sk,D,window,bm,bn", [
    (1, 2, 37, 37, 16, 5, 16, 16),  # a window narrower than a tile, not a multiple of it; ragged tile
    (2, 1, 20, 45, 32, 16, 16, 16),  # fewer queries than keys; a window of exactly one tile
    (1, 1, 50, 50, 64, 20, 32, 16),  # tiles of different shapes
    (1, 1, 40, 40, 16, 1, 16, 16),  # each query sees only itself
    (1, 2, 33, 33, 16, 7, 16, 8),   # narrow key tiles: several skipped
])
def test_attention_window_kernel_matches_the_masked_attention(ex, B, H, Sq, Sk, D, window, bm, bn):
    q, k, v = _attention_case(B, H, Sq, Sk, D, _gen(11))
    o, _ = _check_attention(ex, q, k, v, window, bm, bn, where=f"window {window}:")
    if window == 1:  # softmax over one key: the value itself
        _within(o, v.double()[..., :Sq, :], _attention_bound(q, k, v, 1, bn)[0], "window 1: o = v")


def test_attention_window_kernel_wider_than_the_sequence_is_causal(ex):
    q, k, v = _attention_case(1, 2, 37, 37, 16, _gen(15))
    o, _ = _check_attention(ex, q, k, v, 1000, 16, 16, where="window 1000:")
    want = F.scaled_dot_product_attention(*(x.double() for x in (q, k, v)), is_causal=True)
    _within(o, want, _attention_bound(q, k, v, 1000, 16)[0], "against SDPA's causal attention")


def test_attention_window_kernel_fp16(ex):
    q, k, v = _attention_case(2, 2, 33, 40, 32, _gen(12), torch.float16)
    _check_attention(ex, q, k, v, 9, 16, 16, torch.float16, where="fp16:")


def _window_tiles(Sq, Sk, window, bm, bn):
    """The keys a query tile must load: those of the key tiles from the one holding its first row's
    first visible key to the one holding its last row (masked keys past Sk not loaded)."""
    keys = 0
    for i0 in range(0, Sq, bm):
        lo = max(i0 - window + 1, 0) // bn * bn
        keys += sum(min(bn, Sk - j0) for j0 in range(lo, min(Sk, i0 + bm), bn))
    return keys


@pytest.mark.parametrize("window", [5, 24, 100])
def test_attention_window_kernel_loads_only_the_window(ex, window):
    """Q read once, O and L written once, K and V only for the key tiles that meet a query tile's
    window: nothing else in memory."""
    B, H, Sq, Sk, D, bm, bn = 1, 2, 64, 64, 16, 16, 8
    q, k, v = _attention_case(B, H, Sq, Sk, D, _gen(13))
    with _count_traffic() as t:
        o, lse = ex.attention_window(q, k, v, window, bm, bn)
    _within(o, _attention_ref(q, k, v, window)[0], _attention_bound(q, k, v, window, bn)[0], "the output")
    e, per_key = q.element_size(), B * H * D * q.element_size()
    assert t.read(q) == q.numel() * e, "load each query tile once and keep it"
    want = _window_tiles(Sq, Sk, window, bm, bn) * per_key
    assert t.read(k) == want and t.read(v) == want, (
        f"window {window}: read {t.read(k) // per_key} key rows; the key tiles that meet the query tiles' "
        f"windows hold {want // per_key}")
    assert t.written(o) == o.numel() * e and t.written(lse) == lse.numel() * 4
    assert t.read() == t.read(q) + t.read(k) + t.read(v) and t.written() == t.written(o) + t.written(lse), \
        "no score or probability may go through memory"


def test_attention_window_kernel_rejects_bad_input(ex):
    q, k, v = _attention_case(1, 2, 8, 8, 16, _gen(14))
    ex.attention_window(q, k, v, 4)  # a valid call first
    with pytest.raises(ValueError, match="power of two"):
        ex.attention_window(q[..., :12], k[..., :12], v[..., :12], 4)
    with pytest.raises(ValueError, match="must agree"):
        ex.attention_window(q, k, v[..., :4, :], 4)
    with pytest.raises(ValueError, match="window must be"):
        ex.attention_window(q, k, v, 0)
    with pytest.raises(ValueError, match="power of two"):
        ex.attention_window(q, k, v, 4, block_m=24)


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


# --- 7. softmax_traffic_measured ----------------------------------------------------------------------


@pytest.mark.parametrize("M,N,block,dtype", [(6, 100, None, torch.float32), (5, 64, 16, torch.float16),
                                             (3, 7, 4, torch.float32)])
def test_softmax_traffic_measured_meters_the_eager_ops(ex, M, N, block, dtype):
    from minitorch_dist.analysis.meters import ByteCounter
    from minitorch_dist.kernels.softmax import softmax_reference

    x = _randn(M, N, g=_gen(M + N), dtype=dtype)
    got = ex.softmax_traffic_measured(x, block)
    with ByteCounter() as c:
        softmax_reference(x)
    assert list(got["ops"]) == c.ops, f"the ops metered: {list(got['ops'])}; the eager softmax runs {c.ops}"
    assert (got["read"], got["written"]) == (c.read, c.written), \
        f"measured {got['read']} read, {got['written']} written; the meter counts {c.read}, {c.written}"


@pytest.mark.parametrize("M,N,block,dtype", [(6, 100, None, torch.float32), (5, 64, 16, torch.float16)])
def test_softmax_traffic_measured_predicts_what_it_measures(ex, M, N, block, dtype):
    x = _randn(M, N, g=_gen(M * N + 1), dtype=dtype)
    got = ex.softmax_traffic_measured(x, block)
    assert got["predicted"] == ex.softmax_traffic_forecast(M, N, x.element_size(), block)
    assert got["predicted"]["eager"] == got["read"] + got["written"]


def test_softmax_traffic_measured_rejects_bad_input(ex):
    ex.softmax_traffic_measured(torch.randn(2, 3))  # a valid call first
    with pytest.raises(ValueError, match="M x N"):
        ex.softmax_traffic_measured(torch.randn(2, 3, 4))
