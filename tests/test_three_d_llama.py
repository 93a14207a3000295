"""Chapter 12 with the Llama-shaped model: 3D training (data × tensor × pipeline) equals one process.

``train_3d`` takes a ``LlamaConfig`` as it takes a ``GPTConfig``: the dense model is the Llama, its
tensor-parallel slice ch04's (kv heads split when t divides n_kv_head, replicated — their gradients
summed — when n_kv_head divides t), its stages ch03's. At 2 and 4 ranks, over a few SGD / AdamW steps,
the losses and every reassembled weight equal the single process's, and replicated copies agree.
"""
from __future__ import annotations

import functools

import pytest
import torch

from minitorch_dist.models.llama import LlamaConfig
from minitorch_dist.parallelism import three_d as D
from minitorch_dist.runtime.launch import launch

pytestmark = [pytest.mark.ch12, pytest.mark.timeout(300)]

STEPS, B, T = 3, 8, 16
SGD_TOL = dict(rtol=1e-5, atol=1e-6)
ADAM_TOL = dict(rtol=1e-5, atol=1e-5)  # as tests/test_three_d.py: AdamW's steps are ~lr whatever the gradient


def _cfg(n_kv_head: int = 2) -> LlamaConfig:
    return LlamaConfig.tiny(vocab_size=64, block_size=T, n_layer=4, n_head=4, n_kv_head=n_kv_head)


def _adam(params):
    return torch.optim.AdamW(params, lr=1e-3)


@functools.cache
def _reference(n_kv_head: int, adam: bool):
    return D.reference_run(_cfg(n_kv_head), STEPS, B, T, optimizer=_adam if adam else None)


def _check(d, t, p, m=2, n_kv_head=2, adam=False, **kw):
    cfg = _cfg(n_kv_head)
    results = launch(functools.partial(D.train_3d, optimizer=_adam if adam else None, **kw), d * t * p, cfg,
                     d, t, p, STEPS, B, T, m, timeout_s=240)
    want_losses, want = _reference(n_kv_head, adam)
    assert D.global_losses(results) == pytest.approx(want_losses, rel=1e-5)
    full, spread = D.merge_full_params(results, cfg)
    assert spread <= 1e-6, f"replicated copies disagree by {spread}"
    for k in want:
        torch.testing.assert_close(full[k], want[k], **(ADAM_TOL if adam else SGD_TOL), msg=k)


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
