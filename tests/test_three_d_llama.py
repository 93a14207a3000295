"""Chapter 12 with the Llama-shaped model: 3D training (data × tensor × pipeline) equals one process.

``train_3d`` takes a ``LlamaConfig`` as it takes a ``GPTConfig``: the dense model is the Llama, its
tensor-parallel slice ch04's (kv heads split when t divides n_kv_head, replicated — their gradients
summed — when n_kv_head divides t), its stages ch03's. At 2 and 4 ranks, over a few SGD / AdamW steps,
the losses and every reassembled weight equal the single process's, and replicated copies agree.

Tolerances (derived in tests/_support.py), as tests/test_three_d.py: every run is float64 (on the ranks,
the reference, the reassembled weights). The same sums in other orders, at most N = max(B·T, f, h) = 192
terms each; the Llama's forward chains 11 steps per block + 2 and its loss and gradients run forward, through
the loss and back (tests/test_llama_parallel.py): DEPTH = 2·(11·L + 2) + 2 = 94. Each step's gradients are
within ``model_bound`` of that (scaled by the gradients' size, at least 1), ~5e-9; the losses likewise.
Weights after STEPS = 3 steps: SGD (lr 0.1) ``sgd_bound`` ~1.5e-9, AdamW (lr 1e-3, eps 1e-6) ``adam_bound``
~1.5e-5; a lost microbatch or a replicated kv head's gradient left unsummed moves weights by ~lr·|g| (SGD)
or ~lr = 1e-3 per step (AdamW). Replicated copies agree bitwise (spread 0).
"""
from __future__ import annotations

import functools

import pytest
import torch

from minitorch_dist.models.llama import LlamaConfig
from minitorch_dist.parallelism import three_d as D
from minitorch_dist.runtime.launch import launch

from _support import adam_bound, close, float64, model_bound, sgd_bound

pytestmark = [pytest.mark.ch12, pytest.mark.timeout(300)]

STEPS, B, T = 3, 8, 16
LR, ADAM_LR, ADAM_EPS = 0.1, 1e-3, 1e-6  # train_3d's and reference_run's default SGD lr; AdamW's


def _cfg(n_kv_head: int = 2) -> LlamaConfig:
    return LlamaConfig.tiny(vocab_size=64, block_size=T, n_layer=4, n_head=4, n_kv_head=n_kv_head)


N = max(B * T, _cfg().ffn_hidden, _cfg().n_embd)  # the longest reduction: SwiGLU's down sums f = 192
DEPTH = 2 * (11 * _cfg().n_layer + 2) + 2  # forward, the loss, backward (module docstring)


def _adam(params):
    return torch.optim.AdamW(params, lr=ADAM_LR, eps=ADAM_EPS)


def _train_3d(*args, **kw):
    """``three_d.train_3d`` in float64 (this rank's process)."""
    with float64():
        return D.train_3d(*args, **kw)


@functools.cache
def _reference(n_kv_head: int, adam: bool):
    """``reference_run``'s losses and weights, and the largest gradient of any step (the same run again,
    reading each step's gradients: they scale its bound)."""
    from minitorch_dist.models.llama import Llama
    from minitorch_dist.models.train import train_steps
    from minitorch_dist.runtime.env import single_thread

    opt = _adam if adam else None
    with float64():
        losses, weights = D.reference_run(_cfg(n_kv_head), STEPS, B, T, optimizer=opt)
        with single_thread():
            torch.manual_seed(0)
            model, sizes = Llama(_cfg(n_kv_head)), []
            train_steps(model, STEPS + 1, B, T, optimizer=opt, lr=LR,
                        after_backward=lambda: sizes.append(max(q.grad.abs().max().item()
                                                                for q in model.parameters())))
    return losses, weights, max(sizes)


def _check(d, t, p, m=2, n_kv_head=2, adam=False, **kw):
    cfg = _cfg(n_kv_head)
    results = launch(functools.partial(_train_3d, optimizer=_adam if adam else None, **kw), d * t * p, cfg,
                     d, t, p, STEPS, B, T, m, timeout_s=240)
    want_losses, want, grad = _reference(n_kv_head, adam)
    for got, ref in zip(D.global_losses(results), want_losses, strict=True):
        bound = model_bound(n=N, depth=DEPTH, scale=max(1.0, abs(ref)))
        assert abs(got - ref) <= bound, f"loss {got} vs {ref}: bound {bound:.3g}"
    full, spread = D.merge_full_params(results, cfg)
    assert spread == 0.0, f"replicated copies disagree by {spread}"  # copies get the same bits
    grad_err = model_bound(n=N, depth=DEPTH, scale=max(1.0, grad))
    bound = (adam_bound(steps=STEPS, lr=ADAM_LR, grad_err=grad_err, eps=ADAM_EPS) if adam
             else sgd_bound(steps=STEPS, lr=LR, grad_err=grad_err))
    for k in want:
        close(full[k], want[k], bound, k)


@pytest.mark.parametrize("shape", [(1, 1, 2), (1, 2, 1), (2, 1, 1)])
def test_2_ranks_equal_one_process(shape):
    _check(*shape)


@pytest.mark.parametrize("shape", [(1, 2, 2), (2, 1, 2), (2, 2, 1)])
def test_4_ranks_equal_one_process(shape):
    _check(*shape)


def test_replicated_kv_heads_with_zero1_and_adamw_equal_one_process():
    _check(1, 4, 1, n_kv_head=2, adam=True, zero1=True)  # t = 4 > n_kv_head = 2: kv heads replicated


def test_sequence_parallel_3d_equals_one_process():
    _check(1, 2, 2, sequence_parallel=True)


def test_a_degree_the_model_cannot_take_is_refused_before_any_rank_starts():
    from minitorch_dist.parallelism.mesh import check_model

    with pytest.raises(ValueError, match="use t in"):  # t = 3 divides neither n_head = 4 nor n_kv_head = 2
        check_model(_cfg(n_kv_head=2), tp=3, pp=1)
    with pytest.raises(ValueError, match="n_layer 4 is not divisible"):
        check_model(_cfg(), tp=1, pp=3)
