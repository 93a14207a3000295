"""Chapter 06: ZeRO stages 0, 1 and 2 (``memory/zero/zero12.py``) train exactly like one process on the
global batch, stage 1 agrees with torch's ``ZeroRedundancyOptimizer``, and they work the way
Rajbhandari et al. 2020 say: 2Psi of communication per step at every stage (§7.2), optimizer state
divided by n at stage 1 and gradients too at stage 2 (§5.1-5.2), measured with ``MemoryMeter``.

One launch per world size runs every case and returns plain data; the tests only inspect it.
Expected values are computed here, independently of the module: the dense GPT in one process (one
thread, like a rank) on the global batch with the same optimizer, torch's ZeroRedundancyOptimizer,
byte counts from ``costmodel.transformer_params`` and the ring factors written out.

The model has Psi = 12285 parameters (odd), so the flat buffer is padded at n = 2 (1 element) and
n = 4 (3 elements): every byte count below is of the padded Psi' = n * ceil(Psi / n).

Stage 2 runs with buckets of CAP_MB (~1049 elements, rounded up to a multiple of n: k = 12 buckets at
n = 2 and 4), and once as one bucket (``bucket_cap_mb=None``, the unbucketed form) for contrast. The
buckets are recomputed here from the cap; each holds (hi - lo) / n elements of every rank, so the k
reduce-scatters (and the k all-gathers) together move exactly the Psi' of one: the wire bytes do not
change, only when they move -- during backward. Peak gradient bytes during backward, derived: the
meter (which counts ``p.grad`` and the shard's gradient, not the transient send buffers) can see at
most this rank's gradient shard (4S) plus the gradients of the parameters overlapping one bucket,
``4 (S + B)`` with B the largest such set, rounded out to whole parameters; stages 0/1 hold 4Psi'.

Memory formula. Training is fp32, so the per-rank model states are written from first principles (§5.1 with
4-byte params and grads, K = 8 for AdamW's exp_avg + exp_avg_sq): stage 0: 4Psi' + 4Psi' + 8Psi, stage 1:
4Psi' + 4Psi' + 8Psi_r, stage 2: 4Psi' + 4S + 8Psi_r, where Psi_r = ceil((Psi - r) / n) <= S are the elements
rank r owns (the padding has no optimizer state), plus 4 bytes per tensor for AdamW's per-tensor ``step``
(P = 28 tensors, as in one process), and checked against ``costmodel.zero_memory_bytes(..., k=8,
param_bytes=4, grad_bytes=4)``. Besides the 2Psi' of §7.2 every step all-reduces one byte per tensor:
which tensors got a gradient on some rank (a tensor with none is left untouched, as in one process).

Tolerances (derived in tests/_support.py). The training comparisons run in float64 (``float64()``
around those cases and the reference): averaged gradients are the global batch's reduced in another
order, reductions of at most N = B·T = 128 terms (a weight gradient sums B·T rows; c_proj sums 4·21,
the logits 37), GPT_DEPTH = 6·2 + 2 = 14 chained: ``model_bound(n=128, depth=14, scale=max(1, |g|))``
≈ 4.1e-10 (|g| the largest gradient the one-process run saw). After k = 5 steps the weights are within
``sgd_bound`` (lr 0.1, momentum 0.9: ≈ 2e-9) or ``adam_bound`` (lr 1e-3, eps 1e-6: k·lr·grad_err/eps
≈ 2e-6); AdamW's moments within the gradients' bound (exp_avg, an average of gradients) and 2·|g|·that
(exp_avg_sq, of their squares); its step counts exactly; step s's loss within its own reductions'
``model_bound`` plus ``‖g‖₁ · (the weights' bound after s steps)``. A wrong implementation is far
outside: an unaveraged gradient or a shard updated from the wrong elements moves SGD's weights by
lr·|Δg| ≳ 1e-3 and AdamW's by ~lr = 1e-3 a step; a lost moment update changes exp_avg by (1-β1)·|g|.

The metered step (the memory and communication tests) is a case of its own and stays in float32, the
dtype of the chapter's byte formulas; it compares no values. Offload steps the shard through
``OffloadedOptimizer``, whose host master is float32 whatever the model's dtype: its runs stay in float32
and must equal the same stage without offload on the same ranks *bit for bit* (the same reduce-scatter,
the same elementwise AdamW on the same pieces; copies are exact), which the float64 runs tie to one process.
"""
import functools
import math
import tempfile

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.zero.zero12 import ZeroDataParallel
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import adam_bound, case, close, float64, model_bound, refusal, run_cases, sgd_bound

pytestmark = pytest.mark.ch06

CFG = GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=3, n_embd=21)  # Psi = 12285, odd
B, T, STEPS, SEED = 8, 16, 5, 100  # rank r initialises with SEED + r: the broadcast must fix that
N, GPT_DEPTH = B * T, 6 * CFG.n_layer + 2  # the longest reduction (B·T rows), the chained reductions
SIDE_STEPS = 4
CAP_MB = 0.004  # 4194 bytes: ~1049 fp32 elements per stage-2 bucket (the metered step is float32)
CASES = {0: (0, {}), 1: (1, {}), 2: (2, {"bucket_cap_mb": CAP_MB}),
         "2, one bucket": (2, {"bucket_cap_mb": None})}
LR, ADAM_EPS, MOMENTUM = {"sgd": 0.1, "adamw": 1e-3}, 1e-6, 0.9
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR["sgd"], momentum=MOMENTUM),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR["adamw"], eps=ADAM_EPS, weight_decay=0.1),
}


def _train(zero, steps=STEPS):
    data, losses = MarkovCorpus(CFG.vocab_size, seed=0), []
    for step in range(steps):
        zero.zero_grad()
        x, y = data.batch(step, B, T, dist.get_rank(), dist.get_world_size())
        _, loss = zero(x, y)
        loss.backward()
        zero.step()
        losses.append(loss.item())
    return losses


def _model():
    torch.manual_seed(SEED + dist.get_rank())
    return GPT(CFG)


# --- what runs on the ranks ------------------------------------------------------------------------


def _equivalence(opt, name):
    stage, kw = CASES[name]
    zero = ZeroDataParallel(_model(), OPTIMIZERS[opt], stage, **kw)
    losses = _train(zero)
    full = zero.full_state_dict(optimizer=True)["optimizer"] if opt == "adamw" else None
    return {"losses": losses, "state": zero.full_state_dict(), "full": full}


def _offload():
    """In float32 (OffloadedOptimizer's master is float32): each stage offloaded to cpu and disk, and
    the same stage in memory."""
    out = {}
    for stage in (1, 2):
        zero = ZeroDataParallel(_model(), OPTIMIZERS["adamw"], stage, bucket_cap_mb=CAP_MB)
        _train(zero)
        out["memory", stage] = zero.full_state_dict(optimizer=True)
    for where in ("cpu", "disk"):
        for stage in (1, 2):
            with tempfile.TemporaryDirectory() as d:
                zero = ZeroDataParallel(_model(), OPTIMIZERS["adamw"], stage, offload=where,
                                        offload_dir=d if where == "disk" else None, bucket_cap_mb=CAP_MB)
                _train(zero)
                out[where, stage] = zero.full_state_dict(optimizer=True)
                zero.close()
    return out


def _torch_zero_redundancy():
    """torch's ZeRO-1 around AdamW on the same model and data; gradients averaged by hand."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(SEED)  # every rank starts from the weights rank 0 broadcasts in ours
    model, data, n = GPT(CFG), MarkovCorpus(CFG.vocab_size, seed=0), dist.get_world_size()
    opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                  lr=1e-3, eps=1e-6, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        x, y = data.batch(step, B, T, dist.get_rank(), n)
        model(x, y)[1].backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(n)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _mechanism():
    """One AdamW step per case after a warm-up step: the collectives of backward + step, how many
    reduce-scatters had been issued as each gradient was produced, and the model-state bytes the
    meter sees inside the optimizer step and at its peak over forward + backward + step."""
    out = {}
    for name, (stage, kw) in CASES.items():
        zero = ZeroDataParallel(_model(), OPTIMIZERS["adamw"], stage, **kw)
        _train(zero, steps=1)  # the optimizer state exists from here on
        live, seen = {}, []  # at each gradient's arrival: reduce-scatters issued so far in this backward
        for p in zero.flat.params:  # registered after the module's hooks, so they run after them
            p.register_post_accumulate_grad_hook(lambda _p, live=live, seen=seen:
                                                 seen.append(live["m"].calls["reduce_scatter"])
                                                 if "m" in live else None)
        meter, at_step = MemoryMeter(zero, zero.optimizer), {}
        zero.optimizer.register_step_post_hook(
            lambda *_, at_step=at_step, meter=meter: at_step.update(meter.current()))
        x, y = MarkovCorpus(CFG.vocab_size, seed=0).batch(1, B, T, dist.get_rank(), dist.get_world_size())
        with meter.track():
            zero.zero_grad()
            with comm.meter() as fwd:
                _, loss = zero(x, y)
            with comm.meter() as m:
                live["m"] = m
                loss.backward()
                after_backward = {"calls": dict(m.calls), "peak": dict(meter.peak)}
                zero.step()
        out[name] = {"fwd_calls": sum(fwd.calls.values()), "after_backward": after_backward, "seen": seen,
                     "events": [(e.op, e.nbytes, e.wire_bytes) for e in m.events],
                     "wire": m.total_wire_bytes, "at_step": at_step, "peak": dict(meter.peak),
                     "padding": zero.flat.padding, "buckets": zero.buckets}
    return out


def _errors():
    cases = {"stage": lambda: ZeroDataParallel(GPT(CFG), OPTIMIZERS["sgd"], 3),
             "empty": lambda: ZeroDataParallel(nn.Sequential(nn.ReLU()), OPTIMIZERS["sgd"], 1),
             "offload": lambda: ZeroDataParallel(GPT(CFG), OPTIMIZERS["sgd"], 1, offload="gpu"),
             "bucket": lambda: ZeroDataParallel(GPT(CFG), OPTIMIZERS["sgd"], 2, bucket_cap_mb=0)}
    return {name: refusal(call) for name, call in cases.items()}


class _SideHead(nn.Module):
    """The GPT plus a side head that only even steps use: on odd steps it gets no gradient at all. Its
    input is the rank's mean logit, so its gradient averaged over ranks is the global batch's."""

    def __init__(self):
        super().__init__()
        self.gpt, self.side, self.use_side = GPT(CFG), nn.Linear(CFG.vocab_size, 1), True

    def forward(self, x, y):
        logits, loss = self.gpt(x, y)
        if self.use_side:
            loss = loss + self.side(logits.detach().mean(dim=(0, 1))).sum()
        return logits, loss


def _train_side(model, opt, rows=None, grads=None):
    """SIDE_STEPS AdamW steps, the side head used on even steps; its weights before and after each step
    (the gradients' sizes appended to ``grads`` if given)."""
    data, side = MarkovCorpus(CFG.vocab_size, seed=0), [model.side.weight.detach().clone()]
    for step in range(SIDE_STEPS):
        model.use_side = step % 2 == 0
        opt.zero_grad()
        x, y = data.batch(step, B, T, *(rows or ()))
        model(x, y)[1].backward()
        if grads is not None:
            grads.append(_grad_sizes(model))
        opt.step()
        side.append(model.side.weight.detach().clone())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "side": side}


def _unused_branch():
    out = {}
    for name, (stage, kw) in CASES.items():
        torch.manual_seed(SEED + dist.get_rank())
        model = _SideHead()
        zero = ZeroDataParallel(model, OPTIMIZERS["adamw"], stage, **kw)
        out[name] = _train_side(model, zero, (dist.get_rank(), dist.get_world_size()))
    return out


def _run_every_case():
    with float64():
        out = run_cases({**{("eq", opt, name): functools.partial(_equivalence, opt, name)
                            for opt in OPTIMIZERS for name in CASES},
                         "torch": _torch_zero_redundancy, "errors": _errors, "unused": _unused_branch})
    # float32: the chapter's byte formulas (the metered step), OffloadedOptimizer's float32 master
    return {**out, **run_cases({"mech": _mechanism, "offload": _offload})}


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=120)


def _case(n, name):
    """Each rank's value of case ``name`` on n ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(n))]


# --- the single-process reference ------------------------------------------------------------------


def _grad_sizes(model):
    """After a backward: the largest gradient and the gradients' 1-norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return max(g.abs().max().item() for g in grads), sum(g.abs().sum().item() for g in grads)


def _weight_bound(opt, steps, gmax):
    """Weights after ``steps`` steps on gradients (at most ``gmax``) within ``model_bound``."""
    grad_err = model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, gmax))
    if opt == "sgd":
        return sgd_bound(steps=steps, lr=LR["sgd"], grad_err=grad_err, momentum=MOMENTUM)
    return adam_bound(steps=steps, lr=LR["adamw"], grad_err=grad_err, eps=ADAM_EPS)


def _bounds(opt, losses, grads):
    """On the weights after the run; on each step's loss (its reductions reordered, plus the weights'
    error by then through the gradient, |Δloss| <= ‖g‖₁ · max|Δw| to first order); on AdamW's moments."""
    gmax = max(g for g, _ in grads)
    grad_err = model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, gmax))
    return {"bound": _weight_bound(opt, len(grads), gmax),
            "loss_bounds": [model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, abs(loss)))
                            + g1 * _weight_bound(opt, s, gmax)
                            for s, (loss, (_, g1)) in enumerate(zip(losses, grads, strict=True))],
            "exp_avg": grad_err, "exp_avg_sq": 2 * max(1.0, gmax) * grad_err}


@functools.cache
def _dense(opt):
    """The GPT of rank 0's seed in one process on the whole batch: losses, weights, optimizer state."""
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model, data, losses, grads = GPT(CFG), MarkovCorpus(CFG.vocab_size, seed=0), [], []
        o = OPTIMIZERS[opt](list(model.parameters()))
        for step in range(STEPS):
            o.zero_grad()
            x, y = data.batch(step, B, T)
            _, loss = model(x, y)
            loss.backward()
            grads.append(_grad_sizes(model))
            o.step()
            losses.append(loss.item())
        state = {name: {k: v.clone() for k, v in o.state[p].items()} for name, p in model.named_parameters()}
        return {"losses": losses, "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
                "opt": state, **_bounds(opt, losses, grads)}


def _close_state(got, want, bound, where):
    assert got.keys() == want.keys(), where
    for k in want:
        close(got[k], want[k], bound, f"{where}: {k}")


def _padded(n):
    psi = costmodel.transformer_params(CFG)
    return n * -(-psi // n), -(-psi // n)  # Psi' = n * S, S = ceil(Psi / n)


def _buckets(n, cap_mb=CAP_MB):
    """Stage 2's [lo, hi) buckets: ceil(cap / 4 bytes) elements rounded up to a multiple of n."""
    psi_p, _ = _padded(n)
    size = n * -(-math.ceil(cap_mb * 2 ** 20 / 4) // n)
    return [(lo, min(lo + size, psi_p)) for lo in range(0, psi_p, size)]


def _largest_bucket_in_params(n):
    """B: the most elements of whole parameters that overlap one bucket (a tied weight once)."""
    torch.manual_seed(0)
    spans, off = [], 0
    for p in GPT(CFG).parameters():
        spans.append((off, off + p.numel()))
        off += p.numel()
    return max(sum(z - a for a, z in spans if a < hi and lo < z) for lo, hi in _buckets(n))


# --- the tests ---------------------------------------------------------------------------------------

NS = [2, 4]


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("stage", list(CASES))
def test_stage_equals_single_process(n, opt, stage):
    ref = _dense(opt)
    runs = _case(n, ("eq", opt, stage))
    for r, got in enumerate(runs):
        _close_state(got["state"], ref["state"], ref["bound"], f"rank {r}")
    # each rank's loss is the mean over its rows: their average is the global batch's loss
    mean = torch.tensor([got["losses"] for got in runs], dtype=torch.float64).mean(0)
    for s, (a, b, bound) in enumerate(zip(mean.tolist(), ref["losses"], ref["loss_bounds"], strict=True)):
        assert abs(a - b) <= bound, f"step {s}'s loss {a} vs {b}, bound {bound:.3g}"


@pytest.mark.parametrize("n", NS)
def test_full_optimizer_state_equals_single_process(n):
    dense = _dense("adamw")
    ref = dense["opt"]
    for stage in CASES:
        got = _case(n, ("eq", "adamw", stage))[0]["full"]
        assert got.keys() == ref.keys()
        for name in ref:
            assert torch.equal(got[name]["step"], ref[name]["step"]), f"stage {stage} {name}.step"  # a count
            for k in ("exp_avg", "exp_avg_sq"):
                close(got[name][k], ref[name][k], dense[k], f"stage {stage} {name}.{k}")


@pytest.mark.parametrize("n", NS)
def test_stage1_equals_torch_zero_redundancy_optimizer(n):
    bound = _dense("adamw")["bound"]
    for r, (ours, theirs) in enumerate(zip(_case(n, ("eq", "adamw", 1)), _case(n, "torch"), strict=True)):
        _close_state(ours["state"], theirs, bound, f"rank {r}")


@pytest.mark.parametrize("n", NS)
def test_communication_is_2psi_at_every_stage(n):
    """§7.2: all-reduce (stage 0) or reduce-scatter + all-gather (1, 2) of the padded flat buffer;
    stage 2 in k buckets, reduce-scattered last to first during backward, all-gathered after the step."""
    psi_p, _ = _padded(n)
    nbytes, buckets = 4 * psi_p, _buckets(n)
    k = len(buckets)
    assert k >= 4  # several buckets, or this test shows nothing
    one = lambda op, lo, hi: (op, 4 * (hi - lo), (n - 1) / n * 4 * (hi - lo))
    mask = ("all_reduce", _tensors(), 2 * (n - 1) / n * _tensors())  # one byte per tensor: who got a gradient
    expected = {0: [mask, ("all_reduce", nbytes, 2 * (n - 1) / n * nbytes)],
                1: [mask, one("reduce_scatter", 0, psi_p), one("all_gather", 0, psi_p)],
                2: [one("reduce_scatter", *b) for b in reversed(buckets)] + [mask]
                + [one("all_gather", *b) for b in buckets],
                "2, one bucket": [one("reduce_scatter", 0, psi_p), mask, one("all_gather", 0, psi_p)]}
    for mech in _case(n, "mech"):
        assert mech[0]["padding"] == psi_p - costmodel.transformer_params(CFG) > 0
        assert mech[2]["buckets"] == buckets
        for stage in CASES:
            assert mech[stage]["fwd_calls"] == 0
            assert mech[stage]["events"] == expected[stage]  # the same ring factors, written out
            # formula against a sum of a few events' float64 bytes: k·u << rel
            assert mech[stage]["wire"] == pytest.approx(2 * (n - 1) / n * nbytes + mask[2], rel=1e-12)
        # stage 2 reduce-scatters inside backward (all k before it returns); stages 0 and 1 in step()
        assert mech[2]["after_backward"]["calls"] == {"reduce_scatter": k}
        assert mech["2, one bucket"]["after_backward"]["calls"] == {"reduce_scatter": 1}
        assert mech[0]["after_backward"]["calls"] == mech[1]["after_backward"]["calls"] == {}
        # ... and as the gradients are produced: after some buckets went out, more gradients arrived;
        # the last gradient completes the last bucket. Stages 0/1: nothing while gradients arrive.
        seen = mech[2]["seen"]
        assert seen == sorted(seen) and seen[-1] == k and sum(0 < c < k for c in seen) >= k // 2, seen
        assert set(mech[0]["seen"]) == set(mech[1]["seen"]) == {0}


def _tensors():
    """P: the model's parameter tensors (a tied weight once), one AdamW ``step`` counter each."""
    return len(list(GPT(CFG).parameters()))


@pytest.mark.parametrize("n", NS)
def test_model_state_bytes_per_rank(n):
    """Inside the optimizer step: 4Psi' params; grads 4Psi' (0, 1) or 4S (2); AdamW state 8Psi + 4P
    (stage 0) or 8Psi_r + 4P (1, 2): exp_avg and exp_avg_sq of the elements the rank owns, and one
    float32 ``step`` per tensor (P of them), as one process keeps them."""
    psi_p, s = _padded(n)
    psi, steps = costmodel.transformer_params(CFG), 4 * _tensors()
    for r, mech in enumerate(_case(n, "mech")):
        own = -(-(psi - r) // n)  # Psi_r: the elements r, r + n, ... below Psi
        expected = {0: (4 * psi_p, 4 * psi_p, 8 * psi + steps), 1: (4 * psi_p, 4 * psi_p, 8 * own + steps),
                    2: (4 * psi_p, 4 * s, 8 * own + steps)}
        for stage, (params, grads, opt) in expected.items():
            got = mech[stage]["at_step"]
            measured = (got["parameters"], got["gradients"], got["optimizer_state"])
            assert measured == (params, grads, opt), stage
            # the fp32 form of costmodel.zero_memory_bytes: (4 + 4 + K) Psi at stage 0, etc. (K = 8)
            total = {0: 16 * psi_p, 1: 8 * psi_p + 8 * psi_p / n, 2: 4 * psi_p + 12 * psi_p / n}[stage]
            no_state = 8 * (psi_p - psi if stage == 0 else s - own)  # padding: never updated, no state
            assert got["parameters"] + got["gradients"] + got["optimizer_state"] == total - no_state + steps
            assert costmodel.zero_memory_bytes(psi_p, n, stage, k=8, param_bytes=4, grad_bytes=4) == total
        # over the whole step the parameters and optimizer state never exceed those sizes
        for stage in CASES:
            peak = mech[stage]["peak"]
            assert peak["parameters"] == 4 * psi_p
            assert peak["optimizer_state"] == expected[stage if stage in expected else 2][2]


@pytest.mark.parametrize("n", NS)
def test_stage2_never_holds_the_full_gradient(n):
    """§5.2: during backward stage 2 holds its gradient shard and at most one bucket's parameters'
    gradients, 4 (S + B); stages 0/1 hold the full 4 Psi' and so does stage 2 as one bucket (less
    the last gradient to arrive, which completes the bucket and is freed at once)."""
    psi_p, s = _padded(n)
    psi, bound = costmodel.transformer_params(CFG), 4 * (s + _largest_bucket_in_params(n))
    largest_param = max(p.numel() for p in GPT(CFG).parameters())
    for mech in _case(n, "mech"):
        peak = {name: mech[name]["after_backward"]["peak"]["gradients"] for name in CASES}
        assert peak[0] == peak[1] == 4 * psi_p
        assert 4 * s <= peak[2] <= bound < 4 * psi_p * (1 / n + 0.4), (peak[2], bound)
        assert peak["2, one bucket"] >= 4 * (psi - largest_param)


def test_costmodel_ratio_matches_measured():
    """Stage 1 divides the optimizer state by n exactly as the paper's K*Psi/N term (padding aside)."""
    res = _case(4, "mech")[0]
    psi = costmodel.transformer_params(CFG)
    steps = 4 * _tensors()  # the per-tensor step counters are not divided by n
    measured = (res[0]["at_step"]["optimizer_state"] - steps) / (res[1]["at_step"]["optimizer_state"] - steps)
    paper = ((costmodel.zero_memory_bytes(psi, 4, 0, k=8) - 4 * psi)
             / (costmodel.zero_memory_bytes(psi, 4, 1, k=8) - 4 * psi))
    # padding aside: rank 0 owns ceil(Psi / n) < Psi / n + 1 elements, so the ratio is within n / Psi of n
    assert measured == pytest.approx(paper, rel=4 / psi)


@pytest.mark.parametrize("n", NS)
def test_errors_name_the_fix(n):
    err = _case(n, "errors")[0]
    assert "stage" in err["stage"] and "fully_shard" in err["stage"]
    assert "no parameters" in err["empty"]
    assert "offload" in err["offload"]
    assert "bucket_cap_mb" in err["bucket"]


@pytest.mark.parametrize("n", NS)
def test_offload_equals_single_process(n):
    """Offloaded (cpu, disk; float32, OffloadedOptimizer's master dtype) == the same stage in memory, bit
    for bit: weights and AdamW state; the in-memory stages equal one process (the float64 tests above)."""
    for r, runs in enumerate(_case(n, "offload")):
        assert set(runs) == {(where, stage) for where in ("memory", "cpu", "disk") for stage in (1, 2)}
        for (where, stage), state in runs.items():
            want = runs["memory", stage]
            for part in ("model", "optimizer"):
                torch.testing.assert_close(state[part], want[part], atol=0, rtol=0,
                                           msg=lambda m, r=r, where=where, stage=stage, part=part:
                                           f"rank {r} {where} stage {stage} {part}: {m}")


@pytest.mark.parametrize("n", NS)
def test_parameter_without_gradient_is_left_untouched(n):
    """A parameter that gets no gradient in a step (the side head on odd steps) is not stepped: no
    weight decay, no AdamW state update -- bitwise the same weights -- and the run equals one process,
    whose AdamW skips it (and so counts fewer steps for it: its bias correction differs)."""
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model, grads = _SideHead(), []
        ref = _train_side(model, OPTIMIZERS["adamw"](list(model.parameters())), grads=grads)
    bound = _weight_bound("adamw", SIDE_STEPS, max(g for g, _ in grads))
    for r, unused in enumerate(_case(n, "unused")):
        assert unused.keys() == CASES.keys()
        for name, got in unused.items():
            for step in range(SIDE_STEPS):  # side[k] -> side[k + 1]: moved on even steps, not a bit on odd
                moved = not torch.equal(got["side"][step + 1], got["side"][step])
                assert moved == (step % 2 == 0), (r, name, step)
            _close_state(got["state"], ref["state"], bound, f"rank {r} {name}")
