"""Chapter 03 — the zero-bubble split backward: B (the input gradient) and W (the weight gradients).

Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §2: for a Linear layer ``y = x W^T + b`` the
backward is two products, ``dx = dy W`` (which the previous stage waits for) and ``dW = dy^T x``
(which nobody waits for). B computes the first with ``torch.autograd.grad``, leaving every
Linear's weight unreached; the pairs (x, dy) it keeps let W compute the second later, in a bubble.
:mod:`.executor` runs them as the B and W actions of a schedule that ``splits_backward``.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["LinearTap", "b_params", "backward_input", "backward_weights"]


class LinearTap:
    """Forward hooks on every nn.Linear of a stage: while ``active`` holds a list, each call appends
    ``(module, input, output)``. The output stays in the graph (B takes the gradient w.r.t. it)."""

    def __init__(self, stages):
        self.active = None
        self.handles = [m.register_forward_hook(self._hook)
                        for s in stages for m in s.modules() if isinstance(m, nn.Linear)]

    def _hook(self, module, inputs, output):
        if self.active is not None:
            self.active.append((module, inputs[0].detach(), output))

    def remove(self):
        for h in self.handles:
            h.remove()


def b_params(stage: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient B computes itself: those of non-Linear modules (LayerNorm,
    embeddings). A tied weight that is also an Embedding's belongs here, not to W."""
    seen = {}
    for m in stage.modules():
        if not isinstance(m, nn.Linear):
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    seen[id(p)] = p
    return list(seen.values())


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is not None:
        p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def backward_input(y, g, x, taps, b_params):
    """Qi et al. 2024 §2's B: dL/dx, plus the (cheap) non-Linear parameter gradients; no dW of any Linear.

    ``torch.autograd.grad`` runs only the graph nodes on a path from ``y`` to the tensors asked for,
    and inside a node computes only the gradients needed. Asking for the stage input, the output of
    every Linear and the LayerNorm/embedding parameters leaves every Linear's weight and bias
    unreached: each ``addmm`` backward computes ``dX = dY W`` and skips ``dW = dY^T X``. The Linear
    outputs' gradients dY are returned, kept with the Linear's input X, and W computes ``dW``, ``db``
    from them later: the same arithmetic as the fused backward, done at another time.
    """
    outs = [o for _, _, o in taps]
    wants = ([x] if x is not None else []) + outs + b_params
    grads = torch.autograd.grad(y, wants, g, allow_unused=True)
    dx = grads[0] if x is not None else None
    k = len(wants) - len(b_params)
    dys = grads[k - len(outs):k]
    for p, gp in zip(b_params, grads[k:]):
        _accumulate(p, gp)
    return dx, [(mod, xin, dy) for (mod, xin, _), dy in zip(taps, dys) if dy is not None]


def backward_weights(stash, b_ids: set) -> None:
    """Qi et al. 2024 §2's W: for ``y = x W^T + b``, ``dW = dy^T x`` and ``db = sum(dy)`` over tokens."""
    for mod, xin, dy in stash:
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), xin.reshape(-1, xin.shape[-1])  # (b·T, out), (b·T, in)
        if mod.weight.requires_grad and id(mod.weight) not in b_ids:
            _accumulate(mod.weight, dy2.t() @ x2)  # (out, b·T) @ (b·T, in) -> (out, in)
        if mod.bias is not None and mod.bias.requires_grad and id(mod.bias) not in b_ids:
            _accumulate(mod.bias, dy2.sum(0))
