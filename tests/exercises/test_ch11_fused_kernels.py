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
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from minitorch_dist.course.exercises import load

pytestmark = [
    pytest.mark.ch11,
    # tanh-GeLU through sigmoid: exp(-2u) overflows to inf for very negative u, and 1 / (1 + inf) = 0 is right
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def ex():
    """The chapter's stubs or its worked solutions (see the module docstring)."""
    return load("ch11")


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

def _gelu_ref(x, b, approximate):
    return F.gelu(x.double() + b.double(), approximate=approximate)


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
    torch.testing.assert_close(buf[: M * N].view(M, N).double(), _gelu_ref(x, b, "none"),
                               rtol=1e-5, atol=1e-6)
    assert torch.isnan(buf[M * N:]).all(), "the kernel wrote past the end of its output"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_kernel_matches_torch(ex, approximate):
    g = _gen(0)
    # (37, 99) = 3663 elements: the last of 15 blocks of 256 is partly masked; a 3-D input too
    for shape, block in (((37, 99), 256), ((2, 3, 40), 64), ((1, 1), 16)):
        x, b = _randn(*shape, g=g) * 3, _randn(shape[-1], g=g)
        y = ex.bias_gelu(x, b, approximate, block_size=block)
        assert y.shape == x.shape and y.dtype == x.dtype
        torch.testing.assert_close(y.double(), _gelu_ref(x, b, approximate), rtol=1e-5, atol=1e-6)
    # the two formulas differ (by up to ~5e-4): the kernel must honour APPROXIMATE
    x, b = _randn(8, 64, g=g) * 3, _randn(64, g=g)
    other = "tanh" if approximate == "none" else "none"
    assert (ex.bias_gelu(x, b, approximate).double() - _gelu_ref(x, b, other)).abs().max() > 1e-5


def test_bias_gelu_kernel_random_shapes_and_fp16(ex):
    g = _gen(1)
    for _ in range(3):
        M, N = (int(v) for v in torch.randint(1, 50, (2,), generator=g))
        x, b = _randn(M, N, g=g, dtype=torch.float16), _randn(N, g=g, dtype=torch.float16)
        y = ex.bias_gelu(x, b, block_size=128)
        assert y.dtype == torch.float16
        torch.testing.assert_close(y.double(), _gelu_ref(x, b, "none"), rtol=2e-3, atol=2e-3)


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

@pytest.mark.parametrize("M,N,block", [(13, 300, 32), (7, 64, 64), (4, 1000, 128), (3, 1, 16), (6, 17, 256)])
def test_online_softmax_kernel_matches_torch(ex, M, N, block):
    x = _randn(M, N, g=_gen(N), dtype=torch.float32) * 4
    y = ex.online_softmax(x, block_size=block)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-7)


def test_online_softmax_kernel_rescales_when_the_max_grows(ex):
    # each later block holds larger values, so d must be rescaled at every block; offsets of
    # thousands overflow exp without the max subtracted
    N = 200
    ramp = torch.linspace(0, 60, N)
    x = torch.stack([ramp, ramp.flip(0), ramp + 5000, torch.zeros(N), -ramp - 3000]).to(_dev())
    y = ex.online_softmax(x, block_size=16)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(y.double().sum(-1), torch.ones(5, dtype=torch.float64, device=_dev()),
                               rtol=0, atol=1e-5)


def test_online_softmax_kernel_fp16_and_strided_rows(ex):
    from minitorch_dist.kernels._runtime import triton

    g = _gen(6)
    x16 = _randn(9, 150, g=g, dtype=torch.float16) * 3
    y16 = ex.online_softmax(x16, block_size=64)
    assert y16.dtype == torch.float16
    torch.testing.assert_close(y16.double(), torch.softmax(x16.double(), -1), rtol=2e-3, atol=1e-4)
    # rows with strides other than N, launched directly: the kernel must use both row strides
    M, N, block = 6, 45, 16
    xbig = _randn(M, N + 11, g=g)
    ybig = torch.full((M, N + 3), float("nan"), device=_dev())
    x, y = xbig[:, :N], ybig[:, :N]
    ex.online_softmax_kernel[(M,)](x, y, x.stride(0), y.stride(0), N, BLOCK=block)
    torch.testing.assert_close(y.double(), torch.softmax(x.double(), -1), rtol=1e-5, atol=1e-7)
    assert torch.isnan(ybig[:, N:]).all(), "the kernel wrote outside its N columns"
    assert triton.cdiv(N, block) == 3  # sanity: the row really spans several blocks


def test_online_softmax_kernel_reads_each_row_twice_and_writes_it_once(ex):
    M, N, block = 5, 100, 32
    x = _randn(M, N, g=_gen(7))
    with _count_traffic() as t:
        y = ex.online_softmax(x, block_size=block)
    torch.testing.assert_close(y, torch.softmax(x, -1))
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


@pytest.mark.parametrize("M,N,R", [(45, 70, 4), (16, 128, 16), (9, 33, 2), (5, 1, 3)])
def test_layernorm_backward_kernel_dx_and_partial_sums(ex, M, N, R):
    (x, w, dy, mean, rstd), (dx_ref, dw_ref, db_ref), xhat = _layernorm_case(M, N, _gen(M * N))
    dx, pdw, pdb = ex.layernorm_backward_partials(dy, x, w, mean, rstd, rows_per_group=R)
    G = math.ceil(M / R)
    assert pdw.shape == pdb.shape == (G, N) and dx.shape == x.shape
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-4, atol=1e-5)
    # each group's partial row is the sum over its own rows (the last group may be short)
    dyd = dy.double()
    for k in range(G):
        rows = slice(k * R, min((k + 1) * R, M))
        torch.testing.assert_close(pdw[k].double(), (dyd[rows] * xhat[rows]).sum(0), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(pdb[k].double(), dyd[rows].sum(0), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(pdw.double().sum(0), dw_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(pdb.double().sum(0), db_ref, rtol=1e-4, atol=1e-4)


def test_layernorm_backward_kernel_random_shapes_and_fp16(ex):
    g = _gen(9)
    for _ in range(2):
        M, N = int(torch.randint(2, 24, (1,), generator=g)), int(torch.randint(2, 200, (1,), generator=g))
        (x, w, dy, mean, rstd), (dx_ref, dw_ref, db_ref), _ = _layernorm_case(M, N, g, dtype=torch.float16)
        dx, dw, db = ex.layernorm_backward_reductions(dy, x, w, mean, rstd, rows_per_group=5)
        assert dx.dtype == dw.dtype == db.dtype == torch.float16
        torch.testing.assert_close(dx.double(), dx_ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(dw.double(), dw_ref, rtol=2e-2, atol=5e-2)
        torch.testing.assert_close(db.double(), db_ref, rtol=2e-2, atol=5e-2)


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
    torch.testing.assert_close(dxb[:, :N].double(), dx_ref, rtol=1e-4, atol=1e-5)
    assert torch.isnan(dxb[:, N:]).all(), "the kernel wrote into the padding"
    torch.testing.assert_close(pdb.double().sum(0), db_ref, rtol=1e-4, atol=1e-4)


def test_layernorm_backward_kernel_reads_x_and_dy_once(ex):
    M, N, R = 12, 40, 4
    (x, w, dy, mean, rstd), (dx_ref, _, _), _ = _layernorm_case(M, N, _gen(11))
    x, dy, w = x.contiguous(), dy.contiguous(), w.contiguous()
    with _count_traffic() as t:
        dx, pdw, pdb = ex.layernorm_backward_partials(dy, x, w, mean, rstd, rows_per_group=R)
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-4, atol=1e-5)
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
    torch.testing.assert_close(dx.double(), dx_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dw.double(), dw_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(db.double(), db_ref, rtol=1e-4, atol=1e-4)


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
    # G float32 terms added in any order land within (G-1) * 2^-24 * sum|a| of the exact sum (Higham);
    # the kernel's block order is its own, so hold it to that bound (a row lost or counted twice is ~1)
    bound = (G - 1) * 2.0**-24 * a.double().abs().sum(0) * 1.01
    err = (out.double() - a.double().sum(0)).abs()
    assert (err <= bound).all(), \
        f"column sum off by {err.max().item():.2e}, rounding allows {bound.max().item():.2e}"


def test_column_sum_kernel_strided_rows_and_fp16_output(ex):
    g = _gen(14)
    big = _randn(20, 90, g=g)
    a = big[:, :70]  # row stride 90
    out = ex.column_sum(a, out_dtype=torch.float16, block_g=8, block_n=32)
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.double(), a.double().sum(0), rtol=2e-3, atol=2e-3)


def test_column_sum_kernel_finishes_layernorm_backward(ex):
    """The second stage alone: partials per group made by PyTorch, summed by the kernel, are
    LayerNorm's dw and db."""
    M, N, R = 20, 36, 6
    (x, w, dy, mean, rstd), (_, dw_ref, db_ref), xhat = _layernorm_case(M, N, _gen(15))
    dyd = dy.double()
    pdw = torch.stack([(dyd[k:k + R] * xhat[k:k + R]).sum(0) for k in range(0, M, R)]).float()
    pdb = torch.stack([dyd[k:k + R].sum(0) for k in range(0, M, R)]).float()
    torch.testing.assert_close(ex.column_sum(pdw, block_g=2).double(), dw_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ex.column_sum(pdb, block_g=2).double(), db_ref, rtol=1e-4, atol=1e-4)


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
    torch.testing.assert_close(o.double().cpu(), want, rtol=1e-5, atol=1e-5)
    assert lse.shape == (B, H, Sq) and lse.dtype == torch.float32, "lse: one float32 per query row"
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-5, atol=1e-5)


def test_attention_forward_kernel_fp16(ex):
    q, k, v = _attention_case(2, 2, 33, 40, 32, _gen(12), torch.float16)
    o, lse = ex.attention_forward(q, k, v, causal=True)
    assert o.dtype == torch.float16
    want, want_lse = _attention_ref(q, k, v, True)
    torch.testing.assert_close(o.double().cpu(), want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(lse.double().cpu(), want_lse, rtol=1e-3, atol=1e-3)


def test_attention_forward_kernel_never_writes_a_score(ex):
    """Q read once, O and L written once, K and V read once per query tile: nothing else in memory."""
    from minitorch_dist.kernels._runtime import triton

    B, H, Sq, Sk, D, bm = 1, 2, 40, 48, 16, 16
    q, k, v = _attention_case(B, H, Sq, Sk, D, _gen(13))
    with _count_traffic() as t:
        o, lse = ex.attention_forward(q, k, v, False, bm, 16)
    torch.testing.assert_close(o.double(), _attention_ref(q, k, v, False)[0], rtol=1e-5, atol=1e-5)
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
