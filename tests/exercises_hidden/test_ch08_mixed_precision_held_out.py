"""Chapter 08, held-out: the scaler's floor with factors and intervals the visible tests do not use,
power-of-two tile scales on other tiles, the delayed-scaling update over five tensors with
``most_recent``, and Kahan updates on negative weights.

Expected values as in the visible tests: GradScaler's own update kernel (clamped by hand for the floor),
tiles computed one by one, each tensor's window driven alone. All comparisons are exact.
"""
import math

import pytest
import torch

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
