"""Chapter 09 exercises, autograded: top-k with error feedback, QSGD, a batched PowerSGD step by Cholesky
QR, batched PowerSGD with error feedback on ranks, the bytes of a compressed step, 1-bit Adam.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Expected values
come from independent sources: sorting for the top-k set; the sample mean of many quantisations
against its standard error and the paper's variance bound (QSGD Lemma 3.1); matrices built from a
chosen SVD, so the best rank-r error (Eckart-Young) is known without calling an SVD routine; for
PowerSGD on ranks, torch's own ``batched_powerSGD_hook`` on a DDP model fed the same batches, and the
exact all-reduce's training run; for the bytes of a step, the payload formulas written out in the test; for
1-bit Adam, Adam without bias correction written out in the test, and a quadratic whose optimum is known.

Exercises 4 and 5 run on 2 and 4 ranks, launched once per world size for the whole module, each case
run on its own (``_support.run_cases``) so that an unfinished exercise fails only its own tests. Checks
of bad input first make a valid call, so a stub fails them too.

Tolerances (derived in tests/_support.py). Top-k sets, levels, bytes, and what error feedback keeps of
exactly representable inputs are exact. Error feedback's books over many float32 steps balance up to
the float32 rounding of each step's sum (u of it, tallied step by step) plus the float64 rounding of
the test's own running sums, γ_{steps+2} of their terms. A 2-norm in float32 is one sum of n squares
and a square root: ``reorder_bound(n, ‖v‖)``; a dequantised level ``norm·q/s`` two roundings:
``reorder_bound(2, value)``. PowerSGD's batched step is a short chain of float64 reductions per matrix
(M·Q over m terms, the Cholesky QR over n, Mᵀ·P, P·Qᵀ, the Frobenius norm), ``model_bound(n=max(n, m),
depth=PSGD_DEPTH)`` of the values' size per round; Cholesky QR adds its loss of orthogonality, bounded by
Yamamoto et al. 2015 (ETNA 44, §3) as 5κ(P)²u(nr + r(r+1)) with κ(P) taken of the test's own M·Q widened
by both evaluations' rounding (``_cholqr_bound``); Mᵀ·P of the student's own P is one matmul,
``reorder_bound(n, |M|ᵀ|P|)``; after 25 rounds the subspace's error is (σ_3/σ_2)^50 <= 1e-25 of it, so
the error is the truncated SVD's up to the chain's rounding, relative to it. Against torch's
``batched_powerSGD_hook`` the reducer runs in float64 on DDP's regression MLP: gradients of a sum over 32
rows per rank (N = 64; the padded matrix's side is 49), 4 reductions chained through the model and 5
through the compression (P, its orthonormalisation, Q, P·Qᵀ, the residual), over PSGD_STEPS steps whose
weights feed the next: ``model_bound(n=N, depth=PSGD_STEPS·9)``, below 1e-9 on gradients ~0.1, where an
estimate that forgets its residual (or the padding's), its warm start or Q's mean is off by 1e-2.
Training with it (rank 4) is judged against the exact all-reduce's run by what that run learns: PowerSGD
must close all but 1/20 of the held-out error the exact run closes. The mechanism and the metered step
count float32 bytes and stay float32: ``sent + residual`` rebuilds what was given up to two roundings,
u(|residual| + |kept|); what was sent has rank r up to the rounding of P·Qᵀ and of given − residual
(derived where it is checked); the warm-up's mean of two ranks is one sum and an exact halving,
``reorder_bound(2, (|a| + |b|)/2)``.
1-bit Adam's warm-up is Adam written out in float64, ~10 operations a step on both sides:
γ_{10·steps} of the values' size (``_chain_bound``); its compressed phase checks one float32 formula
at a time, γ_k of its terms, the scale a mean of n = 50 magnitudes, ``reorder_bound(n + 1, scale)``.
Statistical checks state their margins: QSGD's mean within 4.5 standard errors (false alarm ~4e-4 over
64 coordinates), deterministic rounding beyond; the paper's variance bound; 1-bit Adam's quadratic
within 1e-6 of its optimum (|x*| in [1, 2]).
"""
import math

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.communication import FP16, QSGD, ErrorFeedback, PowerSGD, RandomK, Sign, TopK
from minitorch_dist.communication.compression import regression_task
from minitorch_dist.runtime import comm

from _support import case, close, float64, gamma, model_bound, refusal, reorder_bound, run_cases

pytestmark = pytest.mark.ch09


def _dense(values, indices, shape):
    out = torch.zeros(math.prod(shape), dtype=values.dtype)
    out[indices] = values
    return out.view(shape)


# --- 1. topk_with_error_feedback ---------------------------------------------------------------------

def test_topk_with_error_feedback_sends_the_k_largest_of_the_corrected_gradient(ex):
    g = torch.Generator().manual_seed(0)
    grad, residual = torch.randn(6, 7, generator=g), torch.randn(6, 7, generator=g)
    grad0, residual0 = grad.clone(), residual.clone()
    velocity = torch.randn(6, 7, generator=g)
    velocity0 = velocity.clone()
    values, indices, new_residual, _ = ex.topk_with_error_feedback(grad, residual, 5)
    ex.topk_with_error_feedback(grad, residual, 5, velocity, 0.9)
    assert torch.equal(grad, grad0) and torch.equal(residual, residual0), "inputs must not change"
    assert torch.equal(velocity, velocity0), "inputs must not change"
    c = (grad + residual).flatten()
    want = sorted(range(c.numel()), key=lambda i: -abs(c[i].item()))[:5]  # no ties in random floats
    assert sorted(indices.tolist()) == sorted(want)
    assert torch.equal(values, c[indices])
    assert new_residual.shape == grad.shape


def test_topk_with_error_feedback_residual_carries_exactly_what_was_not_sent(ex):
    g = torch.Generator().manual_seed(1)
    shape, k = (10, 9), 7
    residual = torch.zeros(shape)
    sent_total = torch.zeros(shape, dtype=torch.float64)
    grad_total = torch.zeros(shape, dtype=torch.float64)
    slack = torch.zeros(shape, dtype=torch.float64)  # the float32 rounding of grad + residual, step by step
    terms = torch.zeros(shape, dtype=torch.float64)  # Σ|terms| of this test's float64 running sums
    for step in range(40):
        grad = torch.randn(shape, generator=g)
        slack += torch.finfo(torch.float32).eps * (grad + residual).abs().double()  # >= 2x half an ulp
        values, indices, new_residual, _ = ex.topk_with_error_feedback(grad, residual, k)
        sent = _dense(values, indices, shape)
        # exact, bitwise: every entry of grad + residual is either sent or kept
        assert torch.equal(sent + new_residual, grad + residual), f"step {step}: sent + residual != corrected"
        assert int((new_residual.flatten()[indices] != 0).sum()) == 0, "sent entries must leave the residual"
        sent_total += sent.double()
        grad_total += grad.double()
        terms += sent.double().abs() + grad.double().abs()
        residual = new_residual
    # over many steps nothing is lost: what was sent plus what is still held is every gradient, up to
    # the float32 rounding of each step's grad + residual, and the float64 rounding of the sums here
    gap = (sent_total + residual.double() - grad_total).abs()
    slack += gamma(40 + 2, torch.float64) * (terms + residual.double().abs())
    assert (gap <= slack).all(), \
        f"lost {gap.max().item():.2e} (rounding allows {slack.max().item():.2e})"


def test_topk_with_error_feedback_momentum_correction_by_hand(ex):
    # beta 0.5, k 1; numbers exact in binary. Step 1: u = g1, send entry 0 (1), keep [0, .5, -.25], mask u.
    # Step 2: u = .5 [0, .5, -.25] + g2 = [.125, .375, -.875]; accumulated = residual + u = [.125, .875,
    # -1.125]: send entry 2 (-1.125), keep [.125, .875, 0], velocity [.125, .375, 0] (entry 2 masked).
    g1, g2 = torch.tensor([1.0, 0.5, -0.25]), torch.tensor([0.125, 0.125, -0.75])
    v1, i1, r1, u1 = ex.topk_with_error_feedback(g1, torch.zeros(3), 1, None, 0.5)
    assert i1.tolist() == [0] and v1.tolist() == [1.0]
    assert r1.tolist() == [0.0, 0.5, -0.25] and u1.tolist() == [0.0, 0.5, -0.25], \
        f"residual {r1.tolist()}, velocity {u1.tolist()}: the sent entry's velocity is masked to 0"
    v2, i2, r2, u2 = ex.topk_with_error_feedback(g2, r1, 1, u1, 0.5)
    assert i2.tolist() == [2] and v2.tolist() == [-1.125], \
        f"sent {v2.tolist()} at {i2.tolist()}: the residual accumulates the velocity, not the gradient"
    assert r2.tolist() == [0.125, 0.875, 0.0] and u2.tolist() == [0.125, 0.375, 0.0], \
        f"residual {r2.tolist()}, velocity {u2.tolist()}"


def test_topk_with_error_feedback_momentum_run_keeps_the_books(ex):
    g = torch.Generator().manual_seed(3)
    shape, k, beta = (8, 8), 5, 0.9
    residual, velocity = torch.zeros(shape), None
    for step in range(25):
        grad = torch.randn(shape, generator=g)
        u = grad if velocity is None else beta * velocity + grad
        values, indices, new_residual, new_velocity = ex.topk_with_error_feedback(grad, residual, k, velocity,
                                                                                  beta)
        sent = _dense(values, indices, shape)
        assert torch.equal(sent + new_residual, residual + u), f"step {step}: sent + residual != residual + u"
        masked = torch.zeros(math.prod(shape), dtype=torch.bool)
        masked[indices] = True
        masked = masked.view(shape)
        assert torch.equal(new_velocity[masked], torch.zeros(k)), f"step {step}: sent entries keep velocity"
        assert torch.equal(new_velocity[~masked], u[~masked]), f"step {step}: unsent velocity is beta u + g"
        residual, velocity = new_residual, new_velocity


def test_topk_with_error_feedback_rejects_bad_input(ex):
    grad = torch.randn(4, 4)
    ex.topk_with_error_feedback(grad, torch.zeros(4, 4), 3)  # a valid call first
    with pytest.raises(ValueError, match="residual shape"):
        ex.topk_with_error_feedback(grad, torch.zeros(16), 3)
    with pytest.raises(ValueError, match="k must be"):
        ex.topk_with_error_feedback(grad, torch.zeros(4, 4), 17)
    with pytest.raises(ValueError, match="k must be"):
        ex.topk_with_error_feedback(grad, torch.zeros(4, 4), 0)
    with pytest.raises(ValueError, match="velocity shape"):
        ex.topk_with_error_feedback(grad, torch.zeros(4, 4), 3, torch.zeros(16), 0.9)
    with pytest.raises(ValueError, match="beta must be"):
        ex.topk_with_error_feedback(grad, torch.zeros(4, 4), 3, None, 1.0)


# --- 2. QSGD ------------------------------------------------------------------------------------------

def test_qsgd_quantize_values_lie_on_the_grid(ex):
    v = torch.randn(500, generator=torch.Generator().manual_seed(2))
    for s in (1, 4, 15):
        norm, q = ex.qsgd_quantize(v, s, torch.Generator().manual_seed(s))
        assert not q.is_floating_point() and q.shape == v.shape
        assert q.abs().max().item() <= s
        ref_norm = torch.linalg.vector_norm(v)
        close(norm, ref_norm, reorder_bound(v.numel(), ref_norm), "the 2-norm")
        # each |q_i| is one of the two levels around |v_i| / ||v|| * s, with v's sign (or 0)
        a = (v.abs() / v.norm() * s).double()
        lvl = q.abs().double()
        assert bool(((lvl == a.floor()) | (lvl == a.floor() + 1)).all()), f"s={s}: a level is not a neighbour"
        assert bool(((q == 0) | (torch.sign(q.double()) == torch.sign(v.double()))).all())
        deq = ex.qsgd_dequantize(norm, q, s)
        want = norm * q.float() / s
        close(deq, want, reorder_bound(2, want), "norm * q / s")


def test_qsgd_dequantize_scales_levels_by_norm_over_s(ex):
    norm, q = torch.tensor(6.0), torch.tensor([-3, 0, 1, 2], dtype=torch.int8)
    out = ex.qsgd_dequantize(norm, q, 3)
    assert out.dtype == torch.float32 and torch.equal(out, torch.tensor([-6.0, 0.0, 2.0, 4.0]))
    out64 = ex.qsgd_dequantize(torch.tensor(1.0), torch.tensor([1], dtype=torch.int32), 3,
                               dtype=torch.float64)
    assert out64.dtype == torch.float64 and out64.item() == 1 / 3
    with pytest.raises(ValueError, match="levels"):
        ex.qsgd_dequantize(norm, q, 0)


def test_qsgd_quantize_is_unbiased(ex):
    s, n, draws = 2, 64, 4000
    v = torch.randn(n, generator=torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(4)
    samples = torch.stack([ex.qsgd_dequantize(*ex.qsgd_quantize(v, s, gen), s)
                           for _ in range(draws)]).double()
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(draws)
    z = ((mean - v.double()).abs() / se.clamp_min(1e-12)).max().item()
    # 64 coordinates: the largest |z| of 64 standard normals exceeds 4.5 with probability ~4e-4
    assert z < 4.5, f"the mean of {draws} quantisations is {z:.1f} standard errors from v: biased"
    # the paper's variance bound, Lemma 3.1: E||Q(v) - v||^2 <= min(n / s^2, sqrt(n) / s) ||v||^2
    var = ((samples - v.double()) ** 2).sum(1).mean().item()
    assert var <= min(n / s ** 2, math.sqrt(n) / s) * v.double().square().sum().item()
    # the check can fail: deterministic rounding to the nearest level is biased
    nearest = (v.abs() / v.norm() * s).round() * torch.sign(v) * v.norm() / s
    assert ((nearest.double() - v.double()).abs() / se.clamp_min(1e-12)).max().item() > 4.5


def test_qsgd_quantize_buckets_each_on_its_own_grid(ex):
    s, d = 4, 16
    v = torch.randn(5, 10, generator=torch.Generator().manual_seed(5))  # 50 entries: buckets 16, 16, 16, 2
    v.view(-1)[16:32] = 0.0  # the second bucket is all zero
    v.view(-1)[0] = 40.0  # an outlier in the first bucket only
    norms, q = ex.qsgd_quantize(v, s, torch.Generator().manual_seed(6), bucket=d)
    flat = v.reshape(-1)
    want = torch.stack([torch.linalg.vector_norm(flat[i:i + d]) for i in range(0, 50, d)])
    assert norms.shape == (4,) and q.shape == v.shape, f"norms {tuple(norms.shape)}: one per bucket of {d}"
    for b in range(4):
        close(norms[b], want[b], reorder_bound(d, want[b]), f"bucket {b}'s 2-norm")
    qf = q.reshape(-1)
    assert torch.equal(qf[16:32], torch.zeros(16, dtype=q.dtype)), "an all-zero bucket has levels 0"
    for b in (0, 2, 3):
        part = flat[b * d:(b + 1) * d]
        a = (part.abs() / part.norm() * s).double()
        lvl = qf[b * d:(b + 1) * d].abs().double()
        assert bool(((lvl == a.floor()) | (lvl == a.floor() + 1)).all()), \
            f"bucket {b}: a level is not a neighbour of |v_i| / ||bucket|| * s"
    deq = ex.qsgd_dequantize(norms, q, s, bucket=d)
    assert not torch.isnan(deq).any() and torch.equal(deq.reshape(-1)[16:32], torch.zeros(16))
    per = want.repeat_interleave(d)[:50].view(5, 10)
    close(deq, per * q.float() / s, reorder_bound(2, per * s), "norm of its bucket * q / s")


def test_qsgd_dequantize_buckets_by_hand(ex):
    norms, q = torch.tensor([6.0, 3.0]), torch.tensor([-3, 0, 1, 2, 3], dtype=torch.int8)
    out = ex.qsgd_dequantize(norms, q, 3, bucket=4)  # buckets [-3, 0, 1, 2] (norm 6) and [3] (norm 3)
    assert torch.equal(out, torch.tensor([-6.0, 0.0, 2.0, 4.0, 3.0])), f"got {out.tolist()}"
    with pytest.raises(ValueError, match="norms for"):
        ex.qsgd_dequantize(norms, q, 3, bucket=2)


def test_qsgd_quantize_buckets_are_unbiased_with_a_smaller_variance(ex):
    s, n, d, draws = 2, 64, 8, 3000
    v = torch.randn(n, generator=torch.Generator().manual_seed(7))
    gen = torch.Generator().manual_seed(8)
    samples = torch.stack([ex.qsgd_dequantize(*ex.qsgd_quantize(v, s, gen, bucket=d), s, bucket=d)
                           for _ in range(draws)]).double()
    mean, se = samples.mean(0), samples.std(0) / math.sqrt(draws)
    z = ((mean - v.double()).abs() / se.clamp_min(1e-12)).max().item()
    assert z < 4.5, f"the mean of {draws} bucketed quantisations is {z:.1f} standard errors from v: biased"
    var = ((samples - v.double()) ** 2).sum(1).mean().item()
    bound = sum(min(d / s ** 2, math.sqrt(d) / s) * v[i:i + d].double().square().sum().item()
                for i in range(0, n, d))  # Lemma 3.1 for each bucket
    assert var <= bound, f"variance {var:.3g} above the per-bucket bound {bound:.3g}"


def test_qsgd_quantize_zero_vector_and_determinism(ex):
    norm, q = ex.qsgd_quantize(torch.zeros(10), 4, torch.Generator().manual_seed(0))
    assert norm.item() == 0 and torch.equal(ex.qsgd_dequantize(norm, q, 4), torch.zeros(10))
    v = torch.randn(30)
    a = ex.qsgd_quantize(v, 3, torch.Generator().manual_seed(9))
    b = ex.qsgd_quantize(v, 3, torch.Generator().manual_seed(9))
    assert torch.equal(a[1], b[1]), "the same generator seed must give the same quantisation"


def test_qsgd_quantize_rejects_bad_input(ex):
    ex.qsgd_quantize(torch.randn(5), 2)  # a valid call first
    with pytest.raises(ValueError, match="levels"):
        ex.qsgd_quantize(torch.randn(5), 0)
    with pytest.raises(TypeError, match="floating-point"):
        ex.qsgd_quantize(torch.arange(5), 2)
    with pytest.raises(ValueError, match="bucket must be"):
        ex.qsgd_quantize(torch.randn(5), 2, bucket=0)


# --- 3. powersgd_step ------------------------------------------------------------------------------

F64 = torch.float64
U64 = 2.0 ** -53


def _orthonormal(n, r, g):
    return torch.linalg.qr(torch.randn(n, r, generator=g, dtype=F64)).Q


def _with_spectrum(n, m, sigma, g):
    """U diag(sigma) V^T with random orthonormal U, V: its singular values are ``sigma``."""
    k = len(sigma)
    s = torch.diag(torch.tensor(sigma, dtype=F64))
    return _orthonormal(n, k, g) @ s @ _orthonormal(m, k, g).T


def _stack(n, m, spectra, g):
    return torch.stack([_with_spectrum(n, m, sigma, g) for sigma in spectra])


PSGD_DEPTH = 5  # M·Q, its orthonormalisation, Mᵀ·P, P·Qᵀ, the norm of M - P·Qᵀ


def _psgd_bound(n, m, scale):
    return model_bound(n=max(n, m), depth=PSGD_DEPTH, scale=scale)


def _cholqr_bound(M, Q):
    """Per matrix of the stack: how far Cholesky QR's PᵀP may be from I, and κ(P).

    Yamamoto, Nakatsukasa, Yanagisawa & Fukaya 2015 ("Roundoff error analysis of the CholeskyQR2
    algorithm", ETNA 44, §3): for X (n x r) with δ = 8 κ(X) √(u (n r + r(r+1))) <= 1, Cholesky QR's
    ``‖QᵀQ − I‖₂ <= (5/64) δ² = 5 κ(X)² u (n r + r(r+1))``. X is the computed M Q; κ is taken of the
    test's own M Q, which differs from any evaluation of it by at most ε = 2 γ_m ‖|M||Q|‖_F, so
    κ(X) <= (σ₁ + ε) / (σ_r − ε) (and the SVD's own error, γ_n σ₁, is added to ε). The test's PᵀP
    adds γ_n of |P|ᵀ|P| <= 1 + the loss."""
    _, n, m = M.shape
    r = Q.shape[2]
    X = M @ Q
    sv = torch.linalg.svdvals(X)
    eps = 2 * gamma(m, F64) * torch.linalg.matrix_norm(M.abs() @ Q.abs()) + gamma(n, F64) * sv[:, 0]
    kappa = (sv[:, 0] + eps) / (sv[:, -1] - eps)
    assert bool((sv[:, -1] > eps).all()), "sanity: M Q has full rank beyond its rounding"
    delta = 8 * kappa * math.sqrt(U64 * (n * r + r * (r + 1)))
    assert bool((delta <= 1).all()), f"sanity: the bound's assumption δ <= 1 holds, δ = {delta.tolist()}"
    loss = 5 * kappa ** 2 * U64 * (n * r + r * (r + 1))
    return loss + gamma(n, F64) * (1 + loss), kappa


def _check_orthonormal(P, bound, where):
    err = (P.mT @ P - torch.eye(P.shape[2], dtype=P.dtype)).abs().amax(dim=(1, 2))
    assert bool((err <= bound).all()), \
        f"{where}: max |PᵀP − I| per matrix {err.tolist()}, bound {bound.tolist()}"


def test_powersgd_step_reproduces_a_rank_r_stack_in_one_round(ex):
    g = torch.Generator().manual_seed(5)
    n, m, r = 30, 20, 3
    M = _stack(n, m, [[5.0, 2.0, 0.5], [1.0, 1.0, 1.0], [40.0, 3.0, 0.25]], g)
    Q = torch.randn(3, m, r, generator=g, dtype=F64)  # a generic start is a good one
    M0, Q0 = M.clone(), Q.clone()
    P, Q_new, M_hat = ex.powersgd_step(M, Q)
    assert torch.equal(M, M0) and torch.equal(Q, Q0), "the inputs are not modified"
    assert P.shape == (3, n, r) and Q_new.shape == (3, m, r) and M_hat.shape == (3, n, m)
    loss, _ = _cholqr_bound(M, Q)
    _check_orthonormal(P, loss, "a well-conditioned M Q")
    close(Q_new, M.mT @ P, reorder_bound(n, M.abs().mT @ P.abs(), F64), "Q_new = MᵀP")
    for i in range(3):  # P Pᵀ M is M on its own range: the chain's rounding, and PᵀP's distance from I
        scale = M[i].abs().max()
        close(M_hat[i], M[i], _psgd_bound(n, m, scale) + 2 * loss[i].item() * torch.linalg.matrix_norm(M[i]),
              f"matrix {i}: the rank-3 matrix from one round")


def test_powersgd_step_orthogonalises_by_cholesky_qr(ex):
    """P = X R⁻¹ with R = chol(XᵀX): Pᵀ X is R, upper triangular with a positive diagonal (a Householder
    QR's R has diagonal entries of either sign); orthonormal within κ(X)² u, also for κ ~ 10⁴."""
    g = torch.Generator().manual_seed(7)
    n, m, r = 60, 40, 2
    M = _stack(n, m, [[2.0] * 10 + [1.0] * 10] * 4, g)  # κ(M) = 2 on its range
    Q = torch.randn(4, m, r, generator=g, dtype=F64)
    # matrices 2 and 3: two columns of Q nearly parallel, so κ(M Q) ~ 10⁴ (κ² u ~ 1e-8 > u)
    Q[2:, :, 1] = Q[2:, :, 0] + 1e-4 * torch.randn(2, m, generator=g, dtype=F64)
    loss, kappa = _cholqr_bound(M, Q)
    assert kappa[:2].max() < 50 and kappa[2:].min() > 3e3, f"sanity: κ(M Q) = {kappa.tolist()}"
    P, Q_new, M_hat = ex.powersgd_step(M, Q)  # an ill-conditioned, full-rank P is not refused
    _check_orthonormal(P, loss, "Cholesky QR, κ(P) from 1 to 10⁴")
    X = M @ Q
    R = P.mT @ X
    diag = R.diagonal(dim1=1, dim2=2)
    assert bool((diag > 0).all()), f"R = Pᵀ M Q has a positive diagonal (Cholesky's R): {diag.tolist()}"
    # Pᵀ X = (I + E) R + Pᵀ(rounding of X) + the test's product: below the diagonal at most
    # (‖E‖ + 3 γ_m) ‖|M||Q|‖_F, E = PᵀP − I
    lower = R.tril(-1).abs().amax(dim=(1, 2))
    allowed = (loss + 3 * gamma(max(n, m), F64)) * torch.linalg.matrix_norm(M.abs() @ Q.abs())
    assert bool((lower <= allowed).all()), \
        f"Pᵀ M Q is upper triangular: {lower.tolist()} vs {allowed.tolist()}"


def test_powersgd_step_more_rounds_are_never_worse(ex):
    g = torch.Generator().manual_seed(6)
    n, m, r = 40, 25, 2
    spectra = [[10.0, 6.0, 2.0, 1.5, 1.0, 0.5, 0.25], [3.0, 2.5, 0.8, 0.7, 0.1]]
    M = _stack(n, m, spectra, g)
    # Eckart-Young: the best rank-r error is the tail of the spectrum
    best = torch.tensor([math.sqrt(sum(s * s for s in sig[r:])) for sig in spectra], dtype=F64)
    full = torch.tensor([math.sqrt(sum(s * s for s in sig)) for sig in spectra], dtype=F64)
    # the chain's rounding relative to the best error (‖M‖_F of magnitude against it), a few rounds deep;
    # every round's M Q is well-conditioned here (σ₁/σ₂ <= 2 after the first), so Cholesky QR's loss is
    # a few u, inside the chain's allowance
    rel = model_bound(n=max(n, m), depth=3 * PSGD_DEPTH, scale=full / best)
    Q = torch.randn(2, m, r, generator=g, dtype=F64)
    errors = []
    for k in (1, 2, 3, 4, 6, 9, 13, 25):
        *_, M_hat = ex.powersgd_step(M, Q, iters=k)
        errors.append(torch.linalg.matrix_norm(M - M_hat))
    errors = torch.stack(errors)  # (rounds, matrices)
    assert bool((errors >= best * (1 - rel)).all()), "no rank-r matrix beats the truncated SVD"
    assert bool((errors[0] > best * 1.01).all()), f"sanity: one round is not optimal ({errors[0]} vs {best})"
    # subspace iteration on M Mᵀ (positive semi-definite): the captured energy never falls (for r = 1 the
    # moment inequality μ₀μ₃ >= μ₁μ₂), so the error never rises, up to rounding
    assert bool((errors[1:] <= errors[:-1] + best * rel).all()), f"an extra round made it worse: {errors}"
    # (σ₃/σ₂)^(2·25) <= (0.8/2.5)^50 ~ 1e-25: converged, up to rounding
    assert bool((errors[-1] <= best * (1 + rel)).all()), f"after 25 rounds: {errors[-1]}, best {best}"
    # iters = 3 is three warm-started calls of one round
    P3, Q3, M3 = ex.powersgd_step(M, Q, iters=3)
    P, Qc = None, Q
    for _ in range(3):
        P, Qc, M_hat = ex.powersgd_step(M, Qc)
    bound = model_bound(n=max(n, m), depth=3 * PSGD_DEPTH, scale=full.max())
    for got, want, what in ((P3, P, "P"), (Q3, Qc, "Q_new"), (M3, M_hat, "M_hat")):
        close(got, want, bound, f"iters=3 against three chained rounds: {what}")


def test_powersgd_step_each_matrix_as_if_alone(ex):
    g = torch.Generator().manual_seed(8)
    n, m, r = 12, 9, 3
    spectra = [[9.0, 4.0, 2.0, 1.0], [1.0, 0.9, 0.8, 0.1], [100.0, 10.0, 1.0], [0.5, 0.4, 0.3, 0.2, 0.1]]
    M = _stack(n, m, spectra, g)
    Q = torch.randn(4, m, r, generator=g, dtype=F64)
    stacked = ex.powersgd_step(M, Q, iters=2)
    for i in range(4):
        alone = ex.powersgd_step(M[i:i + 1], Q[i:i + 1], iters=2)
        for got, want, what in zip(stacked, alone, ("P", "Q_new", "M_hat")):
            close(got[i], want[0], model_bound(n=max(n, m), depth=2 * PSGD_DEPTH, scale=spectra[i][0]),
                  f"matrix {i} of the stack against it alone: {what}")
    P32, Q32, M32 = ex.powersgd_step(M.float(), Q.float())
    assert P32.dtype == Q32.dtype == M32.dtype == torch.float32, "float32 in, float32 out"


def test_powersgd_step_rejects_bad_input(ex):
    g = torch.Generator().manual_seed(9)
    M = torch.randn(3, 6, 5, generator=g, dtype=F64)
    Q = torch.randn(3, 5, 2, generator=g, dtype=F64)
    ex.powersgd_step(M, Q, iters=2)  # a valid call first
    for bad in (lambda: ex.powersgd_step(M[0], Q[0]),  # one matrix, no stack
                lambda: ex.powersgd_step(M, Q[:2]),  # two Qs for three matrices
                lambda: ex.powersgd_step(M, torch.randn(3, 6, 2, dtype=F64)),  # Q's rows are not M's columns
                lambda: ex.powersgd_step(M, torch.randn(3, 5, 6, dtype=F64)),  # r > min(n, m)
                lambda: ex.powersgd_step(M, Q, iters=0)):
        with pytest.raises(ValueError):
            bad()
    # rank-deficient M Q: Cholesky breaks down. Matrix 1's last column is zero and Q's second column
    # picks exactly it, so P's second column is exactly 0; matrix 2 of another stack is all zeros.
    M1, Q1 = M.clone(), Q.clone()
    M1[1, :, -1] = 0
    Q1[1, :, 1] = 0
    Q1[1, -1, 1] = 1
    with pytest.raises(ValueError, match="not positive definite"):
        ex.powersgd_step(M1, Q1)
    M2 = M.clone()
    M2[2] = 0
    with pytest.raises(ValueError, match="not positive definite"):
        ex.powersgd_step(M2, Q, iters=3)


# --- 4 and 5 on ranks: one launch per world size for the module ------------------------------------

TIMEOUT_S = 90
PSGD_STEPS = 6
TRAIN_STEPS = 60
METER_SHAPES = [(16, 12), (12,), (8, 20), (3,)]
METER_N = sum(math.prod(s) for s in METER_SHAPES)  # 367 entries
METER_SIDE = 20  # ⌈√367⌉: 400 entries, 33 of them padding


def _grads_of(model):
    return [p.grad for p in model.parameters()]


def _vs_torch_hook(ex, rank):
    """Per step: max |our gradient - DDP+batched_powerSGD_hook's gradient| and max |gradient|, same model,
    same batches, in float64."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
    orthogonalize = ph._orthogonalize
    # torch's batched hook hands its 2-D P and Q to an _orthogonalize that takes only a stack (b, n, r)
    # (it raises AssertionError since the per-tensor hook was batched): the same function, on a stack of one
    ph._orthogonalize = lambda m, epsilon=0: orthogonalize(m.unsqueeze(0) if m.dim() == 2 else m, epsilon)
    try:
        with float64():
            return _vs_torch_hook_64(ex, rank, ph)
    finally:
        ph._orthogonalize = orthogonalize


def _vs_torch_hook_64(ex, rank, ph):
    from torch.nn.parallel import DistributedDataParallel as DDP
    r, n = dist.get_rank(), dist.get_world_size()
    ours, data = regression_task(0, d_in=32, d_hidden=48, d_out=16)
    ref, _ = regression_task(0, d_in=32, d_hidden=48, d_out=16)
    ddp = DDP(ref, bucket_cap_mb=100)  # one bucket: the hook sees all the gradients as one flat tensor
    state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                             use_error_feedback=True, warm_start=True, random_seed=3)
    ddp.register_comm_hook(state, ph.batched_powerSGD_hook)
    reducer = ex.PowerSGDReducer(rank=rank, start_iter=2, seed=3)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ddp)]
    diffs = []
    for step in range(PSGD_STEPS):
        x, y = data(step, 64, r, n)
        for model, opt in zip((ours, ddp), opts):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
        reducer.reduce(_grads_of(ours)[::-1])  # DDP's bucket holds the gradients in reverse order
        diffs.append((max((a.grad - b.grad).abs().max().item()
                          for a, b in zip(ours.parameters(), ddp.module.parameters())),
                      max(b.grad.abs().max().item() for b in ddp.module.parameters())))
        for opt in opts:
            opt.step()
    return diffs


def _mechanism(ex):
    """One warm-up and two compressed steps on known shapes: the collectives metered, and error feedback's
    books."""
    r = dist.get_rank()
    reducer = ex.PowerSGDReducer(rank=2, start_iter=1, seed=0)
    out = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * r + step)
        grads = [torch.randn(s, generator=g) for s in METER_SHAPES]
        local = [t.clone() for t in grads]
        before = None if reducer.error is None else reducer.error.clone()
        with comm.meter() as m:
            back = reducer.reduce(grads)
        after = None if reducer.error is None else reducer.error.clone()
        out.append({"calls": [(e.op, e.nbytes) for e in m.events], "local": local, "back": back is not None
                    and all(a is b for a, b in zip(back, grads)), "grads": [t.clone() for t in grads],
                    "error_before": before, "error_after": after,
                    "q": None if reducer.q is None else tuple(reducer.q.shape), "iter": reducer.iter})
    return out


def _refusals(ex):
    """What the reducer refuses, on every rank alike (before any collective)."""
    out = {}
    reducer = ex.PowerSGDReducer(rank=1, start_iter=1)
    grads = [torch.randn(4, 3), torch.randn(3)]
    reducer.reduce(grads)
    reducer.reduce(grads)  # compressed: the residual and Q now belong to this list
    out["other list"] = refusal(lambda: reducer.reduce([torch.randn(3), torch.randn(4, 3)]))
    out["mixed dtypes"] = refusal(lambda: ex.PowerSGDReducer(start_iter=0).reduce(
        [torch.zeros(4, 4), torch.zeros(4, dtype=torch.float64)]))
    out["rank 5 > side 4"] = refusal(lambda: ex.PowerSGDReducer(rank=5, start_iter=0).reduce(
        [torch.randn(10)]))
    out["rank 4 = side 4 runs"] = refusal(lambda: ex.PowerSGDReducer(rank=4, start_iter=0).reduce(
        [torch.randn(10, generator=torch.Generator().manual_seed(0))]))
    return out


def _train(ex, reduce_with):
    """60 steps of data-parallel SGD on the chapter's regression; the held-out MSE and the parameters."""
    r, n = dist.get_rank(), dist.get_world_size()
    model, data = regression_task(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reducer = ex.PowerSGDReducer(rank=4) if reduce_with == "powersgd" else None
    x, y = data(10**6, 1024)
    with torch.no_grad():
        initial = torch.nn.functional.mse_loss(model(x), y).item()
    for step in range(TRAIN_STEPS):
        opt.zero_grad()
        x, y = data(step, 64, r, n)
        torch.nn.functional.mse_loss(model(x), y).backward()
        if reducer is None:  # the exact mean, one flat all-reduce
            grads = _grads_of(model)
            flat = torch.cat([g.reshape(-1) for g in grads])
            comm.all_reduce(flat)
            torch.nn.utils.vector_to_parameters(flat / n, grads)
        else:
            reducer.reduce(_grads_of(model))
        opt.step()
    x, y = data(10**6, 1024)
    with torch.no_grad():
        final = torch.nn.functional.mse_loss(model(x), y).item()
    return final, [p.detach().clone() for p in model.parameters()], initial


def _meter_cases():
    return {"exact": None, "fp16": FP16(), "topk_ef": ErrorFeedback(TopK(0.1)),
            "randomk": RandomK(0.25, seed=1), "sign": Sign(), "qsgd": QSGD(4),
            "powersgd": PowerSGD(rank=2, start_iter=1)}


def _meter(ex):
    """The measure exercise for each compressor (PowerSGD twice: its warm-up step, then a compressed one)."""
    r = dist.get_rank()
    out = {}
    for name, c in _meter_cases().items():
        for call in range(2 if name == "powersgd" else 1):
            g = torch.Generator().manual_seed(10 * r + call)
            grads = [torch.randn(s, generator=g) for s in METER_SHAPES]
            key = f"{name}_warmup" if name == "powersgd" and call == 0 else name
            out[key] = (lambda grads=grads, c=c: ex.meter_compressed_step(grads, c), grads)
    results = run_cases({key: fn for key, (fn, _) in out.items()})
    return {key: (results[key], [t.clone() for t in grads]) for key, (_, grads) in out.items()}


def _on_ranks(ex):
    cases = {"meter": lambda: _meter(ex), ("vs_torch", 1): lambda: _vs_torch_hook(ex, 1)}
    if dist.get_world_size() == 2:
        cases.update({("vs_torch", 3): lambda: _vs_torch_hook(ex, 3), "refusals": lambda: _refusals(ex)})
        cases.update({"mechanism": lambda: _mechanism(ex), "train_exact": lambda: _train(ex, "exact"),
                      "train_powersgd": lambda: _train(ex, "powersgd")})
    return run_cases(cases)


@pytest.fixture(scope="module")
def ranks(ex, launches):
    """`ranks(n)`: the results of ranks 0..n-1, launched once per n (2 and 4)."""
    return launches(_on_ranks, ex, timeout_s=TIMEOUT_S)


def _results(ranks, n, key):
    """Each rank's value of case ``key`` on n ranks (a case that raised fails only its own tests)."""
    return ranks.case(n, key)


# --- 4. PowerSGDReducer ----------------------------------------------------------------------------


PSGD_N = 64  # the longest reduction: 32 rows per rank on 2 ranks; the padded matrix's side is ⌈√2368⌉ = 49
MODEL_DEPTH = 4  # two layers forward, one back, a weight gradient's sum over rows


@pytest.mark.parametrize("n, rank", [(2, 1), (2, 3), (4, 1)])  # Gram-Schmidt (r <= 2) and QR (r > 2)
def test_PowerSGDReducer_equals_torch_batched_powerSGD_hook(ranks, n, rank):
    for r, diffs in enumerate(_results(ranks, n, ("vs_torch", rank))):
        # two exact warm-up steps, then compressed ones. Each step's weights feed the next one's gradient.
        depth = PSGD_STEPS * (MODEL_DEPTH + PSGD_DEPTH)
        for step, (diff, size) in enumerate(diffs):
            bound = model_bound(n=PSGD_N, depth=depth, scale=max(1.0, size))
            assert diff <= bound, (f"{n} ranks, rank {r}, PowerSGD rank {rank}, step {step}: our gradients "
                                   f"are {diff:.3g} from torch's batched_powerSGD_hook's (bound {bound:.3g})")


def _padded(flat, side):
    out = torch.zeros(side * side, dtype=flat.dtype)
    out[: flat.numel()] = flat
    return out


def test_PowerSGDReducer_sends_one_P_and_one_Q_and_keeps_the_residual(ranks):
    per_rank = _results(ranks, 2, "mechanism")
    side, rank, N = METER_SIDE, 2, METER_N
    for r, steps in enumerate(per_rank):
        assert all(st["back"] for st in steps), f"rank {r}: reduce returns the gradients it was given"
        assert [st["iter"] for st in steps] == [1, 2, 3], f"rank {r}: self.iter counts the calls"
        assert steps[0]["calls"] == [("all_reduce", 4 * N)], \
            f"rank {r}: the warm-up is one all-reduce of the {N} entries, unpadded: {steps[0]['calls']}"
        assert steps[0]["error_after"] is None, f"rank {r}: no residual before the first compressed step"
        for st in steps[1:]:
            assert st["calls"] == [("all_reduce", 4 * side * rank)] * 2, \
                f"rank {r}: a compressed step all-reduces one P and one Q of {side} x {rank}: {st['calls']}"
            assert st["q"] == (side, rank), f"rank {r}: the warm-start Q is side x rank, got {st['q']}"
            err = st["error_after"]
            assert err is not None and err.shape == (side * side,), (f"rank {r}: the residual covers the "
                f"padded matrix, {side}² entries, got {None if err is None else tuple(err.shape)}")
            given = _padded(torch.cat([t.reshape(-1) for t in st["local"]]), side)
            if st["error_before"] is not None:
                given = given + st["error_before"]
            sent = given - err  # what this rank's gradients became, padding included
            kept = torch.cat([t.reshape(-1) for t in st["grads"]])
            # residual = given - estimate, then estimate + residual: one rounding each
            close(kept + err[:N], given[:N], gamma(2, torch.float32) * (err.abs() + given.abs()).max().item(),
                  f"rank {r}: what was sent plus the residual is what was given")
            # what was sent is P Qᵀ over the whole padded matrix: rank 2. Its third singular value is at most
            # the rounding of P Qᵀ (γ_r √side ‖P Qᵀ‖_F: P's rows have norm <= 1) plus that of given − residual
            # (2u(|given| + |sent|)); both doubled for P's orthonormality in float32
            u32 = 2.0 ** -24
            sv = torch.linalg.svdvals(sent.double().view(side, side))
            allowed = 2 * (gamma(rank, torch.float32) * math.sqrt(side) * sv.norm().item()
                           + 2 * u32 * torch.linalg.vector_norm(given.abs() + sent.abs()).item())
            assert sv[rank] <= allowed, (f"rank {r}: what was sent, padding included, has rank {rank}: "
                                         f"σ_3 = {sv[rank]:.3g} (allowed {allowed:.3g}), σ_1 = {sv[0]:.3g}")
    (a, b) = per_rank
    for st_a, st_b in zip(a, b):  # the ranks agree on the estimate
        for x, y in zip(st_a["grads"], st_b["grads"]):
            torch.testing.assert_close(x, y, rtol=0, atol=0)
    for i in range(len(METER_SHAPES)):  # the warm-up is the exact mean
        x, y = a[0]["local"][i], b[0]["local"][i]
        close(a[0]["grads"][i], (x + y) / 2, reorder_bound(2, (x.abs() + y.abs()) / 2),
              f"the warm-up's mean of tensor {i}")


def test_PowerSGDReducer_refuses_what_it_cannot_compress(ex, ranks):
    for r, got in enumerate(_results(ranks, 2, "refusals")):
        assert got["other list"] is not None, f"rank {r}: another list after the memory is set is refused"
        assert got["mixed dtypes"] is not None, f"rank {r}: gradients of two dtypes are refused"
        assert got["rank 5 > side 4"] is not None and "rank" in got["rank 5 > side 4"], \
            f"rank {r}: rank 5 on 10 entries (side 4) is refused, naming the rank: {got['rank 5 > side 4']!r}"
        assert got["rank 4 = side 4 runs"] is None, f"rank {r}: rank 4 on side 4 is allowed"
    with pytest.raises(ValueError, match="rank"):
        ex.PowerSGDReducer(rank=0)
    with pytest.raises(ValueError, match="start_iter"):
        ex.PowerSGDReducer(start_iter=-1)
    with pytest.raises(RuntimeError, match="launch"):
        ex.PowerSGDReducer().reduce([torch.zeros(3, 3)])


def test_PowerSGDReducer_trains_like_the_exact_all_reduce(ranks):
    exact, _, initial = _results(ranks, 2, "train_exact")[0]
    runs = _results(ranks, 2, "train_powersgd")
    ours, params, _ = runs[0]
    learned = initial - exact  # the held-out error exact training closes
    assert exact < initial / 4, f"sanity: exact training learns, held-out MSE {initial:.4f} -> {exact:.4f}"
    assert ours - exact <= learned / 20, \
        f"held-out MSE {ours:.4f} with PowerSGD, {exact:.4f} with the exact mean (from {initial:.4f})"
    for a, b in zip(params, runs[1][1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the ranks stay in sync



# --- 5. meter_compressed_step ----------------------------------------------------------------------


def _expected_bytes(name, n):
    """{op: bytes the meter counts} of one step, from the payloads written out here."""
    d = [math.prod(s) for s in METER_SHAPES]
    if name in ("exact", "powersgd_warmup"):
        return {"all_reduce": 4 * sum(d)}
    if name == "fp16":
        return {"all_reduce": 2 * sum(d)}
    if name == "powersgd":  # rank 2 for the matrices (all compressed here), the 1-D tensors as they are
        return {"all_reduce": sum(4 * (s[0] + s[1]) * 2 if len(s) == 2 else 4 * s[0] for s in METER_SHAPES)}
    payload = {"topk_ef": lambda k: 8 * math.ceil(0.1 * k), "randomk": lambda k: 4 * math.ceil(0.25 * k),
               "sign": lambda k: math.ceil(k / 8) + 4, "qsgd": lambda k: k + 4}[name]
    return {"all_gather": n * sum(payload(k) for k in d)}  # every rank receives every rank's payload


@pytest.mark.parametrize("n", [2, 4])
def test_meter_compressed_step_predicts_and_counts_the_bytes(ranks, n):
    per_rank = _results(ranks, n, "meter")
    names = list(per_rank[0])
    for r, res in enumerate(per_rank):
        for name in names:
            got = case({name: res[name][0]}, name, r)
            want = _expected_bytes(name, n)
            assert got["predicted"] == want, \
                f"rank {r}, {name}: predicted {got['predicted']}, expected {want}"
            assert got["measured"] == want, \
                f"rank {r}, {name}: measured {got['measured']}, the meter counts {want}"
    for name in names:  # the reduction really ran: every rank holds the same averaged gradients
        for a, b in zip(per_rank[0][name][1], per_rank[-1][name][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # all-gathered payloads grow with n: at 4 ranks sign sends twice what it sends at 2
    if n == 4:
        two = _results(ranks, 2, "meter")[0]["sign"][0]["measured"]["all_gather"]
        assert per_rank[0]["sign"][0]["measured"]["all_gather"] == 2 * two


# --- 6. onebit_adam_step ---------------------------------------------------------------------------

def _adam_no_bias_correction(param, grad, m, v, lr, betas, eps):
    """Reference Adam step without bias correction, written independently of the exercise."""
    b1, b2 = betas
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m.tolist(), grad.tolist())]
    v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v.tolist(), grad.tolist())]
    p = [pi - lr * mi / (math.sqrt(vi) + eps) for pi, mi, vi in zip(param.tolist(), m, v)]
    return (torch.tensor(p, dtype=torch.float64), torch.tensor(m, dtype=torch.float64),
            torch.tensor(v, dtype=torch.float64))


def _chain_bound(ops, scale):
    """Two float64 evaluations of the same formulas, ``ops`` roundings each, of values up to ``scale``."""
    return 2 * gamma(ops, torch.float64) * scale


def test_onebit_adam_step_warmup_is_adam_without_bias_correction(ex):
    g = torch.Generator().manual_seed(7)
    n, lr, betas, eps = 12, 0.05, (0.8, 0.95), 1e-6
    p = torch.randn(n, generator=g, dtype=torch.float64)
    m, v, e = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    p_ref, m_ref, v_ref = p.clone(), m.clone(), v.clone()
    moved = p.abs().max().item()  # |p| plus every step's |lr·m/(√v + eps)| so far
    for step in range(5):  # all 5 steps are warm-up
        grad = torch.randn(n, generator=g, dtype=torch.float64)
        p, m, v, e, sent = ex.onebit_adam_step(p, grad, m, v, e, step, 5, lr, betas, eps)
        p_ref, m_ref, v_ref = _adam_no_bias_correction(p_ref, grad, m_ref, v_ref, lr, betas, eps)
        ops = 10 * (step + 1)  # ~10 roundings a step (the moments' averages, √v, the ratio, the update)
        moved += lr * (m_ref.abs() / (v_ref.sqrt() + eps)).max().item()
        m_scale = m_ref.abs().max().item() + grad.abs().max().item()
        v_scale = v_ref.abs().max().item() + grad.square().max().item()
        close(m, m_ref, _chain_bound(ops, m_scale), f"step {step}: m")
        close(v, v_ref, _chain_bound(ops, v_scale), f"step {step}: v")
        close(p, p_ref, _chain_bound(ops, moved), f"step {step}: the parameters")
        assert torch.equal(sent, m), f"step {step}: during warm-up the full-precision momentum is sent"
        assert torch.equal(e, torch.zeros(n, dtype=torch.float64)), "no compression, no error during warm-up"


def test_onebit_adam_step_freezes_v_and_sends_plus_or_minus_scale(ex):
    g = torch.Generator().manual_seed(8)
    n, lr, warmup = 50, 0.01, 3
    p = torch.randn(n, generator=g)
    m, v, e = torch.zeros(n), torch.zeros(n), torch.zeros(n)
    for step in range(15):
        grad = torch.randn(n, generator=g)
        inputs = [t.clone() for t in (p, grad, m, v, e)]
        p2, m2, v2, e2, sent = ex.onebit_adam_step(p, grad, m, v, e, step, warmup, lr)
        assert all(torch.equal(a, b) for a, b in zip(inputs, (p, grad, m, v, e))), "inputs must not change"
        want = 0.9 * m + 0.1 * grad  # momentum is updated in both phases: 3 roundings a side
        close(m2, want, reorder_bound(3, 0.9 * m.abs() + 0.1 * grad.abs()), f"step {step}: momentum")
        if step == warmup - 1:
            v_frozen = v2.clone()
        if step >= warmup:
            assert torch.equal(v2, v_frozen), f"step {step}: v must stay frozen after warm-up"
            c = m2 + e
            scale = c.abs().mean()  # a mean of n magnitudes: n terms and a division, in any order
            assert len(set(sent.abs().tolist())) == 1, "sent must take only the values ±scale"
            close(sent, torch.where(c >= 0, scale, -scale), reorder_bound(n + 1, scale), f"step {step}: sent")
            # the update uses the compressed momentum and the frozen variance: 4 roundings a side
            step_size = lr * sent.abs() / (v_frozen.sqrt() + 1e-8)
            close(p2, p - lr * sent / (v_frozen.sqrt() + 1e-8), reorder_bound(4, p.abs() + step_size),
                  f"step {step}: the parameters")
        p, m, v, e = p2, m2, v2, e2
    assert v_frozen.abs().sum() > 0, "sanity: warm-up filled v"


def test_onebit_adam_step_sign_of_zero_is_plus(ex):
    # after the warm-up, entries whose corrected momentum is exactly 0 still send +scale (one bit each)
    param, v = torch.zeros(4), torch.ones(4)
    grad = torch.tensor([4.0, 0.0, -2.0, 0.0])
    zeros = torch.zeros(4)
    _, m1, _, err, sent = ex.onebit_adam_step(param, grad, zeros, v, zeros, step=5, warmup_steps=2, lr=0.1,
                                              betas=(0.5, 0.9))
    # m' = 0.5 g = [2, 0, -1, 0]; scale = mean|m'| = 0.75; sent = [+, +, -, +] 0.75
    assert torch.equal(m1, torch.tensor([2.0, 0.0, -1.0, 0.0]))
    assert torch.equal(sent, torch.tensor([0.75, 0.75, -0.75, 0.75])), \
        f"sent {sent.tolist()}: sign(0) is +1, so every entry sends ±scale"
    assert torch.equal(err, torch.tensor([1.25, -0.75, -0.25, -0.75]))


def test_onebit_adam_step_error_feedback_carries_exactly_the_residual(ex):
    # dyadic inputs (multiples of 1/16) and betas of 1/2, 64 entries: every operation is exact in
    # float64, so the identity must hold bit for bit
    g = torch.Generator().manual_seed(9)
    n = 64
    dyadic = lambda: torch.randint(-64, 65, (n,), generator=g).double() / 16
    p, m, v, e = dyadic(), dyadic(), dyadic().abs() + 1, dyadic()
    grad = dyadic()
    _, m2, _, e2, sent = ex.onebit_adam_step(p, grad, m, v, e, 4, 2, 0.1, betas=(0.5, 0.5))
    assert torch.equal(sent + e2, m2 + e), "sent + new_error must be exactly m_new + error"
    # over many steps with random float32 data nothing is lost either: the sum of what was sent plus
    # the error still held is the sum of the momenta (the paper's error-feedback telescoping)
    p, m, v, e = torch.randn(n, generator=g), torch.zeros(n), torch.rand(n, generator=g) + 0.5, torch.zeros(n)
    sent_total, m_total = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    slack = torch.zeros(n, dtype=torch.float64)  # float32 rounding of c = m + e and of e_new = c - sent
    terms = torch.zeros(n, dtype=torch.float64)  # Σ|terms| of this test's float64 running sums
    for step in range(30):
        e_old = e
        p, m, v, e, sent = ex.onebit_adam_step(p, torch.randn(n, generator=g), m, v, e, step, 0, 0.01)
        assert len(set(sent.abs().tolist())) == 1
        slack += torch.finfo(torch.float32).eps * ((m + e_old).abs() + e.abs()).double()
        sent_total += sent.double()
        m_total += m.double()
        terms += sent.double().abs() + m.double().abs()
    gap = (sent_total + e.double() - m_total).abs()
    slack += gamma(30 + 2, torch.float64) * (terms + e.double().abs())  # the float64 sums' own rounding
    assert (gap <= slack).all(), \
        f"lost {gap.max().item():.2e} (rounding allows {slack.max().item():.2e})"
    assert e.abs().sum() > 0, "sanity: the sign dropped something"


def test_onebit_adam_step_converges_on_a_quadratic(ex):
    # f(x) = 1/2 sum_i a_i (x_i - x*_i)^2, optimum x*, |x*_i| in [1, 2] so warm-up gradients fill v
    n, lr, warmup, steps = 16, 0.01, 20, 1000
    a = torch.linspace(0.5, 2.0, n, dtype=torch.float64)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        x_star = (1 + torch.rand(n, generator=g, dtype=torch.float64)) * torch.randn(n, generator=g,
                                                                                      dtype=torch.float64).sign()
        x = torch.zeros(n, dtype=torch.float64)
        m, v, e = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
        for step in range(steps):
            x, m, v, e, sent = ex.onebit_adam_step(x, a * (x - x_star), m, v, e, step, warmup, lr)
        err = (x - x_star).abs().max().item()
        assert err < 1e-6, f"seed {seed}: 1-bit Adam ended {err:.2e} from the optimum (tolerance 1e-6)"


def test_onebit_adam_step_rejects_bad_input(ex):
    z = torch.zeros(4)
    ex.onebit_adam_step(z, z, z, z, z, 0, 1, 0.1)  # a valid call first
    with pytest.raises(ValueError, match="v shape"):
        ex.onebit_adam_step(z, z, z, torch.zeros(5), z, 0, 1, 0.1)
    with pytest.raises(ValueError, match="error shape"):
        ex.onebit_adam_step(z, z, z, z, torch.zeros(2, 2), 0, 1, 0.1)
    with pytest.raises(ValueError, match="step must be"):
        ex.onebit_adam_step(z, z, z, z, z, -1, 1, 0.1)
    with pytest.raises(ValueError, match="warmup_steps must be"):
        ex.onebit_adam_step(z, z, z, z, z, 0, 1.5, 0.1)
    with pytest.raises(ValueError, match="lr must be"):
        ex.onebit_adam_step(z, z, z, z, z, 0, 1, 0.0)
    with pytest.raises(ValueError, match="betas"):
        ex.onebit_adam_step(z, z, z, z, z, 0, 1, 0.1, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="eps"):
        ex.onebit_adam_step(z, z, z, z, z, 0, 1, 0.1, eps=0)
