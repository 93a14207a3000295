"""Chapter 07, held-out: segment counts on chains the visible tests do not draw, sliding-window attention
with other shapes and windows, the recursion on 6 and 8 plain blocks, and a recomputation changed by a
buffer updated in place.

Expected values as in the visible tests: ``costmodel.checkpoint_saved_bytes`` searched over every k,
``F.scaled_dot_product_attention`` with a mask written out entry by entry, the plain blocks' gradients in
float64 (held to ``model_bound(n=4D, depth=4 per block)``, the visible tests' block bound), the recursion's
run counts written out.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minitorch_dist import costmodel
from minitorch_dist.models import GPT, GPTConfig

from _support import close, float64, model_bound

pytestmark = pytest.mark.ch07

D = 8


def test_choose_segments_held_out_chains(ex):
    g = np.random.default_rng(2027)
    for _ in range(30):
        n, layer, boundary = int(g.integers(2, 200)), int(g.integers(1, 999)), int(g.integers(1, 999))
        peaks = {k: costmodel.checkpoint_saved_bytes(n, layer, boundary, k) for k in range(1, n + 1)}
        least = min(peaks.values())
        assert ex.choose_segments(n, layer, boundary) == min(k for k, p in peaks.items() if p == least)
        budget = int(g.integers(least, max(peaks.values()) + 1))
        assert ex.choose_segments(n, layer, boundary, budget_bytes=budget) == \
            min(k for k, p in peaks.items() if p <= budget)


def _seen(s, causal, window):
    i = torch.arange(s)
    off = i[:, None] - i[None, :]
    m = (off >= 0) if causal else torch.ones(s, s, dtype=torch.bool)
    return m & (off.abs() < window) if window is not None else m


@pytest.mark.parametrize("causal, window", [(True, 2), (False, 5), (False, 1), (True, 7)])
def test_SelectiveAttention_held_out_windows(ex, causal, window):
    g = torch.Generator().manual_seed(window)
    q, k = (torch.randn(3, 7, 5, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    v = torch.randn(3, 7, 2, generator=g, dtype=torch.float64, requires_grad=True)
    out = ex.selective_attention(q, k, v, causal=causal, window=window)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=_seen(7, causal, window))
    bound = model_bound(n=7, depth=6, scale=max(1.0, ref.abs().max().item()))
    close(out, ref, bound, "output")
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    for a, b, name in zip(torch.autograd.grad(out, (q, k, v), go), torch.autograd.grad(ref, (q, k, v), go),
                          "qkv"):
        close(a, b, model_bound(n=7, depth=6, scale=max(1.0, b.abs().max().item())), f"d{name}")


class Block(nn.Module):
    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2, self.calls = nn.Linear(D, 4 * D), nn.Linear(4 * D, D), 0

    def forward(self, x):
        self.calls += 1
        return F.dropout(self.fc2(F.dropout(F.gelu(self.fc1(x)), 0.3, training=True)), 0.3, training=True)


def _runs(n):
    return [1] if n == 1 else [1 + r for r in _runs((n + 1) // 2)] + _runs(n // 2)


@pytest.mark.parametrize("n", [6, 8])
def test_RecursiveRecompute_held_out_chains(ex, n):
    with float64():
        blocks = nn.ModuleList(Block(s) for s in range(n))
        x = torch.randn(4, D, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        wrapped = ex.RecursiveRecompute(GPT(GPTConfig.tiny(n_layer=1)))
        grads = []
        for run in (lambda h: wrapped.run(blocks, h), lambda h: _plain(blocks, h)):
            blocks.zero_grad()
            for b in blocks:
                b.calls = 0
            xi = x.clone().requires_grad_()
            torch.manual_seed(5)
            run(xi).square().sum().backward()
            grads.append([xi.grad] + [p.grad.clone() for p in blocks.parameters()])
            if len(grads) == 1:
                assert [b.calls for b in blocks] == _runs(n)
        for a, b in zip(*grads):
            close(a, b, model_bound(n=4 * D, depth=4 * n, scale=max(1.0, b.abs().max().item())), "gradient")


def _plain(blocks, h):
    for b in blocks:
        h = b(h)
    return h


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.register_buffer("shift", torch.zeros(D))

    def forward(self, x):
        return self.lin(x) + self.shift


def test_RNGCheckpoint_held_out_buffer_changed_in_place(ex):
    m = WithBuffer()
    x = torch.randn(3, D, requires_grad=True)
    y = ex.rng_checkpoint(m, x)
    m.shift.add_(1.0)  # a running statistic updated between forward and backward
    with pytest.raises(RuntimeError, match="recomputation"):
        y.sum().backward()
    assert math.isfinite(float(m.shift.sum()))
