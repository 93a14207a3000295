"""Chapter 09, held-out: QSGD with buckets of one entry (every level is then exactly ±s), DGC's
momentum correction with k = numel (everything sent, every velocity masked) and a longer hand-worked
run, and a 1-bit Adam step at the warm-up's boundary.

Expected values are exact: worked by hand or written out in binary-exact numbers.
"""
import pytest
import torch

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
