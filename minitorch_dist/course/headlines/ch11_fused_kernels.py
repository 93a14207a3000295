"""Chapter 11 — the tour's rows: each Triton kernel == its PyTorch reference; softmax bytes, eager / fused."""
from __future__ import annotations

import copy

import torch

from ...analysis import costmodel
from ...analysis.meters import ByteCounter
from ...kernels import (
    FusedAdamW,
    backend,
    cross_entropy,
    cross_entropy_reference,
    default_device,
    layer_norm,
    layernorm_reference,
    softmax,
    softmax_reference,
)


def _row(what, err, tol) -> dict:
    return {"chapter": "ch11", "experiment": f"{what} [{backend()}]: max |fused - reference|",
            "theory": f"<= {tol:g}", "measured": float(f"{err:.2e}"), "ok": err <= tol}


def _elementwise_rows(randn, g, M, N) -> list[dict]:
    """Softmax, LayerNorm (forward + backward) and cross-entropy against their references."""
    dev = default_device()
    rows = []
    x = randn(M, N) * 3
    rows.append(_row(f"softmax {M}x{N}", (softmax(x) - softmax_reference(x)).abs().max().item(), 1e-6))

    x, w, b = randn(M, N).requires_grad_(), randn(N).requires_grad_(), randn(N).requires_grad_()
    dy = randn(M, N)
    ours = torch.autograd.grad(layer_norm(x, w, b), (x, w, b), dy)
    ref = torch.autograd.grad(layernorm_reference(x, w, b), (x, w, b), dy)
    err = max((a - r).abs().max().item() for a, r in zip(ours, ref))
    rows.append(_row(f"LayerNorm {M}x{N} forward + backward (dx, dw, db)", err, 1e-4))

    logits, targets = randn(M, N).requires_grad_(), torch.randint(0, N, (M,), generator=g).to(dev)
    targets[::5] = -100  # ignored rows
    ours = cross_entropy(logits, targets)
    ref = cross_entropy_reference(logits, targets)
    err = max((ours - ref).abs().item(), (torch.autograd.grad(ours, logits)[0]
                                          - torch.autograd.grad(ref, logits)[0]).abs().max().item())
    rows.append(_row(f"cross-entropy {M}x{N} loss + gradient", err, 1e-5))
    return rows


def _adamw_row(randn) -> dict:
    """Three steps of FusedAdamW against torch.optim.AdamW on a two-layer MLP."""
    dev = default_device()
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
    return _row("AdamW, 3 steps of a 2-layer MLP vs torch.optim.AdamW(foreach=False)", err, 1e-6)


def _softmax_bytes_row(x) -> dict:
    """Bytes the five-op eager softmax moves (counted per op) over the fused kernel's x in, y out."""
    M, N = x.shape
    model_bytes = costmodel.softmax_bytes(M, N, 4)
    theory = sum(model_bytes.values()) / sum(costmodel.softmax_bytes(M, N, 4, fused=True).values())
    with ByteCounter() as counted:  # every op of the five-op softmax, read and written
        softmax_reference(x)
    measured = (counted.read + counted.written) / (2 * x.numel() * x.element_size())  # fused: x in, y out
    return {"chapter": "ch11",
            "experiment": f"softmax {M}x{N} fp32: bytes moved eager (counted per op) / fused",
            "theory": round(theory, 4), "measured": round(measured, 4), "ok": abs(measured - theory) < 1e-9}


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 11's rows: every kernel equals its PyTorch reference (run by Triton: the interpreter
    on CPU, compiled on a GPU), and fusing softmax cuts its memory traffic about 4x."""
    dev = default_device()
    g = torch.Generator().manual_seed(0)
    M, N = (16, 300) if smoke else (48, 1000)  # N not a power of two: the masked tail is exercised

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(dev)

    rows = _elementwise_rows(randn, g, M, N)
    rows.append(_adamw_row(randn))
    rows.append(_softmax_bytes_row(randn(M, N)))
    return rows
