"""Chapter 07 exercises, autograded: the segment count, an RNG-preserving checkpoint, selective attention,
Chen's recursive recompute policy for a GPT, predicting and metering what it keeps.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: a search over every segment count of
``costmodel.checkpoint_saved_bytes`` (random chains, seeded, and hand-worked ones), the
un-checkpointed forward and backward by autograd (same seed, same dropout),
``F.scaled_dot_product_attention`` with a mask written out entry by entry and
``torch.autograd.gradcheck``, a ``saved_tensors_hooks`` counter that sees every tensor kept for
backward, the plain GPT's gradients with the same dropout masks, forward hooks counting each block's
runs against the recursion written out (and ``costmodel.log_checkpoint_forwards``), and ``MemoryMeter``
on plain and checkpointed GPTs (Chen's chain model calibrated here, the library's √n policy). Each
check that a test can fail is shown failing on a plausible wrong design: the mutants in
``solutions/mutants/ch07_checkpointing/`` (``python -m minitorch_dist.course.mutants --chapter ch07``).

Nothing here needs ranks. Checks of bad input first make a valid call, so a stub fails them too.

Tolerances (derived in tests/_support.py). Segment counts, forward runs and saved bytes are exact, or
held to a stated margin where a model meets a measurement: Chen's chain (n·b + L, and the exercise's
own prediction) counts the blocks' inputs and activations only, not the few floats per token a
LayerNorm also keeps (its mean and rstd), far below 1 % of the total. Gradients of a checkpointed
computation against the plain one run in float64, held to ``model_bound`` (n the longest reduction,
depth the reductions chained, scaled by the values compared): a block (Linear, GeLU, Linear) n = 4D =
64, BLOCK_DEPTH = 4 (two forward, two back), n stacked blocks n x 4 (three checkpoints in a row, the
recursion over n = 2..7 blocks); attention n = s = 12 keys (a window sums fewer: the bound holds),
ATTN_DEPTH = 6 (scores, softmax, P·V, and back); the GPT n = 4·n_embd = 256 (its weight gradients sum
B·T = 128 rows), GPT_DEPTH = 6 per layer + 2. Each is at most ~1e-9 of the values; a dropout
mask drawn anew moves a gradient by O(1) of it, which the tests show on a checkpoint that forgets the RNG.
``gradcheck`` keeps torch's defaults (central differences, eps 1e-6: error O(eps²) + O(u/eps) ~
1e-10, far below its atol 1e-5). The float32 attention test compares two float32 computations of
attention and its gradients elementwise, each within the componentwise first-order bound of
:func:`_attention_f32_bound` of the exact one: the scores by γ_{d+1}·|Q||K|ᵀ/√d, the softmax by
that error twice plus u|S - max| + 2u per exp, γ_n for its sum and u for its division; then P·V, dP
= dO·Vᵀ, D = rowsum(dO∘O) (or of P∘dP), dS = P∘(dP - D), dQ, dK, dV by their sums (γ of their length)
and by the errors they inherit, over the keys each query sees. The recursion's peak is exact to the
byte (⌊log2 n⌋·b + L above the one-block model: the meter counts a block input the first LayerNorm
saves once, as the calibration does). Bytes are counted for the fp32 model (the exercise's own unit).
"""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.checkpointing import apply_recompute
from minitorch_dist.models import GPT, GPTConfig, MarkovCorpus

from _support import close, float64, gamma, model_bound, roundoff

pytestmark = pytest.mark.ch07


class SavedTensors:
    """Every tensor autograd keeps for backward while active: ``.shapes`` and ``.numel``."""

    def __init__(self):
        self.shapes = []

    def __enter__(self):
        def pack(t):
            self.shapes.append(tuple(t.shape))
            return t

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def numel(self):
        return sum(math.prod(s) for s in self.shapes)


# --- 1. choose_segments ---------------------------------------------------------------------------


def _peaks(n, layer, boundary):
    """{k: peak saved bytes} for every k, from the cost model (every segment checkpointed)."""
    return {k: costmodel.checkpoint_saved_bytes(n, layer, boundary, k, checkpoint_last=True)
            for k in range(1, n + 1)}


CASES = [(1, 10, 10), (2, 10, 10), (5, 1, 1), (7, 3, 2), (10, 10, 10), (12, 7, 3), (30, 1, 9),
         (64, 40, 10), (97, 13, 2), (50, 3, 1000)]


def _random_chains(count=40, seed=7):
    """Random chains (n, L, b), seeded: uneven segments are the rule, not the exception."""
    g = np.random.default_rng(seed)
    return [(int(g.integers(1, 120)), int(g.integers(1, 5000)), int(g.integers(1, 5000)))
            for _ in range(count)]


def _least(peaks):
    least = min(peaks.values())
    return min(k for k, p in peaks.items() if p == least), least


@pytest.mark.parametrize("n, layer, boundary", CASES)
def test_choose_segments_least_peak(ex, n, layer, boundary):
    peaks = _peaks(n, layer, boundary)
    expected, least = _least(peaks)
    got = ex.choose_segments(n, layer, boundary)
    assert isinstance(got, int) and 1 <= got <= n, f"n={n}: got {got!r}; expected an int k in 1..{n}"
    assert got == expected, (f"n={n}, layer {layer} B, boundary {boundary} B: k={got} has peak "
                             f"{peaks.get(got)} B; the least peak is {least} B, first at k={expected}")


def test_choose_segments_random_chains_against_the_cost_model(ex):
    for n, layer, boundary in _random_chains():
        peaks = _peaks(n, layer, boundary)
        expected, least = _least(peaks)
        got = ex.choose_segments(n, layer, boundary)
        assert got == expected, (f"n={n}, L={layer} B, b={boundary} B: k={got} (peak {peaks.get(got)} B); "
                                 f"the least peak is {least} B, first at k={expected}")
        g = np.random.default_rng(n * 7919 + layer)
        for budget in g.integers(least, max(peaks.values()) + 2, size=3):
            want = min(k for k, p in peaks.items() if p <= budget)
            got = ex.choose_segments(n, layer, boundary, budget_bytes=int(budget))
            assert got == want, (f"n={n}, L={layer} B, b={boundary} B, budget {budget} B: k={got}; the "
                                 f"fewest segments that fit are k={want} (peak {peaks[want]} B)")


@pytest.mark.parametrize("n, layer, boundary", CASES)
def test_choose_segments_budget(ex, n, layer, boundary):
    peaks = _peaks(n, layer, boundary)
    for budget in sorted(set(peaks.values())) + [max(peaks.values()) + 1, 10 ** 9]:
        expected = min(k for k, p in peaks.items() if p <= budget)
        got = ex.choose_segments(n, layer, boundary, budget_bytes=budget)
        assert got == expected, (f"n={n}, layer {layer} B, boundary {boundary} B, budget {budget} B: got "
                                 f"k={got} (peak {peaks.get(got)} B); the fewest segments that fit are "
                                 f"k={expected} (peak {peaks[expected]} B)")


def test_choose_segments_hand_worked_uneven(ex):
    # n = 5, L = b = 1. k = 2: segments [3, 2]; segment 1 back-propagated with its input: 1 + 3 = 4,
    # segment 2 with both inputs: 2 + 2 = 4 -> 4. k = 3: [2, 2, 1] -> max(3, 4, 4) = 4. k = 1: 1 + 5 = 6.
    # k = 4: [2, 1, 1, 1] -> max(3, 3, 4, 5) = 5. Least 4, first at k = 2 (the ceiling formula
    # k·b + ⌈n/k⌉·L says 5 at k = 2, and would pick k = 2 or 3 on other grounds).
    assert ex.choose_segments(5, 1, 1) == 2
    assert ex.choose_segments(5, 1, 1, budget_bytes=4) == 2
    assert ex.choose_segments(5, 1, 1, budget_bytes=5) == 2
    # n = 64, L = 4000, b = 1000: k = 16 gives 16 000 + 4·4000 = 32 000, but k = 17 ([4]*13 + [3]*4)
    # gives max(13 000 + 16 000, 17 000 + 12 000) = 29 000: the uneven split wins.
    assert ex.choose_segments(64, 4000, 1000) == 17
    # n = 7, L = 3, b = 2: k = 3 ([3, 2, 2]) -> max(2 + 9, 4 + 6, 6 + 6) = 12, the least; k = 2 -> 14
    assert ex.choose_segments(7, 3, 2) == 3
    assert ex.choose_segments(7, 3, 2, budget_bytes=14) == 2


@pytest.mark.parametrize("n", [4, 16, 25, 64, 144, 400, 1024])
def test_choose_segments_sqrt_n_for_equal_sizes(ex, n):
    root = math.isqrt(n)
    expected, _ = _least(_peaks(n, 1000, 1000))
    assert ex.choose_segments(n, 1000, 1000) == expected, \
        f"n={n} equal layers and boundaries: expected k = {expected}, the first of the flat bottom " \
        f"around √n = {root}"
    assert _peaks(n, 1, 1)[expected] == _peaks(n, 1, 1)[root] == 2 * root  # Chen's 2√n


def test_choose_segments_grows_like_sqrt_n(ex):
    ks = {n: ex.choose_segments(n, 1, 1) for n in (100, 400, 1600)}
    for n, k in ks.items():  # the peak itself, O(√n): at most 2√n for equal sizes
        assert _peaks(n, 1, 1)[k] == min(_peaks(n, 1, 1).values()) <= 2 * math.isqrt(n), \
            f"n={n}: k={k} does not give the least peak"


def test_choose_segments_everything_fits_is_no_checkpointing(ex):
    assert ex.choose_segments(12, 10, 10, budget_bytes=10 ** 6) == 1, "a budget that holds everything: k = 1"


def test_choose_segments_impossible_budget(ex):
    # n = 16, L = b = 10: k = 3 ([6, 5, 5]) -> max(10 + 60, 20 + 50, 30 + 50) = 80, the least (k = 4 too)
    ex.choose_segments(16, 10, 10, budget_bytes=80)  # a valid call first: it fits
    with pytest.raises(ValueError, match="no number of segments fits") as info:
        ex.choose_segments(16, 10, 10, budget_bytes=79)
    assert "80" in str(info.value) and "k = 3" in str(info.value), \
        f"the error should name the least peak (80 bytes) and its k (k = 3): {info.value}"


def test_choose_segments_rejects_bad_input(ex):
    ex.choose_segments(4, 1, 1)  # a valid call first
    with pytest.raises(ValueError, match="n_layers"):
        ex.choose_segments(0, 1, 1)
    with pytest.raises(ValueError, match="layer_bytes"):
        ex.choose_segments(4, 0, 1)
    with pytest.raises(ValueError, match="budget_bytes must be > 0"):
        ex.choose_segments(4, 1, 1, budget_bytes=0)


# --- 2. RNGCheckpoint ----------------------------------------------------------------------------

D = 16


class Block(nn.Module):
    """Linear -> GELU -> dropout -> Linear -> dropout, counting its forward calls."""

    def __init__(self, p=0.5, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.p, self.calls = p, 0

    def forward(self, x):
        self.calls += 1
        h = F.dropout(F.gelu(self.fc1(x)), self.p, training=True)
        return F.dropout(self.fc2(h), self.p, training=True)


def _x(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, D, generator=g).requires_grad_()  # float64 under the f64 fixture


@pytest.fixture
def f64():
    """The test's models and inputs in float64 (tests/_support.py)."""
    with float64():
        yield


BLOCK_N, BLOCK_DEPTH = 4 * D, 4  # fc2's 4D inputs; fc1 and fc2 forward, then back through both


def _bound(want, depth=BLOCK_DEPTH, n=BLOCK_N):
    return model_bound(n=n, depth=depth, scale=max(1.0, want.abs().max().item()))


def _run(block, call, x, seed=123, between=False):
    """Seeded forward and backward through ``call(block, x)``; the output, x's and the parameters' grads.

    ``between`` draws random numbers between forward and backward (as the rest of a model would).
    """
    block.zero_grad()
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    y = call(block, x)
    weights = torch.rand(y.shape) if between else torch.ones(y.shape)
    (y * weights).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def _plain(block, x):
    return block(x)


class NoRestore(torch.autograd.Function):
    """A checkpoint that forgets the RNG: backward's dropout draws a fresh mask."""

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        return fn(x)

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, grad_y)
        return None, x.grad


def _assert_same_grads(got, ref, what, depth=BLOCK_DEPTH):
    y, gx, gp = got
    y0, gx0, gp0 = ref
    close(y, y0, _bound(y0, depth), f"{what}: forward output differs")
    close(gx, gx0, _bound(gx0, depth), f"{what}: x.grad differs")
    for name in gp0:
        close(gp[name], gp0[name], _bound(gp0[name], depth), f"{what}: {name}.grad differs")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_RNGCheckpoint_gradients_equal_uncheckpointed_with_dropout(ex, f64, seed):
    block, x = Block(seed=seed), _x(seed)
    ref = _run(block, _plain, x, seed=100 + seed)
    got = _run(block, lambda b, t: ex.rng_checkpoint(b, t), x, seed=100 + seed)
    _assert_same_grads(got, ref, f"dropout p=0.5, seed {seed}")


def test_RNGCheckpoint_restoring_the_rng_is_what_makes_it_right(ex, f64):
    block, x = Block(), _x()
    ref = _run(block, _plain, x)
    wrong = _run(block, lambda b, t: NoRestore.apply(b, t), x)
    # the test can fail: without the restore, the recomputed dropout mask differs, far beyond the bound
    assert (wrong[1] - ref[1]).abs().max() > _bound(ref[1]), \
        "a checkpoint without the RNG restore should give other gradients"
    _assert_same_grads(_run(block, lambda b, t: ex.rng_checkpoint(b, t), x), ref, "with the RNG restored")


def test_RNGCheckpoint_runs_fn_exactly_twice(ex, f64):
    block, x = Block(), _x()
    torch.manual_seed(0)
    y = ex.rng_checkpoint(block, x)
    assert block.calls == 1, f"forward ran fn {block.calls} times; once"
    y.sum().backward()
    assert block.calls == 2, f"forward + backward ran fn {block.calls} times; twice (the recomputation)"
    block.calls = 0
    block(x).sum().backward()
    assert block.calls == 1, "without the checkpoint fn runs once"


def test_RNGCheckpoint_leaves_the_outer_rng_stream_alone(ex, f64):
    block, x = Block(), _x()
    _run(block, _plain, x, seed=7, between=True)
    after_plain = torch.rand(16)
    got = _run(block, lambda b, t: ex.rng_checkpoint(b, t), x, seed=7, between=True)
    after_ckpt = torch.rand(16)
    assert torch.equal(after_ckpt, after_plain), \
        "the random numbers drawn after backward differ: backward rewound the caller's RNG (use fork_rng)"
    # and random numbers drawn between forward and backward did not disturb the recomputation
    _assert_same_grads(got, _run(block, _plain, x, seed=7, between=True), "random draws between fwd and bwd")


def test_RNGCheckpoint_saves_only_its_input(ex, f64):
    block, x = Block(), _x()
    with SavedTensors() as plain:
        block(x)
    assert plain.numel > 4 * x.numel(), "sanity: the plain block keeps its activations"
    with SavedTensors() as ckpt:
        y = ex.rng_checkpoint(block, x)
    assert ckpt.shapes == [tuple(x.shape)], \
        f"the checkpoint kept tensors of shapes {ckpt.shapes}; it must keep only x, {tuple(x.shape)}"
    y.sum().backward()  # and backward still works


def test_RNGCheckpoint_parameters_inside_fn_get_gradients(ex, f64):
    block = Block(p=0.0)  # no dropout: compare against the plain gradients straight away
    x = _x()
    ref = _run(block, _plain, x)
    got = _run(block, lambda b, t: ex.rng_checkpoint(b, t), x)
    assert all(g is not None and torch.count_nonzero(g) > 0 for g in got[2].values()), \
        "some parameter got no grad"
    _assert_same_grads(got, ref, "no dropout")


def test_RNGCheckpoint_stacked_blocks(ex, f64):
    blocks = nn.ModuleList(Block(seed=s) for s in range(3))

    def plain(_, x):
        for b in blocks:
            x = b(x)
        return x

    def ckpt(_, x):
        for b in blocks:
            x = ex.rng_checkpoint(b, x)
        return x

    x = _x()
    ref = _run(blocks, plain, x, seed=11, between=True)
    got = _run(blocks, ckpt, x, seed=11, between=True)
    _assert_same_grads(got, ref, "three checkpointed blocks in a row", depth=3 * BLOCK_DEPTH)


class Scaled(nn.Module):
    """x · scale, a plain attribute: what a flag changed between forward and backward looks like."""

    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(D, D), 1.0

    def forward(self, x):
        return self.lin(x) * self.scale


def _dropout_off(block):
    block.p = 0.0  # as block.eval() would do to nn.Dropout


def _weight_changed(block):
    with torch.no_grad():
        block.fc1.weight.mul_(1.5)  # an optimizer step before backward, say


def _scale_changed(module):
    module.scale = 2.0


@pytest.mark.parametrize("make, change", [(Block, _dropout_off), (lambda: Block(p=0.0), _weight_changed),
                                          (Scaled, _scale_changed)],
                         ids=["dropout_off", "weight_changed", "scale_changed"])
def test_RNGCheckpoint_detects_a_recomputation_that_differs(ex, f64, make, change):
    fn, x = make(), _x()
    torch.manual_seed(0)
    ex.rng_checkpoint(fn, x).sum().backward()  # unchanged: no error
    y = ex.rng_checkpoint(fn, x)
    change(fn)
    with pytest.raises(RuntimeError, match="recomputation"):
        y.sum().backward()


def test_RNGCheckpoint_rejects_bad_input(ex, f64):
    block, x = Block(), _x()
    ex.rng_checkpoint(block, x).sum().backward()  # a valid call first
    with pytest.raises(TypeError, match="callable"):
        ex.rng_checkpoint("block", x)
    with pytest.raises(ValueError, match="requires_grad_"):
        ex.rng_checkpoint(block, x.detach())
    with torch.no_grad():
        assert ex.rng_checkpoint(block, x.detach()).shape == x.shape, "under no_grad it just runs fn"


# --- 3. SelectiveAttention --------------------------------------------------------------------------

SHAPE = (2, 3, 12, 4)  # batch, heads, s, d: s != d, so an s x s tensor is recognisable


def _qkv(seed=0, dtype=torch.float64, shape=SHAPE, dv=None):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(shape, generator=g, dtype=dtype) for _ in range(2))
    v = torch.randn(*shape[:-1], dv or shape[-1], generator=g, dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def _grads(fn, q, k, v, seed=9):
    out = fn(q, k, v)
    g = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    return out.detach(), grads


ATTN_N, ATTN_DEPTH = SHAPE[-2], 6  # s keys; scores, the softmax's sum, P·V, then back through them


def _attn_bound(want, depth=ATTN_DEPTH):
    return _bound(want, depth, ATTN_N)


def _seen(s, causal=True, window=None):
    """The (s, s) mask of the keys each query sees, written out entry by entry."""
    m = torch.zeros(s, s, dtype=torch.bool)
    for i in range(s):
        for j in range(s):
            m[i, j] = (j <= i or not causal) and (window is None or abs(i - j) < window)
    return m


def _sdpa(causal=True, window=None):
    def attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_seen(q.shape[-2], causal, window))
    return attention


WINDOWS = [None, 1, 3, SHAPE[-2] - 1]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dv", [None, 6])
def test_SelectiveAttention_matches_sdpa(ex, causal, dv, window):
    q, k, v = _qkv(seed=1, dv=dv)
    out, grads = _grads(lambda *t: ex.selective_attention(*t, causal=causal, window=window), q, k, v)
    out0, grads0 = _grads(_sdpa(causal, window), q, k, v)
    what = f"causal={causal}, window={window}"
    close(out, out0, _attn_bound(out0), f"{what}: output differs from SDPA with the same mask")
    for name, g, g0 in zip("qkv", grads, grads0):
        close(g, g0, _attn_bound(g0), f"{what}: d{name} differs from SDPA's")


@pytest.mark.parametrize("causal, window", [(True, None), (False, 2)])
def test_SelectiveAttention_gradcheck(ex, causal, window):
    q, k, v = _qkv(seed=2, shape=(1, 2, 5, 3))
    assert torch.autograd.gradcheck(lambda *t: ex.selective_attention(*t, causal=causal, window=window),
                                    (q, k, v))


def test_SelectiveAttention_window_one_is_the_values(ex):
    q, k, v = _qkv(seed=8)
    for causal in (True, False):  # each query sees only its own key: softmax of one entry is exactly 1
        out = ex.selective_attention(q, k, v, causal=causal, window=1)
        assert torch.equal(out, v.detach()), f"causal={causal}, window=1: the output should be v itself"


def _attention_f32_bound(q, k, v, grad_out, causal=True, window=None):
    """Elementwise bounds on |out|, |dq|, |dk|, |dv| of two float32 computations of attention apart:
    twice the first-order componentwise bound of one (the module docstring's account), in float64."""
    u, g = roundoff(torch.float32), (lambda m: gamma(m, torch.float32))
    q, k, v, do = (t.detach().double() for t in (q, k, v, grad_out))
    n, d, dv = k.shape[-2], q.shape[-1], v.shape[-1]
    c = d ** -0.5
    T = lambda t: t.transpose(-2, -1)
    s = c * q @ T(k)
    allowed = _seen(s.shape[-2], causal, window)
    masked = s.masked_fill(~allowed, float("-inf"))
    p = torch.softmax(masked, -1)
    e_s = g(d + 1) * c * q.abs() @ T(k.abs())  # the scores
    spread = (s - masked.amax(-1, keepdim=True)).abs()
    a = (e_s + u * spread + 2 * u).masked_fill(~allowed, 0)  # each exp's relative error
    dp_err = p * (a + (p * a).sum(-1, keepdim=True) + g(n) + u)  # |δP|
    out = p @ v
    d_out = dp_err @ v.abs() + g(n) * p @ v.abs()
    d_dv = T(dp_err) @ do.abs() + g(n) * T(p) @ do.abs()
    dp = do @ T(v)
    d_dp = g(dv) * do.abs() @ T(v.abs())
    rowsum = (do * out).sum(-1, keepdim=True)  # D, as rowsum(dO∘O) or as rowsum(P∘dP)
    d_rowsum = torch.maximum(
        (do.abs() * d_out).sum(-1, keepdim=True) + g(dv) * (do * out).abs().sum(-1, keepdim=True),
        (dp_err * dp.abs() + p * d_dp).sum(-1, keepdim=True) + g(n) * (p * dp).abs().sum(-1, keepdim=True))
    ds = p * (dp - rowsum)
    d_ds = dp_err * (dp - rowsum).abs() + p * (d_dp + d_rowsum) + 2 * u * ds.abs()
    d_dq = c * (d_ds @ k.abs() + g(n + 1) * ds.abs() @ k.abs())
    d_dk = c * (T(d_ds) @ q.abs() + g(n + 1) * T(ds.abs()) @ q.abs())
    return [2 * b for b in (d_out, d_dq, d_dk, d_dv)]


def _within(got, want, bound, where):
    """|got - want| <= bound, elementwise."""
    err = (got.double() - want.double()).abs()
    worst = int((err - bound).flatten().argmax())
    assert (err <= bound).all(), \
        f"{where}: off by {err.flatten()[worst].item():.3g}, {bound.flatten()[worst].item():.3g} allowed"


@pytest.mark.parametrize("window", [None, 4])
def test_SelectiveAttention_float32_and_unbatched(ex, window):
    q, k, v = _qkv(seed=3, dtype=torch.float32, shape=(10, 8))
    out, grads = _grads(lambda *t: ex.selective_attention(*t, window=window), q, k, v)
    out0, grads0 = _grads(_sdpa(True, window), q, k, v)
    assert out.dtype == torch.float32 and all(g.dtype == torch.float32 for g in grads)
    # the output gradient _grads drew (its seed 9)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    b_out, *b_grads = _attention_f32_bound(q, k, v, grad_out, window=window)
    _within(out, out0, b_out, f"window={window}: float32 output vs SDPA's")
    for name, g, g0, b in zip("qkv", grads, grads0, b_grads):
        _within(g, g0, b, f"window={window}: float32 d{name} vs SDPA's")


def test_SelectiveAttention_keeps_no_s_by_s_tensor(ex):
    s = SHAPE[-2]
    q, k, v = _qkv(seed=4)

    def plain(q, k, v):  # the textbook attention: keeps its scores and probabilities
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        return scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1) @ v

    with SavedTensors() as full:
        plain(q, k, v)
    assert any(sh[-2:] == (s, s) for sh in full.shapes), "sanity: plain attention keeps s x s tensors"
    with SavedTensors() as sel:
        out = ex.selective_attention(q, k, v, window=3)
    square = [sh for sh in sel.shapes if sh[-2:] == (s, s)]
    assert not square, \
        f"selective attention kept s x s tensors {square}; keep only q, k, v (and maybe the output)"
    allowed = {tuple(q.shape), tuple(k.shape), tuple(v.shape), tuple(out.shape)}
    assert sel.shapes and all(sh in allowed for sh in sel.shapes) and len(sel.shapes) <= 4, \
        f"kept tensors of shapes {sel.shapes}; expected only q, k, v (and maybe the output), " \
        f"{sorted(allowed)}"
    assert sel.numel < full.numel, "selective attention should keep less than plain attention"


def test_SelectiveAttention_causal_masking(ex):
    s, t = SHAPE[-2], 5
    q, k, v = _qkv(seed=5)
    out = ex.selective_attention(q, k, v, causal=True)
    # positions < t see only keys < t: changing the future leaves them alone
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[..., t:, :] += 3.0
    v2[..., t:, :] -= 2.0
    out2 = ex.selective_attention(q, k2, v2, causal=True)
    bound = _attn_bound(out, depth=3)  # the forward alone
    close(out2[..., :t, :], out[..., :t, :], bound, f"outputs before position {t} depend on later keys")
    assert (out2[..., t:, :] - out[..., t:, :]).abs().max() > bound, "later positions should see the change"
    # and no gradient flows from early outputs to future keys and values
    dq, dk, dv = torch.autograd.grad(out[..., :t, :].sum(), (q, k, v))
    assert torch.count_nonzero(dk[..., t:, :]) == 0 and torch.count_nonzero(dv[..., t:, :]) == 0, \
        "the first positions' outputs have a gradient with respect to future keys or values"
    # the first position attends only to itself: its output is v[0]
    close(out[..., 0, :], v[..., 0, :].detach(), bound, "the first position's output")
    assert s > t


def test_SelectiveAttention_rejects_bad_shapes(ex):
    q, k, v = _qkv(seed=6)
    ex.selective_attention(q, k, v)  # a valid call first
    with pytest.raises(ValueError, match="same shape"):
        ex.selective_attention(q, k[..., :-1, :], v)
    with pytest.raises(ValueError, match="one value per key"):
        ex.selective_attention(q, k, v[..., :-1, :])
    with pytest.raises(ValueError, match="at least 2-D"):
        ex.selective_attention(q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])
    for bad in (0, -2, 2.5, True):
        with pytest.raises(ValueError, match="window must be"):
            ex.selective_attention(q, k, v, window=bad)


@pytest.mark.parametrize("causal", [True, False])
def test_SelectiveAttention_no_gradient_outside_the_window(ex, causal):
    s, w = SHAPE[-2], 3
    q, k, v = _qkv(seed=11)
    out = ex.selective_attention(q, k, v, causal=causal, window=w)
    seen = _seen(s, causal, w)
    for i in (0, s // 2, s - 1):
        dq, dk, dv = torch.autograd.grad(out[..., i, :].sum(), (q, k, v), retain_graph=True)
        for name, g in (("key", dk), ("value", dv)):
            reached = g.abs().sum(dim=(0, 1, 3)) != 0
            # (a query that sees one key only has a constant softmax: no gradient for that key)
            expect = seen[i] if name == "value" or seen[i].sum() > 1 else torch.zeros_like(seen[i])
            assert torch.equal(reached, expect), \
                f"causal={causal}, window={w}: query {i}'s output has a gradient for the {name}s " \
                f"{reached.nonzero().flatten().tolist()}; expected {expect.nonzero().flatten().tolist()}"


# --- 4. RecursiveRecompute and 5. meter_recompute: a GPT ---------------------------------------------------

GB_, GT_ = 4, 32  # batch and sequence: each block's input is 4 x 32 x 64 fp32 = 32 KiB


def _gpt(n):
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(n_layer=n, dropout=0.1, block_size=GT_))


def _batch():
    return MarkovCorpus(GPTConfig.tiny().vocab_size, seed=0).batch(0, GB_, GT_)


def _step(model, seed=1):
    """One seeded forward and backward: the loss, every parameter's gradient, each block's forward runs
    and the peak of saved activations."""
    x, y = _batch()
    blocks = model.model.blocks if hasattr(model, "model") else model.blocks
    runs = [0] * len(blocks)
    handles = [b.register_forward_hook(lambda *_, i=i: runs.__setitem__(i, runs[i] + 1))
               for i, b in enumerate(blocks)]
    meter = MemoryMeter(model)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is faster, and kinder to a shared machine
    try:
        torch.manual_seed(seed)  # the dropout masks of this step
        with meter.track():
            loss = model(x, y)[1]
            loss.backward()
    finally:
        torch.set_num_threads(threads)
        for h in handles:
            h.remove()
    return {"loss": loss.detach(), "grads": {k: p.grad.clone() for k, p in model.named_parameters()},
            "runs": runs, "peak": meter.peak["activations"]}


@pytest.fixture(scope="module")
def chain():
    """Chen's chain model calibrated here, on plain GPTs: L (one block), b (its input), rest (the others)."""
    one, two = _step(_gpt(1))["peak"], _step(_gpt(2))["peak"]
    layer = two - one
    return {"L": layer, "b": GB_ * GT_ * GPTConfig.tiny().n_embd * 4, "rest": one - layer}


def _recursion_runs(n):
    """Each block's forward runs under Chen's recursion, written out: the first ⌈n/2⌉ blocks run once in
    the forward (inside the checkpoint) and then as the recursion of their recomputation; the last ⌊n/2⌋
    are the recursion itself."""
    if n == 1:
        return [1]
    return [1 + r for r in _recursion_runs((n + 1) // 2)] + _recursion_runs(n // 2)


def _counting_blocks(n, p=0.5):
    blocks = [Block(p=p, seed=s) for s in range(n)]
    return blocks


@pytest.mark.parametrize("n", range(1, 8))
def test_RecursiveRecompute_block_runs_follow_the_recursion(ex, f64, n):
    blocks, x = _counting_blocks(n), _x()
    wrapped = ex.RecursiveRecompute(_gpt(1))
    torch.manual_seed(3)
    y = wrapped.run(blocks, x)
    forward = [b.calls for b in blocks]
    y.sum().backward()
    runs, expected = [b.calls for b in blocks], _recursion_runs(n)
    assert forward == [1] * n, f"n={n}: the forward ran the blocks {forward} times; once each"
    assert runs == expected, f"n={n}: forward and backward ran the blocks {runs} times; Chen's recursion " \
                             f"(the first ⌈n/2⌉ checkpointed, the rest recursed) runs them {expected} times"
    assert sum(expected) == costmodel.log_checkpoint_forwards(n)


@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_RecursiveRecompute_gradients_equal_plain_blocks_with_dropout(ex, f64, n):
    blocks, x = nn.ModuleList(_counting_blocks(n)), _x()
    wrapped = ex.RecursiveRecompute(_gpt(1))
    ref = _run(blocks, lambda bs, t: _run_plain(bs, t), x, seed=21, between=True)
    got = _run(blocks, lambda bs, t: wrapped.run(bs, t), x, seed=21, between=True)
    _assert_same_grads(got, ref, f"{n} blocks, dropout 0.5", depth=n * BLOCK_DEPTH)


def _run_plain(blocks, x):
    for b in blocks:
        x = b(x)
    return x


RR_NS = [3, 4, 5]


@pytest.fixture(scope="module")
def wrapped(ex):
    """One seeded step of each RecursiveRecompute GPT and of the plain GPTs, once: in float32 (the bytes
    the chapter counts) and in float64 (the gradients compared), key + ("float64",)."""
    out = {("plain", n): _step(_gpt(n)) for n in RR_NS}
    with float64():
        out.update({("plain", n, "float64"): _step(_gpt(n)) for n in RR_NS})
    for n in RR_NS + [8]:
        try:
            out[n] = _step(ex.RecursiveRecompute(_gpt(n)))
            if n in RR_NS:
                with float64():
                    out[n, "float64"] = _step(ex.RecursiveRecompute(_gpt(n)))
        except Exception as e:  # raised again by each test that needs it
            out[n] = out[n, "float64"] = e
    return out


def _got(wrapped, key):
    got = wrapped[key]
    if isinstance(got, Exception):
        raise got
    return got


GPT_N = 4 * GPTConfig.tiny().n_embd  # the longest reduction: c_proj's 4h inputs (weight gradients: 128 rows)


def _gpt_bound(want, n_layer):
    return model_bound(n=GPT_N, depth=6 * n_layer + 2, scale=max(1.0, want.abs().max().item()))


@pytest.mark.parametrize("n", RR_NS)
def test_RecursiveRecompute_gpt_gradients_equal_plain_with_dropout(wrapped, n):
    ref, got = wrapped["plain", n, "float64"], _got(wrapped, (n, "float64"))
    what = f"n={n}, dropout 0.1"
    close(got["loss"], ref["loss"], _gpt_bound(ref["loss"], n), f"{what}: the loss differs")
    for name, g in ref["grads"].items():
        close(got["grads"]["model." + name], g, _gpt_bound(g, n), f"{what}: {name}.grad differs from plain")


@pytest.mark.parametrize("n", RR_NS)
def test_RecursiveRecompute_gpt_forward_runs(wrapped, n):
    got = _got(wrapped, n)["runs"]
    assert got == _recursion_runs(n), f"n={n}: forward runs per block {got}; expected {_recursion_runs(n)}"


@pytest.mark.parametrize("n", RR_NS + [8])
def test_RecursiveRecompute_saved_bytes(wrapped, chain, n):
    L, b, rest = chain["L"], chain["b"], chain["rest"]
    got = _got(wrapped, n)["peak"]
    # M(1) = L, M(n) = max(b + M(⌊n/2⌋), M(⌈n/2⌉)) = ⌊log2 n⌋·b + L, on top of the one-block model's rest
    want = rest + int(math.floor(math.log2(n))) * b + L
    assert got == want, f"n={n}: the recursion kept {got:,} B at the peak; Chen's M(n) = ⌊log2 n⌋·b + L " \
                        f"on top of the rest gives {want:,} B"
    if n == 8:
        sqrt = _step(apply_recompute(_gpt(8), "sqrt", None))["peak"]
        assert got < sqrt, f"n=8: the recursion kept {got:,} B, √n segments {sqrt:,} B"


def test_RecursiveRecompute_under_no_grad_just_runs(ex, f64):
    x, _ = _batch()
    model = ex.RecursiveRecompute(_gpt(4)).eval()
    meter = MemoryMeter(model)
    with torch.no_grad(), meter.track():
        logits, loss = model(x)
    with torch.no_grad():
        ref, _ = _gpt(4).eval()(x)
    assert loss is None and meter.peak["activations"] == 0
    close(logits, ref, _gpt_bound(ref, 4), "eval logits differ from the plain model's")
    blocks = _counting_blocks(3)
    with torch.no_grad():
        model.run(blocks, _x())
    assert [b.calls for b in blocks] == [1, 1, 1], "under no_grad each block runs once"


def test_RecursiveRecompute_rejects_what_is_not_a_gpt(ex):
    ex.RecursiveRecompute(_gpt(2))(_batch()[0])  # a valid call first
    with pytest.raises(TypeError, match="wraps a minitorch_dist GPT"):
        ex.RecursiveRecompute(nn.Linear(2, 2))


MZ_CASES = [(4, 2), (2, 2)]


@pytest.fixture(scope="module")
def metered(ex):
    """The exercise's answers and this file's own meter of the same policy, once per case."""
    x, y = _batch()
    out = {}
    for n, k in MZ_CASES:
        built = []

        def make(m, built=built):  # _gpt, recording each model built and counting its block forwards
            model, runs = _gpt(m), [0]
            for b in model.blocks:
                b.register_forward_hook(lambda *_: runs.__setitem__(0, runs[0] + 1))
            built.append((model, runs))
            return model

        torch.manual_seed(2)
        got = ex.meter_recompute(make, n, k, x, y)
        out[n, k] = (got, _step(apply_recompute(_gpt(n), "sqrt", k)), built)
    return out


@pytest.mark.parametrize("n, k", MZ_CASES)
def test_meter_recompute_calibration(metered, chain, n, k):
    got, _, _ = metered[n, k]
    for key in ("L", "b", "rest"):
        assert got[key] == chain[key], f"{key} = {got[key]:,} B; the plain models give {chain[key]:,}"


@pytest.mark.parametrize("n, k", MZ_CASES)
def test_meter_recompute_prediction(metered, chain, n, k):
    got, _, _ = metered[n, k]
    L, b, rest = chain["L"], chain["b"], chain["rest"]
    q = n // k  # k equal segments; at the end of the forward: k - 1 inputs, the last segment, the rest
    peak = rest + max((k - 1) * b + q * L, max((j * b + q * L for j in range(1, k)), default=0))
    assert got["predicted"]["peak"] == pytest.approx(peak, rel=1e-9), \
        f"n={n}, k={k}: predicted peak {got['predicted']['peak']:,} B; Chen's chain gives {peak:,}"
    assert got["predicted"]["recomputed"] == n - q, \
        f"n={n}, k={k}: predicted {got['predicted']['recomputed']} recomputed block forwards; " \
        f"expected {n - q}"


@pytest.mark.parametrize("n, k", MZ_CASES)
def test_meter_recompute_measured(metered, n, k):
    got, ref, _ = metered[n, k]
    assert got["measured"]["peak"] == ref["peak"], \
        f"n={n}, k={k}: measured peak {got['measured']['peak']:,} B; MemoryMeter here sees {ref['peak']:,}"
    assert got["measured"]["recomputed"] == sum(ref["runs"]) - n, \
        f"n={n}, k={k}: measured {got['measured']['recomputed']} recomputed forwards; " \
        f"counted {sum(ref['runs']) - n}"
    assert got["measured"]["peak"] == pytest.approx(got["predicted"]["peak"], rel=0.01), \
        f"n={n}, k={k}: prediction and measurement more than 1% apart"


@pytest.mark.parametrize("n, k", MZ_CASES)
def test_meter_recompute_measured_from_a_real_run(metered, n, k):
    got, _, built = metered[n, k]
    # the measurement: a model of n blocks, checkpointed ("sqrt", k segments), that ran forward and backward
    ran = [(m, runs[0]) for m, runs in built if len(m.blocks) == n and getattr(m, "recompute_policy", None)
           == "sqrt" and all(p.grad is not None for p in m.parameters())]
    assert ran, f"n={n}, k={k}: no checkpointed model of {n} blocks ran a forward and backward through " \
                "make_model; measure a real step, not a formula"
    assert any(r == n + got["measured"]["recomputed"] for _, r in ran), \
        f"n={n}, k={k}: the checkpointed model's blocks ran {[r for _, r in ran]} forwards; the measured " \
        f"recomputation {got['measured']['recomputed']} does not come from that run"


def test_meter_recompute_rejects_unequal_segments(ex, metered):
    x, y = _batch()  # (the valid calls are the fixture's)
    with pytest.raises(ValueError, match="does not divide"):
        ex.meter_recompute(_gpt, 5, 2, x, y)
