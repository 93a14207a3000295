"""Mixed precision (Micikevicius et al. 2018): the dynamic loss scaler against ``torch.amp.GradScaler``
on scripted finite / inf / NaN gradients; the fp32 master update against an fp32 reference, bit for
bit; fp16 + scaler training of the tiny GPT against fp32, fp16 without scaling underflowing, bf16
without a scaler; model-state bytes per parameter against ``costmodel.model_state_bytes``.

Tolerances (tests/_support.py's model). The scaler, the master update, the whole trainer against a
hand-written GradScaler loop, and gradient accumulation are the same operations in the same order as
their references: bitwise. The tiny-update test's master weight takes 50 SGD steps of 1e-4 in float32
from 1: each rounds the update and the subtraction (relative u_32 of values <= 1), and the expected
value is rounded once: ``gamma(2·50 + 1) · 1`` ~ 6e-6, while one lost update is 1e-4. Training in a
half format against fp32 (the chapter's claim): the loss curves agree to the format's own precision
on the loss, ``roundoff(dtype) · max L`` (fp16 2^-11, ~1.7e-3 nats; bf16 2^-8, ~1.4e-2 nats, of a
~1 nat drop): the half run's logits carry the format's relative rounding, which the mean over B·T
tokens does not increase, and the fp32 masters keep every update; a skipped or unscaled step, or fp16
without a scaler (which stalls: most gradients flush to zero), is off by far more.
"""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minitorch_dist import costmodel as cm
from minitorch_dist.memory.mixed_precision import (
    DynamicLossScaler,
    Fp32LayerNorm,
    MixedPrecisionTrainer,
    fp32_cross_entropy,
    half_precision_copy,
)
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig

from _support import close, gamma, roundoff

pytestmark = pytest.mark.ch08

CFG = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
B, T, STEPS = 16, 16, 60
# Gradients scaled down 10^4 stand in for a network whose gradients are naturally tiny (the
# paper's Figure 3: most of SSD's activation gradients lie below fp16's range). The tiny GPT's
# median |gradient| is then ~1e-7, under fp16's smallest normal 6.1e-5 and near its smallest
# subnormal 6e-8. AdamW with eps ~ 0 is invariant to that factor, so the fp32 run is unaffected.
LOSS_MULT = 1e-4


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-30, weight_decay=0.0)


def _small_loss(model, x, y):
    return fp32_cross_entropy(model, x, y) * LOSS_MULT


# --- 1. the scaler is torch.amp.GradScaler ---------------------------------------------------
def _drive(scaler, script, seed=0):
    """Run ``script`` ('ok' / 'inf' / 'nan' per step) through ``scaler`` on a small linear model with
    SGD+momentum; return per-step (scale after update, growth tracker, skipped?, params)."""
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tracker = (lambda: scaler._get_growth_tracker()) if isinstance(scaler, torch.amp.GradScaler) \
        else (lambda: scaler.growth_tracker)
    out = []
    for i, kind in enumerate(script):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        scaler.scale(model(x).square().mean()).backward()
        if kind != "ok":  # one poisoned element is enough to make the whole step overflow
            model.weight.grad[1, 2] = float("inf") if kind == "inf" else float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        scaler.step(opt)
        scaler.update()
        skipped = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        out.append((scaler.get_scale(), tracker(), skipped, [p.detach().clone() for p in model.parameters()]))
    return out


def _assert_same_run(ours, theirs):
    for step, (a, b) in enumerate(zip(ours, theirs)):
        assert a[:3] == b[:3], f"step {step}: (scale, tracker, skipped) ours {a[:3]} torch {b[:3]}"
        for p, q in zip(a[3], b[3]):
            assert torch.equal(p, q), f"step {step}: parameters differ"


def test_scale_trajectory_and_skips_equal_gradscaler():
    script = ["ok", "inf", "nan", "ok", "ok", "ok", "ok", "ok", "ok", "inf", "ok", "ok", "nan", "nan", "ok",
              "ok", "ok"]
    kw = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = DynamicLossScaler(**kw)
    run = _drive(ours, script)
    _assert_same_run(run, _drive(torch.amp.GradScaler("cpu", **kw), script))
    # the mechanism, written out: S halves on each overflow, doubles after 3 clean steps in a row
    expected, s, clean = [], 2.0**10, 0
    for kind in script:
        if kind == "ok":
            clean += 1
            if clean == 3:
                s, clean = 2 * s, 0
        else:
            s, clean = s / 2, 0
        expected.append(s)
    assert [r[0] for r in run] == expected
    assert [r[2] for r in run] == [k != "ok" for k in script]
    assert ours.skipped_steps == script.count("inf") + script.count("nan") and ours.steps == len(script)


def test_non_power_of_two_factors_equal_gradscaler():
    script = ["ok", "ok", "inf", "ok", "ok", "ok", "nan", "ok", "ok"]
    kw = dict(init_scale=1000.0, growth_factor=3.0, backoff_factor=0.3, growth_interval=2)
    _assert_same_run(_drive(DynamicLossScaler(**kw), script),
                     _drive(torch.amp.GradScaler("cpu", **kw), script))


def test_default_constants_equal_gradscaler():
    ours, theirs = DynamicLossScaler(), torch.amp.GradScaler("cpu")
    assert (ours.get_scale(), ours.growth_factor, ours.backoff_factor, ours.growth_interval) == (
        theirs.get_scale(), theirs._growth_factor, theirs._backoff_factor, theirs._growth_interval) == (
        2.0**16, 2.0, 0.5, 2000)
    script = ["ok"] * 2001 + ["inf"] + ["ok"] * 3
    a, b = _drive(ours, script), _drive(theirs, script)
    assert [r[:3] for r in a] == [r[:3] for r in b]
    scales = [r[0] for r in a]
    assert scales[1998] == 2.0**16 and scales[1999] == 2.0**17  # grows on the 2000th clean step
    assert scales[2001] == 2.0**16 and a[2001][2]  # the overflow halves it and is skipped


def test_state_dict_loads_both_ways():
    script = ["ok", "inf", "ok", "ok"]
    ours, theirs = DynamicLossScaler(growth_interval=3), torch.amp.GradScaler("cpu", growth_interval=3)
    _drive(ours, script), _drive(theirs, script)
    sd = ours.state_dict()
    assert {k: sd[k] for k in theirs.state_dict()} == theirs.state_dict()
    assert (sd["steps"], sd["skipped_steps"]) == (4, 1)
    fresh_torch, fresh_ours = torch.amp.GradScaler("cpu"), DynamicLossScaler()
    fresh_torch.load_state_dict(sd)
    fresh_ours.load_state_dict(theirs.state_dict())
    more = ["ok", "ok", "nan", "ok"]
    assert [r[:3] for r in _drive(fresh_ours, more)] == [r[:3] for r in _drive(fresh_torch, more)]


def test_unscale_list_of_grads_and_errors():
    s = DynamicLossScaler(init_scale=8.0)
    g = [torch.tensor([8.0, 16.0]), None, torch.tensor([24.0])]
    assert s.unscale_(g) is False and g[0].tolist() == [1.0, 2.0] and g[2].tolist() == [3.0]
    assert s.unscale_([torch.tensor([float("nan")])]) is True
    s.update()
    assert s.get_scale() == 4.0  # the recorded NaN backs the scale off
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s.scale(p.sum()).backward()
    s.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="update"):
        s.step(opt)
    s.update()
    with pytest.raises(RuntimeError, match="step"):
        s.update()
    for bad in (dict(init_scale=0.0), dict(growth_factor=1.0), dict(backoff_factor=1.5),
                dict(growth_interval=0)):
        with pytest.raises(ValueError):
            DynamicLossScaler(**bad)


def test_disabled_scaler_is_a_pass_through():
    s, t = DynamicLossScaler(enabled=False), torch.amp.GradScaler("cpu", enabled=False)
    loss = torch.tensor(3.0)
    assert s.scale(loss) is loss and s.get_scale() == t.get_scale() == 1.0
    assert s.state_dict() == t.state_dict() == {}
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.tensor([float("inf"), 1.0])
    s.step(torch.optim.SGD([p], lr=1.0))  # no check: the update goes through, inf and all
    s.update()
    assert torch.isinf(p[0]) and s.skipped_steps == 0


def _half_grads_run(scaler):
    """fp32 and fp16 parameters under one optimizer, scaled by 2^25, unscaled: what ``unscale_`` and
    ``step`` raise, and the gradients afterwards."""
    a, h = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2, dtype=torch.float16))
    opt = torch.optim.SGD([a, h], lr=0.1)
    scaler.scale(torch.tensor(1.0))
    a.grad, h.grad = torch.full((2,), 2.0**26), torch.full((2,), 2.0**10, dtype=torch.float16)
    errors = []
    for call in (lambda: scaler.unscale_(opt), lambda: scaler.step(opt)):
        with pytest.raises(ValueError) as err:
            call()
        errors.append(str(err.value))
    return errors, a.grad.tolist(), h.grad.tolist(), [a[0].item(), h[0].item()]


def test_unscale_refuses_fp16_gradients_like_gradscaler():
    """GradScaler refuses fp16 gradients before touching any; so does ours, naming the fix. Had it
    unscaled them, 1/S = 2^-25 rounds to 0 in fp16 and every gradient would silently be 0."""
    assert (torch.full((2,), 2.0**10, dtype=torch.float16) * torch.tensor(2.0**-25).half()).eq(0).all()
    ours = _half_grads_run(DynamicLossScaler(init_scale=2.0**25))
    theirs = _half_grads_run(torch.amp.GradScaler("cpu", init_scale=2.0**25))
    assert ours[1:] == theirs[1:] == ([2.0**26] * 2, [2.0**10] * 2, [1.0, 1.0])  # nothing unscaled, no step
    for got, want in zip(ours[0], theirs[0]):
        assert got.startswith(want) and want == "Attempting to unscale FP16 gradients."
        assert "fp32 master" in got and "MixedPrecisionTrainer" in got
    with pytest.raises(ValueError, match="Attempting to unscale FP16"):
        DynamicLossScaler().unscale_([torch.ones(2, dtype=torch.float16)])
    # bf16 gradients (fp32's exponent range) are unscaled, as GradScaler does, to the same values
    got = []
    for scaler in (DynamicLossScaler(init_scale=2.0**25), torch.amp.GradScaler("cpu", init_scale=2.0**25)):
        p = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
        opt = torch.optim.SGD([p], lr=0.1)
        scaler.scale(torch.tensor(1.0))
        p.grad = torch.full((2,), 3.0 * 2.0**25, dtype=torch.bfloat16)
        scaler.unscale_(opt)
        got.append(p.grad.tolist())
    assert got[0] == got[1] == [3.0, 3.0]


# --- the half copy ---------------------------------------------------------------------------
def test_half_copy_keeps_norms_fp32_and_ties():
    torch.manual_seed(0)
    model = GPT(CFG)
    half = half_precision_copy(model, torch.float16)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the original is untouched
    assert all(p.dtype == torch.float16 for p in half.parameters())  # 2 B per weight, norms included
    assert half.lm_head.weight is half.wte.weight
    lns = [m for m in half.modules() if isinstance(m, nn.LayerNorm)]
    assert lns and all(type(m) is Fp32LayerNorm for m in lns)
    x = torch.randn(4, CFG.n_embd).half() * 30
    ln = half.ln_f
    ref = F.layer_norm(x.float(), ln.normalized_shape, ln.weight.float(), ln.bias.float(), ln.eps).half()
    assert torch.equal(ln(x), ref)
    xb, yb = MarkovCorpus(32).batch(0, 2, 8)
    assert fp32_cross_entropy(half, xb, yb).dtype == torch.float32
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        MixedPrecisionTrainer(model, dtype=torch.float32)
    with pytest.raises(ValueError, match="loss_scaling=False"):
        MixedPrecisionTrainer(model, scaler=DynamicLossScaler(), loss_scaling=False)


# --- 3. master weights ---------------------------------------------------------------------
def test_master_update_equals_fp32_reference_bitwise():
    """Same fp32 gradients -> same fp32 masters: the trainer's unscale + AdamW step is the fp32 update."""
    torch.manual_seed(0)
    model = GPT(CFG)
    tr = MixedPrecisionTrainer(model, _adamw, torch.float16)
    ref_params = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt = _adamw(ref_params)
    data = MarkovCorpus(32)
    for step in range(4):
        tr.backward(*data.batch(step, B, T))
        scale = tr.scaler.get_scale()
        for r, h in zip(ref_params, tr.half_params):  # the same half gradients, made fp32 and unscaled here
            r.grad = h.grad.float() / scale
        assert tr.step()
        ref_opt.step()
        for m, r, h in zip(tr.master_params, ref_params, tr.half_params):
            assert torch.equal(m, r), f"step {step}: master differs from the fp32 reference"
            assert torch.equal(h, r.detach().half()), "the half copy is the rounded master"


def test_trainer_skips_overflow_like_gradscaler_loop():
    """The whole trainer against a hand-written loop on fp32 masters driven by torch.amp.GradScaler,
    starting at S = 2^24 so the first steps overflow fp16 and are skipped."""
    torch.manual_seed(1)
    model = GPT(CFG)
    kw = dict(init_scale=2.0**24, growth_interval=2)
    tr = MixedPrecisionTrainer(model, _adamw, torch.float16, scaler=DynamicLossScaler(**kw))
    ref_half = half_precision_copy(model, torch.float16)
    ref_master = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    ref_opt, gs = _adamw(ref_master), torch.amp.GradScaler("cpu", **kw)
    data = MarkovCorpus(32)
    for step in range(8):
        x, y = data.batch(step, B, T)
        tr.train_step([(x, y)])
        gs.scale(fp32_cross_entropy(ref_half, x, y)).backward()
        for m, h in zip(ref_master, ref_half.parameters()):
            m.grad, h.grad = h.grad.float(), None
        gs.step(ref_opt)
        gs.update()
        with torch.no_grad():
            for m, h in zip(ref_master, ref_half.parameters()):
                h.copy_(m)
        assert tr.scaler.get_scale() == gs.get_scale()
        assert all(torch.equal(a, b) for a, b in zip(tr.master_params, ref_master))
    assert tr.scaler.skipped_steps >= 1 and tr.scaler.get_scale() < 2.0**24


def test_gradient_accumulation_is_fp32():
    torch.manual_seed(0)
    tr = MixedPrecisionTrainer(GPT(CFG), _adamw, torch.float16)
    data = MarkovCorpus(32)
    total = None
    for k in range(3):
        tr.backward(*data.batch(k, 4, T), loss_weight=1 / 3)
        g = [h.grad.float() for h in tr.half_params]
        total = g if total is None else [a + b for a, b in zip(total, g)]
    tr._fold_half_grads_into_master()
    assert all(h.grad is None for h in tr.half_params)
    assert all(torch.equal(m.grad, t) for m, t in zip(tr.master_params, total))


def test_tiny_update_lost_in_fp16_kept_by_master():
    one = torch.tensor(1.0, dtype=torch.float16)
    assert one - 1e-4 == one and one + 1e-4 == one  # below half of fp16's gap at 1 (2^-11 below, 2^-10 above)
    assert torch.tensor(1.0) - 1e-4 != 1.0

    class W(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(8))

    sgd = lambda ps: torch.optim.SGD(ps, lr=1e-4)  # unit gradient -> update of 1e-4
    loss = lambda m, x, y: m.w.float().sum()
    pure = W().half()  # fp16 weights updated in place: every update rounds away
    opt = sgd(pure.parameters())
    tr = MixedPrecisionTrainer(W(), sgd, torch.float16, loss_scaling=False, loss_fn=loss)
    for _ in range(50):
        opt.zero_grad()
        loss(pure, None, None).backward()
        opt.step()
        tr.train_step([(None, None)])
    assert torch.all(pure.w == 1.0)  # 50 updates, all lost
    # all kept: 50 float32 steps each rounding the update and the subtraction, the expected value once
    close(tr.master_params[0], torch.full((8,), 1 - 50e-4), gamma(2 * 50 + 1, torch.float32), "master")
    assert torch.equal(tr.model.w, tr.master_params[0].half()) and torch.all(tr.model.w < 1.0)


# --- 2 and 4. training the tiny GPT --------------------------------------------------------
@pytest.fixture(scope="module")
def runs():
    """Loss curves of the same GPT on the same batches: fp32, fp16 + scaler, fp16 without, bf16."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention (measured 4x slower with 2)
    try:
        return _train_all()
    finally:
        torch.set_num_threads(threads)


def _train_all():
    data = MarkovCorpus(32, seed=0)
    out = {}
    torch.manual_seed(0)
    model = GPT(CFG)
    opt, losses = _adamw(list(model.parameters())), []
    for s in range(STEPS):
        opt.zero_grad()
        loss = _small_loss(model, *data.batch(s, B, T))
        loss.backward()
        opt.step()
        losses.append(loss.item() / LOSS_MULT)
    out["fp32"] = torch.tensor(losses)
    for name, dtype, scaling in [("fp16+scaler", torch.float16, True), ("fp16", torch.float16, False),
                                 ("bf16", torch.bfloat16, None)]:
        torch.manual_seed(0)
        tr = MixedPrecisionTrainer(GPT(CFG), _adamw, dtype, loss_scaling=scaling, loss_fn=_small_loss)
        out[name] = torch.tensor([tr.train_step([data.batch(s, B, T)]) / LOSS_MULT for s in range(STEPS)])
        out[name + " trainer"] = tr
    return out


def _underflow_fraction(dtype, scaling):
    """Fraction of gradient entries nonzero in fp32 but exactly zero in the half model, at step 0."""
    torch.manual_seed(0)
    model = GPT(CFG)
    x, y = MarkovCorpus(32).batch(0, B, T)
    _small_loss(model, x, y).backward()
    g32 = torch.cat([p.grad.flatten() for p in model.parameters()])
    tr = MixedPrecisionTrainer(model, _adamw, dtype, loss_scaling=scaling, loss_fn=_small_loss)
    tr.backward(x, y)
    gh = torch.cat([p.grad.flatten() for p in tr.half_params])
    nonzero = g32 != 0
    return ((gh == 0) & nonzero).sum().item() / nonzero.sum().item()


def test_fp16_with_scaler_matches_fp32_and_without_underflows(runs):
    fp32, scaled, raw = runs["fp32"], runs["fp16+scaler"], runs["fp16"]
    assert fp32[0] - fp32[-10:].mean() > 0.8  # the fp32 run learns (~1.0 nat in 60 steps)
    # fp16 rounding of activations and weights, and nothing else: within fp16's precision on the loss
    assert (scaled - fp32).abs().max() <= roundoff(torch.float16) * fp32.max()
    assert runs["fp16+scaler trainer"].scaler.skipped_steps == 0
    # Without scaling most gradient entries flush to zero (the median |g| ~1e-7 is near fp16's smallest
    # subnormal 6e-8, and the backward's intermediate gradients flush before it); S = 2^16 lifts them
    # into fp16's normal range.
    assert _underflow_fraction(torch.float16, False) > 0.9
    assert _underflow_fraction(torch.float16, True) < 1e-3
    # ... and training stalls: less than a third of fp32's drop.
    assert raw[0] - raw[-10:].mean() < 0.3 * (fp32[0] - fp32[-10:].mean())
    assert raw[-10:].mean() > fp32[-10:].mean() + 0.5


def test_bf16_trains_without_scaler(runs):
    tr = runs["bf16 trainer"]
    assert not tr.scaler.enabled and tr.scaler.get_scale() == 1.0
    assert _underflow_fraction(torch.bfloat16, None) == 0.0  # fp32's exponent range: nothing flushes
    # bf16 keeps 8 significant bits (u = 2^-8): within bf16's precision on the loss
    assert (runs["bf16"] - runs["fp32"]).abs().max() <= roundoff(torch.bfloat16) * runs["fp32"].max()


# --- 5. memory per parameter ---------------------------------------------------------------
def test_model_state_bytes_per_parameter_equal_costmodel():
    torch.manual_seed(0)
    model = GPT(CFG)
    P = model.num_params()
    tr = MixedPrecisionTrainer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), torch.float16)
    data = MarkovCorpus(32)
    tr.train_step([data.batch(0, 4, T)])  # creates Adam's m and v
    tr.backward(*data.batch(1, 4, T))  # half gradients present, as during every iteration
    got, want = tr.state_bytes(), cm.model_state_bytes(P, "mixed", "adamw")
    assert got["weights"] == want["weights"] == 2 * P
    assert got["gradients"] == want["gradients"] == 2 * P
    assert got["master_weights"] == want["master_weights"] == 4 * P
    assert got["master_weights"] + got["optimizer"] == want["optimizer"] == 12 * P
    parts = ("weights", "gradients", "master_weights", "optimizer")
    assert sum(got[k] for k in parts) == want["total"] == 16 * P
    # Adam's step counter: one 0-dim fp32 tensor per parameter tensor (4 B each), not per element
    assert got["step_counters"] == 4 * len(tr.master_params)


@pytest.mark.gpu
def test_fp16_trainer_on_cuda_matches_fp32():
    data = MarkovCorpus(32)
    torch.manual_seed(0)
    ref = GPT(CFG).cuda()
    model = copy.deepcopy(ref)
    opt = _adamw(list(ref.parameters()))
    tr = MixedPrecisionTrainer(model, _adamw, torch.float16)
    assert all(p.is_cuda and p.dtype == torch.float32 for p in tr.master_params)
    for s in range(20):
        x, y = (t.cuda() for t in data.batch(s, B, T))
        opt.zero_grad()
        _, loss = ref(x, y)
        loss.backward()
        opt.step()
        assert abs(tr.train_step([(x, y)]) - loss.item()) <= roundoff(torch.float16) * loss.item()
