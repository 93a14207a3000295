"""Adafactor (Shazeer & Stern 2018): the same trajectory as ``torch.optim.Adafactor`` on a small GPT
(2-D weights, 1-D biases and norms) plus a 3-D parameter; the paper's properties of the factored
second moment; its state, measured by the memory meter, equal to ``costmodel.adafactor_state_bytes``
and (r + c) per r x c matrix against Adam's 2*r*c.

Tolerances (tests/_support.py). The trajectories against torch's Adafactor run in float64 and must be
*bitwise* equal: ``memory/adafactor.py`` does torch's operations in torch's order (``mean_square`` is
torch's norm-squared-over-n; the clipping scalar (‖U‖/√n)/d equals torch's ‖U‖/(√n·d) exactly for
d a power of two, d = 1 and 2 here), on gradients the two identical models compute identically. The
single-step checks run in float64 with the rounding of their few operations as the bound: a root mean
square over n entries is within γ_n (Higham, a sum of n positive terms), a difference of two rounded
numbers within u·(|a| + |b|). The factored estimate's row and column sums: at most four reductions of
<= 7 positive terms chained, ``4·reorder_bound(7, sum)``. The memory tests count float32 bytes (the
chapter's formulas) and compare no values."""
import copy

import pytest
import torch
from torch import nn

from minitorch_dist import costmodel as cm
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.adafactor import Adafactor, factored_second_moment
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig

from _support import close, float64, gamma, reorder_bound, roundoff

pytestmark = pytest.mark.ch06

STEPS = 12


class WithTensor3(nn.Module):
    """A tiny GPT plus a 3-D parameter (factored over its last two dims, one pair per leading index)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.gpt = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16))
        self.mix = nn.Parameter(torch.randn(3, 16, 16) * 0.1)
        self.register_buffer("probe", torch.randn(16, 4))

    def forward(self, x, y):
        _, loss = self.gpt(x, y)
        # a second, batch-dependent term so the 3-D parameter gets a gradient that changes per step
        extra = ((self.mix @ self.probe) - x.to(self.mix.dtype).mean() / 32).square().mean()
        return loss + extra


def _train(model, opt, steps=STEPS):
    corpus = MarkovCorpus(32, seed=0)
    trajectory = []
    for step in range(steps):
        x, y = corpus.batch(step, 4, 16)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        trajectory.append([p.detach().clone() for p in model.parameters()])
    return trajectory


HYPER = [
    dict(),                                             # the paper's defaults: rho_t = min(1e-2, 1/sqrt(t))
    dict(lr=1e-3, weight_decay=0.1),                    # lr caps rho_t; decoupled weight decay
    dict(lr=0.3, beta2_decay=-0.5, eps=(1e-6, 1e-2), d=2.0),  # rho_t = 1/sqrt(t) binds; looser clipping
]
# Not eps1 = 1e-30 (the paper's): a parameter whose true gradient is zero (an attention key bias: softmax
# ignores a shift shared by all keys) gets float rounding noise as its gradient, and G / sqrt(V-hat)
# turns that noise into an O(1) update, so any difference in rounding (a mean of squares instead of a
# squared norm) would be magnified to ~1e-3 in one step. With eps1 above the noise (torch's default,
# the dtype's epsilon) the noise stays a no-op and the test checks the algorithm, not the rounding.


@pytest.mark.parametrize("hyper", HYPER, ids=["paper", "lr-wd", "eps-d-decay"])
def test_same_trajectory_as_torch_adafactor(hyper):
    with float64():
        ours_model = WithTensor3()
        torch_model = copy.deepcopy(ours_model)
        dims = {p.dim() for p in ours_model.parameters()}
        assert {1, 2, 3} <= dims  # vectors (unfactored), matrices and a 3-D tensor (factored)
        assert {p.dtype for p in ours_model.parameters()} == {torch.float64}
        ours = _train(ours_model, Adafactor(ours_model.parameters(), **hyper))
        ref = _train(torch_model, torch.optim.Adafactor(torch_model.parameters(), **hyper))
        start = [p.detach() for p in WithTensor3().parameters()]
    for step, (a, b) in enumerate(zip(ours, ref)):
        for pa, pb in zip(a, b):  # bitwise: the same operations in the same order (module docstring)
            torch.testing.assert_close(pa, pb, rtol=0, atol=0,
                                       msg=lambda m, step=step: f"step {step + 1}: {m}")
    moved = max((p - p0).abs().max().item() for p, p0 in zip(ours[-1], start))
    assert moved > 1e-3  # the comparison is not between two models that did not train


def test_state_is_torch_adafactor_state():
    """Same state names and shapes as torch's: torch trains 5 steps, its state dict is loaded into ours,
    and both continue on the same trajectory."""
    with float64():
        model = WithTensor3()
        torch_opt = torch.optim.Adafactor(model.parameters(), lr=1e-2, weight_decay=0.01)
        _train(model, torch_opt, steps=5)
        twin = copy.deepcopy(model)
        opt = Adafactor(twin.parameters(), lr=1e-2, weight_decay=0.01)
        opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # loading keeps the tensors: do not share
        a, b = _train(twin, opt, steps=4), _train(model, torch_opt, steps=4)
    for pa, pb in zip(a[-1], b[-1]):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)  # bitwise, as the trajectory above
    for p_ours, p_torch in zip(twin.parameters(), model.parameters()):
        ours, theirs = opt.state[p_ours], torch_opt.state[p_torch]
        assert sorted(ours) == sorted(theirs)
        assert all(ours[k].shape == theirs[k].shape for k in ours)


def test_first_step_is_sign_descent_scaled_by_parameter_rms():
    """t = 1: beta2-hat_1 = 0, so V-hat = G² exactly for a vector, U = sign(G), RMS(U) = 1 (no clipping),
    and the step is alpha_1 = max(eps2, RMS(theta_0)) * min(lr, 1) (Shazeer & Stern §5, §7)."""
    f64 = torch.float64
    theta0 = torch.tensor([0.5, -2.0, 1.0, 3.0], dtype=f64)
    p = nn.Parameter(theta0.clone())
    p.grad = torch.tensor([1e-3, -4.0, 0.25, -7.0], dtype=f64)
    Adafactor([p], lr=1e-2).step()
    alpha = max(1e-3, (theta0.square().mean() ** 0.5).item()) * 1e-2
    want = theta0 - alpha * torch.sign(p.grad)
    # alpha: two RMS of 4 entries (each within γ_4, and a sqrt, a division, a product: 3u); then each
    # side rounds its difference (u·|θ| + u·alpha)
    u = roundoff(f64)
    bound = alpha * (2 * gamma(4, f64) + 3 * u) + 2 * u * (theta0.abs().max().item() + alpha)
    close(p.detach(), want, bound, "the first step")


def test_factored_estimate_keeps_row_and_column_means():
    """§3: V-hat = R C^T / (1^T R) has exactly the row sums and column sums of V, and is V itself when V
    is rank 1."""
    torch.manual_seed(1)
    f64 = torch.float64
    V = torch.rand(3, 5, 7, dtype=f64) + 0.1
    R, C = V.mean(dim=-1, keepdim=True), V.mean(dim=-2, keepdim=True)
    v_hat = factored_second_moment(R, C, eps1=1e-30)
    for dim in (-1, -2):  # <= 4 chained reductions (R, C, mean(R), the sum) of <= 7 positive terms
        want = V.sum(dim=dim)
        close(v_hat.sum(dim=dim), want, 4 * reorder_bound(7, want, f64), f"sums along {dim}")
    a, b = torch.rand(5, 1, dtype=f64), torch.rand(1, 7, dtype=f64)
    rank1 = a @ b
    got = factored_second_moment(rank1.mean(-1, keepdim=True), rank1.mean(-2, keepdim=True), 1e-30)
    close(got, rank1, 4 * reorder_bound(7, rank1, f64), "rank 1")


def test_update_clipping_caps_the_update_rms():
    """§4: with one huge gradient entry and a second moment that lags (built from tiny gradients), the
    unclipped update G/sqrt(V-hat) has RMS >> d; clipping makes the step's RMS alpha_t * d exactly."""
    f64 = torch.float64
    p = nn.Parameter(torch.ones(64, dtype=f64))
    opt = Adafactor([p], lr=0.1, beta2_decay=-8.0, d=1.0)  # slow decay: V-hat lags a sudden G²
    p.grad = torch.full((64,), 1e-3, dtype=f64)
    opt.step()  # t = 1: V = G² = 1e-6, theta = 1 - 0.1 = 0.9
    before = p.detach().clone()
    p.grad = torch.full((64,), 1e-3, dtype=f64)
    p.grad[0] = 10.0
    opt.step()  # t = 2: 1 - beta2-hat = 2^-8, V-hat lags G² on entry 0
    rms_before = (before.square().mean() ** 0.5).item()
    alpha = rms_before * min(0.1, 2 ** -0.5)
    step = before - p.detach()
    w = 2 ** -8.0  # 1 - beta2-hat_2
    unclipped = p.grad / ((1 - w) * 1e-6 + w * p.grad.square()).sqrt()
    assert (unclipped.square().mean() ** 0.5).item() > 2  # the clip binds
    # three RMS of 64 entries (of θ, of U, of the step), each within γ_64; the step read back as a
    # difference of the two weights, each rounded: u·(|before| + |after|) against its smallest entry
    u = roundoff(f64)
    rel = 3 * gamma(64, f64) + 2 * u * (before.abs().max() / step.abs().min()).item()
    assert (step.square().mean() ** 0.5).item() == pytest.approx(alpha * 1.0, rel=rel)


# --- memory: (r + c) per matrix against Adam's 2*r*c ---------------------------------------------

def _hand_count_adafactor(params):
    """Floats of Adafactor state counted shape by shape: one row and one column per matrix slice."""
    total = 0
    for p in params:
        if p.dim() >= 2:
            slices = p.numel() // (p.shape[-2] * p.shape[-1])
            total += slices * (p.shape[-2] + p.shape[-1])
        else:
            total += p.numel()
    return total


@pytest.mark.parametrize("optimizer", [Adafactor, torch.optim.Adafactor], ids=["ours", "torch"])
def test_state_bytes_measured_equal_the_formula(optimizer):
    model = WithTensor3()
    opt = optimizer(model.parameters())
    _train(model, opt, steps=1)
    params = list(model.parameters())
    shapes = [p.shape for p in params]
    measured = MemoryMeter(optimizer=opt).current()["optimizer_state"]
    step_counters = 4 * len(params)  # one 0-d fp32 step tensor per parameter, counted by the meter
    assert measured == cm.adafactor_state_bytes(shapes, bytes_per_element=4, step_bytes=4)
    assert measured == 4 * _hand_count_adafactor(params) + step_counters
    # and against Adam on the same model, measured the same way
    adam_model = WithTensor3()
    adam = torch.optim.Adam(adam_model.parameters())
    _train(adam_model, adam, steps=1)
    adam_measured = MemoryMeter(optimizer=adam).current()["optimizer_state"]
    assert adam_measured == cm.adam_state_bytes(shapes, step_bytes=4)
    assert adam_measured == 2 * 4 * sum(p.numel() for p in params) + step_counters
    assert measured < adam_measured / 4


def test_one_matrix_keeps_rows_plus_cols_floats():
    r, c = 256, 512
    w = nn.Parameter(torch.randn(r, c))
    w.grad = torch.randn(r, c)
    opt = Adafactor([w])
    opt.step()
    state = {k: v for k, v in opt.state[w].items() if k != "step"}
    assert sum(v.numel() for v in state.values()) == r + c
    assert cm.adafactor_state_bytes([(r, c)]) == 4 * (r + c)
    assert cm.adam_state_bytes([(r, c)]) == 4 * 2 * r * c
    ratio = cm.adam_state_bytes([(r, c)]) / cm.adafactor_state_bytes([(r, c)])
    assert ratio == pytest.approx(2 * r * c / (r + c))


def test_bad_hyper_parameters_name_the_fix():
    p = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match="beta2_decay must be <= 0"):
        Adafactor(p, beta2_decay=0.8)
    with pytest.raises(ValueError, match="d must be >= 1"):
        Adafactor(p, d=0.5)
    with pytest.raises(ValueError, match="lr must be >= 0"):
        Adafactor(p, lr=-1.0)
    with pytest.raises(ValueError, match="eps2"):
        Adafactor(p, eps=(None, -1.0))


def test_parameters_without_gradients_are_left_alone():
    a, b = nn.Parameter(torch.ones(3, 3)), nn.Parameter(torch.ones(4))
    a.grad = torch.ones(3, 3)
    opt = Adafactor([a, b])
    opt.step()
    assert b not in opt.state and torch.equal(b.detach(), torch.ones(4))
    assert not torch.equal(a.detach(), torch.ones(3, 3))
