"""Chapter 11 — the tour's rows: each Triton kernel == its PyTorch reference; softmax bytes, eager / fused;
FlashAttention-2 (Triton and tiled PyTorch) == SDPA, and the memory it saves."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from ... import costmodel
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
    tiled_attention,
)
from ...kernels.attention_bench import saved_bytes
from ...kernels.flash_attention import flash_attention


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


def _attention_rows(randn, S: int) -> list[dict]:
    """FlashAttention-2, Triton and tiled PyTorch, forward + backward against SDPA (causal, grouped-query
    heads, a length that is not a multiple of the tile); the bytes autograd saves, standard / flash."""
    q, k, v, do = randn(1, 4, S, 32), randn(1, 2, S, 32), randn(1, 2, S, 32), randn(1, 4, S, 32)
    ref_in = [x.double().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*ref_in, is_causal=True, enable_gqa=True)
    want = (ref, *torch.autograd.grad(ref, ref_in, do.double()))
    rows = []
    for name, fn in (("FlashAttention-2, Triton", flash_attention), ("FlashAttention-2, tiled PyTorch",
                                                                      tiled_attention)):
        ins = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*ins, causal=True)
        got = (out, *torch.autograd.grad(out, ins, do))
        err = max((a.double() - b).abs().max().item() for a, b in zip(got, want))
        row = _row(f"{name}, S={S}, GQA 4:2, causal, output + dq, dk, dv vs SDPA", err, 1e-4)
        if fn is tiled_attention:  # plain PyTorch: no Triton backend to name
            row["experiment"] = row["experiment"].replace(f" [{backend()}]", "")
        rows.append(row)
    n = 1024  # the N x N scores that standard attention keeps for its backward, against O(N) for flash
    x = [torch.randn(1, 4, n, 32, requires_grad=True) for _ in range(3)]
    std = saved_bytes(lambda a, b, c: (a @ b.transpose(-2, -1) * 32 ** -0.5).softmax(-1) @ c, *x)
    flash = saved_bytes(lambda a, b, c: tiled_attention(a, b, c, causal=True), *x)
    theory = (3 * n * 32 + n * n) / (4 * n * 32 + n)  # per head: Q, K, V, P against Q, K, V, O, L
    rows.append({"chapter": "ch11", "experiment": f"attention, N={n}, d=32: bytes saved for backward, "
                 "standard (Q, K, V, P) / flash (Q, K, V, O, L)", "theory": round(theory, 3),
                 "measured": round(std / flash, 3), "ok": abs(std / flash - theory) < 1e-9})
    return rows


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
    rows += _attention_rows(randn, 37 if smoke else 75)
    return rows
