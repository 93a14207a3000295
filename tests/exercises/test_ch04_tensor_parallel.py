"""Chapter 04 exercises, autograded: row-parallel linear, vocab-parallel cross-entropy, SUMMA.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: the dense single-process computation in torch
(``X @ W + b`` and its autograd gradients, ``F.cross_entropy`` on the full logits, ``A @ B``)
and the comm meter (which collectives ran, in which pass, on how many ranks, how many bytes).

All rank work is batched: one launch on 2 ranks and one on 4 run every exercise, each exercise
guarded so that an unfinished one fails only its own tests.
"""
import sys
import traceback

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import comm, launch
from minitorch_dist.course.exercises import load, resolve_impl

pytestmark = pytest.mark.ch04

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
    return load("ch04")


# --- the data: global tensors every rank and the reference build the same way ------------------

B, S, K, N = 2, 3, 8, 5  # X is (B, S, K), W is (K, N)
ROWS, VOCAB = 12, 256  # cross-entropy: 12 rows, a 256-word vocabulary
M_A, K_A, N_B = 6, 4, 8  # SUMMA: A is (6, 4), B is (4, 8)


def _linear_data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, S, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N, generator=g),
            torch.randn(B, S, N, generator=g))


def _ce_data(shift: float):
    g = torch.Generator().manual_seed(1)
    logits = 4 * torch.randn(ROWS, VOCAB, generator=g) + shift
    targets = torch.randint(0, VOCAB, (ROWS,), generator=g)
    targets[:4] = torch.tensor([0, VOCAB - 1, VOCAB // 2 - 1, VOCAB // 2])  # slice edges
    return logits, targets


def _summa_data():
    g = torch.Generator().manual_seed(2)
    return torch.randn(M_A, K_A, generator=g, dtype=torch.float64), torch.randn(K_A, N_B, generator=g,
                                                                                 dtype=torch.float64)


def _block(x, q, i, j):
    rows, cols = x.shape[0] // q, x.shape[1] // q
    return x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]


# --- what each rank runs ------------------------------------------------------------------------


def _guarded(fn, *args):
    """Run one exercise; an exception becomes a result, so the next exercise still runs."""
    try:
        return {"ok": fn(*args)}
    except Exception:  # noqa: BLE001  (reported by the test of that exercise)
        return {"error": traceback.format_exc()}


def _ops(m):
    # not `m.ops()`: cloudpickle, sending this function by value, would take the attribute name
    # `ops` for the pseudo-module `torch.ops` and fail to pickle it
    return [e.op for e in m.events]


def _row_parallel(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    x, w, b, dy = _linear_data()
    cols = slice(r * K // t, (r + 1) * K // t)
    x_r = x[..., cols].clone().requires_grad_()
    w_r = w[cols].clone().requires_grad_()
    bias = b.clone().requires_grad_()
    x_before = x_r.detach().clone()
    with comm.meter() as fwd:
        y = ex.row_parallel_linear(x_r, w_r, bias)
    with comm.meter() as bwd:
        y.backward(dy)
    with comm.meter() as nobias:
        y0 = ex.row_parallel_linear(x_r.detach(), w_r.detach(), None)
    return {"y": y.detach(), "grad_x": x_r.grad, "grad_w": w_r.grad, "grad_b": bias.grad,
            "y_nobias": y0.detach(), "x_unchanged": torch.equal(x_r.detach(), x_before),
            "fwd_ops": _ops(fwd), "fwd_bytes": fwd.bytes["all_reduce"], "bwd_ops": _ops(bwd),
            "nobias_ops": _ops(nobias)}


def _vocab_parallel(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    out = {}
    for shift in (0.0, 1000.0):  # exp(1000) overflows float32: the max must be subtracted
        logits, targets = _ce_data(shift)
        v_r = VOCAB // t
        with comm.meter() as m:
            loss = ex.vocab_parallel_cross_entropy(logits[:, r * v_r:(r + 1) * v_r].clone(), targets)
        out[shift] = {"loss": loss, "ops": _ops(m), "bytes": m.total_bytes}
    return out


def _summa(ex):
    q = 2
    i, j = divmod(dist.get_rank(), q)
    a, b = _summa_data()
    with comm.meter() as m:
        c = ex.summa_matmul(_block(a, q, i, j).clone(), _block(b, q, i, j).clone())
    return {"c": c, "events": [(e.op, e.group_size, e.nbytes) for e in m.events]}


def _all_on_ranks(impl):
    # each rank imports the chapter by its path (a module object cannot be pickled)
    ex = load("ch04", impl)
    out = {"row": _guarded(_row_parallel, ex), "vocab": _guarded(_vocab_parallel, ex)}
    if dist.get_world_size() == 4:  # a 2 x 2 grid
        out["summa"] = _guarded(_summa, ex)
    return out


@pytest.fixture(scope="module")
def ranks(ex):
    """`run(t)`: the per-rank results of _all_on_ranks on t ranks, launched once per t."""
    cache = {}

    def run(t):
        if t not in cache:
            cache[t] = launch(_all_on_ranks, t, resolve_impl(), timeout_s=TIMEOUT_S)
        return cache[t]
    return run


def _results(ranks, t, part):
    out = []
    for r, res in enumerate(ranks(t)):
        got = res[part]
        assert "error" not in got, f"rank {r} of {t} raised:\n{got['error']}"
        out.append(got["ok"])
    return out


# --- 1. RowParallelLinear ---------------------------------------------------------------------------


def _dense_linear():
    x, w, b, dy = _linear_data()
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = x @ w + b
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad, (x @ w).detach()


@pytest.mark.parametrize("t", [2, 4])
def test_RowParallelLinear_matches_dense(ranks, t):
    y, gx, gw, gb, y_nobias = _dense_linear()
    for r, res in enumerate(_results(ranks, t, "row")):
        cols = slice(r * K // t, (r + 1) * K // t)
        what = f"rank {r} of {t}"
        torch.testing.assert_close(res["y"], y, msg=lambda m: f"{what}, output Y: {m}")
        torch.testing.assert_close(res["y_nobias"], y_nobias,
                                   msg=lambda m: f"{what}, output without bias: {m}")
        assert res["grad_x"] is not None and res["grad_w"] is not None and res["grad_b"] is not None, \
            f"{what}: backward must return gradients for x_r, w_r and bias"
        torch.testing.assert_close(res["grad_x"], gx[..., cols], msg=lambda m: f"{what}, grad of x_r: {m}")
        torch.testing.assert_close(res["grad_w"], gw[cols], msg=lambda m: f"{what}, grad of w_r: {m}")
        torch.testing.assert_close(res["grad_b"], gb, msg=lambda m: f"{what}, grad of bias: {m}")
        assert res["x_unchanged"], f"{what}: forward modified x_r in place"


@pytest.mark.parametrize("t", [2, 4])
def test_RowParallelLinear_one_all_reduce_forward_none_backward(ranks, t):
    for r, res in enumerate(_results(ranks, t, "row")):
        assert res["fwd_ops"] == ["all_reduce"], \
            f"rank {r} of {t}: forward ran {res['fwd_ops']}; expected exactly one comm.all_reduce"
        assert res["fwd_bytes"] == B * S * N * 4, \
            f"rank {r} of {t}: forward all-reduced {res['fwd_bytes']} B; expected the output Y, " \
            f"{B * S * N * 4} B"
        assert res["bwd_ops"] == [], \
            f"rank {r} of {t}: backward ran {res['bwd_ops']}; it needs no communication"
        assert res["nobias_ops"] == ["all_reduce"], \
            f"rank {r} of {t}: without bias, forward ran {res['nobias_ops']}"


# --- 2. vocab_parallel_cross_entropy ----------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("shift", [0.0, 1000.0])
def test_vocab_parallel_cross_entropy_matches_full_logits(ranks, t, shift):
    logits, targets = _ce_data(shift)
    ref = F.cross_entropy(logits.double(), targets).float()
    for r, res in enumerate(_results(ranks, t, "vocab")):
        loss = res[shift]["loss"]
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0, \
            f"rank {r} of {t}: return a 0-dim tensor, got {loss!r}"
        assert torch.isfinite(loss), \
            f"rank {r} of {t}, logits shifted by {shift}: loss {loss}; subtract the max"
        torch.testing.assert_close(loss.float(), ref, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"rank {r} of {t}, logits shifted by {shift}: {m}")


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_parallel_cross_entropy_communicates_per_row_not_per_logit(ranks, t):
    full_logits_bytes = ROWS * VOCAB * 4
    for r, res in enumerate(_results(ranks, t, "vocab")):
        ops, nbytes = res[0.0]["ops"], res[0.0]["bytes"]
        assert ops and set(ops) == {"all_reduce"}, \
            f"rank {r} of {t}: ran {ops}; use comm.all_reduce only (never gather the logits)"
        # a max, a sum of exps and a target logit per row: O(rows), not O(rows * V)
        assert nbytes <= 4 * ROWS * 4 and nbytes < full_logits_bytes / 4, \
            f"rank {r} of {t}: all-reduced {nbytes} B for {ROWS} rows (the full logits are " \
            f"{full_logits_bytes} B); reduce each row to a few numbers before communicating"


# --- 3. summa_matmul --------------------------------------------------------------------------------


def test_summa_matmul_matches_dense(ranks):
    q = 2
    a, b = _summa_data()
    c = a @ b
    for r, res in enumerate(_results(ranks, 4, "summa")):
        i, j = divmod(r, q)
        torch.testing.assert_close(res["c"], _block(c, q, i, j),
                                   msg=lambda m: f"rank {r}, block C_{i}{j}: {m}")


def test_summa_matmul_broadcasts_along_rows_and_columns(ranks):
    q = 2
    a_block, b_block = (M_A // q) * (K_A // q) * 8, (K_A // q) * (N_B // q) * 8  # float64 blocks
    for r, res in enumerate(_results(ranks, 4, "summa")):
        events = res["events"]
        assert [e[0] for e in events] == ["broadcast"] * (2 * q), \
            f"rank {r}: ran {[e[0] for e in events]}; expected {2 * q} comm.broadcast calls (q of A, q of B)"
        assert all(e[1] == q for e in events), \
            f"rank {r}: broadcast group sizes {[e[1] for e in events]}; broadcast within a grid row or " \
            f"column ({q} ranks), not the whole world"
        assert sorted(e[2] for e in events) == sorted([a_block] * q + [b_block] * q), \
            f"rank {r}: broadcast sizes {[e[2] for e in events]} B; expected q A blocks and q B blocks"



# --- 4. gqa_head_shard ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_head,n_kv_head", [(8, 2), (8, 8), (12, 4), (4, 1), (32, 8)])
def test_gqa_head_shard_follows_the_split_or_replicated_rule(ex, n_head, n_kv_head):
    from minitorch_dist.parallelism.tensor_parallel_llama import kv_heads_of_rank, kv_layout

    group = n_head // n_kv_head
    for t in range(1, n_head + 1):
        try:
            layout = kv_layout(n_head, n_kv_head, t)
        except ValueError:
            with pytest.raises(ValueError, match="use t in"):
                ex.gqa_head_shard(n_head, n_kv_head, t, 0)
            continue
        seen_q = []
        for r in range(t):
            q, kv, replicated = ex.gqa_head_shard(n_head, n_kv_head, t, r)
            assert replicated == (layout == "replicated"), (t, r)
            assert list(kv) == list(kv_heads_of_rank(n_head, n_kv_head, t, r)), (t, r)
            assert {h // group for h in q} <= set(kv), f"t={t} r={r}: a query head reads a kv head not held"
            seen_q += list(q)
        assert seen_q == list(range(n_head)), f"t={t}: every query head exactly once, in order"


def test_gqa_head_shard_rejects_bad_input(ex):
    ex.gqa_head_shard(8, 2, 2, 0)  # a valid call first
    with pytest.raises(ValueError, match=r"use t in \(1, 2, 4, 8\)"):
        ex.gqa_head_shard(8, 2, 3, 0)
    with pytest.raises(ValueError, match="not one of the t=2 ranks"):
        ex.gqa_head_shard(8, 2, 2, 2)
    with pytest.raises(ValueError, match="not a multiple"):
        ex.gqa_head_shard(6, 4, 2, 0)
