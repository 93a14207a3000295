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

Tolerances (as chapter 01): averaged gradients differ from the single-process ones by float32 ulps;
after 5 steps weights differ by ~1e-7. atol 1e-6 / rtol 1e-5; AdamW with lr 1e-3, eps 1e-6 (a larger
eps damps rounding noise in nearly-zero gradients, see tests/test_data_parallel.py).
"""
import functools
import math
import tempfile

import pytest
import torch
import torch._dynamo  # noqa: F401  optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
from torch import nn

from minitorch_dist.analysis import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.zero.zero12 import ZeroDataParallel
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch06

CFG = GPTConfig(vocab_size=37, block_size=16, n_layer=2, n_head=3, n_embd=21)  # Psi = 12285, odd
B, T, STEPS, SEED = 8, 16, 5, 100  # rank r initialises with SEED + r: the broadcast must fix that
ATOL, RTOL = 1e-6, 1e-5
SIDE_STEPS = 4
CAP_MB = 0.004  # 4194 bytes: ~1049 fp32 elements per stage-2 bucket
CASES = {0: (0, {}), 1: (1, {}), 2: (2, {"bucket_cap_mb": CAP_MB}),
         "2, one bucket": (2, {"bucket_cap_mb": None})}
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, eps=1e-6, weight_decay=0.1),
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


def _equivalence():
    out = {}
    for opt, factory in OPTIMIZERS.items():
        for case, (stage, kw) in CASES.items():
            zero = ZeroDataParallel(_model(), factory, stage, **kw)
            losses = _train(zero)
            full = zero.full_state_dict(optimizer=True)["optimizer"] if opt == "adamw" else None
            out[opt, case] = {"losses": losses, "state": zero.full_state_dict(), "full": full}
    return out


def _offload():
    out = {}
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
    for case, (stage, kw) in CASES.items():
        zero = ZeroDataParallel(_model(), OPTIMIZERS["adamw"], stage, **kw)
        _train(zero, steps=1)  # the optimizer state exists from here on
        live, seen = {}, []  # at each gradient's arrival: reduce-scatters issued so far in this backward
        for p in zero.flat.params:  # registered after the module's hooks, so they run after them
            p.register_post_accumulate_grad_hook(lambda _p: seen.append(live["m"].calls["reduce_scatter"])
                                                 if "m" in live else None)
        meter, at_step = MemoryMeter(zero, zero.optimizer), {}
        zero.optimizer.register_step_post_hook(lambda *_: at_step.update(meter.current()))
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
        out[case] = {"fwd_calls": sum(fwd.calls.values()), "after_backward": after_backward, "seen": seen,
                     "events": [(e.op, e.nbytes, e.wire_bytes) for e in m.events],
                     "wire": m.total_wire_bytes, "at_step": at_step, "peak": dict(meter.peak),
                     "padding": zero.flat.padding, "buckets": zero.buckets}
    return out


def _errors():
    out = {}
    cases = {"stage": lambda: ZeroDataParallel(GPT(CFG), OPTIMIZERS["sgd"], 3),
             "empty": lambda: ZeroDataParallel(nn.Sequential(nn.ReLU()), OPTIMIZERS["sgd"], 1),
             "offload": lambda: ZeroDataParallel(GPT(CFG), OPTIMIZERS["sgd"], 1, offload="gpu"),
             "bucket": lambda: ZeroDataParallel(GPT(CFG), OPTIMIZERS["sgd"], 2, bucket_cap_mb=0)}
    for case, call in cases.items():
        try:
            call()
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out


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


def _train_side(model, opt, rows=None):
    """SIDE_STEPS AdamW steps, the side head used on even steps; its weights before and after each step."""
    data, side = MarkovCorpus(CFG.vocab_size, seed=0), [model.side.weight.detach().clone()]
    for step in range(SIDE_STEPS):
        model.use_side = step % 2 == 0
        opt.zero_grad()
        x, y = data.batch(step, B, T, *(rows or ()))
        model(x, y)[1].backward()
        opt.step()
        side.append(model.side.weight.detach().clone())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "side": side}


def _unused_branch():
    out = {}
    for case, (stage, kw) in CASES.items():
        torch.manual_seed(SEED + dist.get_rank())
        model = _SideHead()
        zero = ZeroDataParallel(model, OPTIMIZERS["adamw"], stage, **kw)
        out[case] = _train_side(model, zero, (dist.get_rank(), dist.get_world_size()))
    return out


def _run_every_case():
    return {"eq": _equivalence(), "torch": _torch_zero_redundancy(), "mech": _mechanism(),
            "errors": _errors(), "offload": _offload(), "unused": _unused_branch()}


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=120)


# --- the single-process reference ------------------------------------------------------------------


@functools.cache
def _dense(opt):
    """The GPT of rank 0's seed in one process on the whole batch: losses, weights, optimizer state."""
    with single_thread():
        torch.manual_seed(SEED)
        model, data, losses = GPT(CFG), MarkovCorpus(CFG.vocab_size, seed=0), []
        o = OPTIMIZERS[opt](list(model.parameters()))
        for step in range(STEPS):
            o.zero_grad()
            x, y = data.batch(step, B, T)
            _, loss = model(x, y)
            loss.backward()
            o.step()
            losses.append(loss.item())
        state = {name: {k: v.clone() for k, v in o.state[p].items()} for name, p in model.named_parameters()}
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, state


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
    ref_losses, ref_state, _ = _dense(opt)
    for r, res in enumerate(_results(n)):
        got = res["eq"][opt, stage]
        torch.testing.assert_close(got["state"], ref_state, atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"rank {r}: {m}")
    # each rank's loss is the mean over its rows: their average is the global batch's loss
    mean = torch.tensor([res["eq"][opt, stage]["losses"] for res in _results(n)]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(ref_losses), atol=2e-6, rtol=0)


@pytest.mark.parametrize("n", NS)
def test_full_optimizer_state_equals_single_process(n):
    _, _, ref = _dense("adamw")
    for stage in CASES:
        got = _results(n)[0]["eq"]["adamw", stage]["full"]
        assert got.keys() == ref.keys()
        for name in ref:
            for k in ("exp_avg", "exp_avg_sq", "step"):
                torch.testing.assert_close(got[name][k], ref[name][k], atol=ATOL, rtol=RTOL,
                                           msg=lambda m: f"stage {stage} {name}.{k}: {m}")


@pytest.mark.parametrize("n", NS)
def test_stage1_equals_torch_zero_redundancy_optimizer(n):
    for r, res in enumerate(_results(n)):
        torch.testing.assert_close(res["eq"]["adamw", 1]["state"], res["torch"], atol=ATOL, rtol=RTOL,
                                   msg=lambda m: f"rank {r}: {m}")


@pytest.mark.parametrize("n", NS)
def test_communication_is_2psi_at_every_stage(n):
    """§7.2: all-reduce (stage 0) or reduce-scatter + all-gather (1, 2) of the padded flat buffer;
    stage 2 in k buckets, reduce-scattered last to first during backward, all-gathered after the step."""
    psi_p, _ = _padded(n)
    nbytes, buckets = 4 * psi_p, _buckets(n)
    k = len(buckets)
    assert k >= 4  # several buckets, or this test shows nothing
    one = lambda op, lo, hi: (op, 4 * (hi - lo), (n - 1) / n * 4 * (hi - lo))  # noqa: E731
    mask = ("all_reduce", _tensors(), 2 * (n - 1) / n * _tensors())  # one byte per tensor: who got a gradient
    expected = {0: [mask, ("all_reduce", nbytes, 2 * (n - 1) / n * nbytes)],
                1: [mask, one("reduce_scatter", 0, psi_p), one("all_gather", 0, psi_p)],
                2: [one("reduce_scatter", *b) for b in reversed(buckets)] + [mask]
                + [one("all_gather", *b) for b in buckets],
                "2, one bucket": [one("reduce_scatter", 0, psi_p), mask, one("all_gather", 0, psi_p)]}
    for res in _results(n):
        mech = res["mech"]
        assert mech[0]["padding"] == psi_p - costmodel.transformer_params(CFG) > 0
        assert mech[2]["buckets"] == buckets
        for stage in CASES:
            assert mech[stage]["fwd_calls"] == 0
            assert mech[stage]["events"] == expected[stage]  # the same ring factors, written out
            assert mech[stage]["wire"] == pytest.approx(2 * (n - 1) / n * nbytes + mask[2])
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
    for r, res in enumerate(_results(n)):
        own = -(-(psi - r) // n)  # Psi_r: the elements r, r + n, ... below Psi
        expected = {0: (4 * psi_p, 4 * psi_p, 8 * psi + steps), 1: (4 * psi_p, 4 * psi_p, 8 * own + steps),
                    2: (4 * psi_p, 4 * s, 8 * own + steps)}
        for stage, (params, grads, opt) in expected.items():
            got = res["mech"][stage]["at_step"]
            measured = (got["parameters"], got["gradients"], got["optimizer_state"])
            assert measured == (params, grads, opt), stage
            # the fp32 form of costmodel.zero_memory_bytes: (4 + 4 + K) Psi at stage 0, etc. (K = 8)
            total = {0: 16 * psi_p, 1: 8 * psi_p + 8 * psi_p / n, 2: 4 * psi_p + 12 * psi_p / n}[stage]
            no_state = 8 * (psi_p - psi if stage == 0 else s - own)  # padding: never updated, no state
            assert got["parameters"] + got["gradients"] + got["optimizer_state"] == total - no_state + steps
            assert costmodel.zero_memory_bytes(psi_p, n, stage, k=8, param_bytes=4, grad_bytes=4) == total
        # over the whole step the parameters and optimizer state never exceed those sizes
        for stage in CASES:
            peak = res["mech"][stage]["peak"]
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
    for res in _results(n):
        mech = res["mech"]
        peak = {case: mech[case]["after_backward"]["peak"]["gradients"] for case in CASES}
        assert peak[0] == peak[1] == 4 * psi_p
        assert 4 * s <= peak[2] <= bound < 4 * psi_p * (1 / n + 0.4), (peak[2], bound)
        assert peak["2, one bucket"] >= 4 * (psi - largest_param)


def test_costmodel_ratio_matches_measured():
    """Stage 1 divides the optimizer state by n exactly as the paper's K*Psi/N term (padding aside)."""
    res = _results(4)[0]["mech"]
    psi = costmodel.transformer_params(CFG)
    steps = 4 * _tensors()  # the per-tensor step counters are not divided by n
    measured = (res[0]["at_step"]["optimizer_state"] - steps) / (res[1]["at_step"]["optimizer_state"] - steps)
    paper = ((costmodel.zero_memory_bytes(psi, 4, 0, k=8) - 4 * psi)
             / (costmodel.zero_memory_bytes(psi, 4, 1, k=8) - 4 * psi))
    assert measured == pytest.approx(paper, rel=1e-3)


@pytest.mark.parametrize("n", NS)
def test_errors_name_the_fix(n):
    err = _results(n)[0]["errors"]
    assert "stage" in err["stage"] and "fully_shard" in err["stage"]
    assert "no parameters" in err["empty"]
    assert "offload" in err["offload"]
    assert "bucket_cap_mb" in err["bucket"]


@pytest.mark.parametrize("n", NS)
def test_offload_equals_single_process(n):
    _, ref_state, ref_opt = _dense("adamw")
    for res in _results(n):
        for key, state in res["offload"].items():
            torch.testing.assert_close(state["model"], ref_state, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{key}: {m}")
            torch.testing.assert_close(state["optimizer"], ref_opt, atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"{key} optimizer state: {m}")


@pytest.mark.parametrize("n", NS)
def test_parameter_without_gradient_is_left_untouched(n):
    """A parameter that gets no gradient in a step (the side head on odd steps) is not stepped: no
    weight decay, no AdamW state update -- bitwise the same weights -- and the run equals one process,
    whose AdamW skips it (and so counts fewer steps for it: its bias correction differs)."""
    with single_thread():
        torch.manual_seed(SEED)
        model = _SideHead()
        ref = _train_side(model, OPTIMIZERS["adamw"](list(model.parameters())))
    for r, res in enumerate(_results(n)):
        for case, got in res["unused"].items():
            for step in range(SIDE_STEPS):  # side[k] -> side[k + 1]: moved on even steps, not a bit on odd
                moved = not torch.equal(got["side"][step + 1], got["side"][step])
                assert moved == (step % 2 == 0), (r, case, step)
            torch.testing.assert_close(got["state"], ref["state"], atol=ATOL, rtol=RTOL,
                                       msg=lambda m: f"rank {r} {case}: {m}")
