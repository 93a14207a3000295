"""Chapter 06: ZeRO-3 / FSDP equals one process on the global batch, and torch's FSDP2 ``fully_shard``;
and it works the way Rajbhandari et al. 2020 (§5.3, §7.2.2) and Zhao et al. 2023 (§3) say: Ψ
all-gathered in forward, Ψ all-gathered and Ψ reduce-scattered in backward (1.5x ZeRO-1/2's 2Ψ),
(4+4+8)Ψ/n bytes of fp32 model state per rank, the next unit's all-gather issued before the current
unit computes, at most root + 2 blocks gathered at once, hybrid sharding on a 2x2 grid.

One launch per world size runs every case and returns plain data; the tests only inspect it.
Expected values are computed here, independently of the module: the dense GPT in one process (one
thread, like a rank) on the global batch, torch's FSDP2 on the same ranks, parameter counts of
the dense model's modules, this file's own flatten-pad-chunk of the dense gradients.

Tolerances (as chapter 01): a rank's mean loss over B/n rows, averaged over n ranks, is the global
mean summed in another order, so gradients differ from one process by float32 ulps; AdamW with
lr = 1e-3 and eps = 1e-6 keeps near-cancelling components damped. atol 1e-6 / rtol 1e-5 on weights
and gradients, 2e-6 on losses; a gradient not averaged or a shard taken from the wrong place moves
weights by >= lr·|g| ~ 1e-5 (relative 1e-3). Measured after 5 steps: <= 1.5e-7 (AdamW) and 1.5e-8
(SGD) from one process, 1.7e-7 for hybrid 2x2. Against FSDP2, which also sums the n shards'
gradients and divides by n, only the order of the n additions is free: bitwise equal at n = 2
(a + b == b + a), 1 ulp (1.2e-7) at n = 4.

Sizes: V = 61, h = 21 (3 heads), 3 blocks, so no unit's Ψ_u is a multiple of 2 or 4 and every
unit is padded: Ψ_root = 1659 (wte 1281 + wpe 336 + ln_f 42; lm_head tied), Ψ_block = 5565.
"""
import functools
import math

import pytest
import torch
import torch._dynamo  # noqa: F401  optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist

from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.zero.fsdp import fully_shard, hybrid_groups
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.models.train import train_steps
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import RankError, launch

pytestmark = pytest.mark.ch06

CFG = GPTConfig.tiny(vocab_size=61, block_size=16, n_layer=3, n_head=3, n_embd=21)
B, T, STEPS, SEED = 8, 16, 5, 3
OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}
ATOL, RTOL, LOSS_ATOL = 1e-6, 1e-5, 2e-6
F32 = 4


def _train(model, opt, steps=STEPS):
    return train_steps(model, steps, B, T, optimizer=OPTS[opt], rank=dist.get_rank(),
                       world_size=dist.get_world_size())


def _ours(opt, **kw):
    torch.manual_seed(SEED)
    model = fully_shard(GPT(CFG), **kw)
    model.record_trace = True
    run = _train(model, opt)
    ev = lambda m: [(e.op, e.nbytes, e.wire_bytes, e.group_size, e.t) for e in m.events]  # noqa: E731
    out = {"losses": run.losses, "full": model.full_state_dict(),
           "grads": {u.name: u.shard.grad.clone() for u in model.units},
           "events": {"fwd": ev(run.meters[0]), "bwd": ev(run.meters[1])},
           "tied": model.module.lm_head.weight is model.module.wte.weight}
    # One more step by hand, with a fresh optimizer over the same shards: the trace and peaks of
    # one forward / backward, then the memory meter after the step (outside forward/backward).
    optim = OPTS[opt](list(model.parameters()))
    x, y = MarkovCorpus(CFG.vocab_size, seed=0).batch(STEPS, B, T, dist.get_rank(), dist.get_world_size())
    model.reset_stats()
    with comm.meter() as fwd:
        _, loss = model(x, y)
    out["fwd_peak"] = (model.peak_gathered, model.peak_gathered_bytes)
    with comm.meter() as bwd:
        loss.backward()
    optim.step()
    out["trace"] = [(e, u, t) for e, u, t in model.trace]
    out["step_events"] = {"fwd": ev(fwd), "bwd": ev(bwd)}
    out["memory"] = MemoryMeter(model, optim).current()
    out["resharded"] = all(u.full.untyped_storage().nbytes() == 0 and u.full.grad is None for u in model.units)
    out["shard_numels"] = {u.name: u.shard.numel() for u in model.units}
    out["param_numels"] = [p.numel() for p in model.parameters()]
    return out


def _torch_fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(SEED)
    model = GPT(CFG)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    run = _train(model, "adamw")
    return {"losses": run.losses, "full": {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}}


def _hybrid():
    group, replicate = hybrid_groups(2)
    torch.manual_seed(SEED)
    model = fully_shard(GPT(CFG), group=group, replicate_group=replicate)
    run = _train(model, "adamw")
    ev = lambda m: [(e.op, e.nbytes, e.group_size) for e in m.events]  # noqa: E731
    return {"losses": run.losses, "full": model.full_state_dict(),
            "events": {"fwd": ev(run.meters[0]), "bwd": ev(run.meters[1])},
            "shard_numels": [u.shard.numel() for u in model.units]}


def _inference():
    """Under no_grad: gather, run, free per unit; logits of the initial weights on this rank's rows."""
    torch.manual_seed(SEED)
    model = fully_shard(GPT(CFG))
    x, _ = MarkovCorpus(CFG.vocab_size, seed=0).batch(0, B, T, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        logits, loss = model(x)
    return {"logits": logits, "loss": loss, "left_gathered": sorted(model.gathered_now)}


def _errors():
    out = {}
    try:
        hybrid_groups(3)
    except ValueError as e:
        out["grid"] = str(e)
    return out


def _run_every_case():
    n = dist.get_world_size()
    res = {"adamw": _ours("adamw"), "sgd": _ours("sgd"), "adamw_no_prefetch": _ours("adamw", prefetch=False),
           "torch": _torch_fsdp2(), "inference": _inference(), "errors": _errors()}
    if n == 4:
        res["hybrid"] = _hybrid()
    return res


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=120)


# --- independent references ----------------------------------------------------------------------


@functools.cache
def _dense(opt):
    with single_thread():
        torch.manual_seed(SEED)
        model = GPT(CFG)
        run = train_steps(model, STEPS, B, T, optimizer=OPTS[opt])
        return {"losses": run.losses, "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                "model": model}


def _unit_params(model):
    """Dense parameters per unit, in module order: the root (tied lm_head once) then each block."""
    block_ids = {id(p) for p in model.blocks.parameters()}
    root = [p for p in model.parameters() if id(p) not in block_ids]
    return {"root": root, **{f"blocks.{i}": list(b.parameters()) for i, b in enumerate(model.blocks)}}


def _unit_numels():
    return {k: sum(p.numel() for p in ps) for k, ps in _unit_params(GPT(CFG)).items()}


def _padded(n):
    """Ψ padded unit by unit: Σ_u n·ceil(Ψ_u / n)."""
    return sum(n * math.ceil(k / n) for k in _unit_numels().values())


def _close(got, want, where):
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda s: f"{where}: {s}")


def _global_losses(results, key):
    """The mean over ranks of each rank's loss on its B/n rows is the loss of the global batch."""
    per_rank = [r[key]["losses"] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank)]


# --- equals one process, and torch's FSDP2 ------------------------------------------------------------


def test_sizes_pad_every_unit():
    numels = _unit_numels()
    assert numels["root"] == 1659 and numels["blocks.0"] == 5565
    assert all(k % 2 for k in numels.values())  # so every unit is padded at n = 2 and 4


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_zero3_equals_single_process(n, opt):
    ref = _dense(opt)
    results = _results(n)
    assert _global_losses(results, opt) == pytest.approx(ref["losses"], abs=LOSS_ATOL)
    for r, res in enumerate(results):
        got = res[opt]
        assert got["tied"], "lm_head.weight must stay the same tensor as wte.weight"
        assert got["full"].keys() == ref["params"].keys()
        for k in ref["params"]:
            _close(got["full"][k], ref["params"][k], f"{opt} n={n} r={r} {k}")


@pytest.mark.parametrize("n", [2, 4])
def test_gradient_shards_are_this_ranks_slice_of_the_dense_gradient(n):
    """The last step stops after backward: each shard's .grad is rank r's S elements of the unit's
    dense gradient, flattened in module order and zero-padded (computed here, not with FlatParams)."""
    model = _dense("sgd")["model"]
    for r, res in enumerate(_results(n)):
        for name, ps in _unit_params(model).items():
            flat = torch.cat([p.grad.reshape(-1) for p in ps])
            S = math.ceil(flat.numel() / n)
            flat = torch.cat([flat, flat.new_zeros(n * S - flat.numel())])
            _close(res["sgd"]["grads"][name], flat[r * S:(r + 1) * S], f"n={n} r={r} grad shard of {name}")


@pytest.mark.parametrize("n", [2, 4])
def test_equals_torch_fsdp2_fully_shard(n):
    results = _results(n)
    for r, res in enumerate(results):
        ours, theirs = res["adamw"], res["torch"]
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=LOSS_ATOL)
        assert ours["full"].keys() == theirs["full"].keys()
        for k in theirs["full"]:
            _close(ours["full"][k], theirs["full"][k], f"vs FSDP2 n={n} r={r} {k}")
            if n == 2:
                assert torch.equal(ours["full"][k], theirs["full"][k]), f"n=2 should be bitwise: {k}"


@pytest.mark.parametrize("n", [2, 4])
def test_prefetch_changes_nothing_but_the_order(n):
    for res in _results(n):
        assert res["adamw"]["losses"] == res["adamw_no_prefetch"]["losses"]  # bitwise: same sums
        for k, w in res["adamw"]["full"].items():
            assert torch.equal(w, res["adamw_no_prefetch"]["full"][k]), k


@pytest.mark.parametrize("n", [2, 4])
def test_inference_under_no_grad_equals_the_dense_model(n):
    with single_thread():
        torch.manual_seed(SEED)
        dense = GPT(CFG)
        with torch.no_grad():
            want = dense(MarkovCorpus(CFG.vocab_size, seed=0).batch(0, B, T)[0])[0]
    for r, res in enumerate(_results(n)):
        got = res["inference"]
        assert got["loss"] is None and got["left_gathered"] == []
        _close(got["logits"], want.chunk(n)[r], f"no_grad logits n={n} r={r}")


# --- the mechanism --------------------------------------------------------------------------------------


def test_hybrid_2x2_equals_single_process_and_reduces_in_groups_of_two():
    ref, results = _dense("adamw"), _results(4)
    assert _global_losses(results, "hybrid") == pytest.approx(ref["losses"], abs=LOSS_ATOL)
    units = _unit_numels()
    S = [math.ceil(units[k] / 2) for k in ("root", "blocks.0", "blocks.1", "blocks.2")]
    for r, res in enumerate(results):
        h = res["hybrid"]
        for k in ref["params"]:
            _close(h["full"][k], ref["params"][k], f"hybrid r={r} {k}")
        assert h["shard_numels"] == S  # sharded 2 ways, not 4
        ag = sorted((nb, g) for op, nb, g in h["events"]["fwd"] if op == "all_gather")
        assert ag == sorted((2 * s * F32, 2) for s in S)
        bwd = h["events"]["bwd"]
        assert sorted((nb, g) for op, nb, g in bwd if op == "reduce_scatter") == sorted((2 * s * F32, 2) for s in S)
        assert sorted((nb, g) for op, nb, g in bwd if op == "all_reduce") == sorted((s * F32, 2) for s in S)
        assert {op for op, _, _ in bwd} == {"all_gather", "reduce_scatter", "all_reduce"}


@pytest.mark.parametrize("n", [2, 4])
def test_a_step_moves_three_psi_one_and_a_half_times_zero_1_and_2(n):
    """Forward all-gathers Ψ_pad, backward all-gathers Ψ_pad and reduce-scatters Ψ_pad (4 bytes each):
    wire = 3·Ψ_pad·4·(n-1)/n, against the 2·Ψ·4·(n-1)/n of a ZeRO-1/2 step."""
    psi, psi_pad = sum(_unit_numels().values()), _padded(n)
    assert psi == GPT(CFG).num_params()
    units = 1 + CFG.n_layer
    for res in _results(n):
        for ev in (res["adamw"]["events"], res["adamw"]["step_events"]):
            fwd, bwd = ev["fwd"], ev["bwd"]
            assert [e[0] for e in fwd] == ["all_gather"] * units
            assert sorted(e[0] for e in bwd) == ["all_gather"] * units + ["reduce_scatter"] * units
            per_op = lambda evs, op: sum(e[1] for e in evs if e[0] == op)  # noqa: E731
            assert per_op(fwd, "all_gather") == per_op(bwd, "all_gather") == per_op(bwd, "reduce_scatter") \
                == psi_pad * F32
            wire = sum(e[2] for e in fwd + bwd)
            assert wire == pytest.approx(3 * psi_pad * F32 * (n - 1) / n, rel=1e-12)
            zero12 = 2 * psi * F32 * (n - 1) / n
            assert wire / zero12 == pytest.approx(1.5, rel=(psi_pad - psi) / psi + 1e-12)


@pytest.mark.parametrize("n", [2, 4])
def test_per_rank_memory_is_the_zero3_formula(n):
    """Outside forward/backward: parameters 4·S, gradients 4·S, AdamW state 8·S (+ a 4-byte step per
    shard), S summed over units: within padding of ZeRO's (4 + 4 + 8)·Ψ/n, nothing gathered left."""
    psi = sum(_unit_numels().values())
    S = {k: math.ceil(v / n) for k, v in _unit_numels().items()}
    step_bytes = F32 * len(S)  # AdamW's step counter: one float32 scalar per parameter (shard)
    for res in _results(n):
        got = res["adamw"]
        mem = got["memory"]
        assert got["shard_numels"] == S
        assert got["resharded"]
        assert mem["parameters"] == F32 * sum(S.values())
        assert mem["gradients"] == F32 * sum(S.values())
        assert mem["optimizer_state"] == 2 * F32 * sum(S.values()) + step_bytes
        total = mem["parameters"] + mem["gradients"] + mem["optimizer_state"] - step_bytes
        formula = (4 + 4 + 8) * psi / n
        assert formula <= total <= formula + 16 * len(S)  # each unit pads < n elements: < 16 bytes per rank


@pytest.mark.parametrize("n", [2, 4])
def test_forward_holds_the_root_and_at_most_two_blocks(n):
    unit_bytes = {k: F32 * n * math.ceil(v / n) for k, v in _unit_numels().items()}
    root, block = unit_bytes["root"], unit_bytes["blocks.0"]
    for res in _results(n):
        assert res["adamw"]["fwd_peak"] == (3, root + 2 * block)  # prefetch: root, current, next
        assert res["adamw_no_prefetch"]["fwd_peak"] == (2, root + block)
        assert root + 2 * block < sum(unit_bytes.values())  # 3 blocks: never the whole model


def _first(trace, event, unit):
    return next(t for e, u, t in trace if e == event and u == unit)


@pytest.mark.parametrize("n", [2, 4])
def test_prefetch_issues_the_next_all_gather_before_the_current_unit_computes(n):
    """Trace times against the comm meter's own event times: forward all-gather k (root, blocks 0..)
    is launched before block k-2 finishes; in backward, block i-1's before block i's backward ends."""
    L = CFG.n_layer
    for res in _results(n):
        for key, prefetch in (("adamw", True), ("adamw_no_prefetch", False)):
            trace, ev = res[key]["trace"], res[key]["step_events"]
            cut = next(k for k, (e, _, _) in enumerate(trace) if e == "backward")
            fwd_trace, bwd_trace = trace[:cut], trace[cut:]
            ag_fwd = [e[4] for e in ev["fwd"] if e[0] == "all_gather"]  # root, blocks.0, ..., in order
            for i in range(L - 1):
                end_i = _first(fwd_trace, "forward_end", f"blocks.{i}")
                assert (ag_fwd[i + 2] < end_i) == prefetch, (key, "forward", i)
                assert (_first(fwd_trace, "all_gather", f"blocks.{i + 1}") < end_i) == prefetch
            ag_bwd = [e[4] for e in ev["bwd"] if e[0] == "all_gather"]  # root, blocks.L-1, ..., blocks.0
            for i in range(L - 1, 0, -1):
                end_i = _first(bwd_trace, "backward_end", f"blocks.{i}")
                assert (ag_bwd[L - i + 1] < end_i) == prefetch, (key, "backward", i)
                assert (_first(bwd_trace, "all_gather", f"blocks.{i - 1}") < end_i) == prefetch


# --- errors ---------------------------------------------------------------------------------------------


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="launch"):
        fully_shard(GPT(CFG))


@pytest.mark.parametrize("n", [2, 4])
def test_bad_grid_is_a_clear_error(n):
    for res in _results(n):
        assert f"world size {n} is not divisible by shard_size 3" in res["errors"]["grid"]


def test_replicate_group_without_group_is_refused():
    with pytest.raises(RankError, match="replicate_group needs group"):
        launch(lambda: fully_shard(GPT(CFG), replicate_group=dist.group.WORLD), 2, timeout_s=60)
