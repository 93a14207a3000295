"""Chapter 11 — figures: the roofline with eager and fused kernels on it, the bytes fusion saves, the online
softmax's running max and normaliser."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ... import costmodel
from .base import figure, holdings


@figure("ch11_roofline")
def roofline():
    """The H100's roofline in bf16 and fp32, with softmax and LayerNorm (eager and fused) and a matmul."""
    dev = costmodel.device_spec("h100")
    M = N = 8192
    kernels = {
        "softmax": (costmodel.softmax_flops(M, N), costmodel.softmax_bytes(M, N, 2),
                    costmodel.softmax_bytes(M, N, 2, fused=True), "C0"),
        "LayerNorm forward": (costmodel.layernorm_flops(M, N), costmodel.layernorm_bytes(M, N, 2),
                              costmodel.layernorm_bytes(M, N, 2, fused=True), "C2"),
    }
    I = np.logspace(-1.5, 4, 300)
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    for dtype, style in (("bf16", "-"), ("fp32", "--")):
        peak = dev.peak_flops[dtype]
        ax.loglog(I, np.minimum(peak, I * dev.memory_bandwidth) / 1e12, "k", ls=style, lw=1,
                  label=f"{dev.name}, {dtype} peak {peak / 1e12:g} TFLOP/s")
        ridge = costmodel.ridge_point("h100", dtype)
        ax.annotate(f"ridge {ridge:.0f}", xy=(ridge, peak / 1e12), xytext=(ridge * 1.4, peak / 1e12 * 0.45),
                    fontsize=7, arrowprops={"arrowstyle": "->", "lw": 0.6})
    for name, (flops, eager, fused, color) in kernels.items():
        for kind, nbytes, face in (("eager", eager, "white"), ("fused", fused, color)):
            i = costmodel.arithmetic_intensity(flops, nbytes)
            ax.plot(i, i * dev.memory_bandwidth / 1e12, "o", mec=color, mfc=face, ms=7,
                    label=f"{name} {kind}: {i:.2f} FLOP/B")
    mm_flops, mm_bytes = 2 * M ** 3, 3 * M * M * 2
    i = costmodel.arithmetic_intensity(mm_flops, mm_bytes)
    ax.plot(i, dev.peak_flops["bf16"] / 1e12, "s", color="C3", ms=7,
            label=f"matmul {M}³ bf16: {i:.0f} FLOP/B")
    ax.set(xlabel="arithmetic intensity (FLOP per byte of HBM traffic)", ylabel="attainable TFLOP/s",
           ylim=(0.05, 3000))
    ax.set_title(f"The roofline of an H100 ({dev.memory_bandwidth / 1e12:g} TB/s); rows of {N} in bf16",
                 fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return fig


@figure("ch11_bytes")
def bytes_eager_fused():
    """Bytes moved by eager op-by-op PyTorch and by one fused kernel, per kernel (costmodel)."""
    M = N = 4096
    rows = {
        "softmax": (costmodel.softmax_bytes(M, N, 2), costmodel.softmax_bytes(M, N, 2, fused=True)),
        "LayerNorm fwd": (costmodel.layernorm_bytes(M, N, 2), costmodel.layernorm_bytes(M, N, 2, fused=True)),
        "LayerNorm bwd": (costmodel.layernorm_bytes(M, N, 2, backward=True),
                          costmodel.layernorm_bytes(M, N, 2, fused=True, backward=True)),
        "cross-entropy\nfwd + bwd": (costmodel.cross_entropy_bytes(M, N, 2),
                                     costmodel.cross_entropy_bytes(M, N, 2, fused=True)),
        "AdamW step\n(fp32 states)": (costmodel.adamw_bytes(M * N), costmodel.adamw_bytes(M * N, fused=True)),
    }
    names = list(rows)
    eager = np.array([sum(e.values()) for e, _ in rows.values()]) / 1e6
    fused = np.array([sum(f.values()) for _, f in rows.values()]) / 1e6
    x, w = np.arange(len(names)), 0.38
    fig, ax = plt.subplots(figsize=(8, 3.1))
    ax.bar(x - w / 2, eager, w, color="#bbbbbb", label="eager: one kernel per op")
    ax.bar(x + w / 2, fused, w, color="C0", label="fused: one kernel")
    for xi, e, f in zip(x, eager, fused):
        ax.text(xi, e + 25, f"{e / f:.0f}x", ha="center", fontsize=8)
    ax.set(xticks=x, xticklabels=names, ylabel="MB read + written", ylim=(0, eager.max() * 1.18))
    ax.set_title(f"Bytes moved at M = N = {M} in bf16 (AdamW over {M * N:,} fp32 parameters)", fontsize=9)
    ax.legend(fontsize=8, frameon=False, loc="upper left")
    return fig


def _online(x: np.ndarray, block: int):
    """The online softmax's first sweep (Milakov & Gimelshein 2018, Algorithm 3), block by block:
    the running max and normaliser after each block."""
    m, d, ms, ds = -np.inf, 0.0, [], []
    for start in range(0, len(x), block):
        b = x[start:start + block]
        m_new = max(m, b.max())
        d = d * np.exp(m - m_new) + np.exp(b - m_new).sum()
        m = m_new
        ms.append(m)
        ds.append(d)
    return ms, ds


@figure("ch11_online_softmax")
def online_softmax():
    """One row streamed in four blocks: each block that raises the max rescales the sum kept so far."""
    rng = np.random.default_rng(3)
    N, block = 32, 8
    x = rng.normal(0, 1, N) + np.linspace(0, 3, N)  # later blocks hold larger values: the max grows
    ms, ds = _online(x, block)
    exact = np.exp(x - x.max()).sum()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.5, 3.2), gridspec_kw={"width_ratios": [1.5, 1]})
    for j in range(N // block):
        a1.axvspan(j * block - 0.5, (j + 1) * block - 0.5, color="C0" if j % 2 else "C1", alpha=0.08)
        a1.hlines(ms[j], j * block - 0.5, (j + 1) * block - 0.5, color="C3", lw=1.5,
                  label=r"running max $m_j$ after block $j$" if j == 0 else None)
        a1.text((j + 0.5) * block - 0.5, x.max() + 0.7, f"block {j + 1}", ha="center", fontsize=7)
    a1.plot(np.arange(N), x, "o", ms=3, color="k", label="x (one row)")
    a1.set(xlabel="column", ylabel="value", ylim=(x.min() - 0.6, x.max() + 1.3))
    a1.set_title("sweep 1 reads each block once", fontsize=9)
    a1.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    steps = np.arange(1, len(ds) + 1)
    a2.plot(steps, ds, "o-", color="C0", label=r"$d_j = \sum \exp(x - m_j)$ over blocks $1..j$")
    a2.axhline(exact, color="k", ls="--", lw=0.8, label=rf"$\sum \exp(x - \max x)$ = {exact:.3f}")
    a2.set(xticks=steps, xlabel="after block j", ylabel="normaliser")
    a2.set_title(r"$d$ rescaled by $\exp(m_{j-1} - m_j)$ when the max grows", fontsize=9)
    a2.legend(fontsize=7, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    fig.tight_layout()
    return fig


@figure("ch11_who_holds_what")
def who_holds_what():
    """One attention head where each tensor lives: in HBM for standard attention, in HBM and on chip
    (SRAM and registers, one program) for FlashAttention with tiles of N/4 rows; the N × N scores S and
    probabilities P reach HBM only in the standard version. What moves is tiles, HBM to chip and back."""
    fig, ax = plt.subplots(figsize=(9.5, 3.4))
    holdings(ax, ["HBM: standard", "HBM: FlashAttention", "SRAM: one program"], [
        ("Q[N, d]", [("whole", 1.0), ("whole", 1.0), ("Q_i: N/4 rows", 0.25)]),
        ("K[N, d], V[N, d]", [("whole", 1.0), ("whole", 1.0), ("K_j, V_j: one tile", 0.25)]),
        ("S = QKᵀ[N, N]", [("whole: written, read", 1.0), ("never written", 0.0),
                           ("S_ij: one tile", 1 / 16)]),
        ("P = softmax(S)[N, N]", [("kept for backward", 1.0), ("never written", 0.0),
                                  ("P̃_ij: one tile", 1 / 16)]),
        ("running max m, sum ℓ [N]", [("none", 0.0), ("L = m + log ℓ, saved", 1.0),
                                       ("m, ℓ of Q_i's rows", 0.25)]),
        ("O[N, d]", [("whole", 1.0), ("whole, written once", 1.0), ("Õ_i, ÷ ℓ at the end", 0.25)]),
    ], ["standard: S and P go to HBM and back, two N × N matrices a head; autograd keeps P",
        "FlashAttention: Q_i is loaded once, K_j and V_j stream past it, O_i and L_i are written once",
        "its backward recomputes P_ij = exp(S_ij − L_i) tile by tile instead of reading P"])
    ax.set_title("Attention, one head: which memory holds what, and what moves "
                 "(bar: share of the whole tensor)", fontsize=10)
    return fig
