"""Chapter 09 — figures: a compressed reduction's time against the number of ranks, what error feedback
delivers, PowerSGD's warm start against a fresh start."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch

from ... import costmodel
from ...communication import ErrorFeedback, PowerSGD, TopK
from .base import figure, holdings

#: the gradient of 24 GPT layers of width 4096 (qkv, proj, fc, fc-proj weights), as in the chapter
WIDTH, LAYERS = 4096, 24
METHODS = {"exact fp32": ("exact", {}), "fp16": ("fp16", {}), "QSGD, 4 levels": ("qsgd", {"levels": 4}),
           "sign (1 bit)": ("sign", {}), "top-k 1 %": ("topk", {"ratio": 0.01}),
           "PowerSGD rank 4": ("powersgd", {"rank": 4})}


def _gpt_matrices(h: int = WIDTH, layers: int = LAYERS) -> list[tuple[int, int]]:
    return [(3 * h, h), (h, h), (4 * h, h), (h, 4 * h)] * layers


@figure("ch09_time_vs_ranks")
def time_vs_ranks():
    """Alpha-beta seconds of one reduction of the 4.8 B-parameter gradient, per method, against n."""
    link = "Ethernet 100 Gb/s"
    alpha, beta = costmodel.LINKS[link]
    shapes = _gpt_matrices()
    params = sum(a * b for a, b in shapes)
    ranks = [2, 4, 8, 16, 32, 64, 128, 256]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for (label, (method, kw)), marker in zip(METHODS.items(), "os^vDx"):
        t = [costmodel.compressed_reduce_time(method, shapes, n, alpha, beta, **kw) for n in ranks]
        style = "-" if method in costmodel.SUMMABLE else "--"
        ax.plot(ranks, t, style, marker=marker, ms=4, label=label + ("" if method in costmodel.SUMMABLE
                                                                      else " (all-gathered)"))
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xlabel("ranks n"), ax.set_ylabel("seconds per step (communication)")
    ax.set_title(f"{params / 1e9:.2f} B fp32 gradients over {link}: all-gathered payloads grow with n",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper left")
    return fig


@figure("ch09_error_feedback")
def error_feedback():
    """Top-k of 16 coordinates with and without error feedback: what each coordinate gets delivered."""
    d, k, steps = 16, 2, 80
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([2.0 ** (-i / 3) for i in range(d)])  # coordinate i: a steady 2^(-i/3) + noise
    grads = [scale * (1 + 0.3 * torch.randn(d, generator=gen)) for _ in range(steps)]
    total = torch.stack(grads).sum(0)
    delivered, residual_norm = {}, []
    for name, comp in (("top-k alone", TopK(k / d)), ("top-k + error feedback", ErrorFeedback(TopK(k / d)))):
        sent = torch.zeros(d)
        for g in grads:
            sent += comp.decompress(comp.compress(g.clone()))
            if isinstance(comp, ErrorFeedback):
                residual_norm.append(comp.error[0].norm().item())
        delivered[name] = (sent / total).numpy()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.0), gridspec_kw={"width_ratios": [3, 2]})
    x = np.arange(d)
    for i, (name, frac) in enumerate(delivered.items()):
        ax.bar(x + (i - 0.5) * 0.4, frac, 0.4, label=name)
    ax.axhline(1.0, color="k", lw=0.8, ls=":")
    ax.set_xlabel(f"coordinate (largest gradient first), top-{k} of {d} sent per step")
    ax.set_ylabel(f"sent / given, {steps} steps")
    ax.legend(fontsize=7, loc="center right")
    ax.set_title("What has reached the optimizer (the rest waits in e)", fontsize=9)
    bx.plot(range(1, steps + 1), residual_norm, color="C1")
    bx.axhline(float(scale.norm()), color="gray", lw=0.8, ls=":")
    bx.text(steps, float(scale.norm()) * 1.05, "one typical gradient's norm", fontsize=7, ha="right")
    bx.set_xlabel("step"), bx.set_ylabel("‖residual e‖")
    bx.set_ylim(0, None)
    bx.set_title("The memory stays bounded", fontsize=9)
    return fig


def _matrix_with_spectrum(n: int, m: int, sigma, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    u = torch.linalg.qr(torch.randn(n, len(sigma), generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(m, len(sigma), generator=gen, dtype=torch.float64)).Q
    return (u * torch.tensor(sigma, dtype=torch.float64)) @ v.T


@figure("ch09_powersgd_warm_start")
def powersgd_warm_start():
    """Relative error of rank-2 PowerSGD on one fixed matrix, step by step: warm start against fresh Qs."""
    n, m, r, steps = 64, 48, 2, 12
    sigma = [10.0, 7.0, 5.0, 3.0, 2.0, 1.0, 0.5]
    M = _matrix_with_spectrum(n, m, sigma).float()
    best = math.sqrt(sum(s * s for s in sigma[r:]) / sum(s * s for s in sigma))  # Eckart-Young
    fig, ax = plt.subplots(figsize=(6.5, 3.0))
    warm = PowerSGD(rank=r, seed=1)
    runs = {"warm start (last step's Q)": lambda step: warm,
            "a fresh random Q every step": lambda step: PowerSGD(rank=r, seed=1 + step)}
    for label, compressor in runs.items():
        err = []
        for step in range(steps):
            psgd = compressor(step)
            approx = psgd.decompress(psgd.compress(M))
            err.append(float((M - approx).norm() / M.norm()))
        ax.plot(range(1, steps + 1), err, "o-", ms=3, label=label)
    ax.axhline(best, color="k", lw=0.8, ls=":", label=f"best rank {r} (truncated SVD): {best:.3f}")
    ax.set_xlabel("step (one power iteration each)"), ax.set_ylabel("‖M − M̂‖ / ‖M‖")
    ax.set_title(f"Rank-{r} PowerSGD on one {n} × {m} matrix whose spectrum is known", fontsize=9)
    ax.legend(fontsize=7)
    return fig


@figure("ch09_who_holds_what")
def who_holds_what():
    """Rank-r PowerSGD with error feedback on 4 ranks, for one gradient matrix M[n, m] (here n = m = 64,
    r = 4): each rank keeps its own M and error memory e, computes P[n, r] and Q[m, r] from them, and
    only P and Q are all-reduced; every rank ends with the same rank-r approximation of the mean."""
    n_ranks, m, r = 4, 64, 4
    fig, ax = plt.subplots(figsize=(9.5, 3.4))
    holdings(ax, [f"rank {k}" for k in range(n_ranks)], [
        ("gradient M[n, m]{U_dp}", [(f"M_{k}: own samples", 1.0) for k in range(n_ranks)]),
        ("error memory e[n, m]", [(f"e_{k}: own, kept", 1.0) for k in range(n_ranks)]),
        ("Q[m, r] (warm start)", [("last step's Q", r / m)] * n_ranks),
        ("P[n, r]{U_dp} → P[n, r], sum", [(f"(M_{k} + e_{k}) Q", r / m) for k in range(n_ranks)]),
        ("Q[m, r]{U_dp} → Q[m, r], mean", [(f"(M_{k} + e_{k})ᵀ P", r / m) for k in range(n_ranks)]),
        ("M̂[n, m] = P Qᵀ", [("equal everywhere", 1.0)] * n_ranks),
        ("new e[n, m]", [(f"M_{k} + e_{k} − M̂", 1.0) for k in range(n_ranks)]),
    ], ["all-reduce over dp of P[n, r]{U_dp} (a sum), then every rank orthogonalises P the same way",
        "all-reduce over dp of Q[m, r]{U_dp}, divided by 4: (n + m)·r numbers a matrix instead of n·m",
        "M and e never move; biases and norms (1-D) are all-reduced whole, in a third all-reduce"])
    ax.set_title("PowerSGD on 4 ranks: who holds what, and what moves (bar: size, of M's n·m; n = m = 64, "
                 "r = 4)", fontsize=10)
    return fig
