"""Chapter 09, held-out: QSGD with buckets of one entry (every level is then exactly ±s), DGC's
momentum correction with k = numel (everything sent, every velocity masked) and a longer hand-worked
run, a 1-bit Adam step at the warm-up's boundary, a hand-worked batched PowerSGD stack (Cholesky's
positive R where a Householder reflection would flip the column), and the batched reducer on a bucket
that needs no padding, compressing from its first call, of a matrix it sends exactly (rank 1).

Expected values are exact (worked by hand or written out in binary-exact numbers) or within a derived
float64 bound (tests/_support.py).
"""
import pytest
import torch

from minitorch_dist.runtime import comm

from _support import model_bound

pytestmark = pytest.mark.ch09


def test_qsgd_quantize_held_out_buckets_of_one(ex):
    v = torch.tensor([[0.5, -3.0, 0.0], [2.0, -0.25, 7.0]])
    norms, q = ex.qsgd_quantize(v, 5, torch.Generator().manual_seed(0), bucket=1)
    assert torch.equal(norms, v.abs().reshape(-1))
    assert torch.equal(q, (torch.sign(v) * 5).to(torch.int8))
    assert torch.equal(ex.qsgd_dequantize(norms, q, 5, bucket=1), v)


def test_topk_with_error_feedback_held_out_everything_sent(ex):
    grad, residual, velocity = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 0.5]), torch.tensor([4.0, 4.0])
    values, indices, new_residual, new_velocity = ex.topk_with_error_feedback(grad, residual, 2, velocity,
                                                                              0.25)
    sent = torch.zeros(2)
    sent[indices] = values
    assert torch.equal(sent, torch.tensor([2.5, -0.5]))  # residual + (0.25 * 4 + grad)
    assert torch.equal(new_residual, torch.zeros(2)) and torch.equal(new_velocity, torch.zeros(2))


def test_onebit_adam_step_held_out_at_the_boundary(ex):
    p, g = torch.zeros(2), torch.tensor([1.0, -3.0])
    m, v, e = torch.zeros(2), torch.full((2,), 4.0), torch.zeros(2)
    out_warm = ex.onebit_adam_step(p, g, m, v, e, step=2, warmup_steps=3, lr=1.0, betas=(0.5, 0.5))
    out_comp = ex.onebit_adam_step(p, g, m, v, e, step=3, warmup_steps=3, lr=1.0, betas=(0.5, 0.5))
    assert torch.equal(out_warm[2], torch.tensor([2.5, 6.5])), "step 2 < 3: v still moves"
    assert torch.equal(out_comp[2], v), "step 3 >= 3: v frozen"
    assert torch.equal(out_comp[4], torch.tensor([1.0, -1.0])), "sent = ±mean|m'| = ±1"


def test_powersgd_step_held_out_by_hand(ex):
    # Two 4 x 2 matrices from Q = e₁ (r = 1). The first: M e₁ = (1, 1, 1, 1), R = chol(4) = 2,
    # P = (1, 1, 1, 1)/2, Q_new = Mᵀ P = (2, 0), M_hat = P Q_newᵀ; a Householder reflection returns −P.
    # The second: M e₁ = (−2, 0, 0, 0), R = 2, P = (−1, 0, 0, 0), Q_new = (2, 0). Every number is exact.
    M = torch.tensor([[[1.0, 1.0], [1.0, -1.0], [1.0, 1.0], [1.0, -1.0]],
                      [[-2.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0]]], dtype=torch.float64)
    Q = torch.tensor([[[1.0], [0.0]], [[1.0], [0.0]]], dtype=torch.float64)
    want_P = torch.tensor([[[0.5], [0.5], [0.5], [0.5]], [[-1.0], [0.0], [0.0], [0.0]]], dtype=torch.float64)
    want_Q = torch.tensor([[[2.0], [0.0]], [[2.0], [0.0]]], dtype=torch.float64)
    for iters in (1, 2):  # e₁ is a right singular vector of both: every round repeats the first
        P, Q_new, M_hat = ex.powersgd_step(M, Q, iters=iters)
        assert torch.equal(P, want_P), (iters, P)
        assert torch.equal(Q_new, want_Q), (iters, Q_new)
        assert torch.equal(M_hat, want_P @ want_Q.mT), (iters, M_hat)


def _rank_one_bucket(ex):
    """Every rank holds u vᵀ (one 4 x 4 gradient: N = 16, side 4, no padding), compressed at once."""
    u = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
    v = torch.tensor([2.0, 1.0, -1.0, 0.25], dtype=torch.float64)
    grads = [torch.outer(u, v).clone()]
    reducer = ex.PowerSGDReducer(rank=1, start_iter=0, seed=0)
    with comm.meter() as m:
        reducer.reduce(grads)
    return {"calls": [(e.op, e.nbytes) for e in m.events], "grad": grads[0], "want": torch.outer(u, v),
            "error": reducer.error}


@pytest.fixture(scope="module")
def rank_one(ex, launches):
    return launches(_rank_one_bucket, ex, timeout_s=60)


def test_PowerSGDReducer_held_out_rank_one_square_bucket(rank_one):
    for r, got in enumerate(rank_one(2)):
        assert got["calls"] == [("all_reduce", 8 * 4), ("all_reduce", 8 * 4)], \
            f"rank {r}: start_iter=0 compresses at once: one P and one Q of 4 x 1 float64, {got['calls']}"
        # M Q, P's normalisation, Mᵀ P, the mean, P Qᵀ: five float64 roundings of sums of <= 4 terms
        bound = model_bound(n=4, depth=5, scale=got["want"].abs().max())
        torch.testing.assert_close(got["grad"], got["want"], rtol=0, atol=bound)
        assert got["error"] is not None and got["error"].shape == (16,), "N = 16 is a square: no padding"
        torch.testing.assert_close(got["error"], torch.zeros(16, dtype=torch.float64), rtol=0, atol=bound)
