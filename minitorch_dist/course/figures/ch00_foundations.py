"""Chapter 00 — figures: the ring all-reduce step by step, which all-reduce algorithm wins at which size,
and where training's bytes per parameter go."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ... import costmodel
from ...runtime.collectives import chunk_sizes
from .base import figure

CHUNK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


def _ring_schedule(n: int) -> list[list[int]]:
    """``sent[r][s]``: the chunk rank r sends to rank r+1 at step s of the ring all-reduce.

    The indices of ``runtime.collectives._ring``: in the reduce-scatter (steps 0..n-2) rank r sends
    chunk (r-1-s) mod n, in the all-gather (steps n-1..2n-3) chunk (r-s') mod n, s' = s-(n-1)."""
    return [[(r - 1 - s) % n for s in range(n - 1)] + [(r - s) % n for s in range(n - 1)] for r in range(n)]


@figure("ch00_ring_allreduce")
def ring_allreduce():
    """Which chunk each rank sends at each of the ring's 2(n-1) steps, and the bytes that makes per rank."""
    n, numel, itemsize = 4, 4096, 4  # 16 KiB of float32 on 4 ranks
    S = numel * itemsize
    sizes = chunk_sizes(numel, n)
    sent = _ring_schedule(n)
    steps = 2 * (n - 1)
    fig, ax = plt.subplots(figsize=(8, 2.9))
    for r in range(n):
        y = n - 1 - r
        for s, c in enumerate(sent[r]):
            ax.add_patch(Rectangle((s, y), 0.92, 0.8, facecolor=CHUNK_COLORS[c],
                                   alpha=0.95 if s < n - 1 else 0.55, edgecolor="white"))
            ax.text(s + 0.46, y + 0.4, f"c{c} → {(r + 1) % n}", ha="center", va="center", fontsize=7,
                    color="white" if s < n - 1 else "black")
        nbytes = sum(sizes[c] for c in sent[r]) * itemsize
        ax.text(steps + 0.15, y + 0.4, f"{nbytes:,} B", va="center", fontsize=8)
    ax.text(steps + 0.15, n + 0.05, "sent", fontsize=8)
    ax.axvline(n - 1 - 0.04, color="k", lw=0.8, ls="--")
    ax.text((n - 1) / 2, n + 0.05, "reduce-scatter: add what arrives, pass it on", ha="center", fontsize=8)
    ax.text(n - 1 + (n - 1) / 2, n + 0.05, "all-gather: pass the sums on", ha="center", fontsize=8)
    ax.set_xlim(-0.1, steps + 1.2), ax.set_ylim(-0.15, n + 0.45)
    ax.set_yticks([n - 1 - r + 0.4 for r in range(n)], [f"rank {r}" for r in range(n)])
    ax.set_xticks([s + 0.46 for s in range(steps)], [f"step {s + 1}" for s in range(steps)])
    ax.tick_params(length=0)
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    total = costmodel.bus_bytes("all_reduce", S, n)
    ax.set_title(f"Ring all-reduce of S = {S:,} B on {n} ranks: each step every rank sends one chunk "
                 f"(S/n = {S // n:,} B) right;\n2(n−1)/n·S = {total:,.0f} B per rank, whatever n", fontsize=9)
    return fig


@figure("ch00_allreduce_algorithms")
def allreduce_algorithms():
    """α-β times of four all-reduce algorithms against S, and where each overtakes the ring against n."""
    link = "InfiniBand NDR 400 Gb/s"
    alpha, beta = costmodel.LINKS[link]
    n = 8
    sizes = np.geomspace(1e2, 1e9, 200)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.4))
    curves = {"ring": costmodel.allreduce_time,
              "recursive doubling": costmodel.recursive_doubling_allreduce_time,
              "binomial tree": costmodel.tree_allreduce_time,
              "naive (through rank 0)": costmodel.naive_allreduce_time}
    for (name, fn), c in zip(curves.items(), ("C0", "C1", "C2", "C3")):
        ax.loglog(sizes, [fn(S, n, alpha, beta) for S in sizes], c=c, label=name)
    rd = costmodel.allreduce_crossover_bytes(n, alpha, beta, "recursive_doubling")
    half = costmodel.ring_latency_bandwidth_crossover(n, alpha, beta)
    ax.axvline(rd, c="C1", ls=":", lw=1)
    ax.axvline(half, c="gray", ls="--", lw=0.8)
    ax.annotate(f"ring = rec. doubling\nS* = {rd / 1e6:.1f} MB", xy=(rd, 1.3e-5), xytext=(rd * 6, 1.2e-5),
                fontsize=7, arrowprops={"arrowstyle": "->", "alpha": 0.5})
    ax.annotate(f"ring's latency term =\nits bandwidth term:\nnα/β = {half / 1e6:.1f} MB", xy=(half, 3e-3),
                xytext=(1.5e2, 3e-3), fontsize=7, arrowprops={"arrowstyle": "->", "alpha": 0.5})
    ax.set_ylim(8e-6, 1)
    ax.set_xlabel("message size S (bytes)"), ax.set_ylabel("α-β time (s)")
    ax.set_title(f"n = {n}, {link}\n(α = {alpha * 1e6:g} µs, 1/β = {1 / beta / 1e9:g} GB/s)", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    ns = 2 ** np.arange(2, 11)
    bx.loglog(ns, ns, "--", c="gray", label="nα/β (ring: latency = bandwidth)")
    for algo, c, name in (("recursive_doubling", "C1", "recursive doubling"),
                          ("tree", "C2", "binomial tree")):
        bx.loglog(ns, [costmodel.allreduce_crossover_bytes(int(k), 1.0, 1.0, algo) for k in ns], "o-", c=c,
                  ms=3, label=f"{name} beats the ring below")
    bx.set_xscale("log", base=2)
    bx.set_xlabel("ranks n"), bx.set_ylabel("message size, in units of α/β")
    bx.set_title("Where a log-step algorithm overtakes the ring", fontsize=9)
    bx.legend(fontsize=7)
    fig.tight_layout()
    return fig


@figure("ch00_bytes_per_param")
def bytes_per_param():
    """Bytes per parameter of the model states, by precision and optimizer (costmodel.model_state_bytes)."""
    combos = [("fp32", "sgd_nomomentum", "fp32, SGD"), ("fp32", "sgd", "fp32, SGD +\nmomentum"),
              ("fp32", "adamw", "fp32, AdamW"), ("mixed", "adamw", "mixed, AdamW")]
    parts = (("weights", "#4C72B0"), ("gradients", "#DD8452"), ("optimizer", "#55A868"))
    fig, ax = plt.subplots(figsize=(6.2, 2.8))
    for i, (precision, opt, _label) in enumerate(combos):
        b = costmodel.model_state_bytes(1, precision=precision, optimizer=opt)
        left = 0
        for part, color in parts:
            ax.barh(i, b[part], left=left, color=color, edgecolor="white", label=part if i == 0 else None)
            if b[part]:
                ax.text(left + b[part] / 2, i, f"{b[part]:g}", ha="center", va="center", color="white",
                        fontsize=8)
            left += b[part]
        ax.text(left + 0.2, i, f"{b['total']:g} B", va="center", fontsize=8)
    ax.set_yticks(range(len(combos)), [c[2] for c in combos])
    ax.invert_yaxis(), ax.set_xlim(0, 18.5)
    ax.set_xlabel("bytes per parameter (activations not included)")
    ax.set_title("Model states: mixed precision moves bytes into the optimizer, it does not remove them",
                 fontsize=9)
    ax.legend(fontsize=7, ncol=3, loc="lower right", bbox_to_anchor=(1.0, 1.08), frameon=False)
    return fig
