"""Chapter 07 — figures: the saved bytes over one step with and without checkpointed segments, memory
against recompute for GPT-3's policies, and how the attention scores come to dominate a layer."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from ... import costmodel
from .base import figure, holdings

GiB = 2**30
GPT3 = {"seq": 2048, "hidden": 12288, "heads": 96, "layers": 96, "vocab": 51200}


def _chain_timeline(n: int, layer: float, boundary: float, segments: int | None):
    """Saved bytes over one step of Chen's chain (n layers saving ``layer`` bytes each, inputs of
    ``boundary`` bytes) with ``segments`` equal segments, all checkpointed (None: none): the times
    (in layer forwards: a layer's forward takes 1, its backward 2) and the bytes held from each on.

    Forward: a checkpointed segment keeps its input only. Backward, segment by segment from the last:
    recompute it (its layers hold their bytes again), back-propagate it layer by layer, each freeing
    what it saved, and then drop the segment's input."""
    sizes = [n] if segments is None else costmodel.segment_sizes(n, segments)
    t, held, times, trace = 0.0, 0.0, [0.0], [0.0]

    def at(dt, change):
        nonlocal t, held
        t, held = t + dt, held + change
        times.append(t), trace.append(held)

    for s in sizes:  # forward
        for i in range(s):
            at(1, layer if segments is None else (boundary if i == 0 else 0))
    for s in reversed(sizes):  # backward
        if segments is not None:
            for _ in range(s):
                at(1, layer)  # recomputed
        for _ in range(s):
            at(2, -layer)
        if segments is not None:
            at(0, -boundary)
    return times, trace


@figure("ch07_segments")
def segments():
    """Saved bytes over one step of a 16-layer chain (L = 2b): no checkpointing, 4 segments, every
    layer; the peaks drawn from costmodel.checkpoint_saved_bytes."""
    n, L, b = 16, 2.0, 1.0
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for k, color, label in ((None, "C3", "no checkpointing"), (4, "C0", "4 segments (≈ √(n·L/b))"),
                            (n, "C2", "every layer")):
        times, trace = _chain_timeline(n, L, b, k)
        peak = costmodel.checkpoint_saved_bytes(n, L, b, k)
        assert max(trace) == peak, (k, max(trace), peak)  # the drawing and the formula agree
        ax.step(times, trace, where="post", c=color, label=f"{label}: peak {peak:g} b, step {times[-1]:g}")
        ax.axhline(peak, c=color, lw=0.6, ls=":")
    ax.axvline(n, c="k", lw=0.5)
    ax.text(n - 0.5, 35, "forward", ha="right", fontsize=8)
    ax.text(n + 0.5, 35, "backward: recompute a segment, then back-propagate it", ha="left", fontsize=8)
    ax.set_ylim(0, 38)
    ax.set_xlabel("time (a layer's forward = 1, its backward = 2)"), ax.set_ylabel("saved bytes (units of b)")
    ax.set_title("A chain of 16 layers, each saving L = 2b: what is held over one step")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False)
    return fig


@figure("ch07_memory_vs_recompute")
def memory_vs_recompute():
    """GPT-3 (96 layers, one sequence of 2048 tokens, 16-bit): peak saved activations against extra
    FLOPs for each policy, from costmodel."""
    s, h, a, n, V = (GPT3[k] for k in ("seq", "hidden", "heads", "layers", "vocab"))
    L = costmodel.activation_memory_bytes(s, 1, h, a)
    b = costmodel.activation_memory_bytes(s, 1, h, a, recompute="full")
    forward = costmodel.recompute_overhead("full", seq=s, hidden=h, layers=n, vocab=V)  # one more forward
    best = costmodel.optimal_segments(n, L, b)
    points = {
        "none": (0.0, n * L),
        "selective (attention core)": (
            costmodel.recompute_overhead("selective", seq=s, hidden=h, layers=n, vocab=V),
            costmodel.activation_memory_bytes(s, 1, h, a, layers=n, recompute="selective")),
        "every layer": (forward, costmodel.checkpoint_saved_bytes(n, L, b, n)),
        f"best k = {best}": (forward, costmodel.checkpoint_saved_bytes(n, L, b, best)),
        "recursive, O(log n)": (forward * (costmodel.log_checkpoint_forwards(n) - n) / n,
                                costmodel.log_checkpoint_saved_bytes(n, L, b)),
    }
    fig, ax = plt.subplots(figsize=(6.8, 3.4))
    ks = range(1, n + 1)
    ax.plot([100 * forward] * n, [costmodel.checkpoint_saved_bytes(n, L, b, k) / GiB for k in ks], "-",
            c="C0", alpha=0.35, lw=6, label="k segments, k = 1 … 96 (one more forward)")
    offsets = {"none": (8, 0), "every layer": (8, 4), f"best k = {best}": (8, -10),
               "recursive, O(log n)": (-8, 8)}
    for name, (x, y) in points.items():
        ax.plot(100 * x, y / GiB, "o", c="C3" if name == "none" else "k", ms=5)
        dx, dy = offsets.get(name, (8, -4))
        ax.annotate(f"{name}: {y / GiB:.2f} GiB, +{100 * x:.1f}%", (100 * x, y / GiB), xytext=(dx, dy),
                    textcoords="offset points", fontsize=7, ha="left" if dx > 0 else "right")
    ax.set_yscale("log"), ax.set_xlim(-8, 135)
    ax.set_xlabel("extra FLOPs (% of a step's model FLOPs)"), ax.set_ylabel("peak saved activations (GiB)")
    ax.set_title("GPT-3, 96 layers, one sequence of 2048 tokens, 16-bit: memory for compute")
    ax.legend(fontsize=7, loc="upper right")
    return fig


@figure("ch07_attention_share")
def attention_share():
    """Per-layer activation bytes of a GPT-3 layer against the sequence length: the 34·s·b·h that
    selective recomputation keeps and the 5·a·s²·b it recomputes (costmodel.activation_memory_bytes)."""
    h, a = GPT3["hidden"], GPT3["heads"]
    seqs = [512, 1024, 2048, 4096, 8192, 16384]
    kept = np.array([costmodel.activation_memory_bytes(s, 1, h, a, recompute="selective")
                     for s in seqs]) / GiB
    total = np.array([costmodel.activation_memory_bytes(s, 1, h, a) for s in seqs]) / GiB
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    x = np.arange(len(seqs))
    ax.bar(x, kept, color="C0", label="34·s·b·h: kept by selective recomputation")
    ax.bar(x, total - kept, bottom=kept, color="C1", label="5·a·s²·b: scores, softmax, dropout (recomputed)")
    for i, (k, t) in enumerate(zip(kept, total)):
        ax.text(i, t * 1.02, f"{100 * (t - k) / t:.0f}%", ha="center", fontsize=7)
    ax.set_xticks(x, [str(s) for s in seqs])
    ax.set_xlabel("sequence length s (one sequence, b = 1)"), ax.set_ylabel("GiB per layer (16-bit)")
    ax.set_title("A GPT-3 layer (h = 12288, a = 96): the share of the attention scores")
    ax.legend(fontsize=7, loc="upper left")
    return fig


@figure("ch07_who_holds_what")
def who_holds_what():
    """Activation checkpointing of a 16-layer chain in 4 segments, the same on every rank: each segment
    keeps its input X[B, S, D] and the RNG state, drops the activations inside it in the forward, and
    recomputes them in the backward, last segment first; what moves is recomputation, no collective."""
    k = 4
    fig, ax = plt.subplots(figsize=(8.5, 3.2))
    holdings(ax, [f"layers {4 * s + 1}–{4 * s + 4}" for s in range(k)], [
        ("segment input X[B, S, D]", [("kept", 1.0)] * k),
        ("RNG state, before forward", [("saved", 1.0)] * k),
        ("activations inside, forward", [("dropped", 0.0)] * k),
        ("inside, backward of segment 4", [("not yet", 0.0)] * (k - 1) + [("recomputed", 1.0)]),
        ("inside, backward of segment 1", [("recomputed", 1.0)] + [("freed", 0.0)] * (k - 1)),
    ], ["no collective: the backward re-runs each segment's forward from its kept X, last segment first,",
        "with the RNG state restored (the same dropout masks), then back-propagates it and frees it",
        "peak: k kept inputs + one segment's activations, k·b + (n/k)·L; price: one more forward"])
    ax.set_title("Checkpointing 16 layers in 4 segments, on every rank alike: what is kept, what is "
                 "recomputed (bar: share held)", fontsize=10)
    return fig
