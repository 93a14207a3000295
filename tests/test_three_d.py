"""Chapter 12: 3D parallelism (d x t x p ranks) trains the tiny GPT exactly as one process does, and
moves the bytes the formulas say, over the groups the grid says.

Reference: ``models.train.train_steps`` on the whole global batch in one process, one thread
(``three_d.reference_run``: ``steps + 1`` steps, the last without an update). The 3D weights are
reassembled from every rank's shards (``merge_full_params``, which also measures how far replicated
copies drift apart: they must not, at all).

Tolerances (derived in tests/_support.py). Every run, on the ranks and in the reference, is float64
(``merge_full_params`` reassembles in the pieces' dtype). TP splits sums over ranks, the pipeline
sums microbatch gradients, DP averages shards:
the same numbers added in other orders, at most N = max(B·T, 4h) = 256 terms each, chained 6 deep per
block + 2 through the GPT (26): each step's gradients are within ``model_bound`` of that, scaled by
the gradients' size (at least 1), ~1.5e-9; the losses likewise, scaled by the loss. Weights after
STEPS = 3 steps: SGD (lr 0.1): ``sgd_bound``, ~5e-10; AdamW (lr 1e-3, eps 1e-6: an update moves by at
most lr/eps times a gradient's error): ``adam_bound``, ~5e-6. The steps move weights by >= 1e-3
somewhere in every run (asserted), and a missing tied-embedding all-reduce, a sum instead of an
average (SGD) or a lost microbatch moves them by ~lr·|g| ~ 1e-3 (AdamW: ~lr = 1e-3 per step on the
elements it touches): 200 times the AdamW bound, 10^6 times the SGD one. Replicated copies must agree
bitwise (spread 0).

Meters (the last step of each run; every collective records the global ranks of its group):
* every all-reduce inside the pipeline step ran on this rank's TP group: 4 of b·s·h per layer and
  microbatch (``costmodel.tensor_parallel_allreduces_per_layer``; 6 with recomputation, which
  repeats the forward's 2), plus one for the embedding (first stage) and one for the output
  layer's f (last stage); the vocabulary-parallel loss adds 3 of b·s numbers per microbatch;
* every send / recv ran on the PP group; one pipeline's sends add up to ``costmodel.pipeline_p2p_bytes``;
* the tied embedding's gradient: one all-reduce of (V/t)·h on the embedding group (first, last stage);
* the DP step: one all-reduce (ZeRO-1: reduce-scatter + all-gather; ZeRO-2: the same bytes, the
  reduce-scatter bucketed, once after the last microbatch) on the DP group of ELEM = 8 bytes (float64)
  x this rank's parameters (``three_d.local_param_count``, counted from the dense model; padded to a multiple
  of d), and over one pipeline those add up to ``costmodel.tensor_parallel_params_per_rank`` plus the
  tied copy.

Built with a different seed on each rank, the 3D model still holds global rank 0's dense GPT,
bitwise, on every rank (one broadcast before slicing): TP slices, pipeline stages and the tied
embedding's two copies agree.
"""
import functools

import pytest
import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.memory.zero import shard_size
from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.parallelism import three_d as D
from minitorch_dist.parallelism.mesh import RankGrid, init_groups
from minitorch_dist.runtime.launch import launch

from _support import adam_bound, close, float64, model_bound, sgd_bound

pytestmark = pytest.mark.ch12

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
STEPS, B, T, M = 3, 16, 16, 2
LR, ADAM_LR, ADAM_EPS = 0.1, 1e-3, 1e-6  # train_3d's and reference_run's default SGD lr; AdamW's
N = max(B * T, 4 * CFG.n_embd)  # the longest reduction: a weight gradient sums B·T rows
DEPTH = 6 * CFG.n_layer + 2  # chained reductions: 6 per block, ln_f and lm_head
ELEM = 8  # bytes of a float64 element: every run is float64


def _adamw(ps):
    return torch.optim.AdamW(ps, lr=ADAM_LR, eps=ADAM_EPS)


def _train_3d(*args, **kw):
    """``three_d.train_3d`` in float64 (this rank's process)."""
    with float64():
        return D.train_3d(*args, **kw)


@functools.cache
def _reference(adam: bool):
    """``reference_run``'s losses and weights after STEPS steps, the initial weights, and the largest
    gradient of any step (the same run again, reading each step's gradients: they scale its bound)."""
    from minitorch_dist.models.gpt import GPT
    from minitorch_dist.models.train import train_steps
    from minitorch_dist.runtime.env import single_thread

    opt = _adamw if adam else None
    with float64():
        losses, weights = D.reference_run(CFG, STEPS, B, T, optimizer=opt)
        _, initial = D.reference_run(CFG, 0, B, T)
        with single_thread():
            torch.manual_seed(0)
            model, sizes = GPT(CFG), []
            train_steps(model, STEPS + 1, B, T, optimizer=opt, lr=LR,
                        after_backward=lambda: sizes.append(max(q.grad.abs().max().item()
                                                                for q in model.parameters())))
    return losses, weights, initial, max(sizes)


def _run(d, t, p, m=M, adam=False, **kw):
    if adam:
        kw["optimizer"] = _adamw
    return launch(functools.partial(_train_3d, **kw), d * t * p, CFG, d, t, p, STEPS, B, T, m, timeout_s=300)


def _merge(results):
    return D.merge_full_params(results, CFG)


def _check_equal_to_one_process(results, adam=False):
    ref_losses, ref, initial, grad = _reference(adam)
    full, spread = _merge(results)
    assert spread == 0.0  # replicas (DP, TP-replicated, tied copies) are bitwise identical
    assert set(full) == set(ref)
    assert max((ref[k] - initial[k]).abs().max().item() for k in ref) > 1e-3  # the steps did move the weights
    grad_err = model_bound(n=N, depth=DEPTH, scale=max(1.0, grad))
    bound = (adam_bound(steps=STEPS, lr=ADAM_LR, grad_err=grad_err, eps=ADAM_EPS) if adam
             else sgd_bound(steps=STEPS, lr=LR, grad_err=grad_err))
    for k in ref:
        close(full[k], ref[k], bound, k)
    for got, want in zip(D.global_losses(results), ref_losses, strict=True):
        loss_bound = model_bound(n=N, depth=DEPTH, scale=max(1.0, abs(want)))
        assert abs(got - want) <= loss_bound, f"loss {got} vs {want}: bound {loss_bound:.3g}"


def _check_meters(results, d, t, p, m=M, zero1=False, checkpoint=False, v=1, zero2=False):
    act = B // d // m * T * CFG.n_embd * ELEM  # one microbatch's b·s·h, float64
    layers = CFG.n_layer // p
    for r in results:
        ev, ranks, pp = r.events, r.ranks, r.coords.pp
        first, last = pp == 0, pp == p - 1
        pipe = ev["pipeline"]
        # TP: all-reduces only, all on this rank's TP group (none at all when t = 1)
        ar = [e for e in pipe if e.op == "all_reduce"]
        assert all(e.ranks == tuple(ranks["tp"]) for e in ar)
        per_layer = sum(costmodel.tensor_parallel_allreduces_per_layer().values()) + (2 if checkpoint else 0)
        big = [e for e in ar if e.nbytes == act]
        assert len(big) == (m * (per_layer * layers + first + last) if t > 1 else 0)
        if t > 1 and not checkpoint:
            edges = m * (first + last) * costmodel.bus_bytes("all_reduce", act, t)
            wire = sum(e.wire_bytes for e in big) - edges
            assert wire == pytest.approx(m * layers * costmodel.tensor_parallel_bytes_per_layer(
                B // d // m, T, CFG.n_embd, t, bytes_per_element=ELEM), rel=1e-12)  # a few float64 products
        small = [e for e in ar if e.nbytes != act]  # the vocabulary-parallel loss: 3 of b·s per microbatch
        assert [e.nbytes for e in small] == ([act // CFG.n_embd] * 3 * m if t > 1 and last else [])
        assert {e.op for e in pipe} <= {"all_reduce", "send", "recv"}
        assert all(e.ranks == tuple(ranks["pp"]) for e in pipe if e.op in ("send", "recv"))
        # the tied embedding: first and last stage, one all-reduce of their (V/t)·h shard
        emb = ev["embedding"]
        if p > 1 and (first or last):
            assert [(e.op, e.nbytes, e.ranks) for e in emb] == [
                ("all_reduce", ELEM * CFG.vocab_size * CFG.n_embd // t, tuple(ranks["embedding"]))]
        else:
            assert emb == []
        # DP: this rank's parameters, padded to a multiple of d, on the DP group
        padded = ELEM * d * shard_size(D.local_param_count(CFG, t, p, pp, v), d)
        want = [("reduce_scatter", padded), ("all_gather", padded)] if zero1 else [("all_reduce", padded)]
        # ... after ch06's one byte per tensor: which tensors got a gradient on some DP rank
        assert [e.op for e in ev["dp"] if e.dtype == "torch.uint8"] == ["all_reduce"]
        if zero2:  # ZeRO-2: bucketed reduce-scatters (once, after the last microbatch), then the all-gather
            moved = {op: sum(e.nbytes for e in ev["dp"] if e.op == op and e.dtype != "torch.uint8")
                     for op in ("reduce_scatter", "all_gather", "all_reduce")}
            assert moved == {"reduce_scatter": padded, "all_gather": padded, "all_reduce": 0}
        else:
            assert [(e.op, e.nbytes) for e in ev["dp"] if e.dtype != "torch.uint8"] == want
        assert all(e.ranks == tuple(ranks["dp"]) for e in ev["dp"])
    for dp_i in range(d):  # per pipeline (fixed dp, tp): its sends, and its parameters
        for tp_i in range(t):
            line = [r for r in results if r.coords.dp == dp_i and r.coords.tp == tp_i]
            assert len(line) == p
            sent = sum(e.nbytes for r in line for e in r.events["pipeline"] if e.op == "send")
            assert sent == costmodel.pipeline_p2p_bytes(p, m, act, v)
            held = sum(D.local_param_count(CFG, t, p, s, v) for s in range(p))
            tied_copy = CFG.vocab_size * CFG.n_embd // t if p > 1 else 0
            assert held == costmodel.tensor_parallel_params_per_rank(CFG, t) + tied_copy


# --- 8 ranks: 2 x 2 x 2 ---------------------------------------------------------------------------


def test_2x2x2_on_8_ranks_equals_one_process():
    results = _run(2, 2, 2)
    assert sorted(tuple(r.coords) for r in results) == sorted(
        (d, t, p) for d in range(2) for t in range(2) for p in range(2))
    _check_equal_to_one_process(results)
    _check_meters(results, 2, 2, 2)


def test_2x2x2_with_zero1_checkpointing_and_adamw_equals_one_process():
    results = _run(2, 2, 2, adam=True, zero1=True, checkpoint=True)
    _check_equal_to_one_process(results, adam=True)
    _check_meters(results, 2, 2, 2, zero1=True, checkpoint=True)


def test_2x2x2_with_zero2_and_adamw_equals_one_process():
    """ZeRO-2 under the pipeline: one bucketed reduce-scatter after the last microbatch, not m of them."""
    results = _run(2, 2, 2, adam=True, zero_stage=2)
    _check_equal_to_one_process(results, adam=True)
    _check_meters(results, 2, 2, 2, zero2=True)


def test_2x2x2_with_selective_recomputation_equals_one_process():
    """Only the attention core is recomputed: the TP all-reduces are those of no recomputation."""
    results = _run(2, 2, 2, recompute="selective")
    _check_equal_to_one_process(results)
    _check_meters(results, 2, 2, 2)


def test_selective_recomputation_keeps_no_attention_output():
    """On one process: the stage saves fewer tensors with the core checkpointed, and its gradients agree."""
    from minitorch_dist.models.gpt import GPT

    x = torch.randint(0, CFG.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))
    grads, saved = {}, {}
    for mode in ("none", "selective"):
        torch.manual_seed(0)
        with float64():
            model = GPT(CFG)
        stage = D.Stage3D(model, 0, 1, range(CFG.n_layer), recompute=mode)
        count = [0]
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, count=count: count.__setitem__(0, count[0] + 1) or t, lambda t: t):
            loss = stage(x, x)
        loss.backward()
        saved[mode] = count[0]
        grads[mode] = [p.grad for p in model.parameters()]
    assert saved["selective"] < saved["none"]
    for a, b in zip(grads["none"], grads["selective"], strict=True):  # the same sums, recomputed
        close(a, b, model_bound(n=N, depth=DEPTH, scale=max(1.0, b.abs().max().item())), "selective vs none")
    with pytest.raises(ValueError, match="choose one of none, selective, full"):
        D.recompute_of(False, "some")


def test_zero_stage_3_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="every microbatch"):
        D.train_3d(CFG, 2, 2, 2, 1, B, T, 2, zero_stage=3)
    assert D.zero_stage_of(True) == 1 and D.zero_stage_of(False) == 0 and D.zero_stage_of(True, 2) == 2


# --- 4 ranks: every axis of size 1 once --------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_4_ranks_equal_one_process(shape):
    results = _run(*shape)
    _check_equal_to_one_process(results)
    _check_meters(results, *shape)


def test_interleaved_schedule_through_device_mesh_groups_equals_one_process():
    results = _run(1, 2, 2, m=4, schedule="interleaved", virtual_stages=2, use_device_mesh=True)
    _check_equal_to_one_process(results)
    _check_meters(results, 1, 2, 2, m=4, v=2)


# --- sequence parallelism (ch05 inside the grid) ------------------------------------------------------


def _sp_flagged(stage, p):
    """Elements of one stage whose gradient is a per-slice partial sum: per layer ln_1, ln_2 (2h each)
    and the two row-parallel biases (h each); wpe on the first stage, ln_f on the last."""
    h = CFG.n_embd
    ends = (CFG.block_size * h if stage == 0 else 0) + (2 * h if stage == p - 1 else 0)
    return (CFG.n_layer // p) * 6 * h + ends


def _check_sp_meters(results, d, t, p, m=M, recompute=False):
    """TP + SP: no b·s·h all-reduce in the pipeline step, its all-gathers and reduce-scatters on the TP
    group (per layer the costmodel's, with the re-gather; the embedding's ḡ on the first stage, the
    output layer's g on the last), sends of the (b, s/t, h) slice, and one all-reduce over the TP group
    of the partial LayerNorm / bias / wpe gradients."""
    b = B // d // m
    act = b * T * CFG.n_embd * ELEM  # the whole sequence's b·s·h, float64
    for r in results:
        ev, ranks, first, last = r.events, r.ranks, r.coords.pp == 0, r.coords.pp == p - 1
        pipe = ev["pipeline"]
        assert {e.op for e in pipe} <= {"all_gather", "reduce_scatter", "all_reduce", "send", "recv"}
        loss = [act // CFG.n_embd] * 3 * m if last else []  # the vocabulary-parallel loss: 3 of b·s
        assert [e.nbytes for e in pipe if e.op == "all_reduce"] == loss
        sp = [e for e in pipe if e.op in ("all_gather", "reduce_scatter")]
        assert all(e.ranks == tuple(ranks["tp"]) and e.nbytes == act for e in sp)
        per_layer = costmodel.sequence_parallel_bytes_per_layer(b, T, CFG.n_embd, t, ELEM, regather=True,
                                                                recompute=recompute)
        edges = m * (2 * first + 3 * last) * costmodel.bus_bytes("all_gather", act, t)
        want = m * CFG.n_layer // p * per_layer + edges
        assert sum(e.wire_bytes for e in sp) == pytest.approx(want, rel=1e-12)  # a few float64 products
        sends = [e.nbytes for e in pipe if e.op == "send"]
        assert sends == [act // t] * (m * ((not first) + (not last)))
        assert [(e.op, e.nbytes, e.ranks) for e in ev["sequence"]] == [
            ("all_reduce", ELEM * _sp_flagged(r.coords.pp, p), tuple(ranks["tp"]))]


@pytest.mark.parametrize("shape, kw", [((2, 2, 2), {}), ((1, 2, 2), dict(zero_stage=2, adam=True)),
                                       ((2, 2, 1), dict(recompute="full")),
                                       ((1, 2, 2), dict(schedule="zb-h1"))],
                         ids=["2x2x2", "1x2x2-zero2-adamw", "2x2x1-full-recompute", "1x2x2-zb-h1"])
def test_sequence_parallel_3d_equals_one_process(shape, kw):
    """TP + SP inside the grid: the same weights and losses as one process, the collectives of ch05."""
    results = _run(*shape, sequence_parallel=True, **kw)
    _check_equal_to_one_process(results, adam=kw.get("adam", False))
    _check_sp_meters(results, *shape, recompute=kw.get("recompute") == "full")


def test_sequence_parallel_without_the_tp_gradient_sum_is_wrong(monkeypatch):
    """The all-reduce of the partial gradients is what makes SP exact: without it the LayerNorms drift."""
    monkeypatch.setattr(D, "allreduce_sequence_parallel_grads", lambda module, group: None)
    results = _run(1, 2, 2, sequence_parallel=True)
    _, spread = _merge(results)
    assert spread > 1e-6  # each TP rank stepped its LayerNorms with its own slice's partial gradient
    with pytest.raises(AssertionError):
        _check_equal_to_one_process(results)


# --- per-rank seeds --------------------------------------------------------------------------------


def _seeded_model(d, t, p):
    groups = init_groups(RankGrid(dist.get_world_size(), d, t, p, "tp-dp-pp"), False)
    with float64():
        model = D.Model3D(CFG, groups, M, seed=dist.get_rank())
    return D.Result3D(groups.rank, groups.coords, [], {}, model.full_param_pieces(), groups.ranks)


def test_per_rank_seeds_give_rank_0s_dense_model():
    results = launch(_seeded_model, 4, 1, 2, 2, timeout_s=120)
    full, spread = _merge(results)
    assert spread == 0.0
    initial = _reference(False)[2]  # the dense GPT of seed 0, rank 0's
    assert set(full) == set(initial)
    for k in initial:
        assert torch.equal(full[k], initial[k]), k


# --- bad input -----------------------------------------------------------------------------------


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match=r"multiple of dp·m = 8"):
        D.train_3d(CFG, 2, 2, 2, 1, 12, T, 4)
    with pytest.raises(ValueError, match="n_head 4 is not divisible by tp=8"):
        D.train_3d(CFG, 1, 8, 1, 1, B, T, 1)
    with pytest.raises(ValueError, match=r"n_layer 4 is not divisible by pp·v = 8·1 = 8"):
        D.train_3d(CFG, 1, 1, 8, 1, B, T, 8)
    with pytest.raises(ValueError, match="choose a schedule without W"):
        D.train_3d(CFG, 2, 2, 2, 1, B, T, 2, schedule="zb-h1", checkpoint=True)
    with pytest.raises(ValueError, match="unknown schedule"):
        D.train_3d(CFG, 2, 2, 2, 1, B, T, 2, schedule="2f2b")
    with pytest.raises(ValueError, match="choose seq as a multiple of 2"):
        D.train_3d(CFG, 2, 2, 2, 1, B, 15, 2, sequence_parallel=True)
    with pytest.raises(ValueError, match="steps must be a positive int"):
        D.train_3d(CFG, 2, 2, 2, 0, B, T, 2)
    with pytest.raises(RuntimeError, match="launch"):
        D.train_3d(CFG, 2, 2, 2, 1, B, T, 2)


def test_local_param_count_adds_up_to_the_model():
    # one pipeline over t = 1: every parameter once, the tied embedding twice
    for p in (1, 2, 4):
        held = sum(D.local_param_count(CFG, 1, p, s) for s in range(p))
        assert held == costmodel.transformer_params(CFG) + (CFG.vocab_size * CFG.n_embd if p > 1 else 0)
