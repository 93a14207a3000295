"""Chapter 05 exercises, autograded: the attention merge of K blocks, striped sharding, the causal work of
three layouts, the Ulysses all-to-all, a layer's activations, ring attention forward and backward on
striped shards, and the bytes of context parallelism.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: softmax attention over the full key set in
float64 (and its autograd gradients), index lists built position by position, the causal mask
counted entry by entry, slices of the global tensor, PyTorch's ``F.scaled_dot_product_attention`` on
the whole sequence (and its autograd gradients), the comm meter (which collectives ran, on how many
ranks, how many bytes; and a meter around the measure exercise, so that its count comes from a run),
the bytes of Ulysses and of the ring worked out by hand, and ``costmodel.activation_memory_bytes``
(Korthikanti's formulas) over seeded random shapes.

The merge, striped-layout, causal-work and activation-memory exercises are pure functions, tested in
this process. The Ulysses, ring-attention and traffic exercises run on ranks: one launch on 2 ranks
and one on 4 run every case, each a case of its own (``_support.run_cases``) so that an unfinished
exercise fails only its own tests.

Tolerances (derived in tests/_support.py). Shards, positions, counts and bytes are exact. Attention and
its merges run in float64 and are held to ``model_bound`` with n the longest reduction and depth the
reductions chained: for the merge of partial attentions n = NK = 12 keys, MERGE_DEPTH = 6 (scores,
the softmax's sum, P·V, then up to three merges, nested), doubled for the gradients through it; for ring
attention n = RS = 8 positions, RING_DEPTH = 12 (the same forward over t - 1 <= 3 merges, then a
backward as deep). Each is scaled by the size of the values compared: ~1e-11 of them, where a merge
that forgets to re-weight or a block attended twice is off by O(1). The large-logit merge of K = 3
blocks runs in float32, one short chain, against the same merge of the same float32 partials in
float64 (``torch.logsumexp``): with m = max_i lse_i exact, ``lse_i - m`` rounds by u|lse_i - m|, exp
and log by 2u relative, the sum of K weights by (K-1)u, ``m + log s`` by u|lse|; the weights inherit
the error of lse; the weighted sum of K terms and its division round by (K+2)u of Σ_i w_i|out_i|
(:func:`_merge_bound`). A merge
without the max subtracted is inf or NaN there. Formulas (activation bytes, work ratios) are a few
float64 operations: pytest.approx's default rel 1e-6 is far above their k·u; wire bytes are products
of a few floats (rel 1e-9 >> 10 u).
"""
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import comm, costmodel
from minitorch_dist.course.exercises import load, resolve_impl

from _support import close, model_bound, refusal, roundoff, run_cases

pytestmark = pytest.mark.ch05

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this
# file (whatever pytest's import mode). The exercise module is registered by value by `load`.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A rank stuck in a collective its peers never call fails after this long, naming each rank's
# last op, instead of launch's default 300 s.
TIMEOUT_S = 60


# --- 1. merge_partial_attention -------------------------------------------------------------------------

B, H, S, D, NK = 2, 3, 5, 4, 12  # batch, heads, queries, head dim, keys


def _qkv(seed, dtype=torch.float64, scale=1.0, n_keys=NK, n_queries=S):
    g = torch.Generator().manual_seed(seed)
    q = scale * torch.randn(B, H, n_queries, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, n_keys, D, generator=g, dtype=dtype)
    v = torch.randn(B, H, n_keys, D, generator=g, dtype=dtype)
    return q, k, v


def _attend(q, k, v, keys, allowed=None):
    """Softmax attention of every query over the keys `keys` (a list of indices), and its lse.

    `allowed` (queries x all keys, bool) masks scores; a row with no allowed key gets lse -inf
    and out NaN, as softmax (and SDPA) give.
    """
    idx = torch.as_tensor(keys, dtype=torch.long)
    scores = q @ k[..., idx, :].transpose(-1, -2) / math.sqrt(q.shape[-1])
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, idx], float("-inf"))
    return torch.softmax(scores, dim=-1) @ v[..., idx, :], torch.logsumexp(scores, dim=-1)


def _split(n, parts, seed):
    """A random partition of range(n) into `parts` non-empty disjoint sets (not contiguous)."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    cuts = sorted(torch.randperm(n - 1, generator=torch.Generator().manual_seed(seed + 99))[:parts - 1].add(1)
                  .tolist())
    return [sorted(perm[a:b]) for a, b in zip([0] + cuts, cuts + [n])]


MERGE_DEPTH = 6  # chained reductions: scores, the softmax's sum, P·V, then up to three merges


def _finite_scale(t):
    finite = t[torch.isfinite(t)]
    return max(1.0, finite.abs().max().item()) if finite.numel() else 1.0


def _model_bounds(ref_out, ref_lse, depth=MERGE_DEPTH, n=NK):
    """float64: ``model_bound`` of the attention and its merges, scaled by the values compared."""
    return (model_bound(n=n, depth=depth, scale=_finite_scale(ref_out)),
            model_bound(n=n, depth=depth, scale=_finite_scale(ref_lse)))


def _merge_bound(outs, lses):
    """How far the float32 merge of these K partials can be from their merge in float64: (out, lse)."""
    u = roundoff(torch.float32) + roundoff(torch.float64)  # the computation, and the reference's own
    k = len(lses)
    ls = torch.stack([x.double() for x in lses])
    m, lse = ls.max(0).values, torch.logsumexp(ls, 0)
    exp_err = u * (ls - m).abs().max(0).values + 2 * u  # exp(lse_i - m), relative
    lse_err = exp_err + (k - 1) * u + 2 * u * (lse - m).abs() + u * lse.abs()  # the sum, log, m + log s
    weight_err = exp_err + lse_err + u * (ls - lse).abs().max(0).values + 2 * u
    mass = sum((lx - lse).exp()[..., None] * ox.double().abs() for lx, ox in zip(ls, outs))
    return (mass * (weight_err + (k + 2) * u)[..., None]).max().item(), lse_err.max().item()


def _check_merged(got, ref_out, ref_lse, what, bounds=None):
    """``got`` is (out, lse) within ``bounds`` (out's, lse's; default: float64 ``_model_bounds``)."""
    assert isinstance(got, tuple) and len(got) == 2, \
        f"{what}: return the pair (out, lse), got {type(got).__name__}"
    out, lse = got
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape, \
        f"{what}: shapes out {tuple(out.shape)}, lse {tuple(lse.shape)}; expected {tuple(ref_out.shape)}, " \
        f"{tuple(ref_lse.shape)}"
    assert not out.isnan().any() and not lse.isnan().any(), f"{what}: the result holds NaN"
    out_bound, lse_bound = bounds or _model_bounds(ref_out, ref_lse)
    close(out, ref_out, out_bound, f"{what}, out")
    close(lse, ref_lse, lse_bound, f"{what}, lse")


def _parts(q, k, v, key_sets, allowed=None):
    """([out_i], [lse_i]) of attention over each key set."""
    parts = [_attend(q, k, v, keys, allowed) for keys in key_sets]
    return [o for o, _ in parts], [x for _, x in parts]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("blocks", [1, 2, 3, 5])
def test_merge_partial_attention_matches_softmax_over_all_keys(ex, seed, blocks):
    q, k, v = _qkv(seed)
    sets = _split(NK, blocks, seed) if blocks > 1 else [list(range(NK))]
    ref_out, ref_lse = _attend(q, k, v, range(NK))
    _check_merged(ex.merge_partial_attention(*_parts(q, k, v, sets)), ref_out, ref_lse,
                  f"keys split {' | '.join(map(str, sets))}")


def test_merge_partial_attention_any_order_and_nested(ex):
    q, k, v = _qkv(10)
    outs, lses = _parts(q, k, v, _split(NK, 4, 10))
    ref_out, ref_lse = _attend(q, k, v, range(NK))
    m = ex.merge_partial_attention
    for order in ([3, 1, 0, 2], [2, 3, 1, 0]):
        _check_merged(m([outs[i] for i in order], [lses[i] for i in order]), ref_out, ref_lse,
                      f"blocks in the order {order}")
    left, right = m(outs[:2], lses[:2]), m(outs[2:], lses[2:])  # a tree: merge results merged again
    _check_merged(m([left[0], right[0]], [left[1], right[1]]), ref_out, ref_lse, "merged as ((a b)(c d))")
    one = m(outs[:3], lses[:3])  # one block at a time, as a ring does
    _check_merged(m([one[0], outs[3]], [one[1], lses[3]]), ref_out, ref_lse, "merged as ((a b c) d)")


def test_merge_partial_attention_fully_masked_block(ex):
    q, k, v = _qkv(20, n_keys=S)  # causal self-attention: query i sees keys 0..i
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    sets = [[0, 1], [2, 3], [4]]  # query 0 sees only block 0; queries 0-1 see nothing of blocks 1 and 2
    outs, lses = _parts(q, k, v, sets, causal)
    # the setting is as described
    assert torch.isneginf(lses[1][..., :2]).all() and outs[1][..., :2, :].isnan().all()
    assert torch.isneginf(lses[2][..., :4]).all() and outs[2][..., :4, :].isnan().all()
    ref_out, ref_lse = _attend(q, k, v, range(S), causal)
    for order in ([0, 1, 2], [2, 1, 0], [1, 2, 0]):
        _check_merged(ex.merge_partial_attention([outs[i] for i in order], [lses[i] for i in order]),
                      ref_out, ref_lse, f"causal blocks {order}: some rows of blocks 1 and 2 saw no key "
                                        "(lse -inf, out NaN)")

    # a block no query sees at all: merging it changes nothing
    nothing = torch.zeros(S, S, dtype=torch.bool)
    out_0, lse_0 = _attend(q, k, v, [2, 3, 4], nothing)
    out_e, lse_e = _attend(q, k, v, [0, 1], causal)
    _check_merged(ex.merge_partial_attention([out_e, out_0], [lse_e, lse_0]), out_e, lse_e,
                  "merge with an empty block")
    # empty blocks only: out 0, lse -inf, and still mergeable with another block
    out, lse = ex.merge_partial_attention([out_0, out_0.clone(), out_0.clone()],
                                          [lse_0, lse_0.clone(), lse_0])
    assert not out.isnan().any() and (out == 0).all(), "a row empty in every block must get out = 0"
    assert torch.isneginf(lse).all(), "a row empty in every block must get lse = -inf"
    _check_merged(ex.merge_partial_attention([out, out_e], [lse, lse_e]), out_e, lse_e,
                  "an empty merge result merged with a block")
    # and no NaN in the gradient through an empty block's rows
    out_e = out_e.clone().requires_grad_()
    got, _ = ex.merge_partial_attention([out_e, out_0], [lse_e, lse_0])
    got.sum().backward()
    assert not out_e.grad.isnan().any(), "NaN in the gradient: zero an empty block's rows before weighting"


@pytest.mark.parametrize("scale", [200.0, 3000.0])
def test_merge_partial_attention_large_logits_float32(ex, scale):
    q, k, v = _qkv(30, dtype=torch.float32, scale=scale)  # scores of hundreds to thousands: exp overflows
    outs, lses = _parts(q, k, v, _split(NK, 3, 30))
    # the reference: the same float32 partials merged in float64, by the definition
    ls = [x.double() for x in lses]
    ref_lse = torch.logsumexp(torch.stack(ls), 0)
    ref_out = sum((lx - ref_lse).exp()[..., None] * ox.double() for lx, ox in zip(ls, outs))
    got = ex.merge_partial_attention(outs, lses)
    assert got[0].dtype == torch.float32, f"out must keep outs[0]'s dtype float32, got {got[0].dtype}"
    _check_merged((got[0].double(), got[1].double()), ref_out, ref_lse,
                  f"float32, scores scaled by {scale}: subtract the largest lse before exp",
                  bounds=_merge_bound(outs, lses))


def test_merge_partial_attention_gradients(ex):
    q, k, v = (x.requires_grad_() for x in _qkv(40))
    sets = _split(NK, 3, 40)
    g = torch.Generator().manual_seed(41)
    d_out = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    d_lse = torch.randn(B, H, S, generator=g, dtype=torch.float64)
    out, lse = ex.merge_partial_attention(*_parts(q, k, v, sets))
    got = torch.autograd.grad((out * d_out).sum() + (lse * d_lse).sum(), (q, k, v))
    ref_out, ref_lse = _attend(q, k, v, range(NK))
    ref = torch.autograd.grad((ref_out * d_out).sum() + (ref_lse * d_lse).sum(), (q, k, v))
    for name, gg, rr in zip("qkv", got, ref):  # the forward's chain, then back through it
        bound = model_bound(n=NK, depth=2 * MERGE_DEPTH, scale=max(1.0, rr.abs().max().item()))
        close(gg, rr, bound, f"grad of {name} through the merge")


def test_merge_partial_attention_shapes_and_bad_input(ex):
    outs = [torch.randn(2, 3, 7, 8) for _ in range(3)]
    lses = [torch.randn(2, 3, 7) for _ in range(3)]
    out, lse = ex.merge_partial_attention(outs, lses)
    assert tuple(out.shape) == (2, 3, 7, 8) and tuple(lse.shape) == (2, 3, 7), \
        f"got out {tuple(out.shape)}, lse {tuple(lse.shape)}; expected (B, H, S, d) and (B, H, S)"
    with pytest.raises(ValueError, match=r"lses\[1\] has shape"):
        ex.merge_partial_attention(outs, [lses[0], lses[1][..., :1], lses[2]])
    with pytest.raises(ValueError, match="one lse per partial output"):
        ex.merge_partial_attention(outs, lses[:2])


# --- 2. striped_rank_shard, striped_reassemble, causal_work ---------------------------------------------


def _striped_index(seq, t, r):
    """The positions rank r holds in the striped layout, listed one by one (an independent construction)."""
    return [i for i in range(seq) if i % t == r]


def _zigzag_index(seq, t, r):
    c = seq // (2 * t)
    return [i for i in range(seq) if i // c == r] + [i for i in range(seq) if i // c == 2 * t - 1 - r]


def _contiguous_index(seq, t, r):
    c = seq // t
    return [i for i in range(seq) if i // c == r]


INDEX = {"striped": _striped_index, "zigzag": _zigzag_index, "contiguous": _contiguous_index}


def _causal_pairs(rows):
    """(query, key) pairs with key <= query for the query positions `rows`: count the mask's entries."""
    rows = list(rows)
    n = max(rows) + 1
    return int(torch.ones(n, n, dtype=torch.bool).tril()[rows].sum())


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_striped_rank_shard_matches_index_construction(ex, t, dim):
    seq = 3 * t
    shape = [3, 5, 2]
    shape[dim] = seq
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(t))
    for r in range(t):
        got = ex.striped_rank_shard(x, t, r, dim=dim)
        want = x.index_select(dim, torch.tensor(_striped_index(seq, t, r)))
        assert torch.equal(got, want), \
            f"t={t}, rank {r}, dim {dim}: expected positions {_striped_index(seq, t, r)}"


def test_striped_rank_shard_hand_worked(ex):
    x = torch.arange(8)[None]  # (1, 8)
    assert ex.striped_rank_shard(x, 2, 0).tolist() == [[0, 2, 4, 6]]
    assert ex.striped_rank_shard(x, 2, 1).tolist() == [[1, 3, 5, 7]]
    assert ex.striped_rank_shard(x, 4, 3).tolist() == [[3, 7]]


def test_striped_rank_shard_rejects_indivisible_length(ex):
    ex.striped_rank_shard(torch.zeros(2, 32, 4), 4, 0)  # a valid call first
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by t=4"):
        ex.striped_rank_shard(torch.zeros(2, 30, 4), 4, 0)
    with pytest.raises(ValueError, match=r"sequence length 7 is not divisible by t=2"):
        ex.striped_rank_shard(torch.zeros(7, 3), 2, 1, dim=0)


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_striped_reassemble_round_trip(ex, t, dim):
    shape = [4, 5, 3]
    shape[dim] = 2 * t
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(t))
    # built independently
    shards = [x.index_select(dim, torch.tensor(_striped_index(2 * t, t, r))) for r in range(t)]
    got = ex.striped_reassemble(shards, dim=dim)
    assert torch.equal(got, x), f"t={t}, dim {dim}: the striped shards reassembled are not x"


def test_striped_reassemble_inverts_the_shard(ex):
    y = torch.randn(12, 5, generator=torch.Generator().manual_seed(9))
    for t in (2, 3, 4):
        got = ex.striped_reassemble([ex.striped_rank_shard(y, t, r, dim=0) for r in range(t)], dim=0)
        assert torch.equal(got, y), f"t={t}, dim 0: reassemble(shard(y)) != y"


def _causal_cases():
    """Seeded random (seq_len, t) pairs that every layout cuts evenly, and hand-picked ones."""
    g = torch.Generator().manual_seed(5)
    cases = [(8, 2), (16, 4), (24, 3), (64, 8), (4, 1)]
    for _ in range(8):
        t = int(torch.randint(1, 7, (1,), generator=g))
        cases.append((2 * t * int(torch.randint(1, 9, (1,), generator=g)), t))
    return cases


@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous"])
def test_causal_work_counts_the_mask(ex, layout):
    for seq, t in _causal_cases():
        got = ex.causal_work(seq, t, layout)
        want = [_causal_pairs(INDEX[layout](seq, t, r)) for r in range(t)]
        assert got == want, f"{layout}, S={seq}, t={t}: got {got}, counted from the mask {want}"
        assert all(isinstance(w, int) for w in got), \
            f"return Python ints, got {[type(w).__name__ for w in got]}"
        assert sum(got) == seq * (seq + 1) // 2


def test_causal_work_hand_worked(ex):
    # S = 8, t = 2. contiguous: 1+2+3+4 = 10 and 5+6+7+8 = 26; zigzag: {0,1,6,7} 18, {2,3,4,5} 18;
    # striped: {0,2,4,6} 1+3+5+7 = 16, {1,3,5,7} 2+4+6+8 = 20
    assert ex.causal_work(8, 2, "contiguous") == [10, 26]
    assert ex.causal_work(8, 2, "zigzag") == [18, 18]
    assert ex.causal_work(8, 2, "striped") == [16, 20]
    with pytest.raises(ValueError, match="layout"):
        ex.causal_work(8, 2, "diagonal")


@pytest.mark.parametrize("seq,t", [(16, 4), (24, 3), (64, 8)])
def test_causal_work_balance(ex, seq, t):
    zig, con, stripe = (ex.causal_work(seq, t, layout) for layout in ("zigzag", "contiguous", "striped"))
    assert len(set(zig)) == 1, f"zigzag gives every rank the same work, got {zig}"
    assert all(a < b for a, b in zip(con, con[1:])), f"under contiguous, later ranks do more: {con}"
    # striped: each rank's queries are one position later than the previous rank's, S/t of them
    assert [b - a for a, b in zip(stripe, stripe[1:])] == [seq // t] * (t - 1), \
        f"striped: rank r + 1 scores S/t = {seq // t} pairs more than rank r, got {stripe}"


# --- 3. ulysses_seq_to_heads, ulysses_heads_to_seq (on ranks) ----------------------------------

UB, US, UH, UD = 2, 8, 4, 3  # batch, sequence, heads, head dim


def _global_x(n_head=UH, seed=50):
    return torch.randn(UB, US, n_head, UD, generator=torch.Generator().manual_seed(seed))


def _seq_slice(x, t, r):
    return x[:, r * US // t:(r + 1) * US // t]


def _head_slice(x, t, r):
    h = x.shape[2]
    return x[:, :, r * h // t:(r + 1) * h // t]


def _events(m):
    return [(e.op, e.nbytes, e.group_size) for e in m.events]


def _seq_to_heads(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    x_r = _seq_slice(_global_x(), t, r).clone()
    before = x_r.clone()
    with comm.meter() as m:
        y = ex.ulysses_seq_to_heads(x_r)
    return {"y": y, "events": _events(m), "unchanged": torch.equal(x_r, before)}


def _heads_to_seq(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    y_r = _head_slice(_global_x(seed=51), t, r).clone()
    with comm.meter() as m:
        x = ex.ulysses_heads_to_seq(y_r)
    # round trip on data that is not the exercise's own output format's global slicing
    z_r = torch.randn(UB, US // t, UH, UD, generator=torch.Generator().manual_seed(60 + r))
    back = ex.ulysses_heads_to_seq(ex.ulysses_seq_to_heads(z_r))
    return {"x": x, "events": _events(m), "round_trip": torch.equal(back, z_r)}


def _bad_heads(ex):
    t = dist.get_world_size()
    n_head = {2: 3, 4: 6}[t]
    return refusal(lambda: ex.ulysses_seq_to_heads(torch.zeros(UB, US // t, n_head, UD)))


# ring attention: a (1, 2, 8, 4) float64 q, k, v, sharded contiguously (2 or 4 tokens per rank)
RB, RH, RS, RD = 1, 2, 8, 4


def _ring_data():
    g = torch.Generator().manual_seed(70)
    return [torch.randn(RB, RH, RS, RD, generator=g, dtype=torch.float64) for _ in range(4)]  # q, k, v, dO


def _ring(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _ring_data()
    rows = torch.arange(r, RS, t)  # this rank's striped positions
    out = {}
    for causal in (False, True):
        qr, kr, vr = (x[..., rows, :].clone().requires_grad_() for x in (q, k, v))
        with comm.meter() as fwd:
            y = ex.striped_ring_attention(qr, kr, vr, causal)
        with comm.meter() as bwd:
            y.backward(dout[..., rows, :])
        out[causal] = {"y": y.detach(), "grads": [x.grad for x in (qr, kr, vr)],
                       "fwd": [(e.op, e.nbytes) for e in fwd.events],
                       "bwd": [(e.op, e.nbytes) for e in bwd.events]}
    return out


# the traffic of one attention layer: (1, 4, 8, 4) float32, 4 heads so that Ulysses runs at t = 4
TB, TH, TS, TD = 1, 4, 8, 4


def _traffic(ex):
    from minitorch_dist.parallelism.sequence_parallel.ring_attention import ring_attention
    from minitorch_dist.parallelism.sequence_parallel.ulysses import ulysses_attention

    r, t = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(80)
    rows = slice(r * TS // t, (r + 1) * TS // t)
    q, k, v = (torch.randn(TB, TH, TS, TD, generator=g)[..., rows, :] for _ in range(3))
    with comm.meter() as around:  # the layers must run inside the call
        got = ex.context_parallel_traffic(q, k, v)
    own = {}  # the test's own count of the same two layers
    for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
        q_, k_, v_ = (x.clone().requires_grad_() for x in (q, k, v))
        with comm.meter() as m:
            fn(q_, k_, v_).sum().backward()
        own[name] = m.total_wire_bytes
    return {"got": got, "own": own, "around": around.total_wire_bytes,
            "ops": sorted({e.op for e in around.events})}


def _all_on_ranks(impl):
    # each rank imports the chapter by its path (a module object cannot be pickled)
    ex = load("ch05", impl)
    cases = {"seq_to_heads": _seq_to_heads, "heads_to_seq": _heads_to_seq, "bad_heads": _bad_heads,
             "ring": _ring, "traffic": _traffic}
    return run_cases({name: (lambda fn=fn: fn(ex)) for name, fn in cases.items()})


@pytest.fixture(scope="module")
def ranks(ex, launches):
    """`ranks(t)`: the per-rank results of _all_on_ranks on t ranks, launched once per t."""
    return launches(_all_on_ranks, resolve_impl(), timeout_s=TIMEOUT_S)


def _results(ranks, t, part):
    """Each rank's value of case ``part`` on t ranks (a case that raised fails only its own tests)."""
    return ranks.case(t, part)


def _check_one_all_to_all(events, what, nbytes, t):
    assert [e[0] for e in events] == ["all_to_all"], \
        f"{what}: ran {[e[0] for e in events]}; expected exactly one comm.all_to_all"
    assert events[0][1] == nbytes, f"{what}: all-to-all of {events[0][1]} B; expected this rank's whole " \
                                   f"input, {nbytes} B"
    assert events[0][2] == t, f"{what}: all-to-all among {events[0][2]} ranks; expected all {t}"


@pytest.mark.parametrize("t", [2, 4])
def test_ulysses_seq_to_heads_matches_slicing(ranks, t):
    x = _global_x()
    for r, res in enumerate(_results(ranks, t, "seq_to_heads")):
        want = _head_slice(x, t, r)
        assert tuple(res["y"].shape) == tuple(want.shape), \
            f"rank {r} of {t}: shape {tuple(res['y'].shape)}; expected (B, S, n_head/t, d) = " \
            f"{tuple(want.shape)}"
        assert torch.equal(res["y"], want), \
            f"rank {r} of {t}: not heads {r * UH // t}..{(r + 1) * UH // t - 1} " \
            "of the global tensor, all positions"
        assert res["unchanged"], f"rank {r} of {t}: the input x_r was modified in place"


@pytest.mark.parametrize("t", [2, 4])
def test_ulysses_seq_to_heads_one_all_to_all(ranks, t):
    for r, res in enumerate(_results(ranks, t, "seq_to_heads")):
        _check_one_all_to_all(res["events"], f"rank {r} of {t}", UB * US // t * UH * UD * 4, t)


@pytest.mark.parametrize("t", [2, 4])
def test_ulysses_seq_to_heads_rejects_indivisible_heads(ranks, t):
    n_head = {2: 3, 4: 6}[t]
    for r, msg in enumerate(_results(ranks, t, "bad_heads")):
        assert msg is not None and f"n_head {n_head} is not divisible by t={t}" in msg, \
            f"rank {r} of {t}: expected ValueError 'n_head {n_head} is not divisible by t={t}', got {msg!r}"


@pytest.mark.parametrize("t", [2, 4])
def test_ulysses_heads_to_seq_matches_slicing(ranks, t):
    y = _global_x(seed=51)
    for r, res in enumerate(_results(ranks, t, "heads_to_seq")):
        want = _seq_slice(y, t, r)
        assert tuple(res["x"].shape) == tuple(want.shape), \
            f"rank {r} of {t}: shape {tuple(res['x'].shape)}; expected (B, S/t, n_head, d) = " \
            f"{tuple(want.shape)}"
        assert torch.equal(res["x"], want), \
            f"rank {r} of {t}: not positions {r * US // t}..{(r + 1) * US // t - 1} " \
            "of the global tensor, all heads"
        _check_one_all_to_all(res["events"], f"rank {r} of {t}", UB * US * (UH // t) * UD * 4, t)


@pytest.mark.parametrize("t", [2, 4])
def test_ulysses_heads_to_seq_round_trip(ranks, t):
    for r, res in enumerate(_results(ranks, t, "heads_to_seq")):
        assert res["round_trip"], f"rank {r} of {t}: heads_to_seq(seq_to_heads(x_r)) != x_r"


# --- 4. activation_bytes_per_layer --------------------------------------------------------------

SHAPES = [(2048, 1, 4096, 32), (512, 4, 1024, 16), (8, 2, 12, 3)]  # (s, b, h, a)


@pytest.mark.parametrize("t", [1, 2, 4, 8])
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("s,b,h,a", SHAPES)
def test_activation_bytes_per_layer_matches_korthikanti(ex, s, b, h, a, t, sp):
    got = ex.activation_bytes_per_layer(s, b, h, a, t=t, sequence_parallel=sp)
    names = set(ex.SAVED_TENSORS)
    assert set(got) == names, \
        f"one entry per saved tensor: missing {names - set(got)}, extra {set(got) - names}"
    want = costmodel.activation_memory_bytes(s, b, h, a, layers=1, tp=t, sequence_parallel=sp)
    assert sum(got.values()) == pytest.approx(want), \
        f"t={t}, sequence_parallel={sp}: total {sum(got.values())}"


def test_activation_bytes_per_layer_what_sp_shards(ex):
    s, b, h, a, t = 512, 2, 256, 8, 4
    sbh = s * b * h
    tp = ex.activation_bytes_per_layer(s, b, h, a, t=t)
    sp = ex.activation_bytes_per_layer(s, b, h, a, t=t, sequence_parallel=True)
    one = ex.activation_bytes_per_layer(s, b, h, a)
    assert sum(one.values()) == pytest.approx(sbh * (34 + 5 * a * s / h)), "t = 1 is the paper's eq. 1"
    assert one["softmax_output"] == pytest.approx(2 * a * s * s * b)
    assert one["gelu_input"] == pytest.approx(8 * sbh)
    replicated = [n for n in tp if tp[n] == pytest.approx(one[n])]  # what TP alone leaves whole on every rank
    assert sum(one[n] for n in replicated) == pytest.approx(10 * sbh), \
        f"TP leaves {replicated} replicated; the paper's 10sbh are the LayerNorm inputs, the inputs of the " \
        "QKV and first MLP projections and the two dropout masks"
    for n in sp:
        assert sp[n] == pytest.approx(one[n] / t), f"with SP every saved tensor is split t ways, {n} is not"


def test_activation_bytes_per_layer_random_shapes(ex):
    g = torch.Generator().manual_seed(11)
    draw = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    for _ in range(40):
        a, t = draw(1, 17), 2 ** draw(0, 4)
        s, b, h = draw(1, 4097), draw(1, 9), a * draw(1, 129)
        for sp in (False, True):
            got = ex.activation_bytes_per_layer(s, b, h, a, t=t, sequence_parallel=sp)
            want = costmodel.activation_memory_bytes(s, b, h, a, layers=1, tp=t, sequence_parallel=sp)
            assert sum(got.values()) == pytest.approx(want), \
                f"s={s}, b={b}, h={h}, a={a}, t={t}, sequence_parallel={sp}: total {sum(got.values())}, " \
                f"Korthikanti's {want}"


# --- 5. StripedRingAttn ---------------------------------------------------------------------------


def _sdpa(causal):
    """Attention over the whole sequence in one process, and the gradients of q, k, v."""
    q, k, v, dout = _ring_data()
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    y.backward(dout)
    return y.detach(), [q.grad, k.grad, v.grad]


RING_DEPTH = 12  # scores, the softmax's sum, P·V, up to 3 merges; then a backward as deep


def _ring_close(got, want, where):
    close(got, want, model_bound(n=RS, depth=RING_DEPTH, scale=max(1.0, want.abs().max().item())), where)


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_StripedRingAttn_matches_sdpa(ranks, t, causal):
    y, grads = _sdpa(causal)
    for r, res in enumerate(_results(ranks, t, "ring")):
        rows, what = torch.arange(r, RS, t), f"rank {r} of {t}, causal={causal}"
        got = res[causal]
        assert not got["y"].isnan().any(), f"{what}: NaN in the output (a row that saw no key of a block)"
        _ring_close(got["y"], y[..., rows, :], f"{what}, output at this rank's striped positions")
        for name, g, want in zip("qkv", got["grads"], grads):
            assert g is not None, f"{what}: no gradient for {name}"
            _ring_close(g, want[..., rows, :], f"{what}, gradient of {name} (this rank's striped rows)")


@pytest.mark.parametrize("t", [2, 4])
def test_StripedRingAttn_passes_blocks_round_the_ring(ranks, t):
    block = RB * RH * (RS // t) * RD * 8  # one float64 shard of k (or v, dk, dv)
    for r, res in enumerate(_results(ranks, t, "ring")):
        for causal, got in res.items():
            what = f"rank {r} of {t}, causal={causal}"
            for phase, sends in (("fwd", 2 * (t - 1)), ("bwd", 2 * (t - 1) + 2 * t)):
                ops = {op for op, _ in got[phase]}
                assert ops <= {"send", "recv"}, f"{what}, {phase}: ran {sorted(ops)}; only point-to-point " \
                                                f"sends and receives round the ring"
                sent = [n for op, n in got[phase] if op == "send"]
                assert sent == [block] * sends, \
                    f"{what}, {phase}: sent {len(sent)} messages of {sorted(set(sent))} B; expected {sends}" \
                    f" of one shard, {block} B (forward: K and V, t-1 hops; backward: the same, plus dK" \
                    f" and dV, t hops)"


# --- 6. context_parallel_traffic ----------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_context_parallel_traffic_prediction_and_count(ranks, t):
    shard = TB * (TS // t) * TH * TD * 4  # one rank's (b, s/t, h) block, float32
    by_hand = {"ulysses": 8 * shard * (t - 1) / t,  # eight all-to-alls, each keeps 1/t of the shard
               "ring": (6 * t - 4) * shard}  # K, V: t-1 hops each way; dK, dV: t hops
    for r, res in enumerate(_results(ranks, t, "traffic")):
        for name in ("ulysses", "ring"):
            got, own, what = res["got"][name], res["own"][name], f"rank {r} of {t}, {name}"
            assert own == pytest.approx(by_hand[name], rel=1e-9), (name, own, by_hand[name])  # the layer
            assert got["predicted"] == pytest.approx(by_hand[name], rel=1e-9), \
                f"{what}: predicted {got['predicted']} B; worked by hand {by_hand[name]} B"
            assert got["measured"] == pytest.approx(own, rel=1e-9), \
                f"{what}: measured {got['measured']} B; the meter counts {own} B (wire bytes, forward and " \
                f"backward)"
            assert got["predicted"] == pytest.approx(got["measured"], rel=1e-9), \
                f"{what}: prediction {got['predicted']} B and measurement {got['measured']} B disagree"
        assert res["around"] == pytest.approx(res["own"]["ulysses"] + res["own"]["ring"], rel=1e-9), \
            f"rank {r} of {t}: a meter around context_parallel_traffic counted {res['around']} B " \
            f"({res['ops']}); running both layers forward and backward sends " \
            f"{res['own']['ulysses'] + res['own']['ring']} B: measure by running them, not by the formula"
