"""Chapter 05: ring attention (Liu et al. 2023) computes full attention -- forward and backward,
causal or not, contiguous or zigzag layout -- and works the way §3 says: t-1 K/V block pairs sent
per rank forward, only O(S/t) tensors saved for backward, no block of scores larger than
(S/t) x (S/t); and zigzag sharding balances causal work where the contiguous layout does not.

One launch per ring size t runs every case and returns plain data; the tests only inspect it.
Expected values come from elsewhere: ``F.scaled_dot_product_attention`` on the full sequence in
one process (one thread, like a rank), cut into shards by ``shard_sequence`` (itself checked
against the layouts' definitions, written out here), byte counts from B·h·(S/t)·d written out
here, block counts from the causal rule counted by hand.

Tolerances (tests/_support.py's model). Ring attention sums the softmax over t blocks and merges
them with logaddexp where SDPA sums in one pass: the same exact function computed two ways, so each
comparison is bounded, entry by entry, by the sum of the two computations' forward-error bounds
(Higham's first-order analysis, written out in ``_attention_error``, computed from the inputs): every
score q·k·scale is within ``γ_{d+1}·scale·|q|·|k|``; every probability (the forward's, the
backward's recomputed ones) is off by a relative ρ at most twice the score error of its row, plus the
normaliser's sum of S positive terms (γ_S), plus one exp / log (each within 1 ulp = 2u, the accuracy
of the vectorised and the libm functions torch calls) of an argument at most X = 2·max|s| + log S,
with its rounding u·X, per factor in the chain (at most S + 4t + 8 factors: one rescaling per key
tile, t merges' logaddexp and weights, the block's own); the output is then off by
``(ρ + γ_{S+2t})·Σ_j P_ij|v_j|``, and the backward's dV, dP, D = rowsum(dO∘O), dS = P∘(dP - D), dQ,
dK each by their sums' γ times Σ|terms| plus the propagated errors. The main cases run in float64
(u = 2^-53: the bound is ~1e-13 of the values); one float32 case checks the production dtype
(u = 2^-24, ~1e-4 of the values) against float32 SDPA; a bfloat16 case (blocks computed in
float32, q/k/v/dO and the saved output in bfloat16, results rounded to bfloat16) is compared with
float64 SDPA of the same rounded inputs: its bound adds bfloat16's rounding (u = 2^-8) of every
result, and of the saved output, which enters D (|dO|·|O|·u) and through dS every dQ and dK. A
missing block, a wrong mask or a gradient left on the wrong rank moves entries by O(0.1): over 100
times the bound even in bfloat16 (one causal chunk pair left out exceeds it 160x to 3000x).
"""
import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.analysis.observers import Recorder
from minitorch_dist.parallelism.sequence_parallel import ring_attention as RA
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import gamma, roundoff

pytestmark = pytest.mark.ch05

B, H, S, D = 2, 3, 32, 8
SEED = 11
CASES = [(causal, layout) for causal in (False, True) for layout in RA.LAYOUTS]
FN_ULPS = 2  # exp, log, log1p within 1 ulp = 2u (see the module docstring)
MEM_S, MEM_B, MEM_H, MEM_D = (256, 512), 1, 2, 8


def _full(seq=S, dtype=torch.float64, seed=SEED, b=B, h=H, d=D):
    """Full-sequence q, k, v and an upstream gradient G, (b, h, seq, d)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, seq, d, generator=g, dtype=torch.float64).to(dtype) for _ in range(4)]


# --- what runs on the ranks ---------------------------------------------------------------------


def _ring(t, r, causal, layout, dtype=torch.float64, scale=None, group=None, seed=SEED):
    """Ring attention of this rank's shard: output and the three gradients, plus the comm meters."""
    Q, K, V, G = _full(dtype=dtype, seed=seed)
    q, k, v = (RA.shard_sequence(x, t, r, -2, layout).requires_grad_(True) for x in (Q, K, V))
    with comm.meter() as fwd:
        out = RA.ring_attention(q, k, v, group=group, causal=causal, layout=layout, scale=scale)
    with comm.meter() as bwd:
        (out * RA.shard_sequence(G, t, r, -2, layout)).sum().backward()
    ev = lambda m: [(e.op, e.nbytes, e.group_size) for e in m.events]
    return {"grads": [out.detach(), q.grad, k.grad, v.grad], "fwd": ev(fwd), "bwd": ev(bwd)}


def _equivalence():
    t, r = dist.get_world_size(), dist.get_rank()
    res = {(c, lay): _ring(t, r, c, lay) for c, lay in CASES}
    res["float32"] = _ring(t, r, True, "zigzag", dtype=torch.float32)
    res["scale"] = _ring(t, r, True, "contiguous", scale=0.3)
    res["bfloat16"] = _ring(t, r, True, "zigzag", dtype=torch.bfloat16)
    res["strided"] = _strided(t, r)
    if t == 4:  # two rings of 2 inside the 4 ranks: peers must be the group's, not the world's
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        res["subgroup"] = _ring(2, r % 2, True, "zigzag", group=groups[r // 2], seed=SEED + r // 2)
    return res


def _strided(t, r):
    """q a transposed view of a (B, S/t, h, d) shard, k and v slices of one fused (B, h, S/t, 2d)
    tensor (none of them contiguous), causal, contiguous layout: output and the leaves' gradients."""
    Q, K, V, G = _full()
    q_leaf = RA.shard_sequence(Q, t, r).transpose(1, 2).contiguous().requires_grad_(True)
    kv_leaf = torch.cat([RA.shard_sequence(K, t, r), RA.shard_sequence(V, t, r)], -1).requires_grad_(True)
    q, k, v = q_leaf.transpose(1, 2), kv_leaf[..., :D], kv_leaf[..., D:]
    strided = [not x.is_contiguous() for x in (q, k, v)]
    out = RA.ring_attention(q, k, v, causal=True)
    (out * RA.shard_sequence(G, t, r)).sum().backward()
    dkv = kv_leaf.grad
    return {"grads": [out.detach(), q_leaf.grad.transpose(1, 2), dkv[..., :D], dkv[..., D:]],
            "strided": strided}


def _memory():
    """Per S: the meter's peak saved-for-backward bytes, every saved shape, the largest score block."""
    t, r = dist.get_world_size(), dist.get_rank()
    out = {}
    for seq in MEM_S:
        Q, K, V, _ = _full(seq, torch.float32, b=MEM_B, h=MEM_H, d=MEM_D)
        q, k, v = (RA.shard_sequence(x, t, r, -2, "zigzag").requires_grad_(True) for x in (Q, K, V))
        meter = MemoryMeter()
        with observe.watching(Recorder()) as work, meter.track():  # ring attention announces its blocks
            RA.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()
        shapes = []  # a second forward lists every saved tensor (only the innermost hooks see them)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x, shapes=shapes: shapes.append(tuple(x.shape)) or x, lambda x: x):
            RA.ring_attention(q, k, v, causal=True, layout="zigzag").sum().backward()
        out[seq] = {"activations": meter.peak["activations"], "shapes": shapes,
                    "largest": {p: max(work.counts(f"{p} score entries")) for p in ("forward", "backward")}}
    return out


def _work():
    """Forward and backward FLOPs of the score blocks on this rank, causal, per layout."""
    t, r = dist.get_world_size(), dist.get_rank()
    Q, K, V, _ = _full()
    out = {}
    for layout in RA.LAYOUTS:
        q, k, v = (RA.shard_sequence(x, t, r, -2, layout).requires_grad_(True) for x in (Q, K, V))
        with observe.watching(Recorder()) as w:
            RA.ring_attention(q, k, v, causal=True, layout=layout).sum().backward()
        out[layout] = {p: w.totals[f"{p} flops"] for p in ("forward", "backward")}
    return out


def _run_every_case():
    return {"eq": _equivalence(), "memory": _memory(), "work": _work()}


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=120)


# --- the dense reference -------------------------------------------------------------------------------


@functools.cache
def _dense(causal, dtype=torch.float64, scale=None, seed=SEED):
    """SDPA on the full sequence, computed in float64 for bfloat16 inputs (rounded to bfloat16 first)."""
    with single_thread():
        Q, K, V, G = (x.double().requires_grad_(True) if dtype == torch.bfloat16 else x.requires_grad_(True)
                      for x in _full(dtype=dtype, seed=seed))
        out = F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale)
        (out * G).sum().backward()
        return [out.detach(), Q.grad, K.grad, V.grad]


def _attention_error(q, k, v, g=None, mask=None, scale=None, acc=torch.float64, rounded_to=None, t=1):
    """First-order bounds on |computed - exact| of attention, entry by entry, for ONE computation whose
    sums run in ``acc`` over t merged key blocks (the module docstring's account): a dict of
    ``out``, ``lse``, ``dq``, ``dk``, ``dv`` (the backward's for the upstream gradient ``g``, default 0).
    ``rounded_to``: the dtype the results (and the output
    the backward reads) are rounded to, as bfloat16 inputs' are. The magnitudes come from the exact
    attention of the given inputs, computed here in float64; ``mask`` (Sq, Sk): which keys a query sees."""
    g = torch.zeros_like(q) if g is None else g
    q, k, v, g = (x.double() for x in (q, k, v, g))
    S, D = k.shape[-2], q.shape[-1]
    c = D ** -0.5 if scale is None else scale
    u, u_out = roundoff(acc), roundoff(rounded_to) if rounded_to is not None else 0.0
    seen = torch.ones(q.shape[-2], S, dtype=torch.bool) if mask is None else mask
    s = (c * q @ k.mT).masked_fill(~seen, float("-inf"))
    P, A = s.softmax(-1), (c * q.abs() @ k.abs().mT).masked_fill(~seen, 0.0)
    O = P @ v
    X = 2 * s.masked_fill(~seen, 0.0).abs().max().item() + math.log(S)  # bounds every exp / log argument
    factors = S + 4 * t + 8  # exp / log evaluations in one probability's chain
    rho = 2 * gamma(D + 1, acc) * A.amax(-1) + factors * (FN_ULPS + X) * u + gamma(S, acc)  # (.., Sq)
    e_out = (rho + gamma(S + 2 * t, acc))[..., None] * (P @ v.abs())
    e_read = e_out + u_out * (O.abs() + e_out)  # the output the backward reads, rounded (|fl(x) - x| <= u|x|)
    dP, delta = g @ v.mT, (g * O).sum(-1)
    e_dP = gamma(D, acc) * (g.abs() @ v.abs().mT)
    e_delta = torch.maximum(  # D as rowsum(dO ∘ O) (ring, FlashAttention) or as rowsum(P ∘ dP) (SDPA's math)
        gamma(D, acc) * (g.abs() * O.abs()).sum(-1) + (g.abs() * e_read).sum(-1),
        (gamma(S, acc) + rho) * (P * dP.abs()).sum(-1) + (P * e_dP).sum(-1))
    dS = P * (dP - delta[..., None])
    e_dS = (rho[..., None] + 2 * u) * dS.abs() + P * (e_dP + e_delta[..., None])
    gs = gamma(S + 2, acc)
    e_dq = c * (gs * dS.abs() @ k.abs() + e_dS @ k.abs())
    e_dk = c * (gs * dS.abs().mT @ q.abs() + e_dS.mT @ q.abs())
    e_dv = ((rho + gs)[..., None] * P).mT @ g.abs()
    return {"out": e_read, "lse": rho,  # each result then rounded: u·(|exact| + its error)
            "dq": e_dq + u_out * ((c * dS @ k).abs() + e_dq),
            "dk": e_dk + u_out * ((c * dS.mT @ q).abs() + e_dk),
            "dv": e_dv + u_out * ((P.mT @ g).abs() + e_dv)}


def _within(got, want, bound, where):
    """|got - want| <= bound entry by entry (bound: a tensor of want's shape from _attention_error)."""
    excess = (got.double() - want.double()).abs() - bound
    assert excess.max() <= 0, (f"{where}: |got - want| exceeds its derived bound by "
                               f"{excess.max().item():.3g} (largest bound {bound.max().item():.3g})")


@functools.cache
def _ref_bounds(causal, dtype=torch.float64, scale=None, seed=SEED, t=1):
    """The ring (t blocks, sums in dtype's accumulation type, results in dtype) against the reference
    _dense(causal, dtype, ...): float32 SDPA for float32 (its own error added), float64 SDPA else."""
    Q, K, V, G = _full(dtype=dtype, seed=seed)
    mask = torch.ones(S, S, dtype=torch.bool).tril() if causal else None
    acc = torch.float32 if dtype in (torch.float32, torch.bfloat16) else torch.float64
    ring = _attention_error(Q, K, V, G, mask, scale, acc, dtype if dtype == torch.bfloat16 else None, t)
    ref_acc = torch.float32 if dtype == torch.float32 else torch.float64
    ref = _attention_error(Q, K, V, G, mask, scale, ref_acc)
    return [ring[n] + ref[n] for n in ("out", "dq", "dk", "dv")]


def _check(per_rank, ref, bounds, layout, dtype, where):
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        got = RA.unshard_sequence([res[i] for res in per_rank], -2, layout)
        assert got.dtype == dtype
        _within(got, ref[i], bounds[i], f"{where} {name}")


# --- ring attention equals full attention ----------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("causal,layout", CASES)
def test_ring_attention_equals_full_attention_forward_and_backward(t, causal, layout):
    per_rank = [res["eq"][causal, layout]["grads"] for res in _results(t)]
    _check(per_rank, _dense(causal), _ref_bounds(causal, t=t), layout, torch.float64,
           f"t={t} causal={causal} {layout}")


@pytest.mark.parametrize("t", [2, 4])
def test_float32_and_a_custom_scale(t):
    res = _results(t)
    _check([x["eq"]["float32"]["grads"] for x in res], _dense(True, torch.float32),
           _ref_bounds(True, torch.float32, t=t), "zigzag", torch.float32, "float32")
    _check([x["eq"]["scale"]["grads"] for x in res], _dense(True, scale=0.3),
           _ref_bounds(True, scale=0.3, t=t), "contiguous", torch.float64, "scale=0.3")
    _check([x["eq"]["bfloat16"]["grads"] for x in res], _dense(True, torch.bfloat16),
           _ref_bounds(True, torch.bfloat16, t=t), "zigzag", torch.bfloat16, "bfloat16")


@pytest.mark.parametrize("t", [2, 4])
def test_non_contiguous_shards_are_accepted(t):
    """A transposed q and k, v sliced from one fused tensor (as Ulysses accepts them): the result and
    the gradients are those of contiguous shards."""
    res = _results(t)
    assert all(x["eq"]["strided"]["strided"] == [True, True, True] for x in res)
    _check([x["eq"]["strided"]["grads"] for x in res], _dense(True), _ref_bounds(True, t=t), "contiguous",
           torch.float64, "strided")


def test_rings_inside_a_larger_world_use_their_group():
    res = _results(4)
    for g in range(2):  # ranks 2g, 2g+1 form ring g on the data of seed SEED+g
        per_rank = [res[2 * g + i]["eq"]["subgroup"]["grads"] for i in range(2)]
        _check(per_rank, _dense(True, seed=SEED + g), _ref_bounds(True, seed=SEED + g, t=2), "zigzag",
               torch.float64, f"subgroup {g}")
        assert {n for ev in ("fwd", "bwd") for *_, n in res[2 * g]["eq"]["subgroup"][ev]} == {2}


# --- the mechanism: bytes on the ring ----------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("case", [(False, "contiguous"), (True, "zigzag"), "float32", "bfloat16"])
def test_forward_sends_t_minus_1_kv_pairs_backward_adds_t_dkv_pairs(t, case):
    """Forward: t-1 steps, each sends k and v, (S/t)-blocks: 2(t-1)·B·h·(S/t)·d·elem bytes.
    Backward: the same t-1 K/V pairs, and t dK/dV pairs (the accumulator's last hop takes it home),
    the accumulators in float32 for bfloat16 inputs."""
    elem, acc = {"float32": (4, 4), "bfloat16": (2, 4)}.get(case, (8, 8))
    blk = B * H * (S // t) * D
    for res in _results(t):
        ev = res["eq"][case]
        for which in ("fwd", "bwd"):
            assert {n for _, _, n in ev[which]} == {t}
        assert {nb for _, nb, _ in ev["fwd"]} == {blk * elem}  # every message is one (S/t)-block
        assert {nb for _, nb, _ in ev["bwd"]} == {blk * elem, blk * acc}
        sends = lambda which, ev=ev: [nb for op, nb, _ in ev[which] if op == "send"]
        recvs = lambda which, ev=ev: [nb for op, nb, _ in ev[which] if op == "recv"]
        assert len(sends("fwd")) == 2 * (t - 1) and sum(sends("fwd")) == 2 * (t - 1) * blk * elem
        assert len(sends("bwd")) == 2 * (t - 1) + 2 * t
        assert sum(sends("bwd")) == 2 * (t - 1) * blk * elem + 2 * t * blk * acc
        assert sends("fwd") == recvs("fwd") and sends("bwd") == recvs("bwd")  # a ring: what leaves arrives
        want = costmodel.ring_attention_bytes_per_layer(B, S, H * D, t, elem, acc)
        assert (sum(sends("fwd")), sum(sends("bwd"))) == (want["forward"], want["backward"])


# --- memory: O(S/t) saved, (S/t)-sized score blocks ---------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_saved_activations_are_linear_in_s_over_t_and_no_score_matrix_exists(t):
    for res in _results(t):
        mem = res["memory"]
        for seq in MEM_S:
            n = seq // t
            qkvo = MEM_B * MEM_H * n * MEM_D * 4
            assert mem[seq]["activations"] == 4 * qkvo + MEM_B * MEM_H * n * 4  # q, k, v, out + lse
            assert max(math.prod(s) for s in mem[seq]["shapes"]) == MEM_B * MEM_H * n * MEM_D
            # causal zigzag computes chunk pairs: (S/2t) x (S/2t) scores at most, forward and backward
            assert mem[seq]["largest"] == {"forward": (n // 2) ** 2, "backward": (n // 2) ** 2}
        a, b = (mem[s]["activations"] for s in MEM_S)
        assert b == 2 * a  # S doubled: saved bytes double, where naive attention's quadruple


def test_naive_attention_saves_the_s_by_s_scores_that_ring_attention_avoids():
    """The comparison the memory test rests on: softmax(q k^T) v saves S x S probabilities."""
    peaks = []
    for seq in MEM_S:
        q, k, v = (x.requires_grad_(True) for x in _full(seq, torch.float32, b=MEM_B, h=MEM_H, d=MEM_D)[:3])
        meter = MemoryMeter()
        with meter.track():
            ((q @ k.transpose(-2, -1)) * D ** -0.5).softmax(-1) @ v
        peaks.append(meter.peak["activations"])
        assert meter.peak["activations"] >= MEM_B * MEM_H * seq * seq * 4
    assert peaks[1] > 3.5 * peaks[0]


# --- load balance of causal attention -----------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_zigzag_balances_causal_work_and_contiguous_does_not(t):
    """Counted by hand. Contiguous: rank r computes r full (S/t)^2 blocks and its diagonal block.
    Zigzag, chunks c = S/2t: its two diagonal chunks, (late, early) of its own, and two chunk pairs
    against every other rank -- 2t+1 chunk pairs on every rank."""
    n, c = S // t, S // (2 * t)
    for r, res in enumerate(_results(t)):
        w = res["work"]
        assert w["contiguous"]["forward"] == 4 * B * H * D * (r + 1) * n * n
        assert w["zigzag"]["forward"] == 4 * B * H * D * (2 * t + 1) * c * c
        for layout in RA.LAYOUTS:  # the backward recomputes exactly the forward's blocks
            assert w[layout]["backward"] * 4 == w[layout]["forward"] * 10
    work = [res["work"] for res in _results(t)]
    contiguous = [w["contiguous"]["forward"] for w in work]
    assert contiguous[-1] == t * contiguous[0]  # the last rank does t times the first one's work
    assert len({w["zigzag"]["forward"] for w in work}) == 1


# --- the block algebra, in one process ----------------------------------------------------------------------


def _softmax_attention(q, k, v, mask=None):
    s = q @ k.transpose(-2, -1) * D ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v, torch.logsumexp(s, -1)


def attention_block_of(q, k, v, causal=False):
    return RA.attention_block(q, k, v, causal, D ** -0.5)


def test_merge_is_associative_and_equals_softmax_over_the_concatenated_keys():
    q, k, v, _ = _full(12)
    parts = [attention_block_of(q, k[..., sl, :], v[..., sl, :])
             for sl in (slice(0, 3), slice(3, 8), slice(8, 12))]
    a, b, c = parts
    left = RA.merge_attention(*RA.merge_attention(*a, *b), *c)
    right = RA.merge_attention(*a, *RA.merge_attention(*b, *c))
    swapped = RA.merge_attention(*RA.merge_attention(*c, *a), *b)
    full = _softmax_attention(q, k, v)
    merged, one_pass = _attention_error(q, k, v, t=3), _attention_error(q, k, v)  # 3 blocks; one pass
    for got in (left, right, swapped):
        _within(got[0], full[0], merged["out"] + one_pass["out"], "merged out")
        _within(got[1], full[1], merged["lse"] + one_pass["lse"], "merged lse")


def test_fully_masked_rows_merge_without_nans():
    q, k, v, _ = _full(6)
    a = attention_block_of(q, k[..., :0, :], v[..., :0, :])  # a block of no key: every row sees nothing
    assert torch.isneginf(a[1]).all() and (a[0] == 0).all()
    b = attention_block_of(q, k[..., 3:, :], v[..., 3:, :], causal=True)
    b[0][..., :2, :], b[1][..., :2] = 0.0, float("-inf")  # rows 0, 1 see nothing in block b either
    none = torch.zeros(6, 3, dtype=torch.bool)
    half = torch.ones(6, 3, dtype=torch.bool).tril()
    out, lse = RA.merge_attention(*a, *b)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, b[0]) and torch.equal(lse, b[1])  # an empty side has weight exactly 0
    assert (out[..., :2, :] == 0).all() and torch.isneginf(lse[..., :2]).all()
    mask = torch.cat([none, half], 1)
    ref = _softmax_attention(q[..., 2:, :], k, v, mask[2:])
    # the merged computation (2 blocks) and the one-pass reference
    err = [_attention_error(q[..., 2:, :], k, v, mask=mask[2:], t=t)["out"] for t in (2, 1)]
    _within(out[..., 2:, :], ref[0], err[0] + err[1], "out of the rows that see keys")


def test_block_backward_equals_autograd():
    q, k, v, g = (x.requires_grad_(True) for x in _full(10))
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    out, lse = _softmax_attention(q, k, v, mask)
    (out * g).sum().backward()
    delta = (g * out).sum(-1)
    got = RA.attention_block_backward(q.detach(), k.detach(), v.detach(), True, D ** -0.5, g.detach(),
                                      lse.detach(), delta.detach())
    err = _attention_error(q, k, v, g, mask)  # one computation's bound, twice: the block's and autograd's
    for x, want, name in zip(got, (q.grad, k.grad, v.grad), ("dq", "dk", "dv"), strict=True):
        _within(x, want, 2 * err[name], name)


# --- layouts and errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [1, 2, 4])
@pytest.mark.parametrize("layout", RA.LAYOUTS)
def test_shard_and_unshard_are_inverse_and_zigzag_pairs_early_with_late(t, layout):
    x = torch.arange(2 * 8 * 3).reshape(2, 8, 3).float()
    shards = [RA.shard_sequence(x, t, r, 1, layout) for r in range(t)]
    assert torch.equal(RA.unshard_sequence(shards, 1, layout), x)
    for r in range(t):
        pos = RA.sequence_positions(8, t, r, layout)
        assert torch.equal(shards[r], x[:, pos])
        if layout == "zigzag":  # 2t chunks of c: chunk r, then chunk 2t-1-r (whose positions mirror r's)
            c = 8 // (2 * t)
            assert pos.tolist() == list(range(r * c, (r + 1) * c)) + list(range((2 * t - 1 - r) * c,
                                                                                (2 * t - r) * c))
            assert sorted(pos.tolist()) == sorted((7 - pos).tolist())
        else:
            assert pos.tolist() == list(range(r * 8 // t, (r + 1) * 8 // t))
    assert torch.equal(RA.zigzag_unshard([RA.zigzag_shard(x, 2, r, 1) for r in range(2)], 1), x)
    assert torch.equal(RA.contiguous_unshard([RA.contiguous_shard(x, 2, r, 1) for r in range(2)], 1), x)


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError,
                       match=r"sequence length 30 is not divisible by 2\*t=4 for the zigzag layout"):
        RA.zigzag_shard(torch.zeros(1, 1, 30, 4), 2, 0)
    with pytest.raises(ValueError,
                       match="sequence length 30 is not divisible by t=4 for the contiguous layout"):
        RA.contiguous_shard(torch.zeros(1, 1, 30, 4), 4, 0)
    with pytest.raises(ValueError, match="layout 'striped' is not one of"):
        RA.shard_sequence(torch.zeros(8), 2, 0, 0, "striped")
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match=r"head_dim of q \(4\) and k \(8\) differ"):
        RA.ring_attention(q, torch.zeros(1, 2, 8, 8), torch.zeros(1, 2, 8, 8))
    with pytest.raises(ValueError, match="same shape"):
        RA.ring_attention(q, torch.zeros(1, 2, 6, 4), torch.zeros(1, 2, 6, 4))
    with pytest.raises(ValueError, match=r"must be \(B, n_head, S/t, head_dim\)"):
        RA.ring_attention(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="local sequence length 7 is odd"):
        RA.ring_attention(*[torch.zeros(1, 2, 7, 4)] * 3, layout="zigzag")
    with pytest.raises(RuntimeError, match="launch"):
        RA.ring_attention(q, q, q)
