"""Chapter 08, held-out: the scaler's floor with factors and intervals the visible tests do not use,
a loss scaler with hysteresis 4 and factors 4 and 1/4, training whose *first* micro-batch overflows (with
two micro-batches a step, a clip, and a hysteresis that holds the scale), power-of-two tile scales on
other tiles, the delayed-scaling update over five tensors with ``most_recent``, and Kahan updates on
negative weights.

Expected values as in the visible tests: GradScaler's own update kernel (clamped by hand for the floor),
a hand-written schedule of scales and counters, a loop written around ``torch.amp.GradScaler``, tiles
computed one by one, each tensor's window driven alone. All comparisons are exact.
"""
import copy
import math

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.ch08


def _kernel(scale, tracker, found, growth, backoff, interval):
    s = torch.tensor([scale], dtype=torch.float32)
    t = torch.tensor([tracker], dtype=torch.int32)
    torch._amp_update_scale_(s, t, torch.tensor([float(found)]), growth, backoff, interval)
    return s.item(), int(t.item())


def test_scaler_update_held_out_floor(ex):
    g = torch.Generator().manual_seed(77)
    found = (torch.rand(200, generator=g) < 0.5).tolist()
    floor = torch.tensor(7.3, dtype=torch.float32).item()
    scale, tracker, ref_scale, ref_tracker = 50.0, 0, 50.0, 0
    for f in found:
        new, ref_tracker = _kernel(ref_scale, ref_tracker, f, 1.5, 0.7, 3)
        ref_scale = min(ref_scale, max(new, floor)) if f else new
        scale, tracker = ex.scaler_update(scale, tracker, f, 1.5, 0.7, 3, min_scale=7.3)
        assert (scale, tracker) == (ref_scale, ref_tracker)


def test_quantize_tiles_1x128_held_out_power_of_two(ex):
    x = torch.randn(6, 45, generator=torch.Generator().manual_seed(8)) * 3.0
    q, scales = ex.quantize_tiles_1x128(x, 10, power_of_two=True)
    assert scales.shape == (6, 5)
    for i in range(6):
        for j in range(5):
            part = x[i, 10 * j:10 * (j + 1)]
            s = torch.tensor(448.0) / part.abs().max()
            want = 2.0 ** (math.frexp(s.item())[1] - 1)
            assert scales[i, j].item() == want
            assert torch.equal(q[i, 10 * j:10 * (j + 1)].float(),
                               (part * want).clamp(-448, 448).to(torch.float8_e4m3fn).float())


def test_delayed_scaling_update_held_out_five_tensors(ex):
    g = torch.Generator().manual_seed(9)
    amaxes = torch.exp2(torch.randint(-3, 4, (8, 5), generator=g).float())
    history, scale = torch.zeros(3, 5), torch.ones(5)
    alone = [(torch.zeros(3), torch.tensor(1.0)) for _ in range(5)]
    for step in range(8):
        history = history.clone()
        history[0] = amaxes[step]
        history, scale = ex.delayed_scaling_update(history, scale, 57344.0, algo="most_recent")
        for t in range(5):
            h, s = alone[t]
            h = h.clone()
            h[0] = amaxes[step, t]
            alone[t] = ex.delayed_scaling_update(h, s, 57344.0, algo="most_recent")
            assert scale[t].item() == alone[t][1].item() == 57344.0 / amaxes[step, t].item()
            assert history[:, t].tolist() == alone[t][0].tolist()


def test_kahan_bf16_update_held_out_negative_weights(ex):
    bf = torch.bfloat16
    w, c = torch.full((1,), -2.0, dtype=bf), torch.zeros(1, dtype=bf)
    for _ in range(1000):
        w, c = ex.kahan_bf16_update(w, c, torch.tensor([-1e-4]))
    # the exact sum is -2.1; bf16's ulp at 2 is 2^-6: within one ulp
    assert abs(w.double().item() - (-2.1)) <= 2.0 ** -6


# after each iteration's update(): (S, growth tracker, hysteresis counter); "C" clean, the others overflow
HYSTERESIS_4 = [  # init 2^12, growth x4, backoff x1/4, growth_interval 2
    ("F", 4096.0, 0, 3), ("C", 4096.0, 1, 3), ("N", 4096.0, 0, 2), ("C", 4096.0, 1, 2), ("F", 4096.0, 0, 1),
    ("C", 4096.0, 1, 1), ("N", 1024.0, 0, 0), ("F", 256.0, 0, 0), ("C", 256.0, 1, 0), ("C", 1024.0, 0, 4),
    ("F", 1024.0, 0, 3), ("C", 1024.0, 1, 3), ("C", 4096.0, 0, 4),
]


def test_LossScaler_held_out_hysteresis_four(ex):
    p = nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([p], lr=0.25)
    scaler = ex.LossScaler(init_scale=4096.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2,
                           hysteresis=4)
    applied = 0
    for i, (kind, scale, tracker, h) in enumerate(HYSTERESIS_4):
        opt.zero_grad()
        scaler.scale(p.sum()).backward()
        if kind != "C":
            p.grad[0] = float("inf") if kind == "F" else float("nan")
        if i % 3 == 0:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        state = (scaler.get_scale(), scaler.growth_tracker, scaler.hysteresis_tracker)
        assert state == (scale, tracker, h), f"iteration {i} ({kind}): {state}, want {(scale, tracker, h)}"
        applied += kind == "C"
        assert p.detach().tolist() == [1.0 - applied / 4] * 3, f"iteration {i}: skipped or applied wrongly"


def _mse(model, x, y):
    return (model(x.to(model[0].weight.dtype)).float() - y).square().mean()


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.5)


def _reference(model, steps, scaler, max_norm):
    half = copy.deepcopy(model).half()
    masters = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    opt, applied, norms = _sgd(masters), [], []
    for step in steps:
        for x, y in step:
            scaler.scale(_mse(half, x, y) / len(step)).backward()
            for m, h in zip(masters, half.parameters()):
                m.grad = h.grad.float() if m.grad is None else m.grad + h.grad.float()
                h.grad = None
        before = [m.detach().clone() for m in masters]
        scaler.unscale_(opt)
        norms.append(torch.nn.utils.clip_grad_norm_(masters, max_norm).item())
        scaler.step(opt)
        scaler.update()
        applied.append(not all(torch.equal(a, m) for a, m in zip(before, masters)))
        with torch.no_grad():
            for m, h in zip(masters, half.parameters()):
                h.copy_(m)
                m.grad = None
    return applied, norms, masters


def test_train_with_loss_scaling_held_out_first_micro_batch_overflows(ex):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    g = torch.Generator().manual_seed(11)
    steps = [[(torch.randn(3, 5, generator=g), torch.randn(3, 2, generator=g) * (1e5 if c == "o" else 1.0))
              for c in kind] for kind in ("oc", "cc", "co", "cc")]
    kw = dict(init_scale=2.0 ** 11, growth_interval=50)
    applied, norms, masters = _reference(model, steps, torch.amp.GradScaler("cpu", **kw), 0.3)
    assert applied == [False, True, False, True], "sanity: the overflowing steps are skipped"
    got = ex.train_with_loss_scaling(model, steps, _sgd, torch.amp.GradScaler("cpu", **kw), loss_fn=_mse,
                                     max_norm=0.3)
    assert got["applied"] == applied
    assert [n for n in got["grad_norms"] if math.isfinite(n)] == [n for n in norms if math.isfinite(n)]
    assert all(torch.equal(a, b) for a, b in zip(got["masters"], masters, strict=True))
    # hysteresis 3 holds S through both overflows: the steps are skipped all the same
    scaler = ex.LossScaler(**kw, hysteresis=3)
    got = ex.train_with_loss_scaling(model, steps, _sgd, scaler, loss_fn=_mse, max_norm=0.3)
    assert got["applied"] == applied and scaler.get_scale() == 2.0 ** 11 and scaler.hysteresis_tracker == 1
    first = ex.train_with_loss_scaling(model, steps[:1], _sgd, ex.LossScaler(**kw, hysteresis=3),
                                       loss_fn=_mse)
    assert all(torch.equal(m, p) for m, p in zip(first["masters"], model.parameters(), strict=True)), \
        "a skipped first step leaves the masters at the model's weights"
