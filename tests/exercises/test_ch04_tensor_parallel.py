"""Chapter 04 exercises, autograded: a row-parallel matmul that scatters its output along the sequence,
Megatron's MLP on an uneven split, a label-smoothed vocab-parallel cross-entropy, SUMMA, GQA heads, and
one layer's traffic predicted then counted.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: the dense single-process computation in torch
(``X @ W + b`` and its autograd gradients, sliced to a rank's positions and features; the dense MLP
and its gradients; ``F.cross_entropy`` with ``label_smoothing`` on the full logits; ``A @ B``),
PyTorch's DTensor tensor parallelism (``parallelize_module``), the formula for a layer's traffic
worked by hand, and the comm meter (which collectives ran, in which pass, on how many ranks, how many
bytes).

All rank work is batched: one launch on 2 ranks and one on 4 run every exercise, each exercise a
case of its own (``_support.run_cases``), so that an unfinished one fails only its own tests.

Tolerances (derived in tests/_support.py). The row-parallel matmul is one operation, in float32: each
output (or gradient) is one dot product of n terms (K + 1 with the bias, N for dX, S·B rows for dW
and db) split over ranks, within ``reorder_bound(n, Σ|terms|)`` of the dense one, Σ|terms| computed
from the inputs' magnitudes. Megatron's MLP (against the dense MLP and against DTensor) is two
layers forward and back, so it runs in float64: its longest reduction has at most 4h = 64 terms and
at most MLP_DEPTH = 4 are chained (two forward, two back), ``model_bound`` scaled by the tensor's size
(~1e-10 of it); its all-reduces then move float64 activations (``ELEM = 8`` bytes). A shard of the
wrong units or a missing all-reduce moves an output by a whole partial sum, O(1). SUMMA is one
float64 matmul of K = 4 terms: ``reorder_bound(K, |A|·|B|)``. The vocab-parallel cross-entropy
computes in float32 (its docstring says so) against float64: per row the max is exact, ``z - M``
rounds by u|z|, exp and log by 2u relative, the sum of V exponentials by γ_V of itself, ``M + log s``
and ``- z_y`` by u of their results; the smoothing's mean of V raw logits by γ_{V+1}·mean|z| (times
the smoothing), and its three weighted terms by u of max|z| and of the row each; the mean of the rows
by γ_{rows+1} of Σ|loss|/rows, and the reference's rounding to float32 by u of itself
(:func:`_ce_bound`). A row counted with another row's target, without its max, or smoothed over the
wrong number of tokens is off by O(1), not finite, or by smoothing·|z_y - mean z|/V (~1e-3 here, far
above the bound at shift 0). The layer's traffic is counted in float32 bytes; wire bytes are products
of a few floats (rel 1e-9 >> 10 u).
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist import comm
from minitorch_dist.course.exercises import load, resolve_impl
from minitorch_dist.models.gpt import GPT, MLP, GPTConfig

from _support import close, float64, gamma, model_bound, reorder_bound, roundoff, run_cases

pytestmark = pytest.mark.ch04

# The rank functions below are sent to the ranks by value, so spawned ranks need not import this
# file (whatever pytest's import mode). The exercise module is registered by value by `load`.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

# A rank stuck in a collective its peers never call fails after this long, naming each rank's
# last op, instead of launch's default 300 s.
TIMEOUT_S = 60
ELEM = 8  # bytes of a float64 element: the MLP's cases run in float64


# --- the data: global tensors every rank and the reference build the same way ------------------

S, B, K, N = 4, 3, 8, 5  # X is (S, B, K), sequence-first (Megatron's layout), W is (K, N)
ROWS, VOCAB = 12, 256  # cross-entropy: 12 rows, a 256-word vocabulary
SMOOTHINGS = (0.0, 0.1)  # label smoothing: none, and the usual 0.1
UNEVEN = 63  # the MLP width of the uneven split: 32 + 31 on 2 ranks, 16 + 16 + 16 + 15 on 4
M_A, K_A, N_B = 6, 4, 8  # SUMMA: A is (6, 4), B is (4, 8)
# the MLP and the layer: h = 16, MLP width 64, 4 heads, vocabulary 64 (all divisible by t = 4)
MLP_CFG = GPTConfig.tiny(vocab_size=64, block_size=8, n_layer=1, n_head=4, n_embd=16)
MB, MS = 2, 4  # the MLP's and the layer's input is (MB, MS, h)


def _linear_data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(S, B, K, generator=g), torch.randn(K, N, generator=g), torch.randn(N, generator=g),
            torch.randn(S, B, N, generator=g))


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


def _mlp_data(width=None):
    """The dense MLP (the same weights wherever it is built), its input and the output's gradient; with
    ``width``, its hidden layer that wide instead of 4h."""
    torch.manual_seed(3)
    mlp = MLP(MLP_CFG)
    if width is not None:
        h = MLP_CFG.n_embd
        mlp.c_fc, mlp.c_proj = torch.nn.Linear(h, width), torch.nn.Linear(width, h)
    g = torch.Generator().manual_seed(4)
    h = MLP_CFG.n_embd
    return mlp, torch.randn(MB, MS, h, generator=g), torch.randn(MB, MS, h, generator=g)


def _block(x, q, i, j):
    rows, cols = x.shape[0] // q, x.shape[1] // q
    return x[i * rows:(i + 1) * rows, j * cols:(j + 1) * cols]


# --- what each rank runs ------------------------------------------------------------------------


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
        y = ex.row_scatter_matmul(x_r, w_r, bias)
    with comm.meter() as bwd:
        y.backward(dy[_positions(t, r)])  # the gradient of this rank's positions only
    with comm.meter() as nobias:
        y0 = ex.row_scatter_matmul(x_r.detach(), w_r.detach(), None)
    return {"y": y.detach(), "grad_x": x_r.grad, "grad_w": w_r.grad, "grad_b": bias.grad,
            "y_nobias": y0.detach(), "x_unchanged": torch.equal(x_r.detach(), x_before),
            "fwd": [(e.op, e.nbytes) for e in fwd.events], "bwd": [(e.op, e.nbytes) for e in bwd.events],
            "nobias_ops": _ops(nobias)}


def _positions(t, r):
    """Rank r's positions of the sequence: the r-th of t contiguous runs."""
    return slice(r * S // t, (r + 1) * S // t)


def _column_row_mlp(ex):
    with float64():
        return _column_row_mlp_64(ex)


def _column_row_mlp_64(ex):
    mlp, x, dy = _mlp_data(UNEVEN)
    ours = ex.UnevenMLP(mlp)
    x = x.clone().requires_grad_()
    with comm.meter() as fwd:
        y = ours(x)
    with comm.meter() as bwd:
        y.backward(dy)
    return {"y": y.detach(), "grad_x": x.grad,
            "params": {k: (tuple(q.shape), q.grad) for k, q in ours.named_parameters()},
            "fwd": [(e.op, e.nbytes) for e in fwd.events], "bwd": [(e.op, e.nbytes) for e in bwd.events]}


def _column_row_mlp_vs_dtensor(ex):
    with float64():
        return _column_row_mlp_vs_dtensor_64(ex)


def _column_row_mlp_vs_dtensor_64(ex):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mlp, x0, dy = _mlp_data()
    ours = ex.UnevenMLP(mlp)  # copies its shards before parallelize_module makes them DTensors
    theirs = parallelize_module(mlp, init_device_mesh("cpu", (dist.get_world_size(),)),
                                {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    out = {}
    for name, m in (("ours", ours), ("torch", theirs)):
        x = x0.clone().requires_grad_()
        y = m(x)
        y.backward(dy)
        local = {k: (q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad)
                 for k, q in m.named_parameters()}
        out[name] = {"y": y.detach(), "grad_x": x.grad, "grads": local}
    p = dict(ours.named_parameters())
    out["ours"]["grads"] = {"c_fc.weight": p["w_fc"].grad, "c_fc.bias": p["b_fc"].grad,
                            "c_proj.weight": p["w_proj"].grad, "c_proj.bias": p["b_proj"].grad}
    return out


class _OneMore(torch.nn.Module):
    """A layer that all-reduces once more than Megatron's (a copy of its output, forward): what a
    prediction from the shapes does not see, and a measurement must."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        y = self.block(x)
        comm.all_reduce(y.detach().clone())
        return y


def _layer_traffic(ex, one_more=False):
    from minitorch_dist.parallelism.tensor_parallel import parallelize_gpt

    torch.manual_seed(5)
    block = parallelize_gpt(GPT(MLP_CFG)).blocks[0]
    if one_more:
        block = _OneMore(block)
    x = torch.randn(MB, MS, MLP_CFG.n_embd, generator=torch.Generator().manual_seed(6))
    got = ex.tp_layer_traffic(block, x)
    xr = x.clone().requires_grad_()  # the test's own count of the same layer
    with comm.meter() as fwd:
        y = block(xr)
    with comm.meter() as bwd:
        y.sum().backward()
    own = {"forward": fwd.calls["all_reduce"], "backward": bwd.calls["all_reduce"],
           "wire_bytes": fwd.total_wire_bytes + bwd.total_wire_bytes,
           "ops": [e.op for e in fwd.events + bwd.events]}
    return {"got": got, "own": own}


def _vocab_parallel(ex):
    r, t = dist.get_rank(), dist.get_world_size()
    out = {}
    for shift in (0.0, 1000.0):  # exp(1000) overflows float32: the max must be subtracted
        for eps in SMOOTHINGS:
            logits, targets = _ce_data(shift)
            v_r = VOCAB // t
            with comm.meter() as m:
                loss = ex.vocab_sharded_smoothed_ce(logits[:, r * v_r:(r + 1) * v_r].clone(),
                                                    targets, eps)
            out[shift, eps] = {"loss": loss, "ops": _ops(m), "bytes": m.total_bytes}
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
    cases = {"row": _row_parallel, "mlp": _column_row_mlp, "vocab": _vocab_parallel,
             "traffic": _layer_traffic, "traffic_one_more": lambda ex: _layer_traffic(ex, True)}
    if dist.get_world_size() == 4:  # a 2 x 2 grid
        cases["summa"] = _summa
    cases["dtensor"] = _column_row_mlp_vs_dtensor  # last: it builds a device mesh
    return run_cases({name: (lambda fn=fn: fn(ex)) for name, fn in cases.items()})


@pytest.fixture(scope="module")
def ranks(ex, launches):
    """`ranks(t)`: the per-rank results of _all_on_ranks on t ranks, launched once per t."""
    import torch.distributed.tensor.parallel  # noqa: F401  (~3 s to import; forked ranks inherit it)

    return launches(_all_on_ranks, resolve_impl(), timeout_s=TIMEOUT_S)


def _results(ranks, t, part):
    """Each rank's value of case ``part`` on t ranks (a case that raised fails only its own tests)."""
    return ranks.case(t, part)


# --- 1. RowScatterMatmul ----------------------------------------------------------------------------


def _dense_linear():
    x, w, b, dy = _linear_data()
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    y = x @ w + b
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad, (x @ w).detach(), dy


def _linear_bounds():
    """Per output, ``reorder_bound`` of its dot product (float32): Σ|terms| from the inputs' magnitudes."""
    x, w, b, dy = (t.abs() for t in _linear_data())
    rows = S * B
    x, dy = x.reshape(rows, K), dy.reshape(rows, N)
    return {"y": reorder_bound(K + 1, x @ w + b), "y_nobias": reorder_bound(K, x @ w),
            "grad_x": reorder_bound(N, dy @ w.T), "grad_w": reorder_bound(rows, x.T @ dy),
            "grad_b": reorder_bound(rows, dy.sum(0))}


@pytest.mark.parametrize("t", [2, 4])
def test_RowScatterMatmul_matches_dense(ranks, t):
    y, gx, gw, _, y_nobias, dy = _dense_linear()
    bound = _linear_bounds()
    for r, res in enumerate(_results(ranks, t, "row")):
        cols, mine = slice(r * K // t, (r + 1) * K // t), _positions(t, r)
        what = f"rank {r} of {t}"
        assert tuple(res["y"].shape) == (S // t, B, N), \
            f"{what}: output of shape {tuple(res['y'].shape)}; expected this rank's {S // t} positions, " \
            f"{(S // t, B, N)}"
        close(res["y"], y[mine], bound["y"], f"{what}, output Y at its positions")
        close(res["y_nobias"], y_nobias[mine], bound["y_nobias"], f"{what}, output without bias")
        assert res["grad_x"] is not None and res["grad_w"] is not None and res["grad_b"] is not None, \
            f"{what}: backward must return gradients for x_r, w_r and bias"
        close(res["grad_x"], gx[..., cols], bound["grad_x"], f"{what}, grad of x_r (every position's dY)")
        close(res["grad_w"], gw[cols], bound["grad_w"], f"{what}, grad of w_r (every position's dY)")
        close(res["grad_b"], dy[mine].reshape(-1, N).sum(0), bound["grad_b"],
              f"{what}, grad of bias: the part from this rank's positions")
        assert res["x_unchanged"], f"{what}: forward modified x_r in place"


@pytest.mark.parametrize("t", [2, 4])
def test_RowScatterMatmul_reduce_scatters_forward_all_gathers_backward(ranks, t):
    full = S * B * N * 4  # the full (s, b, n) partial product, float32
    for r, res in enumerate(_results(ranks, t, "row")):
        assert res["fwd"] == [("reduce_scatter", full)], \
            f"rank {r} of {t}: forward ran {res['fwd']}; expected one comm.reduce_scatter of the full " \
            f"partial product, {full} B (an all-reduce moves twice the bytes and keeps what is not needed)"
        assert res["bwd"] == [("all_gather", full)], \
            f"rank {r} of {t}: backward ran {res['bwd']}; expected one comm.all_gather of dY, {full} B"
        assert res["nobias_ops"] == ["reduce_scatter"], \
            f"rank {r} of {t}: without bias, forward ran {res['nobias_ops']}"


# --- 2. UnevenMLP ------------------------------------------------------------------------


def _units(f, t, r):
    """Rank r's hidden units: contiguous, in rank order, the first f % t ranks one more (independent of
    the exercise: the sizes listed, then their running sum)."""
    sizes = [f // t + (i < f % t) for i in range(t)]
    return slice(sum(sizes[:r]), sum(sizes[:r + 1]))


def _dense_mlp():
    with float64():
        mlp, x, dy = _mlp_data(UNEVEN)
        x = x.requires_grad_()
        y = mlp(x)
        y.backward(dy)
        return y.detach(), x.grad, mlp


MLP_N = 4 * MLP_CFG.n_embd  # the longest reduction: c_proj's <= 4h inputs (the rows of a weight gradient: 8)
MLP_DEPTH = 4  # chained reductions: c_fc and c_proj forward, then back through both


def _mlp_close(got, want, where):
    close(got, want, model_bound(n=MLP_N, depth=MLP_DEPTH, scale=max(1.0, want.abs().max().item())), where)


@pytest.mark.parametrize("t", [2, 4])
def test_UnevenMLP_matches_dense(ranks, t):
    y, gx, mlp = _dense_mlp()
    f = mlp.c_fc.out_features
    assert f % t, "the width is uneven on every t tested"
    for r, res in enumerate(_results(ranks, t, "mlp")):
        rows, what = _units(f, t, r), f"rank {r} of {t}"
        want = {"w_fc": mlp.c_fc.weight.grad[rows], "b_fc": mlp.c_fc.bias.grad[rows],
                "w_proj": mlp.c_proj.weight.grad[:, rows], "b_proj": mlp.c_proj.bias.grad}
        assert {k: v[0] for k, v in res["params"].items()} == {k: tuple(v.shape) for k, v in want.items()}, \
            f"{what}: parameters {[(k, v[0]) for k, v in res['params'].items()]}; expected this rank's " \
            f"shards {[(k, tuple(v.shape)) for k, v in want.items()]}"
        _mlp_close(res["y"], y, f"{what}, output")
        _mlp_close(res["grad_x"], gx, f"{what}, gradient of the input x (f's backward sums the ranks' parts)")
        for k, g in want.items():
            assert res["params"][k][1] is not None, f"{what}: {k} has no gradient"
            _mlp_close(res["params"][k][1], g, f"{what}, gradient of {k}")


@pytest.mark.parametrize("t", [2, 4])
def test_UnevenMLP_one_all_reduce_each_way(ranks, t):
    act = MB * MS * MLP_CFG.n_embd * ELEM  # the (b, s, h) activation in float64
    for r, res in enumerate(_results(ranks, t, "mlp")):
        assert res["fwd"] == [("all_reduce", act)], \
            f"rank {r} of {t}: forward ran {res['fwd']}; expected g's one all-reduce of the output, {act} B"
        assert res["bwd"] == [("all_reduce", act)], \
            f"rank {r} of {t}: backward ran {res['bwd']}; expected f's one all-reduce of dL/dx, {act} B"


@pytest.mark.parametrize("t", [2, 4])
def test_UnevenMLP_matches_torch_dtensor_on_an_even_width(ranks, t):
    for r, res in enumerate(_results(ranks, t, "dtensor")):
        ours, theirs, what = res["ours"], res["torch"], f"rank {r} of {t}"
        _mlp_close(ours["y"], theirs["y"], f"{what}, output vs DTensor")
        _mlp_close(ours["grad_x"], theirs["grad_x"], f"{what}, input gradient vs DTensor")
        for k, g in theirs["grads"].items():
            _mlp_close(ours["grads"][k], g, f"{what}, gradient of {k} vs DTensor's local shard")


# --- 3. vocab_sharded_smoothed_ce ----------------------------------------------------------


def _ce_bound(logits, targets, eps):
    """How far a float32 label-smoothed cross-entropy of these logits (max subtracted) can be from the
    float64 one rounded to float32 (the module docstring's account)."""
    u, f32 = roundoff(torch.float32), torch.float32
    zd = logits.double()
    z = zd - zd.max(-1, keepdim=True).values
    log_s = z.exp().sum(-1).log()
    lse = zd.max(-1).values + log_s
    row = lse - (1 - eps) * zd.gather(1, targets[:, None]).squeeze(1) - eps * zd.mean(-1)
    per_row = gamma(VOCAB, f32) + u * (z.abs().max(-1).values + 2 + 2 * log_s.abs() + lse.abs() + row.abs())
    # the smoothing: the mean of the row's V raw logits (a sum of V in any order, then / V), and the
    # three products and sums that weigh it and the target logit, each rounding by u of <= max|z|
    per_row = per_row + eps * gamma(VOCAB + 1, f32) * zd.abs().mean(-1) + 3 * u * (zd.abs().max(-1).values
                                                                                 + row.abs())
    return (per_row.mean() + gamma(ROWS + 1, f32) * row.abs().mean() + u * row.mean().abs()).item()


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("eps", SMOOTHINGS)
@pytest.mark.parametrize("shift", [0.0, 1000.0])
def test_vocab_sharded_smoothed_ce_matches_full_logits(ranks, t, shift, eps):
    logits, targets = _ce_data(shift)
    ref = F.cross_entropy(logits.double(), targets, label_smoothing=eps).float()
    bound = _ce_bound(logits, targets, eps)
    for r, res in enumerate(_results(ranks, t, "vocab")):
        loss = res[shift, eps]["loss"]
        assert isinstance(loss, torch.Tensor) and loss.dim() == 0, \
            f"rank {r} of {t}: return a 0-dim tensor, got {loss!r}"
        assert torch.isfinite(loss), \
            f"rank {r} of {t}, logits shifted by {shift}: loss {loss}; subtract the max"
        close(loss.float(), ref, bound, f"rank {r} of {t}, logits shifted by {shift}, smoothing {eps}")


@pytest.mark.parametrize("t", [2, 4])
def test_vocab_sharded_smoothed_ce_communicates_per_row_not_per_logit(ranks, t):
    full_logits_bytes = ROWS * VOCAB * 4
    for r, res in enumerate(_results(ranks, t, "vocab")):
        for eps in SMOOTHINGS:
            ops, nbytes = res[0.0, eps]["ops"], res[0.0, eps]["bytes"]
            assert ops and set(ops) == {"all_reduce"}, \
                f"rank {r} of {t}: ran {ops}; use comm.all_reduce only (never gather the logits)"
            # a max, a sum of exps, a target logit and a sum of logits per row: O(rows), not O(rows * V)
            assert nbytes <= 4 * ROWS * 4 and nbytes < full_logits_bytes / 4, \
                f"rank {r} of {t}: all-reduced {nbytes} B for {ROWS} rows (the full logits are " \
                f"{full_logits_bytes} B); reduce each row to a few numbers before communicating"


# --- 4. summa_matmul --------------------------------------------------------------------------------


def test_summa_matmul_matches_dense(ranks):
    q = 2
    a, b = _summa_data()
    c = a @ b
    bound = reorder_bound(K_A, a.abs() @ b.abs(), torch.float64)  # one float64 matmul, K_A terms each
    for r, res in enumerate(_results(ranks, 4, "summa")):
        i, j = divmod(r, q)
        close(res["c"], _block(c, q, i, j), bound, f"rank {r}, block C_{i}{j}")


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



# --- 5. gqa_head_shard ------------------------------------------------------------------------------


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


# --- 6. tp_layer_traffic ------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_tp_layer_traffic_prediction_and_count(ranks, t):
    act = MB * MS * MLP_CFG.n_embd * 4  # bytes of the float32 (b, s, h) activation
    by_hand = 4 * 2 * (t - 1) / t * act  # four ring all-reduces, 2(t-1)/t of the buffer each
    for r, res in enumerate(_results(ranks, t, "traffic")):
        pred, meas, own = res["got"]["predicted"], res["got"]["measured"], res["own"]
        what = f"rank {r} of {t}"
        assert own["ops"] == ["all_reduce"] * 4, own  # the layer itself is sound
        assert (pred["forward"], pred["backward"]) == (2, 2), \
            f"{what}: predicted {pred['forward']} + {pred['backward']} all-reduces; Megatron's layer has g " \
            f"after attention and the MLP forward, f before both backward"
        assert pred["wire_bytes"] == pytest.approx(by_hand, rel=1e-9), \
            f"{what}: predicted {pred['wire_bytes']} wire bytes; 8·b·s·h·(t-1)/t elements of 4 B = {by_hand}"
        assert (meas["forward"], meas["backward"]) == (own["forward"], own["backward"]), \
            f"{what}: counted {meas['forward']} + {meas['backward']}; the meter sees {own['forward']} + " \
            f"{own['backward']} (one meter around the forward, another around the backward)"
        assert meas["wire_bytes"] == pytest.approx(own["wire_bytes"], rel=1e-9), \
            f"{what}: measured {meas['wire_bytes']} wire bytes; the meter counts {own['wire_bytes']}"
        assert (pred["forward"], pred["backward"]) == (meas["forward"], meas["backward"]) and \
            pred["wire_bytes"] == pytest.approx(meas["wire_bytes"], rel=1e-9), \
            f"{what}: prediction {pred} and measurement {meas} disagree"


@pytest.mark.parametrize("t", [2, 4])
def test_tp_layer_traffic_measures_what_ran_not_what_was_predicted(ranks, t):
    """On a layer that all-reduces once more than Megatron's: the prediction, from the shapes, stays
    Megatron's; the measurement must see the extra all-reduce."""
    act = MB * MS * MLP_CFG.n_embd * 4
    for r, res in enumerate(_results(ranks, t, "traffic_one_more")):
        pred, meas, own = res["got"]["predicted"], res["got"]["measured"], res["own"]
        what = f"rank {r} of {t}"
        assert (own["forward"], own["backward"]) == (3, 2), own  # the layer sends one more, forward
        assert (pred["forward"], pred["backward"]) == (2, 2) and \
            pred["wire_bytes"] == pytest.approx(4 * 2 * (t - 1) / t * act, rel=1e-9), \
            f"{what}: predicted {pred}; a prediction comes from the cost model and the shapes, not the run"
        assert (meas["forward"], meas["backward"]) == (3, 2), \
            f"{what}: measured {meas['forward']} + {meas['backward']} all-reduces; the layer ran 3 + 2"
        assert meas["wire_bytes"] == pytest.approx(own["wire_bytes"], rel=1e-9), \
            f"{what}: measured {meas['wire_bytes']} wire bytes; the meter counts {own['wire_bytes']}"
