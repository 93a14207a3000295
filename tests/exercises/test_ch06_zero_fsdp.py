"""Chapter 06 exercises, autograded: flat-buffer partitioning, the ZeRO-2 reduce-scatter hook, Adafactor.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: ``torch.cat`` and ``torch.chunk`` of the
flattened tensors, the single-process gradient of the whole global batch by autograd, the comm
meter (which collectives ran during backward, on how many ranks, how many bytes), an unfactored
exponential moving average of ``G * G``, and ``torch.optim.Adafactor``'s own state and steps.

Flattening and Adafactor are pure functions, tested in this process. The ZeRO-2 hook runs on
ranks: one launch on 2 ranks and one on 4, each guarded so that an unfinished exercise fails
only its own tests. Checks of bad input first make a valid call, so a stub fails them too.
"""
import math
import sys
import traceback

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import comm, launch
from minitorch_dist.course.exercises import load, resolve_impl

pytestmark = pytest.mark.ch06

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this
# file (whatever pytest's import mode). The exercise module is registered by value by `load`.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A rank stuck in a collective its peers never call fails after this long, naming each rank's
# last op, instead of launch's default 300 s.
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def ex():
    """The chapter's stubs or its worked solutions (see the module docstring)."""
    return load("ch06")


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
        torch.testing.assert_close(flat, ref_flat, rtol=0, atol=0, msg=lambda m: f"{what}, flat buffer: {m}")
        assert shard.shape == (s,), \
            f"{what}: shard has shape {tuple(shard.shape)}; expected ({s},), ceil(numel/n)"
        torch.testing.assert_close(shard, ref_shards[rank], rtol=0, atol=0,
                                   msg=lambda m: f"{what}, shard: {m}")


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


def test_flatten_and_partition_rejects_bad_input(ex):
    tensors = _tensors("divisible")
    ex.flatten_and_partition(tensors, 2, 1)  # a valid call first
    with pytest.raises(ValueError, match="rank 2 is outside"):
        ex.flatten_and_partition(tensors, 2, 2)
    with pytest.raises(ValueError, match="n must be >= 1"):
        ex.flatten_and_partition(tensors, 0, 0)
    with pytest.raises(ValueError, match="one dtype"):
        ex.flatten_and_partition([torch.ones(2), torch.ones(2, dtype=torch.float64)], 2, 0)


@pytest.mark.parametrize("kind", list(SHAPES))
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_unflatten_round_trip(ex, kind, n):
    tensors = _tensors(kind, seed=2, dtype=torch.float64)
    flat, _, layout = ex.flatten_and_partition(tensors, n, n - 1)
    back = ex.unflatten(flat, layout)
    assert len(back) == len(tensors), f"unflatten returned {len(back)} tensors; expected {len(tensors)}"
    for i, (t, b) in enumerate(zip(tensors, back)):
        assert b.shape == t.shape, f"tensor {i}: shape {tuple(b.shape)}, expected {tuple(t.shape)}"
        torch.testing.assert_close(b, t, rtol=0, atol=0, msg=lambda m: f"n={n}, tensor {i}: {m}")


def test_unflatten_returns_views_into_flat(ex):
    tensors = _tensors("ragged")
    flat, _, layout = ex.flatten_and_partition(tensors, 4, 0)
    other = torch.arange(flat.numel(), dtype=flat.dtype)  # another buffer of the same layout
    views = ex.unflatten(other, layout)
    offset = 0
    for i, (t, v) in enumerate(zip(tensors, views)):
        expected = torch.arange(offset, offset + t.numel(), dtype=flat.dtype).reshape(t.shape)
        torch.testing.assert_close(v, expected, rtol=0, atol=0,
                                   msg=lambda m: f"tensor {i} of another buffer: {m}")
        offset += t.numel()
    other.mul_(-1)  # an in-place write to the buffer (an all-gather, say) must show in every tensor
    assert all(torch.all(v <= 0) for v in views), \
        "after writing into the flat buffer the tensors did not change: return views (flat[a:b].view(shape))"


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


def _guarded(fn, *args):
    """Run one exercise; an exception becomes a result, so the next exercise still runs."""
    try:
        return {"ok": fn(*args)}
    except Exception:  # noqa: BLE001  (reported by the test of that exercise)
        return {"error": traceback.format_exc()}


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


def _all_on_ranks(impl):
    # each rank imports the chapter by its path (a module object cannot be pickled)
    ex = load("ch06", impl)
    return {"zero2": _guarded(_zero2, ex)}


@pytest.fixture(scope="module")
def ranks(ex):
    """`run(n)`: the per-rank results of _all_on_ranks on n ranks, launched once per n."""
    cache = {}

    def run(n):
        if n not in cache:
            cache[n] = launch(_all_on_ranks, n, resolve_impl(), timeout_s=TIMEOUT_S)
        return cache[n]
    return run


def _results(ranks, n, part):
    out = []
    for r, res in enumerate(ranks(n)):
        got = res[part]
        assert "error" not in got, f"rank {r} of {n} raised:\n{got['error']}"
        out.append(got["ok"])
    return out


def _global_grad_shards(step, n):
    """The single-process gradient of the mean loss over the whole global batch, padded, in n chunks."""
    model = _model()
    x, y = _batch(step)
    F.mse_loss(model(x), y).backward()
    _, shards, _ = _reference_flat([p.grad for p in model.parameters()], n)
    return shards


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_reduce_scatter_hook_keeps_shard_of_average_gradient(ranks, n):
    for r, res in enumerate(_results(ranks, n, "zero2")):
        for step, got in enumerate(res["steps"]):
            ref = _global_grad_shards(step, n)[r]
            shard = got["shard"]
            assert shard.shape == ref.shape, \
                f"rank {r} of {n}: grad_shard has shape {tuple(shard.shape)}; expected ({ref.numel()},)"
            torch.testing.assert_close(shard, ref, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {r} of {n}, backward {step + 1}: the shard is "
                                                     "not this rank's slice of the gradient averaged over "
                                                     f"ranks: {m}")


@pytest.mark.parametrize("n", [2, 4])
def test_zero2_reduce_scatter_hook_one_reduce_scatter_per_backward(ranks, n):
    numel = D_IN * D_HID + D_HID + D_HID * D_OUT + D_OUT
    padded = n * math.ceil(numel / n)
    for r, res in enumerate(_results(ranks, n, "zero2")):
        for step, got in enumerate(res["steps"]):
            assert got["events"] == [("reduce_scatter", padded * 4, n)], \
                f"rank {r} of {n}, backward {step + 1}: ran {got['events']} (op, bytes, ranks); expected " \
                f"one comm.reduce_scatter of the padded flat gradient, {padded} float32 = {padded * 4} B, " \
                f"over {n} ranks"


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


# --- 3. adafactor_update ------------------------------------------------------------------------------

ROWS, COLS = 6, 4


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
        torch.testing.assert_close(update, grad / v.sqrt(),
                                   msg=lambda m: f"step {t + 1} (beta2 {beta2}): not G / sqrt(V) "
                                                 f"for rank-1 V: {m}")


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
        torch.testing.assert_close(row, state["row_var"].reshape(-1),
                                   msg=lambda m: f"step {t}: row averages differ from torch's row_var: {m}")
        torch.testing.assert_close(col, state["col_var"].reshape(-1),
                                   msg=lambda m: f"step {t}: column averages differ from torch's "
                                                 f"col_var: {m}")
        # torch: w -= alpha * U with alpha = max(eps2, RMS(w)) * min(lr, 1/sqrt(t)) (no clipping at d = 1e12)
        alpha = max(eps2, before.norm().item() / math.sqrt(before.numel())) * min(lr, 1 / math.sqrt(t))
        torch.testing.assert_close(update, (before - w.detach()) / alpha,
                                   msg=lambda m: f"step {t}: update differs from "
                                                 f"torch.optim.Adafactor's: {m}")


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
    torch.testing.assert_close(new_row, 0.9 * row0 + 0.1 * sq.mean(1), msg=lambda m: f"row averages: {m}")
    torch.testing.assert_close(new_col, 0.9 * col0 + 0.1 * sq.mean(0), msg=lambda m: f"column averages: {m}")


def test_adafactor_update_rejects_bad_shapes(ex):
    (grad,) = _grads(1, seed=7)
    row, col = torch.zeros(ROWS, dtype=torch.float64), torch.zeros(COLS, dtype=torch.float64)
    ex.adafactor_update(grad, row, col, 0.0)  # a valid call first
    with pytest.raises(ValueError, match="2-D"):
        ex.adafactor_update(grad.reshape(-1), row, col, 0.0)
    with pytest.raises(ValueError, match=rf"row_avg must have shape \({ROWS},\)"):
        ex.adafactor_update(grad, col, col, 0.0)
    with pytest.raises(ValueError, match=rf"col_avg must have shape \({COLS},\)"):
        ex.adafactor_update(grad, row, row, 0.0)
    with pytest.raises(ValueError, match="beta2"):
        ex.adafactor_update(grad, row, col, 1.0)
