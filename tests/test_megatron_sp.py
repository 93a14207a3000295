"""Chapter 05: Megatron sequence parallelism (Korthikanti et al. 2022, §4.2.2) computes the dense
block and the tensor-parallel block, and the whole GPT over several optimizer steps; and it works
the way the paper says: g / ḡ are 2 all-gathers + 2 reduce-scatters per layer forward (and
backward) moving exactly the bytes of TP's 4 all-reduces, and the activations a rank stores fall
as 34·s·b·h/t (TP alone: s·b·h·(10 + 24/t)), measured with ``MemoryMeter``.

One launch per degree t runs every case and returns plain data; the tests only inspect it.
Expected values come from elsewhere: the dense ``Block`` / ``GPT`` in one process (one thread,
like a rank), sliced here by this file's own rules (sequence slice r = positions [r·s/t, (r+1)·s/t);
c_attn rows = rank r's heads inside each of q, k, v), chapter 04's TP block, ``costmodel``.

Tolerances (derived in tests/_support.py). Every case runs in float64. As in chapter 04, a
row-parallel layer (and a reduce-scatter) adds t partial sums where the dense block adds in one pass,
and the sequence-parallel LayerNorm / bias gradients add t partial sums over positions: the same sums
in another order, at most N = max(B·T, 4H) = 128 terms each (a weight gradient sums B·T rows, c_proj
sums 4H inputs), chained at most 6 deep in a block and 6 per block + 2 in the GPT: ``model_bound``,
scaled by each tensor's size (at least 1); the GPT's weights after STEPS - 1 = 2 SGD steps (lr 0.1,
momentum 0.9): ``sgd_bound`` of the GPT's gradient bound; its losses (~4): ``model_bound`` scaled by
the loss. All are below 1e-9 of the values; a lost reduce-scatter or all-reduce divides an output or
gradient by t (an error of half the value or more), a slice from the wrong positions moves it by
O(1). Bytes are counted for float64 (ELEM = 8 bytes an element); a wire total is a product of a few
float64 numbers (rel 1e-12 >> 10 u).

Memory (float64, so the 16-bit formula x ELEM/2 = 4, and ``recompute="selective"`` because SDPA
keeps q, k, v, its output and a log-sum-exp, never the a·s² scores). On this block every saved tensor
is float64: 130·s·b·h/t bytes with SP, vs 4 x 34 = 136 by the formula: the
formula's two dropout masks (1 byte each, x 4) are absent at dropout 0 (-8), the LayerNorms' mean /
rstd and SDPA's log-sum-exp are not in it (+2 at h = 32, a = 4): -4.4%. TP alone: 33 + 97/t vs
40 + 96/t: -7.4% at t = 2, -10.5% at t = 4. So ±15% holds every one of them, and sp / tp is
checked against the formulas' ratio too. ``regather=False`` keeps the two column layers'
gathered inputs whole: exactly 2·(1 - 1/t)·s·b·h·ELEM bytes more.

Per-rank seeds (each rank built its dense model under its own seed) must still give rank 0's dense
model, bitwise: the wrappers broadcast the group's first rank's weights before slicing. Padded
targets (-100) are ignored by the sequence-parallel loss as by the dense GPT's F.cross_entropy.
"""
import copy
import functools

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.models.gpt import GPT, Block, GPTConfig
from minitorch_dist.models.train import train_steps
from minitorch_dist.parallelism import tensor_parallel as TP
from minitorch_dist.parallelism.sequence_parallel import megatron_sp as SP
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

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

pytestmark = pytest.mark.ch05

B, T, H, V, A = 4, 16, 32, 64, 4
CFG = GPTConfig.tiny(vocab_size=V, block_size=T, n_layer=2, n_head=A, n_embd=H)
STEPS, LR, SEED = 3, 0.1, 7
N = max(B * T, 4 * H)  # the longest reduction: a weight gradient sums B·T rows, c_proj sums 4H inputs
BLOCK_DEPTH, GPT_DEPTH = 6, 6 * CFG.n_layer + 2  # chained reductions: one block; the whole GPT
ELEM = 8  # bytes of a float64 element: every case runs in float64
BSH = B * T * H * ELEM  # bytes of one (b, s, h) activation


def _dense_block():
    torch.manual_seed(SEED)
    return Block(CFG)


def _inputs():
    g = torch.Generator().manual_seed(SEED + 1)
    return torch.randn(B, T, H, generator=g), torch.randn(B, T, H, generator=g)


def _seq(x, t, r):  # this file's rule: rank r holds positions [r·s/t, (r+1)·s/t)
    return x.chunk(t, dim=1)[r]


# --- what runs on the ranks ---------------------------------------------------------------------


def _ev(m):
    return [(e.op, e.nbytes, e.wire_bytes) for e in m.events]


def _activations(module, x):
    """Peak bytes saved for backward by one forward of ``module`` (MemoryMeter, saved-tensor hooks)."""
    meter = MemoryMeter(module)
    with meter.track():
        module(x)
        return meter.peak["activations"]


def _block_cases():
    t, r = dist.get_world_size(), dist.get_rank()
    dense, (x_full, G) = _dense_block(), _inputs()
    out = {}
    for regather in (True, False):
        sp = SP.sequence_parallel_block(dense, regather=regather)
        x = _seq(x_full, t, r).clone().requires_grad_(True)
        with comm.meter() as fwd:
            y = sp(x)
        with comm.meter() as bwd:
            (y * _seq(G, t, r)).sum().backward()
        partial = {k: q.grad.clone() for k, q in sp.named_parameters()}
        with comm.meter() as ar:
            SP.allreduce_sequence_parallel_grads(sp)
        out["sp", regather] = {
            "y": y.detach(), "dx": x.grad.clone(), "partial": partial,
            "grads": {k: q.grad.clone() for k, q in sp.named_parameters()},
            "events": {"fwd": _ev(fwd), "bwd": _ev(bwd), "allreduce": _ev(ar)},
            "activations": _activations(sp, _seq(x_full, t, r).clone().requires_grad_(True))}
    tp = copy.deepcopy(dense)  # chapter 04's block: TP attention and MLP, LayerNorms replicated
    tp.attn, tp.mlp = TP.ParallelAttention(dense.attn), TP.ParallelMLP(dense.mlp)
    x = x_full.clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = tp(x)
    with comm.meter() as bwd:
        (y * G).sum().backward()
    out["tp"] = {"y": y.detach(), "dx": x.grad.clone(),
                 "grads": {k: q.grad.clone() for k, q in tp.named_parameters()},
                 "events": {"fwd": _ev(fwd), "bwd": _ev(bwd)},
                 "activations": _activations(tp, x_full.clone().requires_grad_(True))}
    return out


def _gpt():
    """STEPS SGD steps of the TP + SP GPT, the sequence-parallel gradients all-reduced each step."""
    torch.manual_seed(SEED)
    model = SP.parallelize_gpt_sp(GPT(CFG))
    run = train_steps(model, STEPS, B, T, lr=LR, momentum=0.9,
                      after_backward=lambda: SP.allreduce_sequence_parallel_grads(model))
    fwd, bwd = run.meters
    return {"losses": run.losses, "logits": run.logits, "tied": model.lm_head.weight is model.wte.weight,
            "grads": {k: q.grad.clone() for k, q in model.named_parameters()},
            "params": {k: q.detach().clone() for k, q in model.named_parameters()},
            "events": {"fwd": _ev(fwd), "bwd": _ev(bwd)}}


def _padded_targets(y):
    """``y`` with padding (-100): the tail of row 0 (it spans several sequence slices), all of row 2."""
    y = y.clone()
    y[0, T // 4:] = -100
    y[2] = -100
    return y


def _batch():
    from minitorch_dist.models.data import MarkovCorpus
    return MarkovCorpus(V, seed=0).batch(0, B, T)


def _seeded_and_padded():
    """Per-rank seeds (rank 0's is SEED): the GPT's and a block's weights after the wrappers. Then
    the loss and (all-reduced) gradients of a batch with padded targets."""
    r, out = dist.get_rank(), {}
    torch.manual_seed(SEED + 1000 * r)
    dense = GPT(CFG)
    out["built"] = dense.wte.weight.detach().clone()
    out["params"] = {k: q.detach().clone() for k, q in SP.parallelize_gpt_sp(dense).named_parameters()}
    torch.manual_seed(SEED + 1000 * r)
    block = SP.sequence_parallel_block(Block(CFG))
    out["block"] = {k: q.detach().clone() for k, q in block.named_parameters()}
    torch.manual_seed(SEED)
    model = SP.parallelize_gpt_sp(GPT(CFG))
    x, y = _batch()
    _, loss = model(x, _padded_targets(y))
    loss.backward()
    SP.allreduce_sequence_parallel_grads(model)
    out["padded"] = {"loss": loss.item(), "grads": {k: q.grad.clone() for k, q in model.named_parameters()}}
    return out


def _errors():
    t = dist.get_world_size()
    cases = {
        "split": lambda: SP.scatter_to_sequence(torch.zeros(2, 15 if t == 2 else 30, H)),
        "gpt": lambda: SP.parallelize_gpt_sp(GPT(CFG))(torch.zeros(2, 4 * t - 1, dtype=torch.long)),
        "dropout": lambda: SP.sequence_parallel_block(Block(GPTConfig.tiny(dropout=0.1))),
    }
    return {name: refusal(call) for name, call in cases.items()}


def _run_every_case():
    with float64():
        return run_cases({"block": _block_cases, "gpt": _gpt, "errors": _errors,
                          "seeded": _seeded_and_padded})


@functools.cache
def _results(t):
    return launch(_run_every_case, t, timeout_s=120)


def _case(t, name):
    """Each rank's value of case ``name`` on t ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(t))]


# --- the dense references (one process, one thread, like a rank) and this file's slicing rules ----------


def _shard(name, w, t, r):
    """Rank r's part of the dense tensor ``w`` named ``name`` (a Block or GPT parameter)."""
    if "c_attn" in name:  # fused q|k|v: rank r's heads inside each of q, k, v
        return w.reshape(3, t, -1, *w.shape[1:])[:, r].reshape(-1, *w.shape[1:])
    if name.endswith(("c_fc.weight", "c_fc.bias", "wte.weight", "lm_head.weight")):
        return w.chunk(t, 0)[r]
    if name.endswith("c_proj.weight"):
        return w.chunk(t, 1)[r]
    return w  # LayerNorms, wpe, row-parallel biases: whole on every rank


@functools.cache
def _dense_block_ref():
    with float64(), single_thread():
        block, (x, G) = _dense_block(), _inputs()
        x.requires_grad_(True)
        y = block(x)
        (y * G).sum().backward()
        act = _activations(block, _inputs()[0].requires_grad_(True))
        return {"y": y.detach(), "dx": x.grad, "grads": {k: q.grad for k, q in block.named_parameters()},
                "activations": act}


@functools.cache
def _dense_gpt():
    with float64():
        return dense_run(lambda: GPT(CFG), STEPS, B, T, seed=SEED, lr=LR, momentum=0.9)


def _close(got, want, where, depth=BLOCK_DEPTH):
    close_model(got, want, n=N, depth=depth, where=where)


def _close_params(got, want, grads, where):
    """Weights after STEPS - 1 SGD steps (tests/_support.py)."""
    close_after_sgd(got, want, grads, n=N, depth=GPT_DEPTH, steps=STEPS - 1, lr=LR, momentum=0.9, where=where)


def _loss_bound(loss):
    return model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, abs(loss)))


# --- the block equals the TP block and the dense block ------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
@pytest.mark.parametrize("regather", [True, False])
def test_sp_block_equals_the_dense_and_the_tp_block(t, regather):
    ref, blocks = _dense_block_ref(), _case(t, "block")
    sp = [b["sp", regather] for b in blocks]
    _close(torch.cat([p["y"] for p in sp], dim=1), ref["y"], "SP outputs concatenated along the sequence")
    for r, b in enumerate(blocks):
        tp = b["tp"]
        _close(tp["y"], ref["y"], f"TP out r={r}")
        _close(sp[r]["dx"], _seq(ref["dx"], t, r), f"SP dX (slice) r={r}")
        _close(sp[r]["dx"], _seq(tp["dx"], t, r), f"SP dX vs TP r={r}")
        assert sp[r]["grads"].keys() == ref["grads"].keys() == tp["grads"].keys()
        for k in ref["grads"]:
            _close(sp[r]["grads"][k], _shard(k, ref["grads"][k], t, r), f"SP grad {k} r={r}")
            _close(sp[r]["grads"][k], tp["grads"][k], f"SP grad {k} vs TP r={r}")


@pytest.mark.parametrize("t", [2, 4])
def test_layernorm_and_row_bias_grads_are_partial_until_all_reduced(t):
    """Before the all-reduce rank r holds dL/dγ summed over its s/t positions only: the ranks' partial
    gradients add up to the dense one and none of them equals it."""
    ref, blocks = _dense_block_ref(), _case(t, "block")
    for k in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias", "attn.c_proj.bias", "mlp.c_proj.bias"):
        parts = [b["sp", True]["partial"][k] for b in blocks]
        _close(sum(parts), ref["grads"][k], f"sum of partial {k}")
        assert all(not torch.allclose(q, ref["grads"][k], atol=1e-3) for q in parts), k
    for b in blocks:  # one coalesced all-reduce of the 6h flagged numbers (2 LayerNorms, 2 biases)
        assert b["sp", True]["events"]["allreduce"] == [
            ("all_reduce", 6 * H * ELEM, costmodel.bus_bytes("all_reduce", 6 * H * ELEM, t))]


# --- the whole GPT ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_sp_gpt_loss_and_gradients_equal_the_dense_gpt_after_several_steps(t):
    ref, gpts = _dense_gpt(), _case(t, "gpt")
    _close(torch.cat([g["logits"] for g in gpts], dim=-1), ref["logits"],
           "logits gathered over the vocabulary", GPT_DEPTH)
    for r, g in enumerate(gpts):
        assert g["tied"]
        for got, want in zip(g["losses"], ref["losses"], strict=True):
            assert abs(got - want) <= _loss_bound(want), (got, want)
        assert g["grads"].keys() == ref["grads"].keys()
        for k in ref["grads"]:
            _close(g["grads"][k], _shard(k, ref["grads"][k], t, r), f"grad {k} r={r}", GPT_DEPTH)
            _close_params(g["params"][k], _shard(k, ref["params"][k], t, r), ref["grads"].values(),
                          f"param {k} r={r}")


@pytest.mark.parametrize("t", [2, 4])
def test_per_rank_seeds_give_the_first_ranks_dense_model(t):
    with float64(), single_thread():
        torch.manual_seed(SEED)
        dense = {k: q.detach() for k, q in GPT(CFG).named_parameters()}
        torch.manual_seed(SEED)
        block = {k: q.detach() for k, q in Block(CFG).named_parameters()}
    seeded = _case(t, "seeded")
    assert not torch.equal(seeded[1]["built"], dense["wte.weight"])  # rank 1's own model differed
    for r, got in enumerate(seeded):
        assert got["params"].keys() == dense.keys() and got["block"].keys() == block.keys()
        for k in dense:
            assert torch.equal(got["params"][k], _shard(k, dense[k], t, r)), f"{k} r={r}"
        for k in block:
            assert torch.equal(got["block"][k], _shard(k, block[k], t, r)), f"block {k} r={r}"


@functools.cache
def _dense_padded():
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = GPT(CFG)
        x, y = _batch()
        _, loss = model(x, _padded_targets(y))
        loss.backward()
        counted = model(x, _padded_targets(y).clamp(min=0))[1].item()  # were the padding counted
        return {"loss": loss.item(), "counted": counted,
                "grads": {k: q.grad for k, q in model.named_parameters()}}


@pytest.mark.parametrize("t", [2, 4])
def test_padded_targets_are_ignored_like_the_dense_gpt(t):
    ref = _dense_padded()
    assert abs(ref["counted"] - ref["loss"]) > 1e-3
    for r, seeded in enumerate(_case(t, "seeded")):
        got = seeded["padded"]
        assert abs(got["loss"] - ref["loss"]) <= _loss_bound(ref["loss"]), (got["loss"], ref["loss"])
        for k, want in ref["grads"].items():
            _close(got["grads"][k], _shard(k, want, t, r), f"padded grad {k} r={r}", GPT_DEPTH)


@pytest.mark.parametrize("t", [2, 4])
def test_sp_gpt_collectives(t):
    """Forward: per layer AG, RS, AG, RS of b·s·h; the embedding's ḡ (RS), lm_head's g (AG), the
    loss's 3 all-reduces of b·s. Backward (regather): per layer 4 AG + 2 RS, lm_head AG + RS,
    the embedding's AG."""
    L = CFG.n_layer
    for g in _case(t, "gpt"):
        ev = g["events"]
        fwd = sorted((op, n) for op, n, _ in ev["fwd"])
        assert fwd == sorted([("all_gather", BSH)] * (2 * L + 1) + [("reduce_scatter", BSH)] * (2 * L + 1)
                             + [("all_reduce", B * T * ELEM)] * 3)
        bwd = sorted((op, n) for op, n, _ in ev["bwd"])
        assert bwd == sorted([("all_gather", BSH)] * (4 * L + 2) + [("reduce_scatter", BSH)] * (2 * L + 1))


# --- the mechanism: collectives and bytes -------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_sp_replaces_tp_all_reduces_by_all_gathers_and_reduce_scatters_with_the_same_bytes(t):
    ag = ("all_gather", BSH, costmodel.bus_bytes("all_gather", BSH, t))
    rs = ("reduce_scatter", BSH, costmodel.bus_bytes("reduce_scatter", BSH, t))
    want = costmodel.tensor_parallel_bytes_per_layer(B, T, H, t, bytes_per_element=ELEM)
    for b in _case(t, "block"):
        tp = b["tp"]["events"]
        tp_wire = sum(w for _, _, w in tp["fwd"] + tp["bwd"])
        assert tp_wire == pytest.approx(want, rel=1e-12)
        for regather in (True, False):
            ev = b["sp", regather]["events"]
            assert ev["fwd"] == [ag, rs, ag, rs]  # g before c_attn, ḡ after c_proj, the same for the MLP
            assert sorted(ev["bwd"]) == sorted([ag] * (4 if regather else 2) + [rs] * 2)
            wire = sum(w for _, _, w in ev["fwd"] + ev["bwd"])
            # regather: the 2 extra backward all-gathers (memory traded for bandwidth, §4.2.2) add 2/8
            assert wire == pytest.approx(want * (1.25 if regather else 1.0), rel=1e-12)
            assert all(op != "all_reduce" for op, _, _ in ev["fwd"] + ev["bwd"])


# --- activation memory per rank vs Korthikanti et al. 2022, Table 2 -----------------------------------------


def _formula(t, sp):
    return ELEM // 2 * costmodel.activation_memory_bytes(T, B, H, A, tp=t, sequence_parallel=sp,
                                                 recompute="selective")


def test_dense_block_activations_match_the_formula():
    assert _dense_block_ref()["activations"] == pytest.approx(_formula(1, False), rel=0.15)


@pytest.mark.parametrize("t", [2, 4])
def test_activation_memory_per_rank_falls_with_t_as_the_formula_says(t):
    dense = _dense_block_ref()["activations"]
    for b in _case(t, "block"):
        sp, tp = b["sp", True]["activations"], b["tp"]["activations"]
        assert sp == pytest.approx(_formula(t, True), rel=0.15)
        assert tp == pytest.approx(_formula(t, False), rel=0.15)
        assert sp / tp == pytest.approx(_formula(t, True) / _formula(t, False), rel=0.15)
        assert sp * t == dense  # every tensor the block saves is split t ways, nothing is replicated
        # without the backward re-gather, the gathered inputs of c_attn and c_fc stay whole
        gathered = b["sp", False]["activations"]
        assert gathered - sp == 2 * (1 - 1 / t) * BSH


# --- errors -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t", [2, 4])
def test_bad_input_is_a_clear_error(t):
    for err in _case(t, "errors"):
        assert f"sequence length {15 if t == 2 else 30} is not divisible by tp={t}" in err["split"]
        assert f"sequence length {4 * t - 1} is not divisible by tp={t}" in err["gpt"]
        assert "dropout 0.1 is not supported" in err["dropout"]


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="launch"):
        SP.sequence_parallel_block(Block(CFG))
