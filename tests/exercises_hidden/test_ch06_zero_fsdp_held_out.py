"""Chapter 06, held-out: aligned flattening, unflatten, Adafactor and the ZeRO-2 hook on seeded random
sizes, dtypes (bfloat16, int64), a tied parameter and a world size (n = 3) the visible tests do not use.

Expected values as in the visible tests: buffers built element by element, per-parameter shards built
with ``torch.chunk``, the single-process gradient of the global batch, the paper's Algorithm 4 slice by
slice. Buffers are exact; the gradient in float64 is held to ``model_bound(n=rows, depth=4)``, as in the
visible tests; Adafactor to ``model_bound(n=24, depth=12)``, the visible tests' (slices here have at
most 6 x 6 = 36 elements, their reductions at most 6 terms).
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

from _support import close, float64, model_bound, run_cases

pytestmark = pytest.mark.ch06

if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _random_tensors(seed):
    rng = random.Random(seed)
    dtype = [torch.bfloat16, torch.int64, torch.float64][seed % 3]
    shapes = [tuple(rng.randrange(1, 5) for _ in range(rng.randrange(0, 3)))
              for _ in range(rng.randrange(1, 6))]
    tensors = [(torch.arange(math.prod(s)) + 1 + 100 * i).reshape(s).to(dtype) for i, s in enumerate(shapes)]
    n, align = rng.randrange(1, 6), rng.choice([1, 2, 3, 4, 8])
    return tensors, shapes, dtype, n, align


@pytest.mark.parametrize("seed", range(12))
def test_flatten_and_partition_random(ex, seed):
    tensors, shapes, dtype, n, align = _random_tensors(seed)
    offsets, end = [], 0
    for t in tensors:
        end = -(-end // align) * align
        offsets.append(end)
        end += t.numel()
    s = -(-end // (n * align)) * align
    want = torch.zeros(n * s, dtype=dtype)
    for t, o in zip(tensors, offsets):
        want[o:o + t.numel()] = t.reshape(-1)
    for rank in range(n):
        flat, shard, layout = ex.flatten_and_partition(tensors, n, rank, align=align)
        what = f"shapes {shapes}, {dtype}, n={n}, align={align}, rank {rank}"
        assert flat.dtype == dtype and torch.equal(flat, want), what
        assert torch.equal(shard, want[rank * s:(rank + 1) * s]), what
        assert [int(o) for o, _ in layout] == offsets, what


@pytest.mark.parametrize("seed", range(12))
def test_unflatten_random(ex, seed):
    tensors, shapes, dtype, n, align = _random_tensors(seed)
    layout, end = [], 0
    for t in tensors:  # an aligned layout written out here, and a buffer holding the tensors there
        end = -(-end // align) * align
        layout.append((end, t.shape))
        end += t.numel()
    flat = torch.full((end + 3,), -1).to(dtype)
    for (o, _), t in zip(layout, tensors):
        flat[o:o + t.numel()] = t.reshape(-1)
    back = ex.unflatten(flat, layout)
    assert all(torch.equal(b, t) for b, t in zip(back, tensors)), f"shapes {shapes}, {dtype}, align {align}"


@pytest.mark.parametrize("seed", range(6))
def test_adafactor_update_random_shapes(ex, seed):
    rng = random.Random(40 + seed)
    shape = tuple(rng.randrange(1, 7) for _ in range(rng.randrange(2, 5)))
    by_size = sorted(range(len(shape)), key=lambda d: (shape[d], d))
    r, c = sorted(by_size[-2:])
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(*shape, generator=g, dtype=torch.float64)
    row = torch.rand(shape[:c] + shape[c + 1:], generator=g, dtype=torch.float64)
    col = torch.rand(shape[:r] + shape[r + 1:], generator=g, dtype=torch.float64)
    update, new_row, new_col = ex.adafactor_update(grad, row, col, 0.8, eps=1e-3)
    # the reference, one slice at a time (the other dims' indices enumerated)
    others = [d for d in range(len(shape)) if d not in (r, c)]
    bound = lambda want: model_bound(n=24, depth=12, scale=max(1.0, want.abs().max().item()))
    for idx in (torch.cartesian_prod(*[torch.arange(shape[d]) for d in others]).reshape(-1, len(others))
                if others else [()]):
        sel = [slice(None)] * len(shape)
        for d, i in zip(others, list(idx)):
            sel[d] = int(i)
        gs = grad[tuple(sel)]
        rsel = [s for d, s in enumerate(sel) if d != c]
        csel = [s for d, s in enumerate(sel) if d != r]
        sq = gs * gs + 1e-3
        rr = 0.8 * row[tuple(rsel)] + 0.2 * sq.mean(1)
        cc = 0.8 * col[tuple(csel)] + 0.2 * sq.mean(0)
        want = gs / (torch.outer(rr, cc) / rr.mean()).sqrt()
        close(update[tuple(sel)], want, bound(want), f"shape {shape}, slice {sel}")
        close(new_row[tuple(rsel)], rr, bound(rr), f"shape {shape}, row averages of slice {sel}")
        close(new_col[tuple(csel)], cc, bound(cc), f"shape {shape}, column averages of slice {sel}")


ROWS = 9  # three rows per rank at n = 3


class _Tied(torch.nn.Module):
    """An encoder and a decoder sharing one weight (tied), and a head registered first, used last."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)
        self.head = torch.nn.Linear(4, 2)
        self.shared = torch.nn.Linear(4, 4, bias=False)
        self.mid = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.shared(torch.tanh(self.mid(self.shared(x)))))


def _batch():
    g = torch.Generator().manual_seed(6)
    return torch.randn(ROWS, 4, generator=g), torch.randn(ROWS, 2, generator=g)


def _zero2(ex):
    r, n = dist.get_rank(), dist.get_world_size()
    with float64():
        model = _Tied()
        params = list(model.parameters())
        shard, _ = ex.zero2_reduce_scatter_hook(params)
        x, y = _batch()
        rows = slice(r * ROWS // n, (r + 1) * ROWS // n)
        out = []
        for _ in range(2):
            F.mse_loss(model(x[rows]), y[rows]).backward()
            out.append(shard.clone())
        return out


def _on_ranks(impl):
    ex = load("ch06", impl)
    return run_cases({"zero2": lambda: _zero2(ex)})


@pytest.fixture(scope="module")
def ranks(ex, launches):
    return launches(_on_ranks, resolve_impl(), timeout_s=60)


def test_zero2_reduce_scatter_hook_three_ranks_tied_weight(ranks):
    n = 3
    with float64():
        model = _Tied()
        x, y = _batch()
        F.mse_loss(model(x), y).backward()
        pieces = []
        for p in model.parameters():
            flat = p.grad.reshape(-1)
            c = -(-flat.numel() // n)
            pieces.append(torch.cat([flat, flat.new_zeros(n * c - flat.numel())]).chunk(n))
        want = [torch.cat([p[r] for p in pieces]) for r in range(n)]
    for r, got in enumerate(ranks.case(n, "zero2")):
        for step, shard in enumerate(got):
            close(shard, want[r], model_bound(n=ROWS, depth=4, scale=max(1.0, want[r].abs().max().item())),
                  f"rank {r} of 3, backward {step + 1}: tied weight, head registered first")
