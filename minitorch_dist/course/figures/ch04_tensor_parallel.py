"""Chapter 04 — figures: the MLP split by columns then rows with f and g, the fused q|k|v rows each rank
holds, and a layer's all-reduce time against its compute on each link."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyBboxPatch, Rectangle

from ... import costmodel
from ...parallelism.tensor_parallel import head_rows
from .base import figure

RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")
GREY = "#bbbbbb"


def _matrix(ax, x, y, w, h, parts, axis, label):
    """A w x h rectangle at (x, y) cut into ``parts`` coloured slices along ``axis`` (0: columns side by
    side, 1: rows stacked), rank 0 first (left or top); ``parts`` = 0 draws it whole and grey."""
    if parts == 0:
        ax.add_patch(Rectangle((x, y), w, h, facecolor=GREY, edgecolor="white", lw=1.5))
    for r in range(parts):
        if axis == 0:
            box = (x + r * w / parts, y, w / parts, h)
        else:
            box = (x, y + h - (r + 1) * h / parts, w, h / parts)
        ax.add_patch(Rectangle(box[:2], *box[2:], facecolor=RANK_COLORS[r], edgecolor="white", lw=1.5))
    ax.text(x + w / 2, y - 0.25, label, ha="center", va="top", fontsize=8)


def _op(ax, x, y, name, fwd, bwd):
    """One of Megatron's conjugate operators, with what it does in each pass."""
    ax.add_patch(FancyBboxPatch((x - 0.32, y - 0.32), 0.64, 0.64, boxstyle="round,pad=0.05",
                                facecolor="white", edgecolor="k", lw=1.2))
    ax.text(x, y, name, ha="center", va="center", fontsize=12, style="italic")
    ax.text(x, y + 0.55, f"fwd: {fwd}\nbwd: {bwd}", ha="center", va="bottom", fontsize=7)


@figure("ch04_mlp_split")
def mlp_split():
    """Y = GeLU(X A) B on t = 4 ranks: X whole, A cut into columns, B into rows, f before and g after."""
    t = 4
    fig, ax = plt.subplots(figsize=(9, 3.2))
    _matrix(ax, 0.0, 0.4, 1.0, 1.6, 0, 0, "X  (b·s × h)\nthe same on\nevery rank")
    _op(ax, 2.0, 1.2, "f", "identity", "all-reduce")
    _matrix(ax, 3.0, 0.4, 3.2, 1.6, t, 0, "A  (h × 4h): rank r holds\nits columns A_r, h × 4h/t")
    ax.text(6.85, 1.2, "GeLU\nper rank,\nno comm.", ha="center", va="center", fontsize=8)
    _matrix(ax, 7.5, 0.0, 1.0, 2.4, t, 1, "B  (4h × h): rank r\nholds its rows B_r,\n4h/t × h")
    _op(ax, 9.5, 1.2, "g", "all-reduce", "identity")
    _matrix(ax, 10.5, 0.4, 1.0, 1.6, 0, 0, "Y = Σ_r GeLU(X A_r) B_r\non every rank")
    for x0, x1 in ((1.05, 1.6), (2.4, 2.95), (8.55, 9.1), (9.9, 10.45)):
        ax.annotate("", xy=(x1, 1.2), xytext=(x0, 1.2), arrowprops={"arrowstyle": "->", "lw": 1})
    for r in range(t):
        ax.add_patch(Rectangle((2.6 + 1.5 * r, -1.45), 0.25, 0.25, facecolor=RANK_COLORS[r]))
        ax.text(2.92 + 1.5 * r, -1.33, f"rank {r}", va="center", fontsize=8)
    ax.set_xlim(-0.2, 11.8), ax.set_ylim(-1.6, 2.9), ax.set_aspect("equal"), ax.axis("off")
    ax.set_title("Megatron's MLP on t = 4 ranks: one all-reduce forward (g), one backward (f)")
    return fig


@figure("ch04_qkv_rows")
def qkv_rows():
    """Which rows of the fused q|k|v weight each rank holds: contiguous blocks vs whole heads (head_rows)."""
    n_head, head_dim, t = 8, 4, 4
    h = n_head * head_dim
    contiguous = np.repeat(np.arange(t), 3 * h // t)
    by_heads = np.empty(3 * h, dtype=int)
    for r in range(t):
        by_heads[head_rows(n_head, head_dim, t, r).numpy()] = r
    fig, axes = plt.subplots(2, 1, figsize=(9, 2.6), sharex=True)
    titles = ("contiguous rows: rank 0 gets only queries, rank 3 only values",
              "head_rows: rank r gets its heads' rows inside each of q, k and v")
    for ax, owner, title in zip(axes, (contiguous, by_heads), titles):
        for i, r in enumerate(owner):
            ax.add_patch(Rectangle((i, 0), 1, 1, facecolor=RANK_COLORS[r], lw=0))
        for part, name in enumerate("qkv"):
            ax.axvline(part * h, c="k", lw=1.5)
            ax.text(part * h + h / 2, 1.12, name, ha="center", va="bottom", fontsize=9)
        for head in range(1, 3 * n_head):  # head boundaries
            ax.plot([head * head_dim] * 2, [0, 1], c="white", lw=0.8)
        ax.set_xlim(0, 3 * h), ax.set_ylim(0, 1.5), ax.set_yticks([])
        ax.spines["left"].set_visible(False)
        ax.set_title(title, fontsize=8, loc="left")
    axes[1].set_xlabel(f"row of c_attn's weight: 3h = {3 * h} rows, {n_head} heads of {head_dim} rows in "
                       f"each of q, k, v; t = {t}; colour = rank")
    fig.tight_layout()
    return fig


@figure("ch04_comm_vs_compute")
def comm_vs_compute():
    """A GPT-3 layer's four all-reduces over each link, as a fraction of its compute, against t."""
    b, s, h = 1, 2048, 12288
    peak, mfu = costmodel.device_spec("h100").peak_flops["bf16"], 0.5
    layer_flops = costmodel.megatron_flops_per_step(b, s, 1, h, 0)
    ts = [2, 4, 8, 16, 32]
    fig, ax = plt.subplots(figsize=(6.8, 3.2))
    for (link, (alpha, beta)), mark in zip(costmodel.LINKS.items(), "osD^"):
        ratio = [costmodel.tensor_parallel_comm_time_per_layer(b, s, h, t, alpha, beta)
                 / (layer_flops / t / (peak * mfu)) for t in ts]
        ax.plot(ts, ratio, marker=mark, label=link)
    ax.axhline(1, c="k", lw=0.8, ls="--")
    ax.text(2.05, 1.25, "communication = compute", fontsize=7)
    ax.axvspan(8 * 2**0.5, 40, color="k", alpha=0.06)
    ax.text(12.5, 0.02, "more GPUs than a node's 8", fontsize=7)
    ax.set_xlim(1.7, 40)
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xticks(ts, [str(t) for t in ts])
    ax.set_xlabel("tensor-parallel degree t")
    ax.set_ylabel("all-reduce time / compute time")
    ax.set_title(f"One GPT-3 layer (b = {b}, s = {s}, h = {h}, bf16), compute at {mfu:.0%} of "
                 f"{peak / 1e12:g} TFLOP/s", fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    return fig
