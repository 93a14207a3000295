"""Chapter 06: ``ShardedOptimizer`` (``memory/zero/sharded_optimizer.py``), ZeRO stages 1 and 2 as an
optimizer, takes the step of one process on the global batch and of torch's
``ZeroRedundancyOptimizer`` under DDP -- including for the parameters torch's optimizers skip.

Five small models, each on 2 and 4 gloo ranks, stages 1 and 2 (stage 2 in several buckets), with
SGD + momentum + weight decay and with AdamW, an LR scheduler editing ``param_groups`` every step:
an MLP given as a list of tensors; a tied weight (one tensor used twice in forward); a frozen
parameter (``requires_grad=False``, still handed to the optimizer); a branch only even steps use
(a parameter with *no* gradient on odd steps: it must not move by one bit -- no weight decay, no
momentum -- and later steps see AdamW's per-tensor step count of one process); parameter groups
with their own lr and weight decay. References: the same optimizer in one process on the whole
batch (one thread, like a rank), and ``ZeroRedundancyOptimizer`` around DDP with
``find_unused_parameters`` (which leaves a gradient None when no rank produced one).

Also: the consolidated ``state_dict()`` equals one process's, and round-trips (save after 2 steps,
a fresh model and optimizer load it, 2 more steps == 4 uninterrupted, bit for bit), and one process's
state dict loads into it; the mechanism -- reduce-scatter + all-gather bytes ==
``costmodel.zero_comm_bytes`` of the padded buffer plus one byte per tensor for the "who has a
gradient" mask, per-element optimizer state per rank == ``costmodel.adam_state_bytes`` of the ~1/n
elements it owns; ``step(closure)``; offload; and bad input named with its fix.

One launch per world size runs every case; the tests inspect what it returns.

Tolerances (derived in tests/_support.py). The training comparisons run in float64 (``float64()``
around those cases and the one-process runs). Averaged gradients are the global batch's reduced in
another order: reductions of at most N = B·D = 48 terms (the loss's mean; a weight gradient sums B = 8
rows, a layer's dot product H = 10), DEPTH = 2·4 + 2 chained (a, b, c and the loss forward, as many
backward): ``model_bound(n=48, depth=10, scale=max(1, |g|))`` ≈ 1.1e-10 (|g| the largest gradient the
one-process run saw). The weights after s steps: ``sgd_bound`` (lr 0.05, momentum 0.9: ≈ s·5.5e-11)
or ``adam_bound`` (lr 1e-2, the largest of any group; the schedule only lowers it; eps 1e-6:
s·lr·grad_err/eps ≈ s·1.1e-6); before the first step, bitwise (rank 0's weights, broadcast). AdamW's
moments within the gradients' bound (exp_avg) and 2·|g|·that (exp_avg_sq); step counts exactly. A
wrong implementation is far outside: an unaveraged gradient, a piece updated from the wrong elements,
weight decay or momentum applied to a parameter without a gradient move the weights by lr·|Δg| ≳ 1e-3
(SGD) or ~lr = 1e-2 a step (AdamW).

The metered step (bytes and state per rank) and the refusals are cases of their own in float32, the
dtype of the chapter's byte formulas. Offload steps the shard through ``OffloadedOptimizer``, whose host
master is float32 whatever the model's dtype: that run stays in float32 and equals the same optimizer
without offload, on the same ranks, bit for bit (the same elementwise AdamW on the same pieces).
"""
import contextlib
import functools

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.zero.sharded_optimizer import ShardedOptimizer
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import adam_bound, case, close, float64, model_bound, refusal, run_cases, sgd_bound

pytestmark = [pytest.mark.ch06, pytest.mark.timeout(120)]

D, H, B, STEPS, SEED = 6, 10, 8, 4, 3
CAP_MB = 256 / 2 ** 20  # 64 fp32 (32 float64) elements per stage-2 bucket: several buckets
N, DEPTH = B * D, 2 * 4 + 2  # the longest reduction (the loss's mean), the chained reductions
VARIANTS = ("mlp", "tied", "frozen", "unused", "groups")
OPTIMIZERS = {"sgd": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}),
              "adamw": (torch.optim.AdamW, {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.1})}
NS, STAGES = (2, 4), (1, 2)


class Net(nn.Module):
    """An MLP; ``variant`` adds a tied weight, a frozen bias, or a side head only even steps use."""

    def __init__(self, variant="mlp"):
        super().__init__()
        self.variant = variant
        self.a, self.b, self.c = nn.Linear(D, H), nn.Linear(H, H), nn.Linear(H, D)
        self.side = nn.Linear(D, 1) if variant == "unused" else None
        if variant == "frozen":
            self.b.bias.requires_grad_(False)

    def forward(self, x, y, step):
        h = torch.tanh(self.b(torch.tanh(self.a(x))))
        out = self.c(h)
        if self.variant == "tied":
            out = out + F.linear(h, self.a.weight.t())  # a.weight used a second time
        loss = ((out - y) ** 2).mean()
        if self.side is not None and step % 2 == 0:
            loss = loss + self.side(x).mean()  # linear in the rows: its average over ranks is the global one
        return loss


def _net(variant="mlp", seed=SEED):
    torch.manual_seed(seed)
    return Net(variant)


def _params(model):
    """A list of tensors, or (the "groups" variant) two groups with their own lr and weight decay."""
    if model.variant != "groups":
        return list(model.parameters())
    named = list(model.named_parameters())
    return [{"params": [p for k, p in named if k.endswith("weight")], "weight_decay": 0.2},
            {"params": [p for k, p in named if k.endswith("bias")], "lr": 3e-3, "weight_decay": 0.0}]


def _batch(step, rows=None):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    if rows is None:
        return x, y
    r, n = rows
    return x[r * B // n:(r + 1) * B // n], y[r * B // n:(r + 1) * B // n]


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(forward, model, opt, steps, rows=None, first=0, schedule=True, grads=None):
    """Steps ``first .. first+steps-1``; the weights before and after every step (the largest
    gradient of each step appended to ``grads`` if given)."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.7 ** s) if schedule else None
    trace = [_snapshot(model)]
    for step in range(first, first + steps):
        opt.zero_grad()
        forward(*_batch(step, rows), step).backward()
        if grads is not None:
            grads.append(max(p.grad.abs().max().item() for p in model.parameters() if p.grad is not None))
        opt.step()
        if sched is not None:
            sched.step()
        trace.append(_snapshot(model))
    return trace


# --- what runs on the ranks ------------------------------------------------------------------------


def _rows():
    return dist.get_rank(), dist.get_world_size()


def _ours(variant, opt, stage, **kw):
    model = _net(variant, SEED + dist.get_rank())  # different weights per rank: the broadcast must fix that
    cls, defaults = OPTIMIZERS[opt]
    sharded = ShardedOptimizer(_params(model), cls, stage=stage, bucket_cap_mb=CAP_MB, **kw, **defaults)
    return model, sharded


def _equivalence(variant, opt, stage):
    model, sharded = _ours(variant, opt, stage)
    return _train(model, model, sharded, STEPS, _rows())


def _offload():
    """In float32 (OffloadedOptimizer's master is float32): offloaded, and the same run in memory."""
    model, sharded = _ours("unused", "adamw", 2)
    out = {"memory": _train(model, model, sharded, STEPS, _rows())}
    model, sharded = _ours("unused", "adamw", 2, offload="cpu")
    out["offload"] = _train(model, model, sharded, STEPS, _rows())
    sharded.close()
    return out


def _zero_redundancy():
    """torch's ZeroRedundancyOptimizer around DDP on the same models and rows."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    out = {}
    for variant in VARIANTS:
        for opt in OPTIMIZERS:
            model = _net(variant)
            ddp = nn.parallel.DistributedDataParallel(model, find_unused_parameters=variant == "unused")
            cls, defaults = OPTIMIZERS[opt]
            zro = ZeroRedundancyOptimizer(_params(model), optimizer_class=cls, **defaults)
            out[variant, opt] = _train(ddp, model, zro, STEPS, _rows())[-1]
    return out


def _round_trip(single):
    """Save after 2 steps, load into a fresh model and optimizer, 2 more; and continue one process's."""
    out = {}
    for stage in STAGES:
        model, sharded = _ours("unused", "adamw", stage)
        _train(model, model, sharded, 2, _rows(), schedule=False)
        saved, weights = sharded.state_dict(), _snapshot(model)
        whole = _train(model, model, sharded, 2, _rows(), first=2, schedule=False)[-1]
        fresh, again = _ours("unused", "adamw", stage)
        fresh.load_state_dict(weights)
        again.load_state_dict(saved)
        resumed = _train(fresh, fresh, again, 2, _rows(), first=2, schedule=False)[-1]
        other, from_single = _ours("unused", "adamw", stage)
        other.load_state_dict(single["weights"])
        from_single.load_state_dict(single["state"])
        continued = _train(other, other, from_single, 2, _rows(), first=2, schedule=False)[-1]
        out[stage] = {"saved": saved, "whole": whole, "resumed": resumed, "continued": continued}
    return out


def _closure():
    """``step(closure)``, torch's form: the closure zeroes, runs forward and backward, returns the loss."""
    model, sharded = _ours("tied", "sgd", 2)
    trace, losses = [_snapshot(model)], []
    for step in range(STEPS):
        def closure(step=step):
            sharded.zero_grad()
            loss = model(*_batch(step, _rows()), step)
            loss.backward()
            return loss
        losses.append(sharded.step(closure).item())
        trace.append(_snapshot(model))
    sharded.close()
    return {"trace": trace, "losses": losses}


def _mechanism():
    """One metered AdamW step on the MLP after a warm-up step: the collectives, and the state."""
    out = {}
    for stage in STAGES:
        model, sharded = _ours("mlp", "adamw", stage)
        _train(model, model, sharded, 1, _rows(), schedule=False)
        meter = MemoryMeter(model, sharded)
        with comm.meter() as m:
            sharded.zero_grad()
            model(*_batch(1, _rows()), 1).backward()
            after_backward = meter.current()
            sharded.step()
        states = [s for s in sharded.state.values()]
        out[stage] = {"events": [(e.op, e.nbytes, e.wire_bytes) for e in m.events],
                      "buckets": len(sharded.buckets),
                      "elementwise": sum(t.numel() * t.element_size() for s in states for t in s.values()
                                         if t.dim() == 1),
                      "steps": sum(s["step"].numel() * s["step"].element_size() for s in states),
                      "grads_after_backward": after_backward["gradients"], "meter": meter.current()}
    return out


def _no_sync():
    """Stage 2, two half-batches each: reduced in each backward, or accumulated under ``no_sync()`` and
    reduce-scattered once by ``reduce_accumulated()``: the same step, half the reduce-scatters."""
    out = {}
    for pause in (False, True):
        model, sharded = _ours("mlp", "sgd", 2)
        x, y = _batch(0, _rows())
        with comm.meter() as m:
            sharded.zero_grad()
            with sharded.no_sync() if pause else contextlib.nullcontext():
                for half in range(2):
                    rows = slice(half * len(x) // 2, (half + 1) * len(x) // 2)
                    (model(x[rows], y[rows], 1) / 2).backward()
                inside = sum(e.op == "reduce_scatter" for e in m.events)
            sharded.reduce_accumulated()
            sharded.step()
        out[pause] = {"inside": inside, "rs": sum(e.op == "reduce_scatter" for e in m.events),
                      "buckets": len(sharded.buckets), "weights": _snapshot(model)}
        sharded.close()
    return out


def _errors():
    """Each refusal's message; only the expected exception type is caught (another fails the case)."""
    mixed = _net("mlp")
    mixed.c.double()
    sgd = torch.optim.SGD
    ok = ShardedOptimizer(list(_net("mlp").parameters()), sgd, lr=0.1)
    w = nn.Parameter(torch.zeros(3))
    return {"dtype": refusal(lambda: ShardedOptimizer(mixed.parameters(), sgd, lr=0.1)),
            "stage3": refusal(lambda: ShardedOptimizer(_net().parameters(), sgd, stage=3, lr=0.1)),
            "stage_str": refusal(lambda: ShardedOptimizer(_net().parameters(), sgd, stage="1", lr=0.1)),
            "add_group": refusal(lambda: ok.add_param_group({"params": [w]}), NotImplementedError),
            "twice": refusal(lambda: ShardedOptimizer([{"params": [w, w]}], sgd, lr=0.1)),
            "cls": refusal(lambda: ShardedOptimizer([w], "sgd", lr=0.1), TypeError),
            "offload": refusal(lambda: ShardedOptimizer([w], sgd, offload="gpu", lr=0.1))}


def _everything(single):
    with float64():
        out = run_cases({**{("eq", variant, opt, stage): functools.partial(_equivalence, variant, opt, stage)
                            for variant in VARIANTS for opt in OPTIMIZERS for stage in STAGES},
                         "zro": _zero_redundancy, "trip": functools.partial(_round_trip, single),
                         "closure": _closure, "no_sync": _no_sync})
    # float32: the chapter's byte formulas (the metered step), OffloadedOptimizer's float32 master
    return {**out, **run_cases({"mech": _mechanism, "errors": _errors, "offload": _offload})}


@functools.cache
def _results(n):
    return launch(_everything, n, _single_process_checkpoint(), timeout_s=100)


def _case(n, name):
    """Each rank's value of case ``name`` on n ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(n))]


# --- one process ----------------------------------------------------------------------------------


def _grad_err(gmax):
    """The gradients, reductions reordered: see the module docstring."""
    return model_bound(n=N, depth=DEPTH, scale=max(1.0, gmax))


def _weight_bound(opt, steps, gmax):
    """Weights after ``steps`` steps on gradients (at most ``gmax``) within ``_grad_err``; 0 before any
    (rank 0's weights, broadcast, bit for bit)."""
    kw = OPTIMIZERS[opt][1]  # its lr: the largest of any group; the schedule only lowers it
    if opt == "sgd":
        return sgd_bound(steps=steps, lr=kw["lr"], grad_err=_grad_err(gmax), momentum=kw["momentum"])
    return adam_bound(steps=steps, lr=kw["lr"], grad_err=_grad_err(gmax), eps=kw["eps"])


def _close_weights(got, want, bound, where):
    assert got.keys() == want.keys(), where
    for k in want:
        close(got[k], want[k], bound, f"{where}: {k}")


def _close_trace(got, ref, opt, where):
    """Each step's weights (``got``, a trace) within the bound of that many steps of the reference run."""
    assert len(got) == len(ref["trace"]), where
    for step, (mine, theirs) in enumerate(zip(got, ref["trace"], strict=True)):
        _close_weights(mine, theirs, _weight_bound(opt, step, ref["gmax"]), f"{where} step {step}")


@functools.cache
def _single(variant, opt, schedule=True):
    """One process on the whole batch: its trace, and its largest gradient (the bounds' scale)."""
    with float64(), single_thread():
        model, grads = _net(variant), []
        cls, defaults = OPTIMIZERS[opt]
        o = cls(_params(model), **defaults)
        trace = _train(model, model, o, STEPS, schedule=schedule, grads=grads)
        return {"trace": trace, "gmax": max(grads)}


@functools.cache
def _single_process_checkpoint():
    """AdamW on "unused" in one process after 2 steps: its weights and (torch's) state dict."""
    with float64(), single_thread():
        model = _net("unused")
        o = torch.optim.AdamW(_params(model), **OPTIMIZERS["adamw"][1])
        _train(model, model, o, 2, schedule=False)
        return {"weights": _snapshot(model), "state": o.state_dict()}


# --- the tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("variant", VARIANTS)
def test_equals_one_process_and_zero_redundancy_optimizer(n, variant):
    for opt in OPTIMIZERS:
        ref = _single(variant, opt)
        for r, zro in enumerate(_case(n, "zro")):
            for stage in STAGES:
                got = _case(n, ("eq", variant, opt, stage))[r]
                _close_trace(got, ref, opt, f"rank {r} {opt} stage {stage}")
                _close_weights(got[-1], zro[variant, opt], _weight_bound(opt, STEPS, ref["gmax"]),
                               f"rank {r} {opt} stage {stage} vs ZeRO-R")


@pytest.mark.parametrize("n", NS)
def test_step_with_a_closure(n):
    ref = _single("tied", "sgd", schedule=False)
    runs = _case(n, "closure")
    losses = torch.tensor([run["losses"] for run in runs], dtype=torch.float64).mean(0)  # -> the global mean
    with float64(), single_thread():
        first = _net("tied")(*_batch(0), 0).item()  # the global batch's loss before any step
    assert abs(losses[0].item() - first) <= model_bound(n=N, depth=DEPTH, scale=max(1.0, abs(first)))
    for r, run in enumerate(runs):
        _close_trace(run["trace"], ref, "sgd", f"closure, rank {r}")


@pytest.mark.parametrize("n", NS)
def test_parameter_without_gradient_does_not_move_a_bit(n):
    """Odd steps give the side head no gradient: its weights are bitwise those of the step before
    (AdamW's decoupled decay and SGD's momentum would move them); even steps move them. The frozen
    bias never moves."""
    for r in range(n):
        for opt in OPTIMIZERS:
            for stage in STAGES:
                trace = _case(n, ("eq", "unused", opt, stage))[r]
                for step in range(STEPS):
                    for name in ("side.weight", "side.bias"):
                        moved = not torch.equal(trace[step + 1][name], trace[step][name])
                        assert moved == (step % 2 == 0), (opt, stage, step, name)
                frozen = _case(n, ("eq", "frozen", opt, stage))[r]
                assert all(torch.equal(t["b.bias"], frozen[0]["b.bias"]) for t in frozen)
                assert not torch.equal(frozen[-1]["b.weight"], frozen[0]["b.weight"])


@pytest.mark.parametrize("n", NS)
def test_offloaded_step_equals_one_process(n):
    """Offloaded (float32, OffloadedOptimizer's master dtype) == the same run in memory, bit for bit;
    which equals one process (test_equals_one_process_and_zero_redundancy_optimizer, in float64)."""
    for r, run in enumerate(_case(n, "offload")):
        assert len(run["offload"]) == STEPS + 1
        for step, (off, mem) in enumerate(zip(run["offload"], run["memory"], strict=True)):
            torch.testing.assert_close(off, mem, atol=0, rtol=0,
                                       msg=lambda m, r=r, step=step: f"rank {r} step {step}: {m}")


@pytest.mark.parametrize("n", NS)
def test_state_dict_is_one_process_state_dict_and_round_trips(n):
    ref_state = _single_process_checkpoint()["state"]
    ref = _single("unused", "adamw", schedule=False)
    grad_err = _grad_err(ref["gmax"])
    bounds = {"exp_avg": grad_err, "exp_avg_sq": 2 * max(1.0, ref["gmax"]) * grad_err}  # of g, of g²
    for r, res in enumerate(_results(n)):
        for stage, trip in case(res, "trip", r).items():
            # consolidated: torch's format and values (the side head has one AdamW step fewer)
            assert trip["saved"]["param_groups"] == ref_state["param_groups"]
            state = trip["saved"]["state"]
            assert state.keys() == ref_state["state"].keys()
            for i, want in ref_state["state"].items():
                assert state[i].keys() == want.keys()
                assert torch.equal(state[i]["step"], want["step"]), i  # a count
                for k in ("exp_avg", "exp_avg_sq"):
                    close(state[i][k], want[k], bounds[k], f"rank {r} stage {stage} state {i} {k}")
            assert state[6]["step"].item() == 1 and state[0]["step"].item() == 2  # side.weight, a.weight
            # save, load into a fresh model and optimizer, go on: the uninterrupted run, bit for bit
            torch.testing.assert_close(trip["resumed"], trip["whole"], atol=0, rtol=0)
            # one process's state dict loads too, and the run goes on as that process's
            _close_weights(trip["continued"], ref["trace"][-1], _weight_bound("adamw", STEPS, ref["gmax"]),
                           f"rank {r} stage {stage}")


@pytest.mark.parametrize("n", NS)
def test_no_sync_accumulates_then_reduces_once(n):
    """Gradient accumulation under stage 2 (the 3D model's pipeline uses it): nothing is reduced inside
    ``no_sync()``; ``reduce_accumulated()`` reduce-scatters every bucket once; the step is the same
    (one SGD step on gradients summed in another order)."""
    bound = _weight_bound("sgd", 1, _single("mlp", "sgd")["gmax"])
    for each, once in (((run[False], run[True])) for run in _case(n, "no_sync")):
        assert each["inside"] == each["rs"] == 2 * each["buckets"]
        assert once["inside"] == 0 and once["rs"] == once["buckets"] > 1
        _close_weights(once["weights"], each["weights"], bound, "no_sync")


@pytest.mark.parametrize("n", NS)
def test_bytes_on_the_wire_and_state_per_rank(n):
    """§7.2: one reduce-scatter + one all-gather of the padded flat buffer (stage 2: in k buckets,
    reduce-scattered during backward) == ``zero_comm_bytes``, plus the P-byte "has a gradient" mask;
    §5.1: each rank keeps exp_avg and exp_avg_sq of the Psi_r = ceil((Psi - r) / n) elements it owns,
    and one 4-byte ``step`` per tensor (not divided by n, as in one process)."""
    shapes = [p.shape for p in _net("mlp").parameters()]
    psi, tensors = sum(s.numel() for s in shapes), len(shapes)
    psi_p = n * -(-psi // n)
    for r, per_stage in enumerate(_case(n, "mech")):
        for stage, mech in per_stage.items():
            ev = mech["events"]
            rs = [e for e in ev if e[0] == "reduce_scatter"]
            ag = [e for e in ev if e[0] == "all_gather"]
            assert [e[:2] for e in ev if e[0] == "all_reduce"] == [("all_reduce", tensors)]  # 1 byte a tensor
            assert len(rs) == len(ag) == (mech["buckets"] if stage == 2 else 1)
            assert len(ev) == len(rs) + len(ag) + 1
            assert (mech["buckets"] > 2) == (stage == 2)
            assert sum(e[1] for e in rs) == sum(e[1] for e in ag) == 4 * psi_p
            wire = sum(e[2] for e in rs + ag)
            # formula against a sum of a few events' float64 bytes: k·u << rel
            assert wire == pytest.approx(costmodel.zero_comm_bytes(psi_p, n, stage, bytes_per_element=4),
                                         rel=1e-12)
            own = -(-(psi - r) // n)
            assert mech["elementwise"] == costmodel.adam_state_bytes([(own,)])
            assert mech["elementwise"] <= costmodel.adam_state_bytes(shapes) / n + 8  # ~1/n of one process's
            assert mech["steps"] == 4 * tensors
            assert mech["meter"]["optimizer_state"] == mech["elementwise"] + mech["steps"]
            # stage 2 holds only its gradient shard after backward (4 S), stage 1 the whole flat gradient
            assert mech["grads_after_backward"] == (4 * psi_p // n if stage == 2 else 4 * psi_p)
        total = sum(per_rank[1]["elementwise"] for per_rank in _case(n, "mech"))
        assert total == costmodel.adam_state_bytes(shapes)  # the ranks' shards add up to one process's state


@pytest.mark.parametrize("n", NS)
def test_bad_input_names_the_fix(n):
    err = _case(n, "errors")[0]  # ValueError unless named: another type would have failed the case
    assert "one dtype" in err["dtype"] and "model.float()" in err["dtype"]
    assert "fully_shard" in err["stage3"]
    assert "'1'" in err["stage_str"]
    assert "constructor" in err["add_group"]  # NotImplementedError
    assert "once" in err["twice"]
    assert "optimizer_cls" in err["cls"]  # TypeError
    assert "offload" in err["offload"]


def test_needs_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="ShardedOptimizer needs an initialised process group.*launch"):
        ShardedOptimizer(_net().parameters(), torch.optim.SGD, lr=0.1)
