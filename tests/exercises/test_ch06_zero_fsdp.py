"""Chapter 06 exercises, autograded: aligned flat-buffer partitioning, the ZeRO-2 reduce-scatter hook with
per-parameter shards, a ZeRO-3 unit, predicting and metering a ZeRO step, Adafactor factored over a
tensor's two largest dimensions.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: ``torch.cat`` and ``torch.chunk`` of the flattened
tensors (per parameter, for the ZeRO-2 hook and the ZeRO-3 unit), an aligned buffer built element by
element, the single-process gradient of the whole global batch by autograd, torch's FSDP2
``fully_shard`` trained the same way, the comm meter (which collectives ran during backward, on how
many ranks, how many bytes), ZeRO's memory and traffic formulas written out in the tests, an
unfactored exponential moving average of ``G * G``, ``torch.optim.Adafactor``'s own state and steps,
and the paper's Algorithm 4 (with sums) applied slice by slice to 3-D and 4-D gradients.

Flattening and Adafactor are pure functions, tested in this process. The ZeRO-2 hook, the ZeRO-3 unit
and the metered ZeRO step run on ranks: one launch on 2 ranks and one on 4, each exercise a case of
its own (``_support.run_cases``) so that an unfinished one fails only its own tests. Checks of bad
input first make a valid call, so a stub fails them too.

Tolerances (derived in tests/_support.py). Flattening, layouts, counts and bytes are exact. The ZeRO-2
hook and the ZeRO-3 unit run in float64: their gradients are the single process's sums over the
global batch's GLOBAL_B = 8 rows in another grouping (the widest layer has 7 inputs), at most
DEPTH = 4 reductions chained (two layers forward, one back, the weight gradient's sum over rows,
which the reduce-scatter finishes): ``model_bound(n=8, depth=4)`` scaled by the gradient's size; the
weights after Z3_STEPS = 3 SGD steps (lr 0.1, momentum 0.9), ``sgd_bound`` of it. All are near
1e-11 of the values; a gradient not averaged over ranks is n times too large, a shard of another
rank's slice is another gradient altogether. Their collectives move float64 elements (``ELEM = 8``
bytes). ``meter_zero_stage`` counts the bytes of the chapter's fp32 model and stays float32; its
optimizer state (and so its model states) is "about" the formula's: AdamW's step counters and the
shards' padding add fewer than 64 bytes, below 1 % of 8Ψ/n = 8642 bytes. Adafactor is a short chain
of float64 operations: its averages are one sum of cols (or rows) + 3 terms, ``reorder_bound``; its
update against the rank-1 second moment and against ``torch.optim.Adafactor`` a chain of the
averages, their mean and the update over the steps, ``model_bound(n=rows·cols, depth=ADA_DEPTH)``,
the torch update read back through ``(w_before - w) / alpha``, whose subtraction rounds by
u(|w_before| + |w|) / alpha. The N-D slices are at most 7 x 5, so their reductions are shorter than
ROWS·COLS = 24 terms and the same bound holds; the hand-worked averages are exact in binary.
"""
import math
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import comm
from minitorch_dist.course.exercises import load, resolve_impl

from _support import close, float64, model_bound, reorder_bound, run_cases, sgd_bound

pytestmark = pytest.mark.ch06

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this
# file (whatever pytest's import mode). The exercise module is registered by value by `load`.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A rank stuck in a collective its peers never call fails after this long, naming each rank's
# last op, instead of launch's default 300 s.
TIMEOUT_S = 60


# --- 1. flatten_and_partition / unflatten -----------------------------------------------------------

SHAPES = {
    "divisible": [(2, 3), (4,), (3, 2)],  # 16 elements
    "ragged": [(3, 5), (7,), (1, 2, 3), ()],  # 29 elements (prime) and a 0-dim tensor
    "one": [(5,)],
}


def _tensors(kind, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # +1 so that no element is 0: a zero in the padding is then the padding's, not the data's
    return [torch.rand(s, generator=g, dtype=dtype) + 1 for s in SHAPES[kind]]


def _reference_flat(tensors, n):
    """The padded buffer and its n shards, built with torch.cat and torch.chunk."""
    body = torch.cat([t.reshape(-1) for t in tensors])
    s = -(-body.numel() // n)  # ceil without the solution's formula
    flat = torch.cat([body, torch.zeros(n * s - body.numel(), dtype=body.dtype)])
    return flat, flat.chunk(n) if s else [flat] * n, s


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_flatten_and_partition_matches_cat_and_chunk(ex, kind, n):
    tensors = _tensors(kind)
    ref_flat, ref_shards, s = _reference_flat(tensors, n)
    for rank in range(n):
        flat, shard, _ = ex.flatten_and_partition(tensors, n, rank)
        what = f"{kind} ({sum(t.numel() for t in tensors)} elements), n={n}, rank {rank}"
        assert flat.dim() == 1 and flat.dtype == tensors[0].dtype, \
            f"{what}: flat must be 1-D of the tensors' dtype, got shape {tuple(flat.shape)}, {flat.dtype}"
        torch.testing.assert_close(flat, ref_flat, rtol=0, atol=0,
                                   msg=lambda m, what=what: f"{what}, flat buffer: {m}")
        assert shard.shape == (s,), \
            f"{what}: shard has shape {tuple(shard.shape)}; expected ({s},), ceil(numel/n)"
        torch.testing.assert_close(shard, ref_shards[rank], rtol=0, atol=0,
                                   msg=lambda m, what=what: f"{what}, shard: {m}")


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_flatten_and_partition_equal_shards_zero_padding(ex, kind, n):
    tensors = _tensors(kind, seed=1)
    numel = sum(t.numel() for t in tensors)
    results = [ex.flatten_and_partition(tensors, n, rank) for rank in range(n)]
    flat = results[0][0]
    sizes = [shard.numel() for _, shard, _ in results]
    assert len(set(sizes)) == 1, f"n={n}: shard sizes {sizes} differ; every rank gets ceil(numel/n) elements"
    assert flat.numel() == n * sizes[0] and 0 <= flat.numel() - numel < n, \
        f"n={n}, {numel} elements: flat has {flat.numel()} = n x {sizes[0]}; pad to the least multiple of n"
    assert torch.count_nonzero(flat[numel:]) == 0, \
        f"n={n}: the padding {flat[numel:].tolist()} is not all zeros"
    assert torch.count_nonzero(flat[:numel]) == numel, f"n={n}: the data (all nonzero) was not copied in full"
    torch.testing.assert_close(torch.cat([shard for _, shard, _ in results]), flat, rtol=0, atol=0,
                               msg=lambda m: f"n={n}: the shards of ranks 0..n-1, concatenated, "
                                             f"are not flat: {m}")


def test_flatten_and_partition_shard_is_a_view_and_inputs_untouched(ex):
    tensors = _tensors("ragged")
    before = [t.clone() for t in tensors]
    flat, shard, _ = ex.flatten_and_partition(tensors, 3, 1)
    s = shard.numel()
    shard.fill_(-7.0)
    assert torch.all(flat[s:2 * s] == -7.0), \
        "writing into rank 1's shard did not change flat[S:2S]: the shard must be a view (a slice), " \
        "not a copy"
    assert torch.count_nonzero(flat[:s] == -7.0) == 0 and torch.count_nonzero(flat[2 * s:] == -7.0) == 0, \
        "the shard of rank 1 must be elements [S, 2S) of flat"
    for i, (t, b) in enumerate(zip(tensors, before)):
        assert torch.equal(t, b), f"tensor {i} was modified: flat must be a new buffer holding copies"


@pytest.mark.parametrize("kind", list(SHAPES))
def test_flatten_and_partition_layout(ex, kind):
    tensors = _tensors(kind)
    _, _, layout = ex.flatten_and_partition(tensors, 4, 0)
    expected, offset = [], 0
    for t in tensors:
        expected.append((offset, tuple(t.shape)))
        offset += t.numel()
    got = [(int(o), tuple(s)) for o, s in layout]
    assert got == expected, f"layout {got}; expected one (offset, shape) pair per tensor, {expected}"


def _reference_aligned(tensors, n, align):
    """The aligned buffer built element by element: each tensor's offset the next multiple of align, the
    shard the least multiple of align with n shards covering the end (both found by counting up)."""
    offsets, end = [], 0
    for t in tensors:
        while end % align:
            end += 1
        offsets.append(end)
        end += t.numel()
    s = 0
    while n * s < end:
        s += align
    flat = torch.zeros(n * s, dtype=tensors[0].dtype)
    for t, o in zip(tensors, offsets):
        for e, value in enumerate(t.reshape(-1).tolist()):
            flat[o + e] = value
    return flat, s, offsets


ALIGNED = [("ragged", 4, 2), ("ragged", 3, 4), ("ragged", 2, 8), ("divisible", 4, 4), ("divisible", 3, 2),
           ("one", 5, 3), ("ragged", 5, 3), ("divisible", 1, 8)]


@pytest.mark.parametrize("kind,n,align", ALIGNED)
def test_flatten_and_partition_aligned(ex, kind, n, align):
    tensors = _tensors(kind, seed=3)
    ref_flat, s, offsets = _reference_aligned(tensors, n, align)
    for rank in range(n):
        flat, shard, layout = ex.flatten_and_partition(tensors, n, rank, align=align)
        what = f"{kind}, n={n}, align={align}, rank {rank}"
        assert [int(o) for o, _ in layout] == offsets, \
            f"{what}: offsets {[int(o) for o, _ in layout]}; every tensor starts at the next multiple of " \
            f"{align}: {offsets}"
        assert flat.shape == ref_flat.shape, \
            f"{what}: flat has {flat.numel()} elements; the shortest buffer of n equal shards, each a " \
            f"multiple of {align}, holding every tensor has {ref_flat.numel()} (S = {s})"
        torch.testing.assert_close(flat, ref_flat, rtol=0, atol=0,
                                   msg=lambda m, what=what: f"{what}, flat buffer (zeros in the gaps): {m}")
        torch.testing.assert_close(shard, ref_flat[rank * s:(rank + 1) * s], rtol=0, atol=0,
                                   msg=lambda m, what=what: f"{what}, shard: {m}")


def test_flatten_and_partition_hand_worked(ex):
    # sizes 3, 1, 2 with align 2: offsets 0, 4, 6; end 8; n = 3 shards of 4 (a multiple of 2): 12 elements
    tensors = [torch.tensor([1., 2., 3.]), torch.tensor([4.]), torch.tensor([5., 6.])]
    flat, shard, layout = ex.flatten_and_partition(tensors, 3, 2, align=2)
    assert flat.tolist() == [1, 2, 3, 0, 4, 0, 5, 6, 0, 0, 0, 0], f"got {flat.tolist()}"
    assert shard.tolist() == [0, 0, 0, 0] and [int(o) for o, _ in layout] == [0, 4, 6]
    # unaligned: 6 elements in 4 shards of 2
    flat, shard, _ = ex.flatten_and_partition(tensors, 4, 1)
    assert flat.tolist() == [1, 2, 3, 4, 5, 6, 0, 0] and shard.tolist() == [3, 4], f"got {flat.tolist()}"


def test_flatten_and_partition_rejects_bad_input(ex):
    tensors = _tensors("divisible")
    ex.flatten_and_partition(tensors, 2, 1)  # a valid call first
    with pytest.raises(ValueError, match="rank 2 is outside"):
        ex.flatten_and_partition(tensors, 2, 2)
    with pytest.raises(ValueError, match="n must be >= 1"):
        ex.flatten_and_partition(tensors, 0, 0)
    with pytest.raises(ValueError, match="align must be >= 1"):
        ex.flatten_and_partition(tensors, 2, 0, align=0)
    with pytest.raises(ValueError, match="one dtype"):
        ex.flatten_and_partition([torch.ones(2), torch.ones(2, dtype=torch.float64)], 2, 0)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("align", [1, 4])
def test_unflatten_round_trip(ex, kind, n, align):
    tensors = _tensors(kind, seed=2, dtype=torch.float64)
    flat, _, layout = ex.flatten_and_partition(tensors, n, n - 1, align=align)
    back = ex.unflatten(flat, layout)
    assert len(back) == len(tensors), f"unflatten returned {len(back)} tensors; expected {len(tensors)}"
    for i, (t, b) in enumerate(zip(tensors, back)):
        assert b.shape == t.shape, f"tensor {i}: shape {tuple(b.shape)}, expected {tuple(t.shape)}"
        torch.testing.assert_close(b, t, rtol=0, atol=0,
                                   msg=lambda m, i=i: f"n={n}, align={align}, tensor {i}: {m}")


def test_unflatten_returns_views_into_flat(ex):
    tensors = _tensors("ragged")
    flat, _, layout = ex.flatten_and_partition(tensors, 4, 0)
    other = torch.arange(flat.numel(), dtype=flat.dtype)  # another buffer of the same layout
    views = ex.unflatten(other, layout)
    offset = 0
    for i, (t, v) in enumerate(zip(tensors, views)):
        expected = torch.arange(offset, offset + t.numel(), dtype=flat.dtype).reshape(t.shape)
        torch.testing.assert_close(v, expected, rtol=0, atol=0,
                                   msg=lambda m, i=i: f"tensor {i} of another buffer: {m}")
        offset += t.numel()
    other.mul_(-1)  # an in-place write to the buffer (an all-gather, say) must show in every tensor
    assert all(torch.all(v <= 0) for v in views), \
        "after writing into the flat buffer the tensors did not change: return views (flat[a:b].view(shape))"


def test_unflatten_follows_the_layout_gaps_and_all(ex):
    # a layout written by hand, with gaps between the tensors (alignment) and a 0-dim tensor
    layout = [(0, torch.Size([2, 2])), (6, torch.Size([3])), (9, torch.Size([])), (12, torch.Size([1, 2]))]
    flat = torch.arange(16, dtype=torch.float64)
    got = [v.tolist() for v in ex.unflatten(flat, layout)]
    assert got == [[[0, 1], [2, 3]], [6, 7, 8], 9, [[12, 13]]], \
        f"got {got}: tensor i is the elements from its layout offset on (the gaps belong to no tensor)"


def test_unflatten_gradients_flow_into_flat(ex):
    tensors = _tensors("ragged", seed=4, dtype=torch.float64)
    flat, _, layout = ex.flatten_and_partition(tensors, 3, 0, align=2)
    flat = flat.clone().requires_grad_()
    views = ex.unflatten(flat, layout)
    weights = [torch.full_like(t, float(i + 2)) for i, t in enumerate(tensors)]
    sum((v * w).sum() for v, w in zip(views, weights)).backward()
    want = torch.zeros_like(flat)
    for (o, shape), w in zip(layout, weights):
        want[o:o + math.prod(shape)] = w.reshape(-1)
    assert flat.grad is not None and torch.equal(flat.grad, want), \
        "the gradients of the returned tensors did not land in flat's gradient at their offsets: return " \
        "views that autograd sees (slice and view flat itself, not flat.data or a detached copy)"


def test_unflatten_rejects_mismatched_layout(ex):
    tensors = _tensors("divisible")
    flat, _, layout = ex.flatten_and_partition(tensors, 1, 0)
    ex.unflatten(flat, layout)  # a valid call first
    with pytest.raises(ValueError, match="different buffers"):
        ex.unflatten(flat[:10], layout)


# --- 2. the ZeRO-2 reduce-scatter hook (on ranks) -------------------------------------------------------

GLOBAL_B, D_IN, D_HID, D_OUT = 8, 5, 6, 3  # 5*6+6 + 6*3+3 = 57 parameters: divisible by neither 2 nor 4


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, D_HID), torch.nn.Tanh(), torch.nn.Linear(D_HID, D_OUT))


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(GLOBAL_B, D_IN, generator=g), torch.randn(GLOBAL_B, D_OUT, generator=g)


def _zero2(ex):
    r, n = dist.get_rank(), dist.get_world_size()
    model = _model()
    params = list(model.parameters())
    grad_shard, handles = ex.zero2_reduce_scatter_hook(params)
    rows = slice(r * GLOBAL_B // n, (r + 1) * GLOBAL_B // n)  # this rank's rows of the global batch
    steps = []
    for step in range(2):  # the second backward must start afresh
        x, y = _batch(step)
        loss = F.mse_loss(model(x[rows]), y[rows])
        with comm.meter() as m:
            loss.backward()
        steps.append({"shard": grad_shard.clone(),
                      "events": [(e.op, e.nbytes, e.group_size) for e in m.events],
                      "grads_none": [p.grad is None for p in params]})
    for h in handles:
        h.remove()
    x, y = _batch(0)
    with comm.meter() as m:
        F.mse_loss(model(x[rows]), y[rows]).backward()
    return {"steps": steps, "n_handles": len(handles),
            "after_remove": {"events": len(m.events), "grads_kept": all(p.grad is not None for p in params)}}


class _HeadFirst(torch.nn.Module):
    """The same network with its head registered before its body: the first-registered parameters'
    gradients now come *first* in backward, and the body's last."""

    def __init__(self):
        super().__init__()
        dense = _model()
        self.head, self.body = dense[2], dense[0]

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def _zero2_head_first(ex):
    r, n = dist.get_rank(), dist.get_world_size()
    model = _HeadFirst()
    grad_shard, _ = ex.zero2_reduce_scatter_hook(list(model.parameters()))
    rows = slice(r * GLOBAL_B // n, (r + 1) * GLOBAL_B // n)
    x, y = _batch(0)
    with comm.meter() as m:
        F.mse_loss(model(x[rows]), y[rows]).backward()
    return {"shard": grad_shard.clone(), "ops": [e.op for e in m.events]}


def _in_float64(fn):
    def run(*args):
        with float64():
            return fn(*args)
    return run


def _all_on_ranks(impl):
    # each rank imports the chapter by its path (a module object cannot be pickled)
    ex = load("ch06", impl)
    return run_cases({"zero2": lambda: _in_float64(_zero2)(ex),
                      "zero2_head_first": lambda: _in_float64(_zero2_head_first)(ex),
                      "zero3": lambda: _in_float64(_zero3)(ex),
                      "fsdp2": _in_float64(_zero3_fsdp2), "measure": lambda: _measure(ex)})


@pytest.fixture(scope="module")
def ranks(ex, launches):
    """`ranks(n)`: the per-rank results of _all_on_ranks on n ranks, launched once per n."""
    return launches(_all_on_ranks, resolve_impl(), timeout_s=TIMEOUT_S)


def _results(ranks, n, part):
    """Each rank's value of case ``part`` on n ranks (a case that raised fails only its own tests)."""
    return ranks.case(n, part)


ELEM = 8  # bytes of a float64 element: the ZeRO-2 and ZeRO-3 cases run in float64
N_ROWS, DEPTH = GLOBAL_B, 4  # the longest reduction (the batch's rows), the reductions chained


def _grad_bound(want):
    return model_bound(n=N_ROWS, depth=DEPTH, scale=max(1.0, want.abs().max().item()))


def _per_parameter_shards(grads, n):
    """FSDP2's layout, built with torch.chunk: each gradient flattened, zero-padded to a multiple of n and
    cut into n chunks; rank r's shard is chunk r of every gradient, in order."""
    pieces = []
    for g in grads:
        flat = g.reshape(-1)
        c = -(-flat.numel() // n)
        pieces.append(torch.cat([flat, flat.new_zeros(n * c - flat.numel())]).chunk(n))
    return [torch.cat([p[r] for p in pieces]) for r in range(n)]


def _global_grad_shards(step, n, make=None):
    """The single-process gradient of the mean loss over the whole global batch, in per-parameter shards."""
    with float64():
        model = (make or _model)()
        x, y = _batch(step)
        F.mse_loss(model(x), y).backward()
        return _per_parameter_shards([p.grad for p in model.parameters()], n)


ZERO2_NUMELS = (D_IN * D_HID, D_HID, D_HID * D_OUT, D_OUT)  # 30, 6, 18, 3


def _zero2_s(n):
    return sum(-(-k // n) for k in ZERO2_NUMELS)  # 16 at n = 4, where one flat buffer cut 4 ways gives 15


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_reduce_scatter_hook_keeps_shard_of_average_gradient(ranks, n):
    for r, res in enumerate(_results(ranks, n, "zero2")):
        for step, got in enumerate(res["steps"]):
            ref = _global_grad_shards(step, n)[r]
            shard = got["shard"]
            assert shard.shape == ref.shape, \
                f"rank {r} of {n}: grad_shard has shape {tuple(shard.shape)}; expected ({ref.numel()},), " \
                "one piece of ceil(numel/n) elements per parameter"
            close(shard, ref, _grad_bound(ref), f"rank {r} of {n}, backward {step + 1}: the shard is not "
                                                 "this rank's slice of the gradient averaged over ranks")


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_reduce_scatter_hook_when_the_first_registered_parameter_is_used_last(ranks, n):
    """The last gradient of a backward is not the first-registered parameter's in general: count them."""
    shards = _global_grad_shards(0, n, _HeadFirst)
    for r, res in enumerate(_results(ranks, n, "zero2_head_first")):
        assert res["ops"] == ["reduce_scatter"], f"rank {r} of {n}: collectives {res['ops']}"
        close(res["shard"], shards[r], _grad_bound(shards[r]),
              f"rank {r} of {n}, head registered before body: reduce-scatter once the *last* gradient of "
              "the backward has arrived, whichever parameter it belongs to")


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_reduce_scatter_hook_one_reduce_scatter_per_backward(ranks, n):
    s = _zero2_s(n)
    for r, res in enumerate(_results(ranks, n, "zero2")):
        for step, got in enumerate(res["steps"]):
            assert got["events"] == [("reduce_scatter", n * s * ELEM, n)], \
                f"rank {r} of {n}, backward {step + 1}: ran {got['events']} (op, bytes, ranks); expected " \
                f"one comm.reduce_scatter of n x S = {n} x {s} float64 = {n * s * ELEM} B, over {n} ranks"


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_reduce_scatter_hook_frees_full_gradients(ranks, n):
    for r, res in enumerate(_results(ranks, n, "zero2")):
        for step, got in enumerate(res["steps"]):
            assert all(got["grads_none"]), \
                f"rank {r} of {n}, backward {step + 1}: p.grad is None for {got['grads_none']}; ZeRO-2 " \
                "keeps only the shard, set every p.grad to None once copied"
        assert res["n_handles"] == 4, \
            f"rank {r} of {n}: returned {res['n_handles']} handles; expected one per parameter"
        after = res["after_remove"]
        assert after["events"] == 0 and after["grads_kept"], \
            f"rank {r} of {n}: after removing the returned handles backward still ran {after['events']} " \
            "collective(s) or dropped p.grad; return the handles of every hook registered"


# --- 3. Zero3Unit (on ranks) ------------------------------------------------------------------------------

Z3_IN, Z3_HID, Z3_OUT, Z3_STEPS, Z3_LR = 4, 7, 3, 3, 0.1
# unit 0: Linear(4, 7) + Tanh, 28 + 7 parameters; unit 1: Linear(7, 3), 21 + 3 (every one padded at n = 4)
Z3_SIZES = ((Z3_IN * Z3_HID, Z3_HID), (Z3_HID * Z3_OUT, Z3_OUT))
Z3_NUMELS = tuple(sum(sizes) for sizes in Z3_SIZES)


def _z3_shard(u, n):
    """S of unit u at n ranks: one piece of ceil(numel/n) per parameter."""
    return sum(-(-k // n) for k in Z3_SIZES[u])


def _z3_dense():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Sequential(torch.nn.Linear(Z3_IN, Z3_HID), torch.nn.Tanh()),
                               torch.nn.Linear(Z3_HID, Z3_OUT))


def _z3_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    return torch.randn(GLOBAL_B, Z3_IN, generator=g), torch.randn(GLOBAL_B, Z3_OUT, generator=g)


def _rows(r, n):
    return slice(r * GLOBAL_B // n, (r + 1) * GLOBAL_B // n)


def _sgd(params):  # momentum: an n-fold gradient would be an n-fold step (Adam would hide it)
    return torch.optim.SGD(params, lr=Z3_LR, momentum=0.9)


def _zero3(ex):
    r, n = dist.get_rank(), dist.get_world_size()
    dense = _z3_dense()
    model = torch.nn.Sequential(ex.Zero3Unit(dense[0]), ex.Zero3Unit(dense[1]))
    units = list(model)
    gathered = lambda: [u.full.untyped_storage().nbytes() for u in units]
    seen, calls = [], [0, 0]  # what is gathered while unit 1 computes; forwards run per unit
    dense[1].register_forward_pre_hook(lambda *_: seen.append(gathered()))
    for i in (0, 1):
        dense[i].register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    opt = _sgd(model.parameters())
    steps = []
    for step in range(Z3_STEPS):
        x, y = _z3_batch(step)
        xr = x[_rows(r, n)].clone().requires_grad_()
        opt.zero_grad()
        with comm.meter() as fwd:
            out = model(xr)
        after_fwd = gathered()
        with comm.meter() as bwd:
            F.mse_loss(out, y[_rows(r, n)]).backward()
        steps.append({"grads": [u.shard.grad.clone() for u in units], "x_grad": xr.grad.clone(),
                      "fwd": [(e.op, e.nbytes, e.group_size) for e in fwd.events],
                      "bwd": [(e.op, e.nbytes, e.group_size) for e in bwd.events],
                      "wire": fwd.total_wire_bytes + bwd.total_wire_bytes,
                      "after_fwd": after_fwd, "after_bwd": gathered()})
        opt.step()
    return {"steps": steps, "shards": [u.shard.detach().clone() for u in units], "seen": seen,
            "calls": calls, "param_numels": [p.numel() for p in model.parameters()]}


def _zero3_fsdp2():
    """The same training under torch's FSDP2 `fully_shard`, a unit per child then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    r, n = dist.get_rank(), dist.get_world_size()
    model = _z3_dense()
    mesh = init_device_mesh("cpu", (n,))
    for m in (model[0], model[1], model):
        fully_shard(m, mesh=mesh)
    opt = _sgd(model.parameters())
    for step in range(Z3_STEPS):
        x, y = _z3_batch(step)
        opt.zero_grad()
        F.mse_loss(model(x[_rows(r, n)]), y[_rows(r, n)]).backward()
        opt.step()
    return {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}


def _z3_reference(n):
    """One process on the global batch, in float64: per step, each unit's gradient as n per-parameter shards
    and each rank's input gradient; at the end, each unit's weights as n per-parameter shards, and the bound
    on them (Z3_STEPS SGD steps on gradients within the gradients' bound)."""
    with float64():
        return _z3_reference_64(n)


def _z3_reference_64(n):
    model = _z3_dense()
    opt = _sgd(model.parameters())
    steps = []
    for step in range(Z3_STEPS):
        x, y = _z3_batch(step)
        x_grads = []
        for r in range(n):  # the gradient of rank r's own loss (the mean over its rows) for its rows
            xr = x[_rows(r, n)].clone().requires_grad_()
            F.mse_loss(model(xr), y[_rows(r, n)]).backward(inputs=[xr])
            x_grads.append(xr.grad)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        grads = [_per_parameter_shards([p.grad for p in model[i].parameters()], n) for i in (0, 1)]
        steps.append({"grads": grads, "x_grads": x_grads})
        opt.step()
    final = [_per_parameter_shards([p.detach() for p in model[i].parameters()], n) for i in (0, 1)]
    grad_err = max(_grad_bound(g) for st in steps for unit in st["grads"] for g in unit)
    return steps, final, sgd_bound(steps=Z3_STEPS, lr=Z3_LR, grad_err=grad_err, momentum=0.9)


@pytest.mark.parametrize("n", [2, 4])
def test_Zero3Unit_frees_full_weights(ranks, n):
    for r, res in enumerate(_results(ranks, n, "zero3")):
        assert res["param_numels"] == [_z3_shard(u, n) for u in (0, 1)], \
            f"rank {r} of {n}: the units' parameters have {res['param_numels']} elements; expected the " \
            "shards only"
        for step, got in enumerate(res["steps"]):
            assert got["after_fwd"] == [0, 0] and got["after_bwd"] == [0, 0], \
                f"rank {r} of {n}, step {step + 1}: the full buffers hold {got['after_fwd']} bytes after " \
                f"the forward and {got['after_bwd']} after the backward; free them (resize the storage to 0)"
        assert res["seen"] == [[0, ELEM * Z3_NUMELS[1]]] * Z3_STEPS, \
            f"rank {r} of {n}: while unit 1 computed, the units' full buffers held {res['seen']} bytes; " \
            f"expected unit 0 freed and unit 1 gathered, [0, {ELEM * Z3_NUMELS[1]}], at every step"
        assert res["calls"] == [Z3_STEPS, Z3_STEPS], \
            f"rank {r} of {n}: the modules ran {res['calls']} forwards in {Z3_STEPS} steps; the backward " \
            "must reuse the saved graph, not recompute the forward"


@pytest.mark.parametrize("n", [2, 4])
def test_Zero3Unit_matches_one_process(ranks, n):
    ref_steps, ref_final, weights_bound = _z3_reference(n)
    results = _results(ranks, n, "zero3")
    for r, res in enumerate(results):
        for step, (got, ref) in enumerate(zip(res["steps"], ref_steps)):
            for u in (0, 1):
                want = ref["grads"][u][r]
                close(got["grads"][u], want, _grad_bound(want),
                      f"rank {r} of {n}, step {step + 1}, unit {u}: the shard's gradient is not this rank's "
                      f"slice of the gradient averaged over the ranks")
            want = ref["x_grads"][r]
            close(got["x_grad"], want, _grad_bound(want),
                  f"rank {r} of {n}, step {step + 1}: the input's gradient (unit 1 -> unit 0 -> x) is wrong")
    for u in (0, 1):
        for r, res in enumerate(results):
            close(res["shards"][u], ref_final[u][r], weights_bound,
                  f"n={n}, unit {u}, rank {r}: the shard after {Z3_STEPS} SGD steps is not this rank's "
                  f"pieces of one process's weights on the global batch")


@pytest.mark.parametrize("n", [2, 4])
def test_Zero3Unit_matches_torch_fsdp2(ranks, n):
    ours = _results(ranks, n, "zero3")
    theirs = _results(ranks, n, "fsdp2")[0]
    _, _, weights_bound = _z3_reference(n)
    for u, prefix in ((0, "0.0."), (1, "1.")):
        start = 0
        for k, name in zip(Z3_SIZES[u], ("weight", "bias")):  # parameter: its piece from every rank
            c = -(-k // n)
            weights = torch.cat([res["shards"][u][start:start + c] for res in ours])[:k]
            close(weights, theirs[prefix + name].reshape(-1), weights_bound,
                  f"n={n}, unit {u}, {name}: weights after {Z3_STEPS} steps differ from torch's FSDP2 "
                  f"fully_shard trained the same way")
            start += c


@pytest.mark.parametrize("n", [2, 4])
def test_Zero3Unit_collectives(ranks, n):
    padded = [n * _z3_shard(u, n) for u in (0, 1)]
    gather = [("all_gather", ELEM * p, n) for p in padded]
    scatter = [("reduce_scatter", ELEM * p, n) for p in padded]
    wire = 3 * sum(padded) * ELEM * (n - 1) / n  # ZeRO §7.2.2: 3Ψ per step (padded), (n-1)/n per rank
    for r, res in enumerate(_results(ranks, n, "zero3")):
        for step, got in enumerate(res["steps"]):
            what = f"rank {r} of {n}, step {step + 1}"
            assert got["fwd"] == gather, \
                f"{what}: the forward ran {got['fwd']} (op, bytes, ranks); expected one all-gather of each " \
                f"unit's n x S elements, unit 0 then unit 1: {gather}"
            bwd = [gather[1], scatter[1], gather[0], scatter[0]]
            assert got["bwd"] == bwd, \
                f"{what}: the backward ran {got['bwd']}; expected, unit 1 then unit 0, an all-gather of " \
                f"the weights and a reduce-scatter of the gradient: {bwd}"
            assert got["wire"] == pytest.approx(wire, rel=1e-12), \
                f"{what}: {got['wire']} bytes on the wire; ZeRO-3 moves 3 x the padded parameters " \
                f"x (n-1)/n = {wire}"


# --- 4. meter_zero_stage (on ranks) -------------------------------------------------------------------------

MZ_IN, MZ_HID = 33, 64
MZ_PSI = MZ_IN * MZ_HID + MZ_HID + MZ_HID * MZ_IN + MZ_IN  # 4321: odd, so padded at n = 2 and 4
MZ_TENSORS = 4


def _mz_model():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(MZ_IN, MZ_HID), torch.nn.Tanh(),
                               torch.nn.Linear(MZ_HID, MZ_IN))


def _measure(ex):
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(GLOBAL_B, MZ_IN, generator=g), torch.randn(GLOBAL_B, MZ_IN, generator=g)
    rows = _rows(r, n)
    return {stage: ex.meter_zero_stage(_mz_model, stage, x[rows], y[rows]) for stage in range(4)}


@pytest.mark.parametrize("n", [2, 4])
def test_meter_zero_stage_predictions(ranks, n):
    psi = MZ_PSI
    states = {0: 16 * psi, 1: 8 * psi + 8 * psi / n, 2: 4 * psi + 12 * psi / n, 3: 16 * psi / n}  # ZeRO §5
    wire = {s: (3 if s == 3 else 2) * psi * 4 * (n - 1) / n for s in range(4)}  # ZeRO §7.2
    for r, res in enumerate(_results(ranks, n, "measure")):
        for stage, got in res.items():
            pred = got["predicted"]
            assert pred["model_states"] == pytest.approx(states[stage], rel=1e-9), \
                f"rank {r} of {n}, stage {stage}: predicted {pred['model_states']} B of model states; " \
                f"fp32 AdamW (4 + 4 + 8 bytes per parameter, Ψ = {psi}) gives {states[stage]}"
            assert pred["wire"] == pytest.approx(wire[stage], rel=1e-9), \
                f"rank {r} of {n}, stage {stage}: predicted {pred['wire']} B on the wire; " \
                f"expected {wire[stage]}"


@pytest.mark.parametrize("n", [2, 4])
def test_meter_zero_stage_measured_wire(ranks, n):
    padded, f = n * -(-MZ_PSI // n), (n - 1) / n
    mask = 2 * f * MZ_TENSORS  # stages 0-2: an all-reduce of one byte per tensor
    exact = {0: 2 * f * 4 * padded + mask, 1: 2 * f * 4 * padded + mask, 2: 2 * f * 4 * padded + mask,
             3: f * 4 * (2 * padded + padded + n * MZ_TENSORS)}  # stage 3: two gathers, one scatter + flags
    for r, res in enumerate(_results(ranks, n, "measure")):
        for stage, got in res.items():
            assert got["measured"]["wire"] == pytest.approx(exact[stage], rel=1e-12), \
                f"rank {r} of {n}, stage {stage}: measured {got['measured']['wire']} B on the wire; the " \
                f"meter counts {exact[stage]} for one step (forward, backward and optimizer step)"


@pytest.mark.parametrize("n", [2, 4])
def test_meter_zero_stage_measured_memory(ranks, n):
    psi, padded = MZ_PSI, n * -(-MZ_PSI // n)
    shard = padded // n
    params = {0: padded, 1: padded, 2: padded, 3: shard}  # elements held: the padded buffer, or its shard
    grads = {0: padded, 1: padded, 2: shard, 3: shard}
    for r, res in enumerate(_results(ranks, n, "measure")):
        for stage, got in res.items():
            m, what = got["measured"], f"rank {r} of {n}, stage {stage}"
            assert m["parameters"] == 4 * params[stage] and m["gradients"] == 4 * grads[stage], \
                f"{what}: measured {m['parameters']} B of parameters and {m['gradients']} B of gradients; " \
                f"expected {4 * params[stage]} and {4 * grads[stage]} (after the backward, before the step)"
            state = 8 * psi / (1 if stage == 0 else n)
            assert m["optimizer_state"] == pytest.approx(state, rel=0.01), \
                f"{what}: measured {m['optimizer_state']} B of optimizer state; AdamW keeps about {state} " \
                "(after its first step)"
            assert m["model_states"] == m["parameters"] + m["gradients"] + m["optimizer_state"], \
                f"{what}: model_states must be the sum of the three categories"
            assert m["model_states"] == pytest.approx(got["predicted"]["model_states"], rel=0.01), \
                f"{what}: measured {m['model_states']} B, more than 1% from the prediction"


# --- 5. adafactor_update ------------------------------------------------------------------------------

ROWS, COLS = 6, 4
ADA_DEPTH = 12  # per step: the averages, their mean, the update (square root, ratio); 3-4 steps chained


def _ada_close(got, want, where, scale=None):
    """A chain of Adafactor's float64 operations, computed in another order (module docstring)."""
    scale = max(1.0, want.abs().max().item()) if scale is None else scale
    close(got, want, model_bound(n=ROWS * COLS, depth=ADA_DEPTH, scale=scale), where)


def _grads(steps, seed, rows=ROWS, cols=COLS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(rows, cols, generator=g, dtype=torch.float64) for _ in range(steps)]


def test_adafactor_update_exact_for_rank_one_second_moment(ex):
    """If every G_t * G_t is a multiple of one rank-1 matrix a b^T, so is the average V: factoring loses
    nothing."""
    g = torch.Generator().manual_seed(3)
    a = torch.rand(ROWS, generator=g, dtype=torch.float64) + 0.1
    b = torch.rand(COLS, generator=g, dtype=torch.float64) + 0.1
    row, col = torch.zeros(ROWS, dtype=torch.float64), torch.zeros(COLS, dtype=torch.float64)
    v = torch.zeros(ROWS, COLS, dtype=torch.float64)  # Adam's unfactored second moment
    for t, beta2 in enumerate([0.0, 0.5, 0.9, 0.99]):
        sign = torch.randint(0, 2, (ROWS, COLS), generator=g).double() * 2 - 1
        grad = (t + 1.5) * sign * torch.outer(a, b).sqrt()
        v = beta2 * v + (1 - beta2) * grad * grad
        update, row, col = ex.adafactor_update(grad, row, col, beta2, eps=0.0)
        _ada_close(update, grad / v.sqrt(), f"step {t + 1} (beta2 {beta2}): not G / sqrt(V) for rank-1 V")


def test_adafactor_update_matches_torch_adafactor(ex):
    """Three steps of torch.optim.Adafactor on one matrix, with clipping, weight decay and eps switched
    off."""
    lr, eps1, eps2, decay = 0.05, 1e-30, 1e-3, -0.8
    w = torch.nn.Parameter(torch.randn(ROWS, COLS, dtype=torch.float64,
                                       generator=torch.Generator().manual_seed(4)))
    opt = torch.optim.Adafactor([w], lr=lr, beta2_decay=decay, eps=(eps1, eps2), d=1e12, weight_decay=0.0,
                                foreach=False)
    row, col = torch.zeros(ROWS, dtype=torch.float64), torch.zeros(COLS, dtype=torch.float64)
    for t, grad in enumerate(_grads(3, seed=5), start=1):
        beta2 = 1 - t ** decay  # Adafactor's schedule: 0 at the first step
        update, row, col = ex.adafactor_update(grad, row, col, beta2, eps=eps1)
        before = w.detach().clone()
        w.grad = grad.clone()
        opt.step()
        state = opt.state[w]
        _ada_close(row, state["row_var"].reshape(-1), f"step {t}: row averages differ from torch's row_var")
        _ada_close(col, state["col_var"].reshape(-1), f"step {t}: column averages differ from col_var")
        # torch: w -= alpha * U with alpha = max(eps2, RMS(w)) * min(lr, 1/sqrt(t)) (no clipping at d = 1e12)
        alpha = max(eps2, before.norm().item() / math.sqrt(before.numel())) * min(lr, 1 / math.sqrt(t))
        theirs = (before - w.detach()) / alpha  # the subtraction rounds by u(|before| + |w|): read / alpha
        scale = max(1.0, update.abs().max().item(), ((before.abs() + w.detach().abs()) / alpha).max().item())
        _ada_close(update, theirs, f"step {t}: update differs from torch.optim.Adafactor's", scale)


def test_adafactor_update_state_is_rows_plus_cols(ex):
    rows, cols = 64, 48
    (grad,) = _grads(1, seed=6, rows=rows, cols=cols)
    row, col = torch.rand(rows, dtype=torch.float64), torch.rand(cols, dtype=torch.float64)
    row0, col0, grad0 = row.clone(), col.clone(), grad.clone()
    update, new_row, new_col = ex.adafactor_update(grad, row, col, 0.9)
    assert update.shape == grad.shape, \
        f"update has shape {tuple(update.shape)}; expected grad's {tuple(grad.shape)}"
    assert new_row.shape == (rows,) and new_col.shape == (cols,), \
        f"state shapes {tuple(new_row.shape)}, {tuple(new_col.shape)}; expected ({rows},), ({cols},)"
    assert new_row.numel() + new_col.numel() == rows + cols < rows * cols, \
        "the factored state is rows + cols numbers, Adam's is rows * cols"
    assert torch.equal(row, row0) and torch.equal(col, col0) and torch.equal(grad, grad0), \
        "the inputs were modified in place; return new tensors"
    # the averages themselves, against their definition
    sq = grad * grad + 1e-30
    for name, got, old, mean, n in (("row", new_row, row0, sq.mean(1), cols),
                                    ("column", new_col, col0, sq.mean(0), rows)):
        want = 0.9 * old + 0.1 * mean  # one sum of n squares (+ eps), its mean, the average: n + 3 terms
        close(got, want, reorder_bound(n + 3, want, torch.float64), f"{name} averages")


def test_adafactor_update_rejects_bad_shapes(ex):
    (grad,) = _grads(1, seed=7)
    row, col = torch.zeros(ROWS, dtype=torch.float64), torch.zeros(COLS, dtype=torch.float64)
    ex.adafactor_update(grad, row, col, 0.0)  # a valid call first
    with pytest.raises(ValueError, match="2 or more dimensions"):
        ex.adafactor_update(grad.reshape(-1), row, col, 0.0)
    with pytest.raises(ValueError, match=rf"row_avg must have shape \({ROWS},\)"):
        ex.adafactor_update(grad, col, col, 0.0)
    with pytest.raises(ValueError, match=rf"col_avg must have shape \({COLS},\)"):
        ex.adafactor_update(grad, row, row, 0.0)
    with pytest.raises(ValueError, match="beta2"):
        ex.adafactor_update(grad, row, col, 1.0)


def _factored_slice(grads, beta2s, eps):
    """The 2-D factored second moment of one matrix over steps, written from the paper (Algorithm 4, with
    sums): R = (G² + eps) 1, C = 1ᵀ (G² + eps), V^ = R C / (1ᵀ R), each averaged over the steps."""
    rows, cols = grads[0].shape
    r_sum, c_sum, updates = torch.zeros(rows, dtype=torch.float64), torch.zeros(cols, dtype=torch.float64), []
    for g, beta2 in zip(grads, beta2s):
        sq = g * g + eps
        r_sum = beta2 * r_sum + (1 - beta2) * sq.sum(1)
        c_sum = beta2 * c_sum + (1 - beta2) * sq.sum(0)
        updates.append(g / (torch.outer(r_sum, c_sum) / r_sum.sum()).sqrt())
    return updates, r_sum / cols, c_sum / rows


# (shape, the two dims factored): the largest two, ties to the later dim; never simply the last two
ND_SHAPES = [((7, 3, 5), (0, 2)), ((6, 2, 6), (0, 2)), ((2, 7, 5, 3), (1, 2)), ((5, 5, 5), (1, 2)),
             ((8, 2), (0, 1))]


@pytest.mark.parametrize("shape,dims", ND_SHAPES)
def test_adafactor_update_factors_the_two_largest_dimensions(ex, shape, dims):
    r, c = dims
    g = torch.Generator().manual_seed(sum(shape))
    grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(3)]
    beta2s, eps = [0.0, 0.7, 0.9], 1e-3
    row = torch.zeros(shape[:c] + shape[c + 1:], dtype=torch.float64)
    col = torch.zeros(shape[:r] + shape[r + 1:], dtype=torch.float64)
    got = []
    for grad, beta2 in zip(grads, beta2s):
        update, row, col = ex.adafactor_update(grad, row, col, beta2, eps=eps)
        got.append(update)
    # slice by slice: move (r, c) last, loop over every index of the other dims
    others = [d for d in range(len(shape)) if d not in dims]
    perm = others + [r, c]
    flat_g = [x.permute(perm).reshape(-1, shape[r], shape[c]) for x in grads]
    flat_u = [x.permute(perm).reshape(-1, shape[r], shape[c]) for x in got]
    row_s = row.permute([d - (d > c) for d in others] + [r]).reshape(-1, shape[r])  # dim c removed
    col_s = col.permute([d - (d > r) for d in others] + [c - 1]).reshape(-1, shape[c])  # dim r removed
    for i in range(flat_g[0].shape[0]):
        updates, r_avg, c_avg = _factored_slice([x[i] for x in flat_g], beta2s, eps)
        where = f"grad {shape}, slice {i} over dims {dims}"
        for t, (u, want) in enumerate(zip([x[i] for x in flat_u], updates)):
            _ada_close(u, want, f"{where}, step {t + 1}: update (factor the two largest dimensions, "
                                f"{dims}, each slice on its own)")
        _ada_close(row_s[i], r_avg, f"{where}: row averages (the mean over dim {c})")
        _ada_close(col_s[i], c_avg, f"{where}: column averages (the mean over dim {r})")


def test_adafactor_update_hand_worked(ex):
    # one step, beta2 = 0, eps = 0: G = [[1, 2], [2, 4]] has G² = [[1, 4], [4, 16]], rank 1 already:
    # row means 2.5, 10; column means 2.5, 10; V^ = R C / mean(R) = [[1, 4], [4, 16]] = G²: update = sign(G)
    grad = torch.tensor([[1.0, -2.0], [2.0, 4.0]], dtype=torch.float64)
    update, row, col = ex.adafactor_update(grad, torch.zeros(2, dtype=torch.float64),
                                           torch.zeros(2, dtype=torch.float64), 0.0, eps=0.0)
    assert row.tolist() == [2.5, 10.0] and col.tolist() == [2.5, 10.0], \
        f"averages {row.tolist()}, {col.tolist()}"
    _ada_close(update, grad.sign(), "G² rank 1: the update is sign(G)")
    # eps enters each square before the means: G = 0, eps = 0.25, old averages 1, beta2 = 0.5: 0.625
    ones = lambda k: torch.ones(k, dtype=torch.float64)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    update, row, col = ex.adafactor_update(zeros, ones(2), ones(3), 0.5, eps=0.25)
    assert row.tolist() == [0.625, 0.625] and col.tolist() == [0.625] * 3, \
        f"averages {row.tolist()}, {col.tolist()}: beta2 R + (1 - beta2) mean(G² + eps) = 0.5 + 0.125"
