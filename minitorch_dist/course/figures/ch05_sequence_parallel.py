"""Chapter 05 — figures: the causal work each rank's shard carries in the contiguous and zigzag layouts,
what each rank computes at each step of the ring, and the bytes of Megatron-SP, Ulysses and the ring."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.colors import ListedColormap

from ... import costmodel
from ...parallelism.sequence_parallel.ring_attention import block_plan, sequence_positions
from .base import figure

RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
LAYOUT_NAMES = {"contiguous": "contiguous", "zigzag": "zigzag"}


@figure("ch05_shard_layouts")
def shard_layouts():
    """The causal mask of 16 tokens on 4 ranks, each query row coloured by the rank holding it."""
    seq, t = 16, 4
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.9))
    cmap = ListedColormap(["#f2f2f2", *RANK_COLORS])
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        grid = np.zeros((seq, seq), dtype=int)  # 0: masked (key after query), r + 1: scored by rank r
        for r in range(t):
            for i in sequence_positions(seq, t, r, layout).tolist():
                grid[i, : i + 1] = r + 1
        pairs = [int((grid == r + 1).sum()) for r in range(t)]
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=t, interpolation="nearest")
        ax.set_xticks(range(0, seq, 4)), ax.set_yticks(range(0, seq, 4))
        ax.set_xlabel("key position"), ax.set_ylabel("query position")
        ax.set_title(f"{LAYOUT_NAMES[layout]}: (query, key) pairs per rank\n"
                     + ", ".join(str(p) for p in pairs), fontsize=9)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in RANK_COLORS]
    fig.legend(handles, [f"rank {r}" for r in range(t)], ncol=t, loc="lower center", fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, -0.02))
    fig.suptitle("Causal attention, 16 tokens on 4 ranks: the rows a rank holds decide its work", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def _step_work(seq, t, layout):
    """(t ranks x t steps): unmasked (query, key) pairs rank r scores at ring step i (rank r - i's block)."""
    n = seq // t
    work = np.zeros((t, t), dtype=int)
    for r in range(t):
        for i in range(t):
            for qs, ks, diag in block_plan(r, (r - i) % t, t, n, True, layout):
                rows, cols = qs.stop - qs.start, ks.stop - ks.start
                work[r, i] += rows * (rows + 1) // 2 if diag else rows * cols
    return work


@figure("ch05_ring_steps")
def ring_steps():
    """Pairs each rank scores at each ring step, causal, 4 ranks: every step waits for its busiest rank."""
    seq, t = 32, 4
    fig, axes = plt.subplots(1, 2, figsize=(8.5, 3.1))
    for ax, layout in zip(axes, ("contiguous", "zigzag")):
        work = _step_work(seq, t, layout)
        ax.imshow(work, cmap="Blues", vmin=0, vmax=(seq // t) ** 2 * 2.2, aspect="auto")
        for (r, i), w in np.ndenumerate(work):
            ax.text(i, r, f"K/V of {(r - i) % t}\n{w}" if w else f"K/V of {(r - i) % t}\nskipped",
                    ha="center", va="center", fontsize=7)
        slowest = work.max(axis=0)
        ax.set_xticks(range(t), [f"step {i}\nwaits {w}" for i, w in enumerate(slowest)], fontsize=7)
        ax.set_yticks(range(t), [f"rank {r}" for r in range(t)])
        ax.set_title(f"{LAYOUT_NAMES[layout]}: the steps' slowest ranks add up to {slowest.sum()} pairs\n"
                     f"({work.sum()} pairs in all: {work.sum() // t} per rank if spread evenly)", fontsize=8)
        ax.tick_params(length=0)
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
    fig.suptitle(f"Ring attention, causal, {seq} tokens on {t} ranks: (query, key) pairs scored per step",
                 fontsize=10)
    fig.tight_layout()
    return fig


@figure("ch05_bytes_vs_t")
def bytes_vs_t():
    """Bytes one rank sends per layer, forward and backward, against the degree t, at 128k tokens."""
    b, s, h, e, n_head = 1, 131072, 8192, 2, 64
    ts = [2, 4, 8, 16, 32, 64]
    rows = {t: costmodel.sequence_parallel_comparison(b, s, h, t, e) for t in ts}
    fig, ax = plt.subplots(figsize=(6.5, 3.3))
    for key, label, mark in (("megatron_sp", "Megatron-SP (whole layer)", "s"),
                             ("ring", "ring attention", "o"), ("ulysses", "Ulysses", "D")):
        top = costmodel.ulysses_max_degree(n_head) if key == "ulysses" else ts[-1]
        ax.plot([t for t in ts if t <= top], [rows[t][key] / 2**30 for t in ts if t <= top], marker=mark,
                label=label)
    cap = costmodel.ulysses_max_degree_gqa(n_head, 8)
    ax.axvline(cap, c="k", lw=0.8, ls=":")
    ax.text(cap * 1.08, rows[ts[-1]]["ulysses"] / 2**30 * 1.3, f"Ulysses with 8 kv heads\nstops at t = {cap}",
            fontsize=7)
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.set_xlabel("sequence-parallel degree t"), ax.set_ylabel("GiB sent per rank per layer")
    ax.set_title(f"s = {s:,} tokens, h = {h}, {n_head} heads, bf16, b = {b}: forward + backward", fontsize=9)
    ax.legend(fontsize=7, loc="lower left")
    return fig
