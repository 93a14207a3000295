"""Fused kernels in Triton (chapter 11): fewer trips to memory for the memory-bound ops.

Each module holds the kernels, the math in its docstring, and the PyTorch reference it is tested
against: :mod:`.softmax` (row softmax in one pass; online softmax for long rows; backward),
:mod:`.layernorm` (forward and backward with dw / db partial sums; an ``nn.LayerNorm`` drop-in),
:mod:`.adamw` (one AdamW step over a flat fp32 buffer of the whole model),
:mod:`.cross_entropy` (loss and gradient per row in one kernel). :mod:`.bench` times them
against eager PyTorch, ``torch.compile`` and a copy on a GPU.

:mod:`._runtime` decides where they run: compiled for CUDA when there is a GPU, else Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before any kernel is defined unless
the user set it), so every kernel is checked on any machine. ``backend()`` says which.

``kernels.softmax`` and ``kernels.cross_entropy`` are the differentiable functions (named as in
``torch.nn.functional``); reach a module's kernels with ``from minitorch_dist.kernels.softmax import ...``.
"""
from __future__ import annotations

from ._runtime import backend, default_device  # first: sets TRITON_INTERPRET before any @triton.jit
from .adamw import FlatParameters, FusedAdamW, adamw_reference, fused_adamw_step
from .cross_entropy import cross_entropy, cross_entropy_forward_backward, cross_entropy_reference
from .layernorm import (
    LayerNorm, layer_norm, layernorm_backward, layernorm_forward, layernorm_reference, replace_layernorms,
)
from .softmax import softmax, softmax_backward, softmax_forward, softmax_reference

__all__ = ["backend", "default_device", "FlatParameters", "FusedAdamW", "adamw_reference", "fused_adamw_step",
           "cross_entropy", "cross_entropy_forward_backward", "cross_entropy_reference", "LayerNorm", "layer_norm",
           "layernorm_backward", "layernorm_forward", "layernorm_reference", "replace_layernorms", "softmax",
           "softmax_backward", "softmax_forward", "softmax_reference", "headline"]


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 11's rows: every kernel equals its PyTorch reference (run by Triton: the interpreter
    on CPU, compiled on a GPU), and fusing softmax cuts its memory traffic about 4x."""
    import copy

    import torch

    from ..analysis import costmodel
    from ..analysis.meters import ByteCounter

    dev = default_device()
    g = torch.Generator().manual_seed(0)
    M, N = (16, 300) if smoke else (48, 1000)  # N not a power of two: the masked tail is exercised

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    def row(what, err, tol):
        return {"chapter": "ch11", "experiment": f"{what} [{backend()}]: max |fused - reference|",
                "theory": f"<= {tol:g}", "measured": float(f"{err:.2e}"), "ok": err <= tol}

    rows = []
    x = randn(M, N) * 3
    rows.append(row(f"softmax {M}x{N}", (softmax(x) - softmax_reference(x)).abs().max().item(), 1e-6))

    x, w, b = randn(M, N).requires_grad_(), randn(N).requires_grad_(), randn(N).requires_grad_()
    dy = randn(M, N)
    ours = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    ref = torch.autograd.grad(layernorm_reference(x, w, b), (x, w, b), dy)
    err = max((a - r).abs().max().item() for a, r in zip(ours, ref))
    rows.append(row(f"LayerNorm {M}x{N} forward + backward (dx, dw, db)", err, 1e-4))

    logits, targets = randn(M, N).requires_grad_(), torch.randint(0, N, (M,), generator=g).to(dev)
    targets[::5] = -100  # ignored rows
    ours = cross_entropy(logits, targets)
    ref = cross_entropy_reference(logits, targets)
    err = max((ours - ref).abs().item(), (torch.autograd.grad(ours, logits)[0]
                                          - torch.autograd.grad(ref, logits)[0]).abs().max().item())
    rows.append(row(f"cross-entropy {M}x{N} loss + gradient", err, 1e-5))

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)).to(dev)
    twin = copy.deepcopy(model)
    fused, eager = FusedAdamW(model, lr=1e-2, weight_decay=0.1), torch.optim.AdamW(
        twin.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for _ in range(3):
        batch = randn(16, 32)
        for net, opt in ((model, fused), (twin, eager)):
            opt.zero_grad()
            net(batch).square().mean().backward()
            opt.step()
    err = max((p - q).abs().max().item() for p, q in zip(model.parameters(), twin.parameters()))
    rows.append(row("AdamW, 3 steps of a 2-layer MLP vs torch.optim.AdamW(foreach=False)", err, 1e-6))

    x = randn(M, N)
    model_bytes = costmodel.softmax_bytes(M, N, 4)
    theory = sum(model_bytes.values()) / sum(costmodel.softmax_bytes(M, N, 4, fused=True).values())
    with ByteCounter() as counted:  # every op of the five-op softmax, read and written
        softmax_reference(x)
    measured = (counted.read + counted.written) / (2 * x.numel() * x.element_size())  # fused: x in, y out
    rows.append({"chapter": "ch11", "experiment": f"softmax {M}x{N} fp32: bytes moved eager (counted per op) / fused",
                 "theory": round(theory, 4), "measured": round(measured, 4), "ok": abs(measured - theory) < 1e-9})
    return rows
