"""Chapter 04: Megatron tensor parallelism computes the dense model, layer by layer and for the whole
GPT over several optimizer steps, and agrees with torch's DTensor ``parallelize_module``; and it works
the way Shoeybi et al. 2019 §3 says: 2 all-reduces of b·s·h per layer forward and 2 backward, the
bytes of Narayanan et al. 2021 §3.2, nothing of size V moving, 1/t of the blocks' weights. The
vocabulary-parallel embedding and loss have their own file, ``test_tensor_parallel_vocab.py``.

One launch per tensor-parallel degree t runs every case and returns plain data; the tests only
inspect it. Expected values come from elsewhere: the dense layers and GPT in one process (one
thread, like a rank), sliced here by this file's own rules (the c_attn rows of each rank are its
heads inside each of q, k and v), ``F.cross_entropy``, torch's DTensor, ``costmodel``'s formulas.

Tolerances (derived in tests/_support.py). Every case runs in float64. A row-parallel layer adds t
partial sums where the dense layer adds in one pass: the same sums in another order, at most
N = max(B·T, 4H) terms each (a weight gradient sums B·T rows; c_proj sums 4H inputs), chained at most
4 deep in a layer and 6 per block + 2 in the GPT: ``model_bound``, scaled by each tensor's size; the
GPT's weights after STEPS - 1 SGD steps with momentum 0.9: ``sgd_bound`` of that. All are below
1e-8 of the values; a lost all-reduce halves (t = 2) or quarters (t = 4) a whole output or
gradient, a shard taken from the wrong heads moves it by O(1). Bytes are counted for float64
(8 bytes an element); a wire total is a product of a few float64 numbers (rel 1e-12 >> 10 u).

Two ways the parallel model could silently leave the dense one are checked too: ranks that built
the dense GPT under different seeds (every wrapper broadcasts the group's first rank's weights
before slicing: the result is rank 0's dense model, bitwise), and padded targets (-100, which
the dense GPT's ``F.cross_entropy`` ignores: the vocabulary-parallel loss must ignore them too).
"""
import functools
import math

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig
from minitorch_dist.models.train import train_steps
from minitorch_dist.parallelism import tensor_parallel as TP
from minitorch_dist.parallelism.replicas import broadcast_from_first_rank
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import RankError, launch

from _support import (
    case,
    close_after_sgd,
    close_model,
    dense_run,
    float64,
    model_bound,
    refusal,
    run_cases,
)

pytestmark = pytest.mark.ch04

B, T, H, V = 4, 16, 32, 64
CFG = GPTConfig.tiny(vocab_size=V, block_size=T, n_layer=2, n_head=4, n_embd=H)  # heads, V divisible by 4
STEPS, LR = 3, 0.1
SEED = 7
N = max(B * T, 4 * H)  # the longest reduction: a weight gradient sums B·T rows, c_proj sums 4H inputs
LAYER_DEPTH, GPT_DEPTH = 4, 6 * CFG.n_layer + 2  # chained reductions: one layer; the whole GPT
ELEM = 8  # bytes of a float64 element: every case runs in float64


def _inputs():
    g = torch.Generator().manual_seed(SEED + 1)
    return {"x": torch.randn(B, T, H, generator=g), "wide": torch.randn(B, T, 4 * H, generator=g),
            "G": torch.randn(B, T, 4 * H, generator=g)}


def _dense_layers(seed=SEED):
    torch.manual_seed(seed)
    return {"col": nn.Linear(H, 4 * H), "row": nn.Linear(4 * H, H), "mlp": MLP(CFG),
            "attn": CausalSelfAttention(CFG)}


# --- what runs on the ranks ---------------------------------------------------------------------


def _grads(*tensors):
    return [None if q.grad is None else q.grad.clone() for q in tensors]


def _layers():
    """Each parallel layer on fixed inputs: its output and the input / weight / bias gradients."""
    t, r = dist.get_world_size(), dist.get_rank()
    d, inp, out = _dense_layers(), _inputs(), {}
    G = inp["G"]
    for gather in (False, True):
        m = TP.ColumnParallelLinear.from_dense(d["col"], gather_output=gather)
        x = inp["x"].clone().requires_grad_(True)
        y = m(x)
        (y * (G if gather else G.chunk(t, -1)[r])).sum().backward()
        out["col", gather] = [y.detach(), *_grads(x, m.weight, m.bias)]
    for parallel in (True, False):
        m = TP.RowParallelLinear.from_dense(d["row"], input_is_parallel=parallel)
        x = (inp["wide"].chunk(t, -1)[r] if parallel else inp["wide"]).clone().requires_grad_(True)
        y = m(x)
        (y * G[..., :H]).sum().backward()
        out["row", parallel] = [y.detach(), *_grads(x, m.weight, m.bias)]
    for name, cls in (("mlp", TP.ParallelMLP), ("attn", TP.ParallelAttention)):
        m = cls(d[name])
        x = inp["x"].clone().requires_grad_(True)
        y = m(x)
        (y * G[..., :H]).sum().backward()
        out[name] = [y.detach(), x.grad.clone(), {k: q.grad.clone() for k, q in m.named_parameters()}]
    return out


def _torch_dtensor():
    """The same MLP under torch's ColwiseParallel / RowwiseParallel, and ours beside it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    mlp = _dense_layers()["mlp"]
    # ParallelMLP copies its shards before parallelize_module turns mlp's weights into DTensors
    ours = TP.ParallelMLP(mlp)
    theirs = parallelize_module(mlp, mesh, {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    res = {}
    for name, m in (("ours", ours), ("torch", theirs)):
        x = _inputs()["x"].clone().requires_grad_(True)
        y = m(x)
        (y * _inputs()["G"][..., :H]).sum().backward()
        grads = {k: (q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad).clone()
                 for k, q in m.named_parameters()}
        res[name] = [y.detach(), x.grad.clone(), grads]
    return res


def _gpt():
    """STEPS SGD steps of the TP GPT; comm meter on the forward and backward of the last one."""
    torch.manual_seed(SEED)
    model = TP.parallelize_gpt(GPT(CFG))
    run = train_steps(model, STEPS, B, T, lr=LR, momentum=0.9)
    losses, logits, (fwd, bwd) = run.losses, run.logits, run.meters
    grads = {k: q.grad.clone() for k, q in model.named_parameters()}
    block = model.blocks[0]  # one transformer layer alone, forward and backward
    xb = _inputs()["x"].clone().requires_grad_(True)
    with comm.meter() as bf:
        yb = block(xb)
    with comm.meter() as bb:
        yb.sum().backward()
    ev = lambda m: [(e.op, e.nbytes, e.wire_bytes) for e in m.events]
    return {"losses": losses, "logits": TP.gather_from_tp(logits.detach()),
            "grads": grads, "params": {k: q.detach().clone() for k, q in model.named_parameters()},
            "tied": model.lm_head.weight is model.wte.weight,
            "events": {"fwd": ev(fwd), "bwd": ev(bwd), "block_fwd": ev(bf), "block_bwd": ev(bb)},
            "block_params": sum(q.numel() for q in model.blocks.parameters()),
            "n_params": sum(q.numel() for q in model.parameters())}


def _padded_targets(y):
    """``y`` with positions that are padding (-100): the tail of row 0, all of row 2."""
    y = y.clone()
    y[0, T // 2:] = -100
    y[2] = -100
    return y


def _seeded_and_padded():
    """Per-rank seeds (rank 0's is SEED): the weights each rank ends with, and the dense weights it
    built. Then the loss and gradients of a batch with padded targets, and of one that is all padding."""
    r, out = dist.get_rank(), {}
    torch.manual_seed(SEED + 1000 * r)
    dense = GPT(CFG)
    out["built"] = dense.wte.weight.detach().clone()
    out["params"] = {k: q.detach().clone() for k, q in TP.parallelize_gpt(dense).named_parameters()}
    d = _dense_layers(SEED + 1000 * r)
    out["layers"] = {name: {k: q.detach().clone() for k, q in cls(d[name]).named_parameters()}
                     for name, cls in (("mlp", TP.ParallelMLP), ("attn", TP.ParallelAttention))}
    torch.manual_seed(SEED)
    model = TP.parallelize_gpt(GPT(CFG))
    x, y = _batch()
    for kind, targets in (("padded", _padded_targets(y)), ("all", torch.full_like(y, -100))):
        model.zero_grad()
        _, loss = model(x, targets)
        loss.backward()
        out[kind] = {"loss": loss.item(), "grads": {k: q.grad.clone() for k, q in model.named_parameters()}}
    if dist.get_world_size() == 4:  # the helper on two groups of 2: each group takes its first rank's
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        torch.manual_seed(r)
        lin = nn.Linear(3, 2)
        lin.register_buffer("count", torch.tensor([r, r]))
        lin.register_buffer("mask", torch.tensor([r % 2 == 0, True]))
        broadcast_from_first_rank(lin, groups[r // 2])
        out["subgroup"] = [t.detach().clone() for t in (lin.weight, lin.bias, lin.count, lin.mask)]
    return out


def _batch():
    from minitorch_dist.models.data import MarkovCorpus
    return MarkovCorpus(V, seed=0).batch(0, B, T)


def _errors():
    t = dist.get_world_size()
    bad_heads = 3 if t == 2 else 6
    cases = {
        "heads": lambda: TP.parallelize_gpt(GPT(GPTConfig.tiny(n_head=bad_heads, n_embd=8 * bad_heads))),
        "vocab": lambda: TP.parallelize_gpt(GPT(GPTConfig.tiny(vocab_size=4 * t + 1 + (t == 4)))),
        "column": lambda: TP.ColumnParallelLinear(8, 2 * t + 1),
        "row": lambda: TP.RowParallelLinear(2 * t + 1, 8),
    }
    return {name: refusal(call) for name, call in cases.items()}


def _run_every_case():
    with float64():
        return run_cases({"layers": _layers, "torch": _torch_dtensor, "gpt": _gpt, "errors": _errors,
                          "seeded": _seeded_and_padded})


def _case(t, name):
    """Each rank's value of case ``name`` on t ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(t))]


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=120)


# --- the dense references (one process, one thread, like a rank) and this file's slicing rules ----------


def _cols(w, t, r):  # column-parallel: a contiguous block of output rows
    return w.chunk(t, 0)[r]


def _rows(w, t, r):  # row-parallel: a contiguous block of input columns
    return w.chunk(t, 1)[r]


def _qkv(w, t, r):  # fused q|k|v: rank r's heads inside each of q, k, v (heads are contiguous in each)
    return w.reshape(3, t, -1, *w.shape[1:])[:, r].reshape(-1, *w.shape[1:])


def _shard(name, w, t, r):
    """Rank r's part of the dense tensor ``w`` named ``name`` (a GPT / MLP / attention parameter)."""
    if "c_attn" in name:
        return _qkv(w, t, r)
    if name.endswith(("c_fc.weight", "c_fc.bias", "wte.weight", "lm_head.weight")):
        return _cols(w, t, r)
    if name.endswith("c_proj.weight"):
        return _rows(w, t, r)
    return w  # LayerNorms, wpe, row-parallel biases: replicated


@functools.cache
def _dense_layer_refs():
    with float64(), single_thread():
        d, inp, ref = _dense_layers(), _inputs(), {}
        G = inp["G"]
        for name, xin, g in (("col", inp["x"], G), ("row", inp["wide"], G[..., :H]),
                             ("mlp", inp["x"], G[..., :H]), ("attn", inp["x"], G[..., :H])):
            x = xin.clone().requires_grad_(True)
            y = d[name](x)
            (y * g).sum().backward()
            ref[name] = [y.detach(), x.grad, {k: q.grad for k, q in d[name].named_parameters()}]
        return ref


@functools.cache
def _dense_gpt():
    with float64():
        return dense_run(lambda: GPT(CFG), STEPS, B, T, seed=SEED, lr=LR, momentum=0.9)


def _close(got, want, where, depth=LAYER_DEPTH):
    close_model(got, want, n=N, depth=depth, where=where)


def _close_params(got, want, grads, where):
    """Weights after STEPS - 1 SGD steps (tests/_support.py)."""
    close_after_sgd(got, want, grads, n=N, depth=GPT_DEPTH, steps=STEPS - 1, lr=LR, momentum=0.9, where=where)


def _loss_bound(loss):
    return model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, abs(loss)))


# --- every layer equals the dense one ---------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_column_and_row_parallel_linear_equal_the_dense_linear(t):
    ref = _dense_layer_refs()
    for r, layers in enumerate(_case(t, "layers")):
        (y, dx, dense_p) = ref["col"]
        for gather in (False, True):
            got = layers["col", gather]
            _close(got[0], y if gather else y.chunk(t, -1)[r], f"column out gather={gather} r={r}")
            _close(got[1], dx, f"column dX (f's all-reduce) r={r}")
            _close(got[2], _cols(dense_p["weight"], t, r), f"column dW r={r}")
            _close(got[3], _cols(dense_p["bias"], t, r), f"column db r={r}")
        (y, dx, dense_p) = ref["row"]
        for parallel in (True, False):
            got = layers["row", parallel]
            _close(got[0], y, f"row out input_is_parallel={parallel} r={r}")
            _close(got[1], dx.chunk(t, -1)[r] if parallel else dx, f"row dX r={r}")
            _close(got[2], _rows(dense_p["weight"], t, r), f"row dW r={r}")
            _close(got[3], dense_p["bias"], f"row db r={r}")


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("name", ["mlp", "attn"])
def test_parallel_mlp_and_attention_equal_the_dense_blocks(t, name):
    y, dx, dense_p = _dense_layer_refs()[name]
    for r, layers in enumerate(_case(t, "layers")):
        got_y, got_dx, got_p = layers[name]
        _close(got_y, y, f"{name} out r={r}")
        _close(got_dx, dx, f"{name} dX r={r}")
        assert got_p.keys() == dense_p.keys()
        for k in dense_p:
            _close(got_p[k], _shard(k, dense_p[k], t, r), f"{name}.{k} grad r={r}")


# --- the whole GPT equals the dense GPT over several steps ---------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_gpt_loss_and_gradients_equal_the_dense_gpt_after_several_steps(t):
    ref = _dense_gpt()
    for r, g in enumerate(_case(t, "gpt")):
        assert g["tied"]
        for got, want in zip(g["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= _loss_bound(want), (got, want)
        _close(g["logits"], ref["logits"], f"gathered logits r={r}", GPT_DEPTH)
        assert g["grads"].keys() == ref["grads"].keys()
        for k in ref["grads"]:
            _close(g["grads"][k], _shard(k, ref["grads"][k], t, r), f"grad {k} r={r}", GPT_DEPTH)
            _close_params(g["params"][k], _shard(k, ref["params"][k], t, r), ref["grads"].values(),
                          f"param {k} r={r}")


@pytest.mark.parametrize("t", [2, 4])
def test_equals_torch_dtensor_parallelize_module(t):
    for r, pair in enumerate(_case(t, "torch")):
        ours, theirs = pair["ours"], pair["torch"]
        _close(ours[0], theirs[0], f"MLP out r={r}")
        _close(ours[1], theirs[1], f"MLP dX r={r}")
        assert ours[2].keys() == theirs[2].keys()
        for k in ours[2]:
            _close(ours[2][k], theirs[2][k], f"{k} grad vs DTensor r={r}")


# --- the same dense model on every rank; padding ignored ------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_per_rank_seeds_give_the_first_ranks_dense_model(t):
    """Each rank built its dense GPT (and MLP, attention) under its own seed: the wrappers broadcast
    rank 0's before slicing, so every rank holds its slice of rank 0's dense model, bitwise."""
    with float64(), single_thread():
        torch.manual_seed(SEED)
        dense = {k: q.detach() for k, q in GPT(CFG).named_parameters()}
        layers = {name: {k: q.detach() for k, q in m.named_parameters()}
                  for name, m in _dense_layers().items() if name in ("mlp", "attn")}
    results = _case(t, "seeded")
    assert not torch.equal(results[1]["built"], dense["wte.weight"])  # it did differ
    for r, got in enumerate(results):
        assert got["params"].keys() == dense.keys()
        for k in dense:
            assert torch.equal(got["params"][k], _shard(k, dense[k], t, r)), f"{k} r={r}"
        for name, want in layers.items():
            for k in want:
                assert torch.equal(got["layers"][name][k], _shard(k, want[k], t, r)), f"{name}.{k} r={r}"


def test_broadcast_from_first_rank_uses_the_groups_first_rank():
    for r, seeded in enumerate(_case(4, "seeded")):
        first = 2 * (r // 2)  # groups {0, 1} and {2, 3}
        torch.manual_seed(first)
        with float64():
            lin = nn.Linear(3, 2)
        weight, bias, count, mask = seeded["subgroup"]
        assert torch.equal(weight, lin.weight.detach()) and torch.equal(bias, lin.bias.detach())
        assert count.tolist() == [first, first] and mask.tolist() == [first % 2 == 0, True]


@functools.cache
def _dense_padded():
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = GPT(CFG)
        x, y = _batch()
        out = {}
        for kind, targets in (("padded", _padded_targets(y)), ("all", torch.full_like(y, -100))):
            model.zero_grad()
            _, loss = model(x, targets)
            loss.backward()
            out[kind] = {"loss": loss.item(),
                         "grads": {k: q.grad.clone() for k, q in model.named_parameters()}}
        return out


@pytest.mark.parametrize("t", [2, 4])
def test_padded_targets_are_ignored_like_the_dense_gpt(t):
    """Targets -100 add nothing: the loss is the mean over the other positions, and the gradients
    those of the dense GPT; a batch of padding only gives NaN and zero gradients, as F.cross_entropy."""
    ref = _dense_padded()
    with float64(), single_thread():  # the loss the padding would have given if it were counted: far from it
        x, y = _batch()
        torch.manual_seed(SEED)
        counted = GPT(CFG)(x, _padded_targets(y).clamp(min=0))[1].item()
    assert abs(counted - ref["padded"]["loss"]) > 1e-3
    for r, seeded in enumerate(_case(t, "seeded")):
        got = seeded["padded"]
        assert abs(got["loss"] - ref["padded"]["loss"]) <= _loss_bound(ref["padded"]["loss"])
        for k, want in ref["padded"]["grads"].items():
            _close(got["grads"][k], _shard(k, want, t, r), f"padded grad {k} r={r}", GPT_DEPTH)
        every = seeded["all"]
        assert math.isnan(every["loss"]) and math.isnan(ref["all"]["loss"])
        for k, want in ref["all"]["grads"].items():
            assert torch.equal(every["grads"][k], _shard(k, want, t, r)), f"all-padding grad {k} r={r}"


# --- the mechanism: the collectives and their bytes ----------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_one_layer_costs_two_all_reduces_forward_and_two_backward(t):
    want = costmodel.tensor_parallel_allreduces_per_layer()
    bsh = B * T * H * ELEM
    for g in _case(t, "gpt"):
        ev = g["events"]
        call = ("all_reduce", bsh, costmodel.bus_bytes("all_reduce", bsh, t))
        assert ev["block_fwd"] == [call] * want["forward"]
        assert ev["block_bwd"] == [call] * want["backward"]
        wire = sum(w for _, _, w in ev["block_fwd"] + ev["block_bwd"])
        assert wire == pytest.approx(
            costmodel.tensor_parallel_bytes_per_layer(B, T, H, t, bytes_per_element=ELEM), rel=1e-12)


@pytest.mark.parametrize("t", [2, 4])
def test_whole_gpt_adds_only_the_embedding_and_loss_collectives(t):
    """Forward: 2 per layer + 1 (the embedding's g) of b·s·h, + 3 of b·s for the loss.
    Backward: 2 per layer + 1 (the output layer's f). Nothing of size V ever moves."""
    want = costmodel.tensor_parallel_allreduces_per_layer()
    bsh, bs, L = B * T * H * ELEM, B * T * ELEM, CFG.n_layer
    for g in _case(t, "gpt"):
        ev = g["events"]
        fwd = sorted((op, n) for op, n, _ in ev["fwd"])
        bwd = sorted((op, n) for op, n, _ in ev["bwd"])
        assert fwd == sorted([("all_reduce", bsh)] * (want["forward"] * L + 1) + [("all_reduce", bs)] * 3)
        assert bwd == [("all_reduce", bsh)] * (want["backward"] * L + 1)
        wire = sum(w for _, _, w in ev["fwd"] + ev["bwd"])
        extra = 2 * costmodel.bus_bytes("all_reduce", bsh, t) + 3 * costmodel.bus_bytes("all_reduce", bs, t)
        assert wire == pytest.approx(L * costmodel.tensor_parallel_bytes_per_layer(B, T, H, t, ELEM) + extra,
                                     rel=1e-12)


@pytest.mark.parametrize("t", [2, 4])
def test_block_parameters_per_rank_fall_as_one_over_t(t):
    dense = GPT(CFG)
    total = sum(q.numel() for q in dense.blocks.parameters())
    replicated = sum(q.numel() for k, q in dense.blocks.named_parameters()
                     if ".ln_" in k or k.endswith("c_proj.bias"))  # LayerNorms, biases added after g
    for g in _case(t, "gpt"):
        assert g["block_params"] == (total - replicated) // t + replicated
        assert (total - replicated) % t == 0


@pytest.mark.parametrize("t", [2, 4])
def test_parameters_per_rank_match_the_formula(t):
    for g in _case(t, "gpt"):
        assert g["n_params"] == costmodel.tensor_parallel_params_per_rank(CFG, t)


# --- errors ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_bad_divisibility_is_a_clear_error(t):
    bad_heads = 3 if t == 2 else 6
    for err in _case(t, "errors"):
        assert f"n_head {bad_heads} is not divisible by tp={t}" in err["heads"]
        assert f"vocab_size {4 * t + 1 + (t == 4)} is not divisible by tp={t}" in err["vocab"]
        assert f"out_features {2 * t + 1} is not divisible by tp={t}" in err["column"]
        assert f"in_features {2 * t + 1} is not divisible by tp={t}" in err["row"]


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="launch"):
        TP.parallelize_gpt(GPT(CFG))


def test_dropout_is_refused_with_a_reason():
    with pytest.raises(RankError, match="ValueError: dropout 0.1 is not supported"):
        launch(lambda: TP.parallelize_gpt(GPT(GPTConfig.tiny(dropout=0.1))), 2)
