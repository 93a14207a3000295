"""Chapter 08 exercises, autograded: the loss scaler's rule, the loss scaler, mixed-precision training
driven by it, the updates bf16 loses, stochastic rounding to bf16, a Kahan bf16 update, fp8 tiles of
1x128, delayed scaling.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: ``torch.amp.GradScaler`` driven by real
finite / inf / NaN gradients and its kernel ``torch._amp_update_scale_``; hand-written schedules of a
hysteresis scaler's scale and counters; a hand-written mixed-precision loop (micro-batches summed in
fp32, a clip between ``unscale_`` and ``step``) around ``torch.amp.GradScaler``; fp32 training on the
same batches; the neighbours of a bf16 weight read from its bits, and torch's own SGD step; bf16
neighbours and ulps computed in float64 from ``log2``; the sample mean of many roundings against its standard
error; float64 running sums. Each statistical check is shown failing on a deliberately wrong
variant (round-to-nearest, an uncompensated bf16 weight).

Nothing here needs ranks. Checks of bad input first make a valid call, so a stub fails them too.

Tolerances (see tests/_support.py). The scaler, the loss-scaled loop against GradScaler's, the
quantised tiles and the bf16 roundings are exact: the same operations in the same order, or integers
and bits. A delayed-scaling scale is one division rounded to float32: rel ``roundoff(float32)`` (+ the
reference's float64 rounding). The lost bf16 updates are counts within the exercise's own 0.5 %
(its docstring: the real step rounds twice, the prediction once). The statistical checks state
their margins from what they compute: a mean of roundings within 5 of its standard errors (false
alarm ~3e-5 over the 52 values), round-to-nearest beyond 50; a loss-scaled fp16 run follows fp32
to 1/100 of what fp32 learns, where an unscaled one learns less than 0.4 of it; a bf16 run, whose
rounding is 2^3 times coarser than fp16's, to 2^3 times that. Kahan's bf16 weight is held to its
worst case: ``c`` is below half an ulp of w (plus an fp32 rounding of w + y), and each step it misses
its own bf16 rounding, u_bf16·|c|, and two fp32 roundings of y, so after k steps the weight is within
ulp/2 + k·(u_bf16·ulp/2 + u_fp32·(|u| + 2 ulp + |w|)) of the exact sum, ulp taken at the largest
weight the run passes (:func:`_kahan_bound_ulps`); the fp32 running sum it is compared with carries
k·u_fp32·|w| of its own. An uncompensated bf16 weight is tens of ulps off.
"""
import collections
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minitorch_dist.models import GPT, GPTConfig, MarkovCorpus

from _support import roundoff

pytestmark = pytest.mark.ch08


# --- 1. scaler_update ------------------------------------------------------------------------------

INF, NAN = float("inf"), float("nan")
# one gradient entry per step: finite, a huge finite one (1e34 overflows once scaled by >= 2^16,
# not at 2^15), or a non-finite one; the other entry is always 1.0
SCRIPT = [1.0, 1.0, 1.0, 1e34, 1e34, 1e34, NAN, 1.0, 1.0, 1.0, INF, 2.0, -INF, 1.0, 1.0, 1e34, 1.0, 1.0,
          1.0, 1.0, NAN, NAN, 1.0]


def _grad_scaler_run(script, init_scale, growth_factor=2.0, backoff_factor=0.5, growth_interval=3):
    """Drive torch.amp.GradScaler through ``script``; per step: (found_inf, skipped, scale, tracker)."""
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=growth_factor,
                                  backoff_factor=backoff_factor, growth_interval=growth_interval)
    out = []
    for g in script:
        opt.zero_grad()
        loss = (p * torch.tensor([g, 1.0])).sum()  # d loss / d p = [g, 1]
        scaler.scale(loss).backward()
        found_inf = not bool(torch.isfinite(p.grad).all())  # the *scaled* gradient, as GradScaler sees it
        before = p.detach().clone()
        scaler.step(opt)
        scaler.update()
        skipped = torch.equal(before, p.detach())
        out.append((found_inf, skipped, scaler.get_scale(), int(scaler._growth_tracker.item())))
    return out


def _replay(ex, found, init_scale, **kw):
    scale, tracker, out = init_scale, 0, []
    for f in found:
        scale, tracker = ex.scaler_update(scale, tracker, f, **kw)
        out.append((scale, tracker))
    return out


def test_scaler_update_matches_GradScaler_on_a_scripted_run(ex):
    ref = _grad_scaler_run(SCRIPT, init_scale=2.0 ** 16)
    found = [f for f, _, _, _ in ref]
    # sanity of the script: the optimizer skipped exactly the steps with an inf/NaN gradient, and
    # these include overflows of a *finite* gradient by a too-large scale
    assert [s for _, s, _, _ in ref] == found
    assert any(f for g, (f, *_) in zip(SCRIPT, ref) if math.isfinite(g))
    assert any(not f for g, (f, *_) in zip(SCRIPT, ref) if g == 1e34)
    got = _replay(ex, found, 2.0 ** 16, growth_interval=3)
    for step, ((s, t), (f, _, s0, t0)) in enumerate(zip(got, ref)):
        assert (s, t) == (s0, t0), (f"step {step} (gradient {SCRIPT[step]}, found_inf={f}): got scale {s}, "
                                    f"tracker {t}; GradScaler has scale {s0}, tracker {t0}")
    assert all(isinstance(s, float) and isinstance(t, int) for s, t in got), "return (float, int)"


def test_scaler_update_matches_GradScaler_with_other_factors(ex):
    # factors that are not powers of two: the scale must be rounded to fp32 as GradScaler's is
    script = [INF, NAN, INF, 1.0, 1.0, INF, 1.0, 1.0, 1e34, 1.0, 1.0, 1.0, 1.0, NAN, 1.0]
    kw = dict(growth_factor=3.0, backoff_factor=0.3, growth_interval=2)
    ref = _grad_scaler_run(script, init_scale=1000.0, **kw)
    got = _replay(ex, [f for f, *_ in ref], 1000.0, **kw)
    assert got == [(s, t) for _, _, s, t in ref], f"got {got}\nGradScaler {[(s, t) for _, _, s, t in ref]}"


def _kernel(scale, tracker, found, growth_factor, backoff_factor, interval):
    """One step of GradScaler's own kernel."""
    s = torch.tensor([scale], dtype=torch.float32)
    t = torch.tensor([tracker], dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor([float(found)]), growth_factor, backoff_factor, interval)
    return s.item(), int(t.item())


@pytest.mark.parametrize("interval", [1, 2, 5])
def test_scaler_update_random_sequences_match_the_kernel(ex, interval):
    g = torch.Generator().manual_seed(interval)
    found = (torch.rand(300, generator=g) < 0.15).tolist()
    scale, tracker, ref = 2.0 ** 10, 0, []
    for f in found:
        scale, tracker = _kernel(scale, tracker, f, 2.0, 0.5, interval)
        ref.append((scale, tracker))
    assert _replay(ex, found, 2.0 ** 10, growth_interval=interval) == ref


def test_scaler_update_edge_cases(ex):
    # the growth step: only when the clean count reaches the interval
    assert ex.scaler_update(8.0, 0, False, growth_interval=3) == (8.0, 1)
    assert ex.scaler_update(8.0, 2, False, growth_interval=3) == (16.0, 0)
    assert ex.scaler_update(8.0, 0, False, growth_interval=1) == (16.0, 0), \
        "interval 1: grow after every clean step"
    # an overflow resets the count, even one step short of growing
    assert ex.scaler_update(8.0, 2, True, growth_interval=3) == (4.0, 0)
    assert ex.scaler_update(8.0, 0, True, backoff_factor=0.25) == (2.0, 0)
    # the default interval is GradScaler's 2000
    assert ex.scaler_update(2.0 ** 16, 1998, False) == (2.0 ** 16, 1999)
    assert ex.scaler_update(2.0 ** 16, 1999, False) == (2.0 ** 17, 0)
    # a scale that would grow past fp32's largest number stays; the count still restarts
    big = torch.finfo(torch.float32).max
    for scale in (2.0 ** 127, big, 3.0e38):
        scale = torch.tensor(scale, dtype=torch.float32).item()  # an fp32 number
        expected = _kernel(scale, 0, False, 2.0, 0.5, 1)
        assert expected == (scale, 0), "sanity: the kernel keeps a scale that would overflow"
        got = ex.scaler_update(scale, 0, False, growth_interval=1)
        assert got == expected and math.isfinite(got[0]), \
            f"scale {scale} grown: got {got}, expected {expected}"
    # ... but one that lands on fp32's largest number grows: 2 * (2^127 - 2^103) = max
    scale = 2.0 ** 127 - 2.0 ** 103
    assert _kernel(scale, 0, False, 2.0, 0.5, 1) == (big, 0)
    assert ex.scaler_update(scale, 0, False, growth_interval=1) == (big, 0)
    # tiny scales shrink further (GradScaler does not stop at 1)
    assert ex.scaler_update(1.0, 0, True) == (0.5, 0)


def test_scaler_update_floor_hand_worked(ex):
    assert ex.scaler_update(8.0, 0, True, min_scale=2.0) == (4.0, 0), "above the floor: an ordinary backoff"
    assert ex.scaler_update(3.0, 1, True, min_scale=2.0, growth_interval=3) == (2.0, 0), \
        "3 x 0.5 = 1.5 is below the floor 2: the backoff stops at 2"
    assert ex.scaler_update(2.0, 0, True, min_scale=2.0) == (2.0, 0), "at the floor: it stays"
    assert ex.scaler_update(1.0, 0, True, min_scale=2.0) == (1.0, 0), \
        "a scale already below the floor is not raised by an overflow"
    assert ex.scaler_update(1.0, 0, False, min_scale=2.0, growth_interval=1) == (2.0, 0), \
        "the floor does not change growth"
    floor = torch.tensor(0.1, dtype=torch.float32).item()  # 0.1 is not an fp32 number: the floor is rounded
    assert ex.scaler_update(0.15, 0, True, min_scale=0.1) == (floor, 0)


@pytest.mark.parametrize("min_scale", [1.0, 100.0, 3.0e3])
def test_scaler_update_random_sequences_with_a_floor(ex, min_scale):
    g = torch.Generator().manual_seed(int(min_scale))
    found = (torch.rand(300, generator=g) < 0.4).tolist()
    floor = torch.tensor(min_scale, dtype=torch.float32).item()
    scale, tracker, ref, got = 2.0 ** 10, 0, [], []
    for f in found:  # GradScaler's kernel, its backoff clamped by hand
        new, tracker = _kernel(scale, tracker, f, 3.0, 0.3, 2)
        scale = min(scale, max(new, floor)) if f else new
        ref.append((scale, tracker))
    scale, tracker = 2.0 ** 10, 0
    for f in found:
        scale, tracker = ex.scaler_update(scale, tracker, f, 3.0, 0.3, 2, min_scale=min_scale)
        got.append((scale, tracker))
    assert got == ref, f"min_scale={min_scale}: first difference at step " \
                       f"{next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)}"
    assert min(s for s, _ in got) >= min(floor, 2.0 ** 10), "a backoff crossed the floor"


def test_scaler_update_accepts_a_found_inf_tensor(ex):
    assert ex.scaler_update(8.0, 0, torch.tensor([1.0]), growth_interval=3) == (4.0, 0)
    assert ex.scaler_update(8.0, 2, torch.tensor([0.0]), growth_interval=3) == (16.0, 0)


def test_scaler_update_rejects_bad_input(ex):
    ex.scaler_update(8.0, 0, False)  # a valid call first
    with pytest.raises(ValueError, match="scale must be"):
        ex.scaler_update(0.0, 0, False)
    with pytest.raises(ValueError, match="scale must be"):
        ex.scaler_update(INF, 0, False)
    with pytest.raises(ValueError, match="growth_factor"):
        ex.scaler_update(8.0, 0, False, growth_factor=1.0)
    with pytest.raises(ValueError, match="backoff_factor"):
        ex.scaler_update(8.0, 0, False, backoff_factor=1.0)
    with pytest.raises(ValueError, match="growth_interval"):
        ex.scaler_update(8.0, 0, False, growth_interval=0)
    with pytest.raises(ValueError, match="growth_tracker"):
        ex.scaler_update(8.0, 3, False, growth_interval=3)
    with pytest.raises(ValueError, match="min_scale"):
        ex.scaler_update(8.0, 0, False, min_scale=-1.0)


# --- 2. LossScaler ---------------------------------------------------------------------------------
# Expected values: torch.amp.GradScaler driven through the same script, on the same model and optimizer
# (hysteresis 1); hand-written schedules of scale, growth tracker and hysteresis counter (hysteresis > 1).

# per step: an ordinary gradient, an inf or a NaN planted in it, or a loss x 1e35 that is finite but
# overflows fp32 once multiplied by the scale
SCALER_SCRIPT = ["ok", "huge", "ok", "inf", "ok", "ok", "ok", "nan", "ok", "ok", "ok", "ok", "huge", "ok",
                 "ok", "nan", "nan", "ok", "ok", "ok"]


def _scaler_run(scaler, script, clip=None):
    """Per step: (scale after update, growth tracker, skipped?, parameters) of an SGD+momentum Linear."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for i, kind in enumerate(script):
        opt.zero_grad()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(i))
        loss = model(x).square().mean() * (1e35 if kind == "huge" else 1.0)
        scaler.scale(loss).backward()
        if kind in ("inf", "nan"):
            model.weight.grad[1, 2] = INF if kind == "inf" else NAN
        before = [p.detach().clone() for p in model.parameters()]
        if clip is not None:  # unscale, clip the true gradients, then step (which must not unscale again)
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        tracker = scaler._growth_tracker.item() if isinstance(scaler, torch.amp.GradScaler) \
            else scaler.growth_tracker
        skipped = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        params = [p.detach().clone() for p in model.parameters()]
        out.append((scaler.get_scale(), int(tracker), skipped, params))
    return out


def _assert_same_scaler_run(got, want):
    for step, (a, b) in enumerate(zip(got, want)):
        assert a[:3] == b[:3], (f"step {step} ({SCALER_SCRIPT[step]}): (scale, tracker, skipped) "
                                f"got {a[:3]}, GradScaler {b[:3]}")
        for p, q in zip(a[3], b[3]):
            assert torch.equal(p, q), f"step {step}: the parameters differ from GradScaler's run"


@pytest.mark.parametrize("kw", [dict(init_scale=2.0 ** 16, growth_interval=3),
                                dict(init_scale=1e4, growth_factor=3.0, backoff_factor=0.3,
                                     growth_interval=2)])
def test_LossScaler_matches_GradScaler_on_a_scripted_run(ex, kw):
    want = _scaler_run(torch.amp.GradScaler("cpu", **kw), SCALER_SCRIPT)
    assert any(s for _, _, s, _ in want) and not all(s for _, _, s, _ in want), "sanity: some steps skipped"
    assert want[1][2], "sanity: the huge finite gradient overflows once scaled"
    scaler = ex.LossScaler(**kw, hysteresis=1)
    got = _scaler_run(scaler, SCALER_SCRIPT)
    _assert_same_scaler_run(got, want)
    assert scaler.skipped_steps == sum(s for _, _, s, _ in want)


def test_LossScaler_unscales_once_before_clipping(ex):
    kw = dict(init_scale=2.0 ** 10, growth_interval=2)
    want = _scaler_run(torch.amp.GradScaler("cpu", **kw), SCALER_SCRIPT, clip=0.05)
    _assert_same_scaler_run(_scaler_run(ex.LossScaler(**kw), SCALER_SCRIPT, clip=0.05), want)


def test_LossScaler_scale_and_defaults(ex):
    s = ex.LossScaler()
    assert s.get_scale() == 2.0 ** 16 and s.growth_tracker == 0 and s.skipped_steps == 0
    assert s.hysteresis_tracker == 1, "the default hysteresis is 1: GradScaler's rule"
    assert ex.LossScaler(hysteresis=3).hysteresis_tracker == 3, "the counter starts full"
    loss = torch.tensor(0.75, requires_grad=True)
    scaled = s.scale(loss)
    assert scaled.dtype == torch.float32 and scaled.item() == 0.75 * 2.0 ** 16
    scaled.backward()
    assert loss.grad.item() == 2.0 ** 16, "the backward of the scaled loss carries S"


def test_LossScaler_keeps_its_floor(ex):
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ex.LossScaler(init_scale=8.0, min_scale=2.0)
    for _ in range(4):  # four overflows in a row: 8 -> 4 -> 2 -> 2 -> 2
        p.grad = torch.tensor([1.0, float("inf")])
        s.step(opt)
        s.update()
    assert s.get_scale() == 2.0 and s.skipped_steps == 4, \
        f"scale {s.get_scale()} after four overflows with min_scale 2; the backoff stops at the floor"
    assert torch.equal(p.detach(), torch.ones(2)), "skipped steps leave the weights alone"


# Hand-written schedules. Each entry: the iteration ("C" clean; an overflow planted as "F" inf, "N" NaN,
# "H" a loss x 1e37 that overflows fp32 only once scaled) and, after its update(), (S, growth tracker, h).
# Every overflow is skipped; every clean iteration is applied.
HYSTERESIS_2 = [  # growth_interval 3, init 1024
    ("F", 1024.0, 0, 1),  # absorbed: h 2 -> 1, S holds
    ("C", 1024.0, 1, 1), ("C", 1024.0, 2, 1),  # clean iterations do not restore h
    ("N", 512.0, 0, 0),   # the second overflow since S last grew: back off
    ("H", 256.0, 0, 0),   # h is spent: every overflow backs off until S grows
    ("C", 256.0, 1, 0), ("C", 256.0, 2, 0), ("C", 512.0, 0, 2),  # growth restores h
    ("F", 512.0, 0, 1), ("C", 512.0, 1, 1), ("N", 256.0, 0, 0),
    ("C", 256.0, 1, 0), ("C", 256.0, 2, 0), ("C", 512.0, 0, 2),
    ("C", 512.0, 1, 2), ("H", 512.0, 0, 1),  # an absorbed overflow still restarts the growth tracker
    ("C", 512.0, 1, 1), ("C", 512.0, 2, 1), ("C", 1024.0, 0, 2),
]
HYSTERESIS_3_FLOOR = [  # growth_interval 2, init 1024, min_scale 256
    ("F", 1024.0, 0, 2), ("N", 1024.0, 0, 1), ("H", 512.0, 0, 0), ("F", 256.0, 0, 0),
    ("F", 256.0, 0, 0),  # the floor holds
    ("C", 256.0, 1, 0), ("C", 512.0, 0, 3),
    ("N", 512.0, 0, 2), ("C", 512.0, 1, 2), ("F", 512.0, 0, 1), ("C", 512.0, 1, 1), ("C", 1024.0, 0, 3),
]


def _hysteresis_run(scaler, schedule):
    """Drive ``scaler`` through ``schedule`` on p = (1, 1), loss sum(p), SGD lr 1/8; check every iteration.

    S stays a power of two, so an unscaled clean gradient is exactly (1, 1) and a step moves p by exactly
    1/8: a gradient divided twice (or not at all) shows in the bits. Odd iterations unscale before step.
    """
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.125)
    applied = 0
    for i, (kind, scale, tracker, h) in enumerate(schedule):
        opt.zero_grad()
        scaler.scale(p.sum() * (1e37 if kind == "H" else 1.0)).backward()
        if kind in ("F", "N"):
            p.grad[1] = INF if kind == "F" else NAN
        before = p.detach().clone()
        if i % 2:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        state = (scaler.get_scale(), scaler.growth_tracker, scaler.hysteresis_tracker)
        assert state == (scale, tracker, h), \
            f"iteration {i} ({kind}): (S, growth tracker, h) = {state}, want {(scale, tracker, h)}"
        if kind == "C":
            applied += 1
            assert p.grad.tolist() == [1.0, 1.0], f"iteration {i}: the gradient must be divided by S once"
            assert p.detach().tolist() == [1.0 - applied / 8] * 2, f"iteration {i}: a clean step is applied"
        else:
            assert torch.equal(p.detach(), before), f"iteration {i}: an overflowing step must be skipped"
    assert scaler.skipped_steps == sum(kind != "C" for kind, *_ in schedule)


def test_LossScaler_hysteresis_follows_a_hand_written_schedule(ex):
    _hysteresis_run(ex.LossScaler(init_scale=1024.0, growth_interval=3, hysteresis=2), HYSTERESIS_2)


def test_LossScaler_hysteresis_with_a_floor(ex):
    _hysteresis_run(ex.LossScaler(init_scale=1024.0, growth_interval=2, min_scale=256.0, hysteresis=3),
                    HYSTERESIS_3_FLOOR)


def test_LossScaler_refuses_misuse(ex):
    p = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    s = ex.LossScaler(init_scale=4.0)
    s.scale(p.sum()).backward()
    assert s.unscale_(opt) is False and p.grad.tolist() == [1.0, 1.0]  # a valid call first
    with pytest.raises(RuntimeError, match="unscale_"):
        s.unscale_(opt)
    s.step(opt)
    with pytest.raises(RuntimeError, match="step"):
        s.step(opt)
    s.update()
    with pytest.raises(RuntimeError, match="update"):
        s.update()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="hysteresis"):
            ex.LossScaler(hysteresis=bad)


# --- 3. train_with_loss_scaling --------------------------------------------------------------------
# Expected values: a hand-written loop (half model, fp32 masters, micro-batches summed in fp32,
# torch.amp.GradScaler's unscale_ / clip_grad_norm_ / step / update), and fp32 training of the same model
# on the same batches.

TINY = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
TB, TT = 8, 16


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-30, weight_decay=0.0)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _xent(model, x, y):
    logits, _ = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def _mse(model, x, y):
    return (model(x.to(model[0].weight.dtype)).float() - y).square().mean()


def _reference_loop(model, steps, scaler, make_optimizer=_adamw, loss_fn=_xent, max_norm=None):
    """Micikevicius et al.'s loop written out around torch.amp.GradScaler, with micro-batches and a clip."""
    half = copy.deepcopy(model).half()
    for m in half.modules():
        if type(m) is nn.LayerNorm:  # statistics in fp32, weights in half
            m.forward = (lambda ln: lambda x: F.layer_norm(x.float(), ln.normalized_shape, ln.weight.float(),
                                                           ln.bias.float(), ln.eps).to(x.dtype))(m)
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt, losses, applied, norms = make_optimizer(masters), [], [], []
    for step in steps:
        total = 0.0
        for x, y in step:
            loss = loss_fn(half, x, y)
            scaler.scale(loss / len(step)).backward()
            for m, h in zip(masters, half.parameters()):
                m.grad = h.grad.float() if m.grad is None else m.grad + h.grad.float()
                h.grad = None
            total += loss.item()
        before = [m.detach().clone() for m in masters]
        scaler.unscale_(opt)
        norms.append(None if max_norm is None else torch.nn.utils.clip_grad_norm_(masters, max_norm).item())
        scaler.step(opt)
        scaler.update()
        applied.append(not all(torch.equal(a, m) for a, m in zip(before, masters)))
        with torch.no_grad():
            for m, h in zip(masters, half.parameters()):
                h.copy_(m)
                m.grad = None
        losses.append(total / len(step))
    return {"losses": losses, "applied": applied, "grad_norms": norms, "masters": masters}


def _assert_same_run(got, want, model):
    assert got["losses"] == want["losses"], f"losses {got['losses']}\nreference {want['losses']}"
    assert got["applied"] == want["applied"], f"applied {got['applied']}, reference {want['applied']}"
    for step, (a, b) in enumerate(zip(got["grad_norms"], want["grad_norms"], strict=True)):
        both_overflowed = None not in (a, b) and not math.isfinite(a) and not math.isfinite(b)
        assert a == b or both_overflowed, f"step {step}: grad norm {a}, reference {b}"
    for step_master, ref_master in zip(got["masters"], want["masters"], strict=True):
        assert step_master.dtype == torch.float32 and torch.equal(step_master, ref_master), "masters differ"
    for h, m in zip(got["half_model"].parameters(), got["masters"]):
        assert h.dtype == torch.float16 and torch.equal(h, m.detach().half()), \
            "the half model is the rounded master"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "the fp32 model must stay as it was"


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only add contention
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("scaler", ["GradScaler", "LossScaler"])
def test_train_with_loss_scaling_equals_a_GradScaler_loop(ex, one_thread, scaler):
    torch.manual_seed(1)
    model = GPT(TINY)
    data = MarkovCorpus(32, seed=0)
    steps = [[data.batch(3 * s + j, 4, TT) for j in range(3)] for s in range(6)]  # 3 micro-batches a step
    kw = dict(init_scale=2.0 ** 24, growth_interval=2)  # 2^24 overflows fp16's gradients: steps are skipped
    want = _reference_loop(model, steps, torch.amp.GradScaler("cpu", **kw), max_norm=0.5)
    assert not all(want["applied"]) and any(want["applied"]), "sanity: some steps skipped, others applied"
    assert any(n > 0.5 for n in want["grad_norms"] if math.isfinite(n)), "sanity: the clip binds"
    use = torch.amp.GradScaler("cpu", **kw) if scaler == "GradScaler" else ex.LossScaler(**kw)
    got = ex.train_with_loss_scaling(model, steps, _adamw, use, torch.float16, loss_fn=_xent, max_norm=0.5)
    _assert_same_run(got, want, model)


def _mlp_steps(kinds):
    """One step per string, one micro-batch per letter: "c" clean, "o" targets of 1e5 whose fp16 gradient
    overflows at S = 2^10 (d loss / d output ~ 2e5 / 12 / 3 per element, times S: far above fp16's 65504)."""
    g = torch.Generator().manual_seed(5)
    return [[(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g) * (1e5 if c == "o" else 1.0))
             for c in kind] for kind in kinds]


def _mlp():
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def test_train_with_loss_scaling_skips_a_step_whose_middle_micro_batch_overflowed(ex, one_thread):
    model, steps = _mlp(), _mlp_steps(["ccc", "coc", "ccc", "cco"])
    kw = dict(init_scale=2.0 ** 10, growth_interval=100)
    want = _reference_loop(model, steps, torch.amp.GradScaler("cpu", **kw), _sgd, _mse, max_norm=1.0)
    assert want["applied"] == [True, False, True, False], "sanity: the reference skips steps 2 and 4"
    got = ex.train_with_loss_scaling(model, steps, _sgd, torch.amp.GradScaler("cpu", **kw), torch.float16,
                                     loss_fn=_mse, max_norm=1.0)
    _assert_same_run(got, want, model)
    # with hysteresis 2 the first overflow leaves S where it was: the step is skipped all the same
    scaler = ex.LossScaler(**kw, hysteresis=2)
    got = ex.train_with_loss_scaling(model, steps, _sgd, scaler, torch.float16, loss_fn=_mse, max_norm=1.0)
    assert got["applied"] == [True, False, True, False], \
        f"applied {got['applied']}: a step is skipped when the scaler finds an overflow, not when S falls"
    assert scaler.get_scale() == 2.0 ** 9 and scaler.skipped_steps == 2
    prefix = ex.train_with_loss_scaling(model, steps[:2], _sgd, ex.LossScaler(**kw, hysteresis=2),
                                        torch.float16, loss_fn=_mse, max_norm=1.0)
    want = _reference_loop(model, steps[:2], torch.amp.GradScaler("cpu", **kw), _sgd, _mse, max_norm=1.0)
    _assert_same_run(prefix, want, model)


def test_train_with_loss_scaling_clips_only_when_the_clip_binds(ex, one_thread):
    model, steps = _mlp(), _mlp_steps(["cc", "cc", "cc"])
    kw = dict(init_scale=2.0 ** 10, growth_interval=100)
    run = lambda max_norm: ex.train_with_loss_scaling(model, steps, _sgd, torch.amp.GradScaler("cpu", **kw),
                                                      torch.float16, loss_fn=_mse, max_norm=max_norm)
    free, loose, tight = run(None), run(1e3), run(0.05)
    assert free["grad_norms"] == [None] * 3
    want = _reference_loop(model, steps, torch.amp.GradScaler("cpu", **kw), _sgd, _mse, max_norm=0.05)
    assert min(want["grad_norms"]) > 0.05, "sanity: the clip binds at every step"
    _assert_same_run(tight, want, model)
    want_loose = _reference_loop(model, steps, torch.amp.GradScaler("cpu", **kw), _sgd, _mse, max_norm=1e3)
    assert max(want_loose["grad_norms"]) < 1e3, "sanity: the loose clip never binds"
    _assert_same_run(loose, want_loose, model)
    for a, b in zip(free["masters"], loose["masters"], strict=True):
        assert torch.equal(a, b), "a clip that does not bind must change no bit"
    assert not all(torch.equal(a, c) for a, c in zip(free["masters"], tight["masters"])), \
        "a clip that binds must change the update"


def test_train_with_loss_scaling_learns_what_fp32_learns_from_tiny_gradients(ex, one_thread):
    # the loss x 1e-4 stands in for a network whose gradients are naturally tiny (median ~1e-7): most of
    # them are subnormal or zero in fp16. AdamW with eps ~ 0 does not notice the factor in fp32.
    n_steps, mult = 40, 1e-4
    data = MarkovCorpus(32, seed=0)
    batches = [data.batch(s, TB, TT) for s in range(n_steps)]
    steps = [[b] for b in batches]
    small = lambda m, x, y: _xent(m, x, y) * mult
    torch.manual_seed(0)
    model = GPT(TINY)
    ref = copy.deepcopy(model)
    opt, fp32 = _adamw(ref.parameters()), []
    for x, y in batches:
        opt.zero_grad()
        loss = small(ref, x, y)
        loss.backward()
        opt.step()
        fp32.append(loss.item())
    fp32 = torch.tensor(fp32) / mult
    drop = lambda curve: (curve[0] - curve[-10:].mean()).item()
    assert drop(fp32) > 0.25, "sanity: fp32 learns"
    scaler = ex.LossScaler()
    scaled = ex.train_with_loss_scaling(model, steps, _adamw, scaler, torch.float16, loss_fn=small)
    raw = ex.train_with_loss_scaling(model, steps, _adamw, None, torch.float16, loss_fn=small)
    bf16 = ex.train_with_loss_scaling(model, steps, _adamw, None, torch.bfloat16, loss_fn=small)
    assert raw["applied"] == [True] * n_steps, "without a scaler every step is applied"
    scaled, raw, bf16 = (torch.tensor(r["losses"]) / mult for r in (scaled, raw, bf16))
    # following fp32: off by rounding noise, far less than what fp32 learns (1/100 of it); an unscaled
    # fp16 run loses most gradients to underflow and learns less than 0.4 of it
    follows = drop(fp32) / 100
    assert (scaled - fp32).abs().max() < follows, "fp16 with loss scaling should follow fp32"
    assert scaler.skipped_steps == 0
    assert drop(raw) < 0.4 * drop(fp32), "fp16 without loss scaling should barely learn"
    # bf16 has fp32's range and needs no scaler; its rounding is 2^3 times fp16's
    assert (bf16 - fp32).abs().max() < follows * roundoff(torch.bfloat16) / roundoff(torch.float16)


def test_train_with_loss_scaling_rejects_bad_input(ex, one_thread):
    torch.manual_seed(0)
    model = GPT(TINY)
    batch = MarkovCorpus(32, seed=0).batch(0, 2, 8)
    ex.train_with_loss_scaling(model, [[batch]], _adamw, None, torch.bfloat16, max_norm=1.0)  # a valid call
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        ex.train_with_loss_scaling(model, [[batch]], _adamw, None, torch.float32)
    with pytest.raises(TypeError, match="scaler"):
        ex.train_with_loss_scaling(model, [[batch]], _adamw, object())
    for bad in (0.0, -1.0, INF, NAN):
        with pytest.raises(ValueError, match="max_norm"):
            ex.train_with_loss_scaling(model, [[batch]], _adamw, None, torch.bfloat16, max_norm=bad)
    for bad in ([batch], [[]]):  # a step that is a bare (x, y), and an empty step
        with pytest.raises(ValueError, match="micro-batches"):
            ex.train_with_loss_scaling(model, bad, _adamw, None, torch.bfloat16)


# --- 4. count_lost_bf16_updates --------------------------------------------------------------------
# Expected values: the neighbours of each bf16 weight read from its bits (a rule independent of the
# cost model), and torch.optim.SGD's own step on a copy of the model.


def _lost_by_bits(w, u):
    """True where bf16 weight ``w`` (any sign) stays w after adding fp32 update ``u``: |u| below half the
    gap to the neighbour on its side, or exactly half with w even (ties go to even)."""
    a = w.float().abs()
    bits = a.view(torch.int32)
    up = (bits + 0x10000).view(torch.float32).double()  # the next bf16 magnitude
    down = (bits - 0x10000).clamp(min=0).view(torch.float32).double()
    a = a.double()
    gap_up, gap_down = up - a, torch.where(a > 0, a - down, up - a)
    v = u.double() * torch.where(w.float() < 0, -1.0, 1.0).double()  # the update along |w|
    even = ((bits >> 16) & 1) == 0
    inside = (v < gap_up / 2) & (v > -gap_down / 2)
    if (a == 0).any():  # at 0 both neighbours are 2^-133 away
        inside = inside | ((a == 0) & (v.abs() < gap_up / 2))
    tie = ((v == gap_up / 2) | (v == -gap_down / 2)) & even
    return inside | tie


@pytest.mark.parametrize("lr", [0.01, 1.0])
def test_count_lost_bf16_updates_predicts_and_counts(ex, one_thread, lr):
    torch.manual_seed(0)
    model = GPT(TINY).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    x, y = MarkovCorpus(32, seed=0).batch(0, TB, TT)
    got = ex.count_lost_bf16_updates(model, x, y, lr, loss_fn=_xent)
    _xent(ref, x, y).backward()
    before = [p.detach().clone() for p in ref.parameters()]
    updates = [-lr * p.grad.float() for p in ref.parameters()]
    torch.optim.SGD(ref.parameters(), lr=lr).step()
    moved = [u != 0 for u in updates]
    updated = sum(m.sum().item() for m in moved)
    predicted = sum((_lost_by_bits(w, u) & m).sum().item() for w, u, m in zip(before, updates, moved))
    measured = sum(((p.detach() == w) & m).sum().item() for p, w, m in zip(ref.parameters(), before, moved))
    assert got["updated"] == updated
    assert abs(got["predicted"] - predicted) <= 0.005 * updated, \
        f"predicted {got['predicted']} lost updates; bf16's bit layout says {predicted}"
    assert got["measured"] == measured, \
        f"measured {got['measured']}; SGD's own step leaves {measured} unmoved"
    assert abs(got["predicted"] - got["measured"]) <= 0.005 * updated, "prediction and count should agree"
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q), "the model should have taken SGD's step"
    if lr == 0.01:  # a small learning rate: most of the step rounds away
        assert got["measured"] > 0.5 * updated
    else:
        assert got["measured"] < 0.3 * updated


def test_count_lost_bf16_updates_leaves_zero_updates_out(ex, one_thread):
    # a bf16 linear layer fed inputs whose last 4 features are 0: those weight columns get a zero gradient,
    # so a zero update, which moves nothing and loses nothing
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(torch.bfloat16)
    x = torch.randn(16, 8).to(torch.bfloat16)
    x[:, 4:] = 0
    y = torch.randn(16, 4)
    mse = lambda m, x, y: ((m(x).float() - y) ** 2).mean()
    ref = copy.deepcopy(model)
    got = ex.count_lost_bf16_updates(model, x, y, 1e-3, loss_fn=mse)
    mse(ref, x, y).backward()
    before = [p.detach().clone() for p in ref.parameters()]
    moved = [p.grad != 0 for p in ref.parameters()]
    torch.optim.SGD(ref.parameters(), lr=1e-3).step()
    updated = sum(m.sum().item() for m in moved)
    measured = sum(((p.detach() == w) & m).sum().item() for p, w, m in zip(ref.parameters(), before, moved))
    assert updated == 4 * 4 + 4, "sanity: half the weight columns have a zero gradient"
    assert got["updated"] == updated, f"updated {got['updated']}; only the {updated} nonzero updates count"
    assert got["measured"] == measured and got["predicted"] <= updated, \
        f"measured {got['measured']} (expected {measured}), predicted {got['predicted']}: count only " \
        "elements whose update is not zero"


def test_count_lost_bf16_updates_rejects_bad_input(ex):
    torch.manual_seed(0)
    x, y = MarkovCorpus(32, seed=0).batch(0, 2, 8)
    ex.count_lost_bf16_updates(GPT(TINY).to(torch.bfloat16), x, y, 0.1)  # a valid call first
    with pytest.raises(TypeError, match="bf16"):
        ex.count_lost_bf16_updates(GPT(TINY), x, y, 0.1)
    with pytest.raises(ValueError, match="lr"):
        ex.count_lost_bf16_updates(GPT(TINY).to(torch.bfloat16), x, y, 0.0)


# --- 5. stochastic_round_to_bf16 -------------------------------------------------------------------

BF16_MANTISSA = 7
BF16_MIN_NORMAL_EXP = -126  # bf16 has fp32's exponent range


def _neighbours(x):
    """float64 (lo, hi): the bf16 numbers around fp32 ``x``, towards zero and away from it."""
    x = x.double()
    a = x.abs()
    exp = torch.floor(torch.log2(torch.where(a > 0, a, torch.ones_like(a)))).clamp(min=BF16_MIN_NORMAL_EXP)
    ulp = torch.exp2(exp - BF16_MANTISSA)
    lo = torch.floor(a / ulp) * ulp
    return torch.sign(x) * lo, torch.sign(x) * (lo + ulp), ulp


def _values(seed=0):
    """fp32 values over many binades and both signs, mostly not bf16-representable; and a few subnormals."""
    g = torch.Generator().manual_seed(seed)
    mant = 1 + torch.rand(48, generator=g)
    exps = torch.randint(-20, 20, (48,), generator=g).double()
    signs = torch.where(torch.rand(48, generator=g) < 0.5, -1.0, 1.0).double()
    x = (signs * mant.double() * torch.exp2(exps)).float()
    tiny = torch.tensor([3.3e-39, -1.7e-39, 2.0e-40, 1.1e-38], dtype=torch.float32)  # below 2^-126
    return torch.cat([x, tiny])


def _round_to_nearest(x, generator):
    return x.to(torch.bfloat16)


def _bias_in_standard_errors(round_fn, x, n, seed):
    """|mean of n roundings - x| in standard errors of the mean, per element (0 where x is representable)."""
    g = torch.Generator().manual_seed(seed)
    samples = round_fn(x.expand(n, -1).contiguous(), g).double()
    lo, hi, ulp = _neighbours(x)
    p = ((x.double() - lo) / (hi - lo)).abs()  # P(away from zero)
    se = torch.sqrt(p * (1 - p)) * ulp / math.sqrt(n)
    err = (samples.mean(0) - x.double()).abs()
    return torch.where(se > 0, err / se.clamp(min=1e-300), err * math.inf)


def test_stochastic_round_to_bf16_is_unbiased(ex):
    x = _values()
    z = _bias_in_standard_errors(ex.stochastic_round_to_bf16, x, n=4000, seed=1)
    worst = int(z.argmax())
    assert z.max() < 5, (f"the mean of 4000 roundings of x = {x[worst].item()!r} is {z[worst].item():.1f} "
                         "standard errors from x; stochastic rounding must satisfy E[round(x)] = x")
    # the check can fail: round-to-nearest is biased by many standard errors
    assert _bias_in_standard_errors(_round_to_nearest, x, n=4000, seed=1).max() > 50


def test_stochastic_round_to_bf16_gives_a_neighbour(ex):
    x = _values(seed=2)
    out = ex.stochastic_round_to_bf16(x.expand(200, -1).contiguous(), torch.Generator().manual_seed(3))
    assert out.dtype == torch.bfloat16 and out.shape == (200, x.numel())
    lo, hi, _ = _neighbours(x)
    o = out.double()
    ok = (o == lo) | (o == hi)
    assert ok.all(), (f"x = {x[(~ok).any(0)][0].item()!r} rounded to a number that is not one of its two "
                      "bf16 neighbours")
    # both neighbours occur (x is not representable): the rounding is random, not a fixed direction
    assert ((o == lo).any(0) & (o == hi).any(0)).float().mean() > 0.9


def test_stochastic_round_to_bf16_keeps_representable_values(ex):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1000, generator=g)
    x = (x * 10.0 ** torch.randint(-8, 8, (1000,), generator=g)).to(torch.bfloat16)
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -2.0, 2.0 ** -133, torch.finfo(torch.bfloat16).max],
                                   dtype=torch.bfloat16)]).float()
    for seed in range(5):
        out = ex.stochastic_round_to_bf16(x, torch.Generator().manual_seed(seed))
        assert torch.equal(out.float(), x), "a value bf16 already holds must come back unchanged"
    assert torch.equal(torch.signbit(out), torch.signbit(x)), "the sign of zero is kept"


def test_stochastic_round_to_bf16_special_values(ex):
    x = torch.tensor([INF, -INF, NAN, -NAN], dtype=torch.float32)
    # NaNs whose mantissa has only low bits set: truncating those bits alone would make them inf
    # the last two are negative
    low_nans = torch.tensor([0x7F800001, 0x7F800100, -0x007FFFFF, -0x007FF000], dtype=torch.int32)
    x = torch.cat([x, low_nans.view(torch.float32)])
    assert torch.isnan(x[2:]).all()
    for seed in range(20):
        out = ex.stochastic_round_to_bf16(x, torch.Generator().manual_seed(seed))
        assert out[0] == INF and out[1] == -INF, f"infinities must stay: {out}"
        assert torch.isnan(out[2:]).all(), f"NaNs must stay NaN: {out}"


def test_stochastic_round_to_bf16_uses_only_the_generator(ex):
    x = _values(seed=5)
    state = torch.get_rng_state()
    a = ex.stochastic_round_to_bf16(x, torch.Generator().manual_seed(7))
    assert torch.equal(torch.get_rng_state(), state), \
        "the global random stream was used; draw from `generator`"
    torch.manual_seed(123)
    b = ex.stochastic_round_to_bf16(x, torch.Generator().manual_seed(7))
    assert torch.equal(a, b), "the same generator seed must give the same rounding"
    c = ex.stochastic_round_to_bf16(x.expand(50, -1).contiguous(), torch.Generator().manual_seed(8))
    assert not all(torch.equal(a, row) for row in c), "different random bits should round differently"


def test_stochastic_round_to_bf16_lets_tiny_updates_add_up(ex):
    # w = 1 in bf16 has ulp 2^-7; an update of 1e-3 is below half of it (Gupta et al. §3)
    u, steps, n = 1e-3, 500, 256
    ulp = 2.0 ** -7
    assert u < ulp / 2
    g = torch.Generator().manual_seed(9)
    w_sr = torch.ones(n, dtype=torch.bfloat16)
    w_rn = torch.ones(n, dtype=torch.bfloat16)
    for _ in range(steps):
        w_sr = ex.stochastic_round_to_bf16(w_sr.float() + u, g)
        w_rn = (w_rn.float() + u).to(torch.bfloat16)
    assert torch.equal(w_rn, torch.ones(n, dtype=torch.bfloat16)), "sanity: round-to-nearest never moves"
    target = 1.0 + steps * u
    # each step adds variance at most ulp^2/4 (ulp <= 2^-7 below 2); the mean over n weights
    se = math.sqrt(steps * (ulp ** 2) / 4 / n)
    mean = w_sr.double().mean().item()
    assert abs(mean - target) < 5 * se, (f"after {steps} updates of {u}, stochastically rounded weights "
                                         f"average {mean:.4f}; expected {target} (within {5 * se:.4f})")
    assert w_sr.dtype == torch.bfloat16


def test_stochastic_round_to_bf16_rejects_bad_input(ex):
    g = torch.Generator().manual_seed(0)
    ex.stochastic_round_to_bf16(torch.ones(3), g)  # a valid call first
    with pytest.raises(TypeError, match="float32"):
        ex.stochastic_round_to_bf16(torch.ones(3, dtype=torch.float16), g)
    with pytest.raises(TypeError, match="float32"):
        ex.stochastic_round_to_bf16([1.0, 2.0], g)
    with pytest.raises(TypeError, match="torch.Generator"):
        ex.stochastic_round_to_bf16(torch.ones(3), 0)


# --- 6. kahan_bf16_update --------------------------------------------------------------------------


def _bf16_ulp(x):
    """float64 gap between neighbouring bf16 numbers at |x| (normal range)."""
    return torch.exp2(torch.floor(torch.log2(x.double().abs())) - BF16_MANTISSA)


def _kahan_bound_ulps(steps, largest, update, at):
    """Kahan's bf16 weight against the exact sum after ``steps`` updates of at most ``update``, in ulps of
    ``at``: ``largest`` the largest |weight| the run passes (the module docstring's worst case)."""
    u16, u32 = roundoff(torch.bfloat16), roundoff(torch.float32)
    ulp, w = _bf16_ulp(largest), largest.double().abs()
    c = ulp / 2 + u32 * w  # what the compensation can hold
    per_step = u16 * c + u32 * (update.double().abs() + 2 * ulp + w)
    return (c + steps * per_step) / _bf16_ulp(at)


def test_kahan_bf16_update_single_steps(ex):
    bf = torch.bfloat16
    w, c = torch.tensor([1.0, 1.0, 1.0, 4.0], dtype=bf), torch.zeros(4, dtype=bf)
    u = torch.tensor([0.5, 1e-3, 0.0, -2.0 ** -6])
    new_w, new_c = ex.kahan_bf16_update(w, c, u)
    assert new_w.dtype == bf and new_c.dtype == bf
    # representable sums: exact, nothing lost; a tiny update: the weight stays, the compensation holds it
    torch.testing.assert_close(new_w.double(),
                               torch.tensor([1.5, 1.0, 1.0, 4.0 - 2.0 ** -6], dtype=torch.float64),
                               rtol=0, atol=0)
    assert new_c[0] == 0 and new_c[2] == 0 and new_c[3] == 0
    assert new_c[1] == torch.tensor(1e-3).to(bf), \
        f"the lost 1e-3 should be in the compensation, got {new_c[1]}"
    # the inputs are left alone
    assert torch.equal(w, torch.tensor([1.0, 1.0, 1.0, 4.0], dtype=bf))
    assert torch.equal(c, torch.zeros(4, dtype=bf))


def test_kahan_bf16_update_keeps_the_update_in_fp32(ex):
    # w = 1 (ulp 2^-7), u = 2^-8 + 2^-20: just above half an ulp, by less than bf16 can hold beside 2^-8.
    # In fp32, w + u = 1 + 2^-8 + 2^-20 rounds up to 1 + 2^-7 and the compensation is u - 2^-7 (negative);
    # rounded to bf16 first, u becomes 2^-8, a tie, and the weight would stay at 1 (ties to even).
    bf = torch.bfloat16
    u = torch.tensor([2.0 ** -8 + 2.0 ** -20])
    new_w, new_c = ex.kahan_bf16_update(torch.ones(1, dtype=bf), torch.zeros(1, dtype=bf), u)
    assert new_w.item() == 1 + 2.0 ** -7, \
        f"w + u should round up to 1 + 2^-7, got {new_w.item()}: keep u in fp32"
    assert new_c.item() == torch.tensor(2.0 ** -8 + 2.0 ** -20 - 2.0 ** -7).to(bf).item(), \
        f"the compensation should hold u - 2^-7, got {new_c.item()}"


def test_kahan_bf16_update_tracks_the_exact_sum_of_tiny_updates(ex):
    u, steps = 1e-4, 3000  # 1e-4 is 1/78 of an ulp at 1.0
    w, c = torch.ones(1, dtype=torch.bfloat16), torch.zeros(1, dtype=torch.bfloat16)
    plain = torch.ones(1, dtype=torch.bfloat16)
    ref = torch.ones(1, dtype=torch.float32)  # the fp32 master weight
    upd = torch.full((1,), u)
    for _ in range(steps):
        w, c = ex.kahan_bf16_update(w, c, upd)
        plain = (plain.float() + upd).to(torch.bfloat16)
        ref = ref + upd
    assert plain.item() == 1.0, "sanity: plain bf16 never moves"
    err = (w.double() - ref.double()).abs() / _bf16_ulp(ref)
    # the fp32 running sum rounds too: by u_fp32·|ref| a step
    own = steps * roundoff(torch.float32) * ref.double() / _bf16_ulp(ref)
    allowed = (_kahan_bound_ulps(steps, ref, upd, ref) + own).item()
    assert err.item() <= allowed, (f"after {steps} updates of {u} the weight is {w.item()}, the fp32 sum "
                                   f"{ref.item():.5f}: {err.item():.2f} ulp apart (at most {allowed:.2f})")
    assert w.item() > 1.25, \
        f"the compensated weight should have moved to about {ref.item():.3f}, is {w.item()}"


def test_kahan_bf16_update_random_updates_against_float64(ex):
    g = torch.Generator().manual_seed(11)
    n, steps = 64, 1500
    w0 = (1 + torch.rand(n, generator=g)) * torch.exp2(torch.randint(-3, 3, (n,), generator=g).float())
    w, c = w0.to(torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    plain = w.clone()
    ref = w.double()
    largest, biggest_update = ref.abs(), torch.zeros(n, dtype=torch.float64)
    for _ in range(steps):
        # updates of 1e-4..1e-3 relative to the weight, both signs: each below half an ulp
        sign = torch.where(torch.rand(n, generator=g) < 0.3, -1.0, 1.0)
        u = sign * w0 * 1e-4 * (1 + 9 * torch.rand(n, generator=g))
        w, c = ex.kahan_bf16_update(w, c, u)
        plain = (plain.float() + u).to(torch.bfloat16)
        ref += u.double()
        largest = torch.maximum(largest, ref.abs())
        biggest_update = torch.maximum(biggest_update, u.double().abs())
    ulp = _bf16_ulp(ref)
    err = (w.double() - ref).abs() / ulp
    allowed = _kahan_bound_ulps(steps, largest + ulp, biggest_update, ref)  # + ulp: w may lead the sum by c
    worst = int((err - allowed).argmax())
    assert (err <= allowed).all(), (f"the Kahan-compensated weights drifted {err[worst].item():.2f} ulp from "
                                    f"the float64 sum (at most {allowed[worst].item():.2f})")
    # the check can fail: the uncompensated weights are far off
    assert ((plain.double() - ref).abs() / ulp > allowed).any()
    assert ((plain.double() - ref).abs() / ulp).max().item() > 10


def test_kahan_bf16_update_rejects_bad_input(ex):
    bf = torch.bfloat16
    w, c, u = torch.ones(4, dtype=bf), torch.zeros(4, dtype=bf), torch.full((4,), 1e-3)
    ex.kahan_bf16_update(w, c, u)  # a valid call first
    with pytest.raises(ValueError, match="compensation shape"):
        ex.kahan_bf16_update(w, torch.zeros(3, dtype=bf), u)
    with pytest.raises(ValueError, match="update shape"):
        ex.kahan_bf16_update(w, c, torch.zeros(2, 2))
    with pytest.raises(TypeError, match="bfloat16"):
        ex.kahan_bf16_update(w.float(), c, u)
    with pytest.raises(TypeError, match="bfloat16"):
        ex.kahan_bf16_update(w, c.float(), u)
    with pytest.raises(TypeError, match="floating-point"):
        ex.kahan_bf16_update(w, c, torch.zeros(4, dtype=torch.int64))


# --- 7. quantize_tiles_1x128 -----------------------------------------------------------------------
# Expected values: Python loops over the tiles (amax, 448 / amax, the cast of each element), the
# float64 rounding of costmodel.round_to_format, and a tensor without the outlier.

def _tiles_by_hand(x, tile, power_of_two=False):
    M, K = x.shape
    n = math.ceil(K / tile)
    scales = torch.empty(M, n)
    q = torch.empty(M, K)
    for i in range(M):
        for j in range(n):
            part = x[i, j * tile:(j + 1) * tile].float()
            amax = part.abs().max().item()
            s = torch.tensor(448.0, dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32) \
                if amax > 0 else torch.tensor(1.0)
            if power_of_two:  # the largest power of two not above the fp32 quotient
                mantissa, e = math.frexp(s.item())
                s = torch.tensor(2.0 ** (e - 1), dtype=torch.float32)
            scales[i, j] = s
            q[i, j * tile:(j + 1) * tile] = (part * s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return q, scales


@pytest.mark.parametrize("power_of_two", [False, True])
@pytest.mark.parametrize("shape, tile", [((5, 300), 128), ((3, 128), 128), ((4, 7), 3), ((2, 5), 8)])
def test_quantize_tiles_1x128_equals_a_hand_computation(ex, shape, tile, power_of_two):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g) * torch.exp2(torch.randint(-8, 8, shape, generator=g).float())
    x[-1, :] = 0.0  # an all-zero row: every tile of it gets scale 1
    before = x.clone()
    q, scales = ex.quantize_tiles_1x128(x, tile, power_of_two=power_of_two)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (shape[0], math.ceil(shape[1] / tile))
    want_q, want_s = _tiles_by_hand(x, tile, power_of_two)
    torch.testing.assert_close(scales, want_s, rtol=0, atol=0)
    assert torch.equal(q.float(), want_q)
    assert torch.equal(x, before), "x must not change"
    assert torch.equal(scales[-1], torch.ones_like(scales[-1]))


def test_quantize_tiles_1x128_round_trip_and_default_tile(ex):
    from minitorch_dist.costmodel.precision import round_to_format

    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 384, generator=g)
    q, scales = ex.quantize_tiles_1x128(x)  # the default tile is 128
    assert scales.shape == (16, 3)
    per = scales.repeat_interleave(128, dim=1)
    # every tile's largest magnitude lands on 448, and each value is rounded to the nearest E4M3
    assert torch.equal(q.float().abs().view(16, 3, 128).amax(-1), torch.full((16, 3), 448.0))
    assert torch.equal(q.double(), round_to_format((x * per).double().clamp(-448, 448), "fp8_e4m3"))
    err = (q.float() / per - x).abs()
    assert (err <= x.abs() * 2.0 ** -4 + 2.0 ** -10 / per).all()  # half an ulp, or the subnormal floor


def test_quantize_tiles_1x128_power_of_two_scales(ex):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 256, generator=g) * torch.exp2(torch.randint(-6, 6, (8, 1), generator=g).float())
    x[0, :128] = 448.0 / 3  # 448 / amax = 3 exactly: the scale is 2, and the tile's amax lands on 298.67
    x[1, :128] = 7.0        # 448 / 7 = 64: already a power of two, kept
    q, scales = ex.quantize_tiles_1x128(x, power_of_two=True)
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5), f"scales {scales[mantissa != 0.5][:4].tolist()} are not powers of two"
    assert scales[0, 0].item() == 2.0 and scales[1, 0].item() == 64.0
    landed = (x.abs() * scales.repeat_interleave(128, dim=1)).view(8, 2, 128).amax(-1)
    assert (landed > 224).all() and (landed <= 448).all(), "each tile's amax lands in (224, 448]"
    # the scaling itself is exact: q / s is the E4M3 rounding of x * s, divided back with no error
    _, plain = ex.quantize_tiles_1x128(x)
    assert (scales <= plain).all() and (scales > plain / 2).all()


def test_quantize_tiles_1x128_confines_an_outlier_to_its_tile(ex):
    g = torch.Generator().manual_seed(2)
    clean = torch.randn(64, 512, generator=g) * 1e-2
    x = clean.clone()
    x[5, 200] = 1e3  # 1e5 times the typical value
    q, scales = ex.quantize_tiles_1x128(x)
    q0, s0 = ex.quantize_tiles_1x128(clean)
    other = torch.ones_like(x, dtype=torch.bool)
    other[5, 128:256] = False
    assert torch.equal(q.float()[other], q0.float()[other])
    assert (scales != s0).sum().item() == 1  # only the outlier's tile got a new scale
    # one scale for the whole tensor would lose much of it: the check can fail
    s = 448.0 / x.abs().max()
    per_tensor = (x * s).to(torch.float8_e4m3fn).float() / s
    tiled = q.float() / scales.repeat_interleave(128, dim=1)
    assert (per_tensor - x)[other].norm() > 4 * (tiled - x)[other].norm()


def test_quantize_tiles_1x128_rejects_bad_input(ex):
    ex.quantize_tiles_1x128(torch.ones(2, 4), 2)  # a valid call first
    with pytest.raises(ValueError, match="2-D"):
        ex.quantize_tiles_1x128(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="tile must be a positive int"):
        ex.quantize_tiles_1x128(torch.ones(2, 4), 0)
    with pytest.raises(TypeError, match="floating-point"):
        ex.quantize_tiles_1x128(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="power_of_two"):
        ex.quantize_tiles_1x128(torch.ones(2, 4), 2, power_of_two=1)


# --- 8. delayed_scaling_update ---------------------------------------------------------------------
# Expected values: a deque of the last L amaxes kept by hand; the TE rule written out in Python floats.

ONE_ROUNDING = roundoff(torch.float32) + roundoff(torch.float64)  # fp8_max / amax rounded to fp32 (and ours)


def _drive(ex, amaxes, L, fp8_max=448.0, **kw):
    """Record each amax in slot 0 and update; per step: (scale, history) after the update."""
    history, scale, out = torch.zeros(L), torch.tensor(1.0), []
    for a in amaxes:
        history = history.clone()
        history[0] = a
        history, scale = ex.delayed_scaling_update(history, scale, fp8_max, **kw)
        out.append((scale.item(), history.tolist()))
    return out


def test_delayed_scaling_update_slides_a_window_of_amaxes(ex):
    L, amaxes = 3, [2.0, 4.0, 1.0, 1.0, 1.0, 8.0, 0.5, 0.5, 0.5, 0.5]
    window, scale = collections.deque(maxlen=L), 1.0
    for step, (a, (got_scale, got_hist)) in enumerate(zip(amaxes, _drive(ex, amaxes, L))):
        window.append(a)
        scale = 448.0 / max(window)
        assert got_scale == pytest.approx(scale, rel=ONE_ROUNDING, abs=0), \
            f"step {step}: scale from the last {L} amaxes"
        kept = list(window)[-(L - 1):]  # the last L-1 amaxes, oldest first, the newest at the end
        assert got_hist[0] == 0.0, "slot 0 is cleared for the next step"
        assert got_hist[1:] == [0.0] * (L - 1 - len(kept)) + kept, f"step {step}: history {got_hist}"
    # the peak of 8 leaves the window L steps later, and the scale recovers
    scales = [s for s, _ in _drive(ex, amaxes, L)]
    assert scales[5] == scales[6] == scales[7] == 448.0 / 8 and scales[8] == 448.0 / 0.5


def test_delayed_scaling_update_rolls_like_torch_roll(ex):
    h = torch.tensor([5.0, 1.0, 2.0, 3.0])
    new_h, _ = ex.delayed_scaling_update(h, torch.tensor(1.0), 448.0)
    assert new_h.tolist() == [0.0, 2.0, 3.0, 5.0]  # slot i -> i-1, slot 0 -> the end, then slot 0 cleared
    assert h.tolist() == [5.0, 1.0, 2.0, 3.0], "the input history must not change"
    one, s = ex.delayed_scaling_update(torch.tensor([7.0]), torch.tensor(1.0), 448.0)
    assert one.tolist() == [0.0] and s.item() == 64.0  # a window of one: the most recent amax


def test_delayed_scaling_update_options_and_special_amaxes(ex):
    h, s = torch.tensor([2.0, 8.0, 0.0]), torch.tensor(3.0)
    assert ex.delayed_scaling_update(h, s, 448.0)[1].item() == 56.0
    assert ex.delayed_scaling_update(h, s, 448.0, algo="most_recent")[1].item() == 224.0
    assert ex.delayed_scaling_update(h, s, 448.0, margin=2)[1].item() == 14.0
    assert ex.delayed_scaling_update(h, s, 57344.0)[1].item() == 7168.0  # E5M2's max
    for bad in (torch.zeros(3), torch.tensor([math.inf, 1.0, 0.0]), torch.tensor([math.nan, 0.0])):
        new_h, new_s = ex.delayed_scaling_update(bad, s, 448.0)
        assert new_s.item() == 3.0, f"amax {bad.tolist()}: keep the old scale"
    assert s.item() == 3.0 and new_s.dim() == 0 and new_s.dtype == torch.float32


def test_delayed_scaling_update_rejects_bad_input(ex):
    h, s = torch.tensor([1.0, 0.0]), torch.tensor(1.0)
    ex.delayed_scaling_update(h, s, 448.0)  # a valid call first
    with pytest.raises(ValueError, match="1-D"):
        ex.delayed_scaling_update(torch.zeros(2, 2, 2), s, 448.0)
    with pytest.raises(ValueError, match="0-dim"):
        ex.delayed_scaling_update(h, torch.ones(1), 448.0)
    with pytest.raises(ValueError, match="one per column"):
        ex.delayed_scaling_update(torch.zeros(3, 2), torch.ones(3), 448.0)
    with pytest.raises(ValueError, match="fp8_max"):
        ex.delayed_scaling_update(h, s, -1.0)
    with pytest.raises(ValueError, match="margin"):
        ex.delayed_scaling_update(h, s, 448.0, margin=-1)
    with pytest.raises(ValueError, match="algo"):
        ex.delayed_scaling_update(h, s, 448.0, algo="mean")


def test_delayed_scaling_update_many_tensors_hand_worked(ex):
    # L = 3 slots, T = 2 tensors: column 0 has amaxes 2, 8, 0; column 1 has 1, 0.5, 0
    h = torch.tensor([[2.0, 1.0], [8.0, 0.5], [0.0, 0.0]])
    s = torch.tensor([3.0, 5.0])
    new_h, new_s = ex.delayed_scaling_update(h, s, 448.0)
    assert new_s.shape == (2,) and new_s.tolist() == [56.0, 448.0], \
        f"scales {new_s.tolist()}: each column's own max (8 and 1), not the max over all"
    assert new_h.tolist() == [[0.0, 0.0], [0.0, 0.0], [2.0, 1.0]], \
        f"window {new_h.tolist()}: each column slides along the slots (dim 0), slot 0 cleared"
    assert ex.delayed_scaling_update(h, s, 448.0, algo="most_recent")[1].tolist() == [224.0, 448.0]
    zero = torch.tensor([[0.0, 4.0], [0.0, 0.0]])  # column 0 has seen nothing: keeps its scale
    assert ex.delayed_scaling_update(zero, s, 448.0)[1].tolist() == [3.0, 112.0]
    assert h.tolist() == [[2.0, 1.0], [8.0, 0.5], [0.0, 0.0]] and s.tolist() == [3.0, 5.0]


def test_delayed_scaling_update_many_tensors_equal_one_at_a_time(ex):
    L, steps = 4, 12
    g = torch.Generator().manual_seed(5)
    amaxes = torch.exp2(torch.randint(-4, 6, (steps, 3), generator=g).float())
    amaxes[2, 1] = 0.0
    amaxes[7, 2] = math.inf
    history, scale = torch.zeros(L, 3), torch.ones(3)
    for step in range(steps):
        history = history.clone()
        history[0] = amaxes[step]
        history, scale = ex.delayed_scaling_update(history, scale, 448.0, margin=1)
        for t in range(3):
            alone = _drive(ex, amaxes[: step + 1, t].tolist(), L, margin=1)[-1]
            assert scale[t].item() == alone[0] and history[:, t].tolist() == alone[1], \
                f"step {step}, tensor {t}: ({scale[t].item()}, {history[:, t].tolist()}); alone: {alone}"
