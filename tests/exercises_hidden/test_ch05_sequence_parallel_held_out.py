"""Chapter 05, held-out: the merge, the striped layout, the causal work and striped ring attention on
seeded random sizes, masks and a world size (t = 3) the visible tests do not use.

Expected values as in the visible tests: softmax attention over all the keys in float64, index lists
built position by position, the causal mask counted, PyTorch's SDPA on the whole sequence. Shards and
counts are exact; attention in float64 is held to ``model_bound`` with n the longest reduction (the
keys) and the visible tests' depths (MERGE_DEPTH = 6, RING_DEPTH = 12), scaled by the values compared.
"""
import math
import random
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist.course.exercises import load, resolve_impl

from _support import close, model_bound, run_cases

pytestmark = pytest.mark.ch05

if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _attend(q, k, v, keys, allowed):
    idx = torch.as_tensor(keys, dtype=torch.long)
    scores = (q @ k[..., idx, :].transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(~allowed[:, idx],
                                                                                      float("-inf"))
    return torch.softmax(scores, dim=-1) @ v[..., idx, :], torch.logsumexp(scores, dim=-1)


@pytest.mark.parametrize("seed", range(6))
def test_merge_partial_attention_random_blocks_and_masks(ex, seed):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n_q, n_k, d, blocks = rng.randrange(2, 7), rng.randrange(6, 20), rng.randrange(2, 9), rng.randrange(2, 7)
    q, k, v = (torch.randn(2, 2, n, d, generator=g, dtype=torch.float64) for n in (n_q, n_k, n_k))
    allowed = torch.rand(n_q, n_k, generator=g) < 0.6
    allowed[:, rng.randrange(n_k)] = True  # every query sees at least one key somewhere
    perm = list(range(n_k))
    rng.shuffle(perm)
    cuts = sorted(rng.sample(range(1, n_k), blocks - 1))
    sets = [perm[a:b] for a, b in zip([0] + cuts, cuts + [n_k])]
    parts = [_attend(q, k, v, s, allowed) for s in sets]
    out, lse = ex.merge_partial_attention([p[0] for p in parts], [p[1] for p in parts])
    ref_out, ref_lse = _attend(q, k, v, range(n_k), allowed)
    assert not out.isnan().any() and not lse.isnan().any(), f"seed {seed}: NaN in the merge"
    scale = max(1.0, ref_out.abs().max().item())
    close(out, ref_out, model_bound(n=n_k, depth=6, scale=scale), f"seed {seed}: {blocks} blocks, out")
    close(lse, ref_lse, model_bound(n=n_k, depth=6, scale=max(1.0, ref_lse.abs().max().item())),
          f"seed {seed}: {blocks} blocks, lse")


def test_merge_partial_attention_keeps_a_half_precision_dtype(ex):
    g = torch.Generator().manual_seed(3)
    outs = [torch.randn(1, 2, 3, 4, generator=g).half() for _ in range(3)]
    lses = [torch.randn(1, 2, 3, generator=g) for _ in range(3)]
    out, _ = ex.merge_partial_attention(outs, lses)
    assert out.dtype == torch.float16 and not out.isnan().any()


def _random_striped(seed):
    rng = random.Random(100 + seed)
    t = rng.randrange(1, 7)
    shape = [rng.randrange(1, 4) for _ in range(rng.randrange(1, 5))]
    dim = rng.randrange(-len(shape), len(shape))
    shape[dim] = t * rng.randrange(1, 5)
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    shards = [x.index_select(dim, torch.arange(r, shape[dim], t)) for r in range(t)]
    return x, t, dim, shards


@pytest.mark.parametrize("seed", range(20))
def test_striped_rank_shard_random(ex, seed):
    x, t, dim, shards = _random_striped(seed)
    for r, want in enumerate(shards):
        assert torch.equal(ex.striped_rank_shard(x, t, r, dim=dim), want), \
            f"shape {tuple(x.shape)}, dim {dim}, t={t}, rank {r}"


@pytest.mark.parametrize("seed", range(20))
def test_striped_reassemble_random(ex, seed):
    x, t, dim, shards = _random_striped(seed)
    assert torch.equal(ex.striped_reassemble(shards, dim=dim), x), f"shape {tuple(x.shape)}, dim {dim}, t={t}"


def test_causal_work_random_lengths(ex):
    rng = random.Random(7)
    index = {"striped": lambda s, t, r: range(r, s, t),
             "zigzag": lambda s, t, r: [i for i in range(s) if i // (s // (2 * t)) in (r, 2 * t - 1 - r)],
             "contiguous": lambda s, t, r: range(r * s // t, (r + 1) * s // t)}
    for _ in range(30):
        t = rng.randrange(1, 9)
        s = 2 * t * rng.randrange(1, 40)
        for layout, rows in index.items():
            assert ex.causal_work(s, t, layout) == [sum(i + 1 for i in rows(s, t, r)) for r in range(t)], \
                (layout, s, t)


RS = 9  # three positions per rank at t = 3


def _ring_data():
    g = torch.Generator().manual_seed(90)
    return [torch.randn(1, 2, RS, 3, generator=g, dtype=torch.float64) for _ in range(4)]


def _ring(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    q, k, v, dout = _ring_data()
    rows = torch.arange(r, RS, t)
    out = {}
    for causal in (False, True):
        qr, kr, vr = (x[..., rows, :].clone().requires_grad_() for x in (q, k, v))
        y = ex.striped_ring_attention(qr, kr, vr, causal)
        y.backward(dout[..., rows, :])
        out[causal] = [y.detach()] + [x.grad for x in (qr, kr, vr)]
    return out


def _on_ranks(impl):
    ex = load("ch05", impl)
    return run_cases({"ring": lambda: _ring(ex)})


@pytest.fixture(scope="module")
def ranks(ex, launches):
    return launches(_on_ranks, resolve_impl(), timeout_s=60)


@pytest.mark.parametrize("causal", [False, True])
def test_StripedRingAttn_three_ranks(ranks, causal):
    q, k, v, dout = (x.requires_grad_() for x in _ring_data())
    y = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    y.backward(dout.detach())
    want = [y.detach(), q.grad, k.grad, v.grad]
    for r, res in enumerate(ranks.case(3, "ring")):
        rows = torch.arange(r, RS, 3)
        for name, got, ref in zip(("out", "dq", "dk", "dv"), res[causal], want):
            ref = ref[..., rows, :]
            close(got, ref, model_bound(n=RS, depth=12, scale=max(1.0, ref.abs().max().item())),
                  f"rank {r} of 3, causal={causal}, {name}")
