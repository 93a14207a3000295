"""Large-batch optimisers (ch01): LARS and LAMB against independent references and against
torch's own SGD / Adam / AdamW where they coincide, the trust-ratio conventions, the
scale invariance that is the point of layer-wise adaptation, the linear scaling rule, the
warmup schedule, argument checking, and a short LAMB training run of the tiny GPT.

Tolerances (tests/_support.py: formula against formula). Everything is float64 and compares one
algorithm written twice -- the optimizer against the paper's algorithm written out here, or against
the torch optimizer it reduces to -- on fixed gradients (no model in the loop): the same arithmetic up
to the order of a few operations. Per step and element at most ~20 operations and two norms of at most
48 terms (γ_48 ≈ 5.3e-15, relative), with no amplification (trust ratios and Adam's m/√v are of order
1, v >> eps here): over 6 steps at most ~6·(20u + 2γ_48) ≈ 8e-14 relative, so rtol 1e-12 (atol 1e-12
for entries near 0) holds with room. Where a step is read back as a difference of weights (LAMB against
AdamW's q - p; ‖Δw‖ against lr·‖w‖) cancellation costs a factor |w|/|Δw| <= 1/(lr·ratio) <= 1e3:
rtol 1e-10 and 1e-9. Scaling a layer's gradients by 1e±4 rounds each (u) and the norms cancel the
scale up to a few u per step: rtol 1e-9. Learning-rate rules and schedules are closed forms of a few
operations (k·u ~ 1e-15), checked with pytest.approx's rel 1e-6 or abs 1e-12. The LAMB smoke run must
close a fifth of the gap from its first loss to the corpus's entropy rate (the floor), computed.
"""
import io
import math

import pytest
import torch

from minitorch_dist.models import GPT, GPTConfig, MarkovCorpus
from minitorch_dist.parallelism.large_batch import (
    LAMB,
    LARS,
    linear_scaling_lr,
    sqrt_scaling_lr,
    trust_ratios,
    warmup_schedule,
)

pytestmark = pytest.mark.ch01

SHAPES = [(8, 6), (5,), (3, 4, 2)]  # a matrix, a bias-like vector, a conv-like kernel
STEPS = 6


def make_params(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in SHAPES]


def make_grads(seed=1, dtype=torch.float64, scales=None):
    """STEPS lists of gradients, one per parameter; layer i's gradients are multiplied by scales[i]."""
    g = torch.Generator().manual_seed(seed)
    scales = scales or [1.0] * len(SHAPES)
    return [[c * torch.randn(s, generator=g, dtype=dtype) for s, c in zip(SHAPES, scales)]
            for _ in range(STEPS)]


def run(opt, params, grads, lrs=None):
    """Feed the given gradients to ``opt``; return the parameters after each step."""
    history = []
    for t, gs in enumerate(grads):
        if lrs is not None:
            for group in opt.param_groups:
                group["lr"] = lrs[t]
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        history.append([p.detach().clone() for p in params])
    return history


def clone(params):
    return [p.detach().clone().requires_grad_() for p in params]


# --------------------------------------------------------------------------- LARS


def lars_reference(ws, grads, lrs, m, beta, eta, eps, adapt):
    """You, Gitman & Ginsburg 2017, Algorithm 1, written out independently on plain tensors."""
    ws, vs, out = [w.detach().clone() for w in ws], [torch.zeros_like(w) for w in ws], []
    for lr, gs in zip(lrs, grads):
        for i, (w, g) in enumerate(zip(ws, gs)):
            b = beta if adapt[i] else 0.0
            wn, gn = w.norm().item(), g.norm().item()
            local = eta * wn / (gn + b * wn + eps) if adapt[i] and wn > 0 and gn > 0 else 1.0
            vs[i] = m * vs[i] + lr * local * (g + b * w)
            ws[i] = w - vs[i]
        out.append([w.clone() for w in ws])
    return out


@pytest.mark.parametrize("weight_decay", [0.0, 5e-3])
def test_lars_matches_algorithm1(weight_decay):
    params, grads = make_params(), make_grads()
    lrs = [0.5 * (t + 1) for t in range(STEPS)]  # a changing rate checks that γ sits inside the momentum
    opt = LARS(params, lr=lrs[0], momentum=0.9, weight_decay=weight_decay, trust_coefficient=0.02)
    got = run(opt, params, grads, lrs)
    want = lars_reference(make_params(), grads, lrs, 0.9, weight_decay, 0.02, 1e-8,
                          [len(s) > 1 for s in SHAPES])
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # the default rule: the 1-D tensor is not adapted, the others are
    assert float(opt.state[params[1]]["trust_ratio"]) == 1.0
    assert float(opt.state[params[0]]["trust_ratio"]) != pytest.approx(1.0)


def test_lars_without_adaptation_is_momentum_sgd():
    params, ref = make_params(), make_params()
    grads = make_grads()
    got = run(LARS(params, lr=0.1, momentum=0.9, exclude_from_adaptation=lambda p: True), params, grads)
    want = run(torch.optim.SGD(ref, lr=0.1, momentum=0.9, foreach=False), ref, grads)
    for a, b in zip(got[-1], want[-1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- LAMB


def lamb_reference(ws, grads, lr, b1, b2, eps, lam, bias_correction, clamp):
    """You et al. 2020, Algorithm 2, written out independently on plain tensors (every layer adapted)."""
    ws = [w.detach().clone() for w in ws]
    ms, vs, out = [torch.zeros_like(w) for w in ws], [torch.zeros_like(w) for w in ws], []
    for t, gs in enumerate(grads, start=1):
        for i, g in enumerate(gs):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            mh, vh = (ms[i] / (1 - b1**t), vs[i] / (1 - b2**t)) if bias_correction else (ms[i], vs[i])
            u = mh / (vh.sqrt() + eps) + lam * ws[i]
            wn = ws[i].norm().item()
            phi = wn if clamp is None else min(max(wn, clamp[0]), clamp[1])
            ratio = phi / u.norm().item() if wn > 0 and u.norm().item() > 0 else 1.0
            ws[i] = ws[i] - lr * ratio * u
        out.append([w.clone() for w in ws])
    return out


@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("clamp", [None, (0.0, 2.0)])  # ‖w‖ = 6.9, 2.5, 3.6: (0, 2) clamps every layer
def test_lamb_matches_algorithm2(bias_correction, clamp):
    params, grads = make_params(), make_grads()
    opt = LAMB(params, lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=0.1,
               bias_correction=bias_correction,
               clamp_trust=clamp)  # by default LAMB adapts every tensor, as Algorithm 2 does
    got = run(opt, params, grads)
    want = lamb_reference(make_params(), grads, 0.05, 0.9, 0.99, 1e-6, 0.1, bias_correction, clamp)
    for step_got, step_want in zip(got, want):
        for a, b in zip(step_got, step_want):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_lamb_step_is_adamw_step_times_trust_ratio():
    """Every LAMB step equals torch's AdamW step from the same (w, m, v, t), scaled by ‖w‖/‖u‖.

    AdamW moves w to (1 - lr·λ)·w - lr·r = w - lr·(r + λw) = w - lr·u, so its step is -lr·u and
    ‖u‖ = ‖AdamW step‖/lr: LAMB with its trust ratio forced to 1 *is* AdamW, decay included.
    """
    lr, lam = 0.05, 0.1
    params, grads = make_params(), make_grads()
    opt = LAMB(params, lr=lr, betas=(0.9, 0.99), eps=1e-6, weight_decay=lam, clamp_trust=None,
               exclude_from_adaptation=lambda p: False)
    for gs in grads:
        expected = []
        for p, g in zip(params, gs):
            q = p.detach().clone().requires_grad_()
            adamw = torch.optim.AdamW([q], lr=lr, betas=(0.9, 0.99), eps=1e-6, weight_decay=lam,
                                      foreach=False)
            if opt.state[p]:  # hand AdamW the moments LAMB has so far
                s = opt.state[p]
                adamw.state[q] = dict(step=torch.tensor(float(s["step"]), dtype=torch.float64),
                                      exp_avg=s["exp_avg"].clone(), exp_avg_sq=s["exp_avg_sq"].clone())
            q.grad = g.clone()
            adamw.step()
            adamw_step = q.detach() - p.detach()
            ratio = p.detach().norm() / (adamw_step.norm() / lr)
            expected.append((p.detach() + ratio * adamw_step, ratio))
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
        for p, (w, ratio) in zip(params, expected):
            torch.testing.assert_close(p.detach(), w, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(opt.state[p]["trust_ratio"], ratio, rtol=1e-10, atol=0)


def test_lamb_without_adaptation_is_adam():
    """Excluded tensors take ratio 1 and no decay: with every tensor excluded, LAMB is Adam."""
    params, ref, grads = make_params(), make_params(), make_grads()
    got = run(LAMB(params, lr=0.01, weight_decay=0.3, exclude_from_adaptation=lambda p: True), params, grads)
    want = run(torch.optim.Adam(ref, lr=0.01, eps=1e-6, foreach=False), ref, grads)
    for a, b in zip(got[-1], want[-1]):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------------------- trust-ratio conventions


def test_zero_weight_gets_trust_ratio_one():
    g = torch.tensor([[3.0, -4.0]], dtype=torch.float64)  # ‖g‖ = 5
    w = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    opt = LARS([w], lr=0.1, momentum=0.9, weight_decay=0.01)
    w.grad = g.clone()
    opt.step()  # λ = 1, v = lr·g
    assert float(opt.state[w]["trust_ratio"]) == 1.0
    torch.testing.assert_close(w.detach(), -0.1 * g)

    w = torch.zeros(1, 2, dtype=torch.float64, requires_grad=True)
    opt = LAMB([w], lr=0.1, eps=0.0, weight_decay=0.01)
    w.grad = g.clone()
    opt.step()  # ratio 1; Adam's first bias-corrected step is sign(g)
    assert float(opt.state[w]["trust_ratio"]) == 1.0
    torch.testing.assert_close(w.detach(), -0.1 * g.sign())


def test_zero_gradient_gets_trust_ratio_one():
    w0 = torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64)
    w = w0.clone().requires_grad_()
    opt = LARS([w], lr=0.1, momentum=0.9, weight_decay=0.01)
    w.grad = torch.zeros_like(w)
    opt.step()  # λ = 1 (not η/β), so only the decay term moves w
    assert float(opt.state[w]["trust_ratio"]) == 1.0
    torch.testing.assert_close(w.detach(), w0 - 0.1 * 0.01 * w0)

    w = w0.clone().requires_grad_()
    opt = LAMB([w], lr=0.1, weight_decay=0.0)
    w.grad = torch.zeros_like(w)
    opt.step()  # u = 0: ratio 1, nothing moves, no NaN
    assert float(opt.state[w]["trust_ratio"]) == 1.0
    torch.testing.assert_close(w.detach(), w0)


# --------------------------------------------------------------------------- layer-wise adaptation


@pytest.mark.parametrize("make_opt", [
    lambda ps: LARS(ps, lr=0.5, momentum=0.9, trust_coefficient=0.01, eps=0.0,
                    exclude_from_adaptation=lambda p: False),
    lambda ps: LAMB(ps, lr=0.01, eps=1e-30, weight_decay=0.0, clamp_trust=None,
                    exclude_from_adaptation=lambda p: False),
], ids=["LARS", "LAMB"])
def test_step_is_invariant_to_a_layers_gradient_scale(make_opt):
    """Multiply one layer's gradients by 1e-4 and another's by 1e4: every step stays the same."""
    a, b = make_params(), make_params()
    base = run(make_opt(a), a, make_grads())
    scaled = run(make_opt(b), b, make_grads(scales=[1e-4, 1.0, 1e4]))
    for step_a, step_b in zip(base, scaled):
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(x, y, rtol=1e-9, atol=1e-12)


def test_relative_step_is_the_learning_rate_whatever_the_gradient():
    """LAMB (φ = id, λ = 0): ‖Δw‖ = lr·‖w‖ for every layer; LARS (first step, β = 0): lr·η·‖w‖."""
    scales = [1e-6, 1.0, 1e6]
    for opt_cls, kw, rel in ((LAMB, dict(lr=0.01, weight_decay=0.0, clamp_trust=None), 0.01),
                             (LARS, dict(lr=0.5, trust_coefficient=0.01, eps=0.0), 0.5 * 0.01)):
        params = make_params()
        before = [p.detach().clone() for p in params]
        after = run(opt_cls(params, exclude_from_adaptation=lambda p: False, **kw), params,
                    make_grads(scales=scales)[:1])[0]
        for w0, w1 in zip(before, after):
            assert (w1 - w0).norm().item() == pytest.approx(rel * w0.norm().item(), rel=1e-9)


# --------------------------------------------------------------------------- helpers, state


def test_trust_ratios_names_and_values():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    lars, lamb = LARS(model.parameters(), lr=0.1), LAMB(model.parameters(), lr=0.01)
    assert trust_ratios(lars) == {} and trust_ratios(lamb) == {}  # nothing has stepped yet
    model(torch.randn(5, 4)).square().sum().backward()
    lars.step()
    lamb.step()
    by_name = trust_ratios(lars, model)
    assert set(by_name) == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert by_name[name] == float(lars.state[p]["trust_ratio"])
        assert (by_name[name] == 1.0) == (p.ndim == 1)  # LARS leaves biases out by default
    assert all(r != 1.0 for r in trust_ratios(lamb).values())  # LAMB adapts every tensor by default
    assert list(trust_ratios(lamb)) == ["group0.0", "group0.1", "group0.2", "group0.3"]


@pytest.mark.parametrize("cls", [LARS, LAMB])
def test_state_dict_round_trip_resumes_exactly(cls):
    grads = make_grads()
    a = make_params()
    opt = cls(a, lr=0.05, weight_decay=0.01, exclude_from_adaptation=lambda p: p.ndim == 1)
    run(opt, a, grads[:3])
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)  # the predicate lives off the param groups, so this pickles
    b = clone(a)
    opt_b = cls(b, lr=0.05, weight_decay=0.01, exclude_from_adaptation=lambda p: p.ndim == 1)
    buf.seek(0)
    opt_b.load_state_dict(torch.load(buf))
    for x, y in zip(run(opt, a, grads[3:])[-1], run(opt_b, b, grads[3:])[-1]):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


# --------------------------------------------------------------------------- schedules


def test_linear_scaling_rule():
    # Goyal et al.'s ImageNet rate η = 0.1·kn/256: 8192 images per step → 3.2
    assert linear_scaling_lr(0.1, 256, 8192) == pytest.approx(3.2)
    assert linear_scaling_lr(0.1, 256, 256) == pytest.approx(0.1)
    assert linear_scaling_lr(0.1, 256, 64) == pytest.approx(0.025)
    k = 7
    assert linear_scaling_lr(0.3, 32, 32 * k) == pytest.approx(0.3 * k)


def test_sqrt_scaling_rule():
    # 16x the batch, 4x the rate; 4x the batch, 2x; the same batch, the same rate
    assert sqrt_scaling_lr(1e-3, 256, 4096) == pytest.approx(4e-3)
    assert sqrt_scaling_lr(1e-3, 256, 1024) == pytest.approx(2e-3)
    assert sqrt_scaling_lr(1e-3, 256, 256) == pytest.approx(1e-3)
    assert sqrt_scaling_lr(1e-3, 64, 32) == pytest.approx(1e-3 / math.sqrt(2))


def lrs_of(scheduler, opt, n):
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    return out


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_warmup_schedule_values(decay):
    lr, W, T = 0.8, 4, 12
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)
    got = lrs_of(warmup_schedule(opt, W, T, decay=decay), opt, T + 2)
    assert got[:W] == pytest.approx([lr * (s + 1) / W for s in range(W)])  # ramp: lr/4, lr/2, 3lr/4, lr
    assert got[W] == pytest.approx(lr)  # the decay starts from the peak
    mid, end = {"cosine": (lr / 2, 0.0), "linear": (lr / 2, 0.0), "constant": (lr, lr)}[decay]
    assert got[(W + T) // 2] == pytest.approx(mid)  # half-way through the decay
    assert got[T] == pytest.approx(end, abs=1e-12) and got[T + 1] == pytest.approx(end, abs=1e-12)
    if decay == "cosine":  # a quarter of the way: ½(1 + cos(π/4))
        assert got[W + 2] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi / 4)))
    assert all(x >= y for x, y in zip(got[W:], got[W + 1:]))  # never rises after warmup


def test_warmup_schedule_without_warmup_starts_at_full_rate():
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.3)
    assert lrs_of(warmup_schedule(opt, 0, decay="constant"), opt, 3) == pytest.approx([0.3] * 3)


# --------------------------------------------------------------------------- bad arguments


def p():
    return [torch.zeros(2, 2, requires_grad=True)]


@pytest.mark.parametrize("make, match", [
    (lambda: LARS(p(), lr=-0.1), "lr"),
    (lambda: LARS(p(), lr=0.1, momentum=1.0), "momentum"),
    (lambda: LARS(p(), lr=0.1, weight_decay=-1e-4), "weight_decay"),
    (lambda: LARS(p(), lr=0.1, trust_coefficient=0.0), "trust_coefficient"),
    (lambda: LARS(p(), lr=0.1, exclude_from_adaptation="bias"), "exclude_from_adaptation"),
    (lambda: LAMB(p(), lr=0.1, betas=(0.9,)), "betas"),
    (lambda: LAMB(p(), lr=0.1, betas=(0.9, 1.5)), "β2"),
    (lambda: LAMB(p(), lr=0.1, eps=-1.0), "eps"),
    (lambda: LAMB(p(), lr=0.1, clamp_trust=(10, 0)), "clamp_trust"),
    (lambda: LAMB(p(), lr=0.1, clamp_trust=5), "clamp_trust"),
    (lambda: LAMB(p(), lr=0.1, bias_correction="yes"), "bias_correction"),
    (lambda: linear_scaling_lr(0.1, 0, 8192), "base_batch"),
    (lambda: linear_scaling_lr(0.1, 256, 1.5), "batch"),
    (lambda: linear_scaling_lr(-0.1, 256, 512), "base_lr"),
    (lambda: sqrt_scaling_lr(0.1, 256, 0), "batch"),
    (lambda: sqrt_scaling_lr(-0.1, 256, 512), "base_lr"),
    (lambda: warmup_schedule(torch.optim.SGD(p(), lr=0.1), -1), "warmup_steps"),
    (lambda: warmup_schedule(torch.optim.SGD(p(), lr=0.1), 5), "total_steps"),
    (lambda: warmup_schedule(torch.optim.SGD(p(), lr=0.1), 5, 5), "total_steps"),
    (lambda: warmup_schedule(torch.optim.SGD(p(), lr=0.1), 5, 50, decay="step"), "decay"),
])
def test_bad_arguments_raise_clear_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# --------------------------------------------------------------------------- smoke


def test_lamb_trains_the_tiny_gpt():
    torch.manual_seed(0)
    corpus = MarkovCorpus(vocab_size=64, seed=0)
    model = GPT(GPTConfig.tiny())
    opt = LAMB(model.parameters(), lr=0.05, weight_decay=0.01)
    losses = []
    for step in range(30):
        x, y = corpus.batch(step, batch_size=16, seq_len=32)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    # it must close a fifth of the way from the first loss to the floor, the corpus's entropy rate
    assert sum(losses[-5:]) / 5 < losses[0] - (losses[0] - corpus.entropy_rate) / 5, losses
    ratios = trust_ratios(opt, model)
    assert all(math.isfinite(r) and r > 0 for r in ratios.values())
    assert all(r != 1.0 for r in ratios.values())  # every tensor was adapted
