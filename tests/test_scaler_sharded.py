"""Chapter 08 with chapter 06: the dynamic loss scaler (``memory/mixed_precision.py``) on the sharded
optimizers. With ``ShardedOptimizer`` at stages 1 and 2 and with ``fully_shard`` it must unscale the
gradients where they live (stage 2: the flat gradient shard; ``p.grad`` is None there) and agree on
the found-inf flag over the group, so that an inf in one rank's shard skips the step on every rank,
halves the scale everywhere alike, and leaves the weights those of one process.

The model is a two-layer MLP, Psi = 5·8+8 + 8·3+3 = 75 (odd: the flat buffers are padded at n = 2 and
4), trained STEPS = 6 SGD steps (momentum 0.9) on a global batch of B = 8 rows (rank r feeds rows
[rB/n, (r+1)B/n)) with the scaler at S = 2^10 growing every 2 clean steps. On step 2 rank 1 writes an
inf into its own gradient shard after backward, on step 4 rank 0 a NaN: where each rank's gradients
live (stage 1: its local gradient, at an element it owns; stage 2: ``partition.shard.grad``;
``fully_shard``: its piece of a sharded parameter's ``.grad``; torch's FSDP2: the local tensor of
the DTensor gradient). Plain DDP cannot put an inf in one rank's gradient alone -- its all-reduce in
backward carries it to all -- so there the inf goes into rank 1's targets and backward makes it.

The references, in one process on the whole batch: our scaler and ``torch.amp.GradScaler`` (the same
operations: equal bit for bit), the bad steps' inf written into a gradient. Against them: ours at
stages 1 and 2 and with ``fully_shard``, torch's FSDP2 ``fully_shard`` with ``ShardedGradScaler``, and
DDP with our scaler, at n = 2 and 4 (gloo, CPU).

Tolerances (tests/_support.py). The scale is a power of two, so scaling and unscaling are exact and
the scale trajectory is compared with ``==``. The weights run in float64 and differ from one process
only by the order of the gradient's sums (each rank sums its rows, the reduction sums the ranks):
reductions of at most N = B·3 = 24 terms (the mean squared error), DEPTH = 6 chained (two matmuls and
the loss forward; the loss, the two weight gradients and the hidden gradient backward), so each step's
gradient is within ``model_bound(n=24, depth=6, scale=max(1, |g|))`` and the weights after 6 steps
within ``sgd_bound`` of that (about 2e-10). Wrong implementations are far outside: a gradient left
scaled moves SGD by lr·1023·|g| a step, an inf stepped on by one rank makes its weights inf or NaN, and
ranks that disagree run different collectives and time out.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist.memory.mixed_precision import DynamicLossScaler
from minitorch_dist.memory.zero import ShardedOptimizer, full_state_dict, fully_shard
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import case, close_after_sgd, float64, run_cases

pytestmark = [pytest.mark.ch08, pytest.mark.ch06, pytest.mark.timeout(300)]

IN, HID, OUT = 5, 8, 3  # Psi = 75
B, STEPS, SEED = 8, 6, 0
LR, MOMENTUM = 0.1, 0.9
SCALER = {"init_scale": 2.0 ** 10, "growth_interval": 2}
BAD = {2: (math.inf, 1), 4: (math.nan, 0)}  # step -> (the value written, the rank that writes it)
N, DEPTH = B * OUT, 6
CAP_MB = 16 * 8 / 2 ** 20  # stage-2 buckets of 16 float64 elements: several per backward
FLAG = ("all_reduce", str(torch.uint8), (1,))  # the scaler's found-inf flag, as the comm meter sees it
SHARDED = ["stage1", "stage2", "fsdp"]
NS = [2, 4]


def _model():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, OUT))


def _batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(B, IN, generator=g), torch.randn(B, OUT, generator=g)


def _rank_and_size():
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _train(model, opt, scaler, inject=None, gmax=None):
    """STEPS steps on this rank's rows. On a bad step its rank calls ``inject(value)`` between backward
    and ``scaler.step`` (``inject=None``: the value goes into its targets, and backward makes the inf).
    Returns the scale before the first step and after each, and every step's collectives inside
    ``scaler.step`` (op, dtype, shape). ``gmax``: a list to append each step's largest finite
    gradient to (after unscaling)."""
    r, n = _rank_and_size()
    lo, hi = r * B // n, (r + 1) * B // n
    scales, events = [scaler.get_scale()], []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(step)
        x, y = x[lo:hi], y[lo:hi].clone()
        value, bad_rank = BAD.get(step, (None, None))
        hit = value is not None and r == bad_rank % n
        if hit and inject is None:
            y[0, 0] = value
        scaler.scale(F.mse_loss(model(x), y)).backward()
        if hit and inject is not None:
            with torch.no_grad():
                inject(value)
        with comm.meter() as m:
            scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        events.append([(e.op, e.dtype, tuple(e.shape)) for e in m.events])
        if gmax is not None:
            finite = [p.grad[torch.isfinite(p.grad)] for p in model.parameters() if p.grad is not None]
            gmax.append(max(float(g.abs().max()) for g in finite if g.numel()))
    return {"scales": scales, "events": events}


def _poison(grads, value) -> None:
    """Write ``value`` into this rank's first non-empty gradient (a flat view: it lands there)."""
    next(g.view(-1) for g in grads if g is not None and g.numel())[0] = value


# --- what runs on the ranks ------------------------------------------------------------------------


def _zero(stage):
    model = _model()
    opt = ShardedOptimizer(model.parameters(), torch.optim.SGD, stage=stage, lr=LR, momentum=MOMENTUM,
                           bucket_cap_mb=CAP_MB)
    r = dist.get_rank()

    def inject(value):
        if stage == 1:  # the local gradient, at the element of the flat buffer this rank owns (r::n)
            model[0].weight.grad.view(-1)[r] = value
        else:  # the reduced gradient shard: the only gradient there is at stage 2
            opt.partition.shard.grad[0] = value

    run = _train(model, opt, DynamicLossScaler(**SCALER), inject)
    return run | {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _fsdp():
    model = _model()
    fully_shard(model[0])
    fully_shard(model)
    params = list(model.parameters())  # this rank's pieces of the sharded parameters
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    run = _train(model, opt, DynamicLossScaler(**SCALER), lambda v: _poison([p.grad for p in params], v))
    return run | {"params": full_state_dict(model)}


def _torch_fsdp2():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model()
    torch_fully_shard(model[0], mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    def inject(value):  # into the local shard of a DTensor gradient (to_local aliases it under no_grad)
        _poison([p.grad.to_local() if p.grad is not None else None for p in model.parameters()], value)

    run = _train(model, opt, ShardedGradScaler("cpu", **SCALER), inject)
    return run | {"params": {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}}


def _ddp():
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(_model())
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    run = _train(model, opt, DynamicLossScaler(**SCALER))  # the inf enters through rank 1's targets
    return run | {"params": {k: v.detach().clone() for k, v in model.module.state_dict().items()}}


def _run_every_case():
    with float64():
        return run_cases({"stage1": functools.partial(_zero, 1), "stage2": functools.partial(_zero, 2),
                          "fsdp": _fsdp, "torch_fsdp2": _torch_fsdp2, "ddp": _ddp})


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=120)


def _case(n, name):
    return [case(res, name, r) for r, res in enumerate(_results(n))]


# --- the single-process references -----------------------------------------------------------------


@functools.cache
def _reference(kind):
    """One process on the whole batch, with our scaler or torch's GradScaler."""
    scaler = DynamicLossScaler(**SCALER) if kind == "ours" else torch.amp.GradScaler("cpu", **SCALER)
    with float64(), single_thread():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        gmax = []
        run = _train(model, opt, scaler, lambda v: _poison([model[0].weight.grad], v), gmax)
        params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return run | {"gmax": max(gmax), "params": params}


def _expected_scales():
    """The trajectory the rules give: double after every 2 clean steps in a row, halve on a bad one."""
    s, clean, out = SCALER["init_scale"], 0, [SCALER["init_scale"]]
    for step in range(STEPS):
        if step in BAD:
            s, clean = s / 2, 0
        else:
            clean += 1
            if clean == SCALER["growth_interval"]:
                s, clean = s * 2, 0
        out.append(s)
    return out


def _close_to_reference(got, where):
    ref = _reference("ours")
    assert got["scales"] == ref["scales"], f"{where}: scales {got['scales']} vs {ref['scales']}"
    grads = [torch.tensor(ref["gmax"])]
    for k, want in ref["params"].items():
        close_after_sgd(got["params"][k], want, grads, n=N, depth=DEPTH, steps=STEPS, lr=LR,
                        momentum=MOMENTUM, where=f"{where}, {k}")


# --- the tests ---------------------------------------------------------------------------------------


def test_one_process_scaler_equals_torch_gradscaler():
    ours, theirs = _reference("ours"), _reference("torch")
    assert ours["scales"] == theirs["scales"] == _expected_scales()
    for k, v in theirs["params"].items():
        torch.testing.assert_close(ours["params"][k], v, atol=0, rtol=0)  # the same operations, in order
    assert all(torch.isfinite(v).all() for v in ours["params"].values())


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", SHARDED)
def test_inf_in_one_shard_skips_every_rank_and_equals_one_process(n, kind):
    runs = _case(n, kind)
    for r, got in enumerate(runs):
        _close_to_reference(got, f"{kind}, rank {r} of {n}")
    for r, got in enumerate(runs[1:], 1):  # the replicas stay one model
        assert got["scales"] == runs[0]["scales"]
        for k, v in runs[0]["params"].items():
            torch.testing.assert_close(got["params"][k], v, atol=0, rtol=0, msg=f"rank {r}, {k}")


@pytest.mark.parametrize("n", NS)
def test_torch_fsdp2_with_sharded_grad_scaler_agrees(n):
    for r, got in enumerate(_case(n, "torch_fsdp2")):
        _close_to_reference(got, f"torch FSDP2 + ShardedGradScaler, rank {r} of {n}")


@pytest.mark.parametrize("n", NS)
def test_ddp_needs_no_agreement_and_still_equals_one_process(n):
    for r, got in enumerate(_case(n, "ddp")):
        _close_to_reference(got, f"DDP, rank {r} of {n}")
        assert all(ev == [] for ev in got["events"]), "DDP: the scaler ran a collective of its own"


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("kind", SHARDED)
def test_found_inf_is_agreed_by_one_all_reduce_of_one_flag_per_step(n, kind):
    for r, got in enumerate(_case(n, kind)):
        for step, ev in enumerate(got["events"]):
            where = f"{kind}, rank {r} of {n}, step {step}: {ev}"
            assert ev.count(FLAG) == 1 and ev[0] == FLAG, where  # first: the verdict precedes the step
            if step in BAD:  # skipped on every rank: the optimizer ran no collective at all
                assert ev == [FLAG], where
    # and the single-process scaler talks to nobody
    assert all(ev == [] for ev in _reference("ours")["events"])
