"""Chapter 06 — figures: which rank holds which model state at each ZeRO stage, the bytes per device as
ranks are added, and one ZeRO-3 step of a chain of units with and without prefetch."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Patch, Rectangle

from ... import costmodel
from .base import figure

PARTS = (("parameters", 2, "#4C72B0"), ("gradients", 2, "#DD8452"), ("optimizer state", 12, "#55A868"))
STAGE_NAMES = ("stage 0: DP", "stage 1: P_os", "stage 2: P_os+g", "stage 3: P_os+g+p")
GREY = "#dddddd"


def _held(stage: int, part: int) -> bool:
    """Is model-state ``part`` (0 parameters, 1 gradients, 2 optimizer state) sharded at ``stage``?"""
    return part >= 3 - stage


@figure("ch06_partitioning")
def partitioning():
    """ZeRO's Figure 1 on 4 ranks: each rank's parameters, gradients and optimizer state (2 + 2 + 12
    bytes per parameter), the slices it holds coloured; per-device GB of a 7.5B model from costmodel."""
    n, psi = 4, 7.5e9
    total = sum(b for _, b, _ in PARTS)
    fig, ax = plt.subplots(figsize=(9, 3.3))
    cell_w, gap, row_h = 4.0, 0.35, 0.62
    for stage in range(4):
        y = 3 - stage
        for r in range(n):
            x0 = r * (cell_w + gap)
            for k, (_, nbytes, color) in enumerate(PARTS):
                w = cell_w * nbytes / total
                start = x0 + cell_w * sum(b for _, b, _ in PARTS[:k]) / total
                for j in range(n):  # the part cut into n slices: rank j's slice is the j-th
                    mine = not _held(stage, k) or j == r
                    ax.add_patch(Rectangle((start + j * w / n, y), w / n, row_h, lw=0.4, edgecolor="white",
                                           facecolor=color if mine else GREY))
        gb = costmodel.zero_memory_bytes(psi, n, stage) / costmodel.GB
        ax.text(n * (cell_w + gap) - gap + 0.2, y + row_h / 2, f"{gb:g} GB", va="center", fontsize=8)
        ax.text(-0.2, y + row_h / 2, STAGE_NAMES[stage], va="center", ha="right", fontsize=8)
    for r in range(n):
        ax.text(r * (cell_w + gap) + cell_w / 2, 4 - 0.25, f"rank {r}", ha="center", fontsize=8)
    ax.text(n * (cell_w + gap) - gap + 0.2, 4 - 0.25, "per device,\nΨ = 7.5B", fontsize=7, va="bottom")
    handles = [Patch(facecolor=c, label=f"{name} ({b}Ψ bytes)") for name, b, c in PARTS]
    handles.append(Patch(facecolor=GREY, label="held by another rank"))
    ax.legend(handles=handles, ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 0.02),
              frameon=False)
    ax.set_xlim(-4.2, n * (cell_w + gap) + 1.6), ax.set_ylim(-0.1, 4.1), ax.axis("off")
    ax.set_title("What each of 4 ranks keeps (mixed-precision Adam: 2 + 2 + 12 bytes per parameter)")
    return fig


@figure("ch06_memory_vs_ranks")
def memory_vs_ranks():
    """Model-state GB per device against the number of ranks for a 7.5B model, each stage (costmodel)."""
    psi, dps = 7.5e9, 2 ** np.arange(0, 11)
    fig, ax = plt.subplots(figsize=(6.4, 3.3))
    for stage, marker in zip(range(4), "osD^"):
        gb = [costmodel.zero_memory_bytes(psi, int(d), stage) / costmodel.GB for d in dps]
        ax.plot(dps, gb, marker=marker, ms=3.5, label=STAGE_NAMES[stage])
    for stage, floor in ((1, 4), (2, 2)):  # what stages 1 and 2 never go below: the replicated states
        ax.axhline(floor * psi / costmodel.GB, c=f"C{stage}", lw=0.7, ls=":")
        ax.text(1.1, floor * psi / costmodel.GB * 0.8, f"{floor}Ψ = {floor * psi / costmodel.GB:g} GB",
                fontsize=7, c=f"C{stage}", va="top")
    ax.axhline(80, c="k", lw=0.8, ls="--")
    ax.text(dps[-1], 85, "80 GB device", ha="right", fontsize=7)
    ax.set_xscale("log", base=2), ax.set_yscale("log")
    ax.set_xlabel("data-parallel ranks N_d"), ax.set_ylabel("model states per device (GB)")
    ax.set_title("Ψ = 7.5B, mixed-precision Adam: only stage 3 keeps falling as 1/N_d")
    ax.legend(fontsize=7, loc="lower left")
    return fig


def _zero3_schedule(units: int, prefetch: bool, ag=0.6, fwd=1.0, bwd=2.0, rs=0.6):
    """One ZeRO-3 step of a chain of ``units`` on two lanes, compute and communication (each one thing at a
    time): ``[(lane, start, duration, label)]``. Without prefetch a unit's all-gather starts when it is
    needed; with it, the next unit's all-gather is issued as soon as the current unit starts computing. The
    last unit's backward follows its own forward, so it runs on the weights still gathered (no all-gather)."""
    rows, comm_free, compute_free = [], 0.0, 0.0

    def gather(label, not_before):
        nonlocal comm_free
        start = max(comm_free, not_before)
        rows.append(("comm", start, ag, label))
        comm_free = start + ag
        return comm_free

    order = [("F", u) for u in range(units)] + [("B", u) for u in reversed(range(units))]
    ready = {order[0]: gather("AG 0", 0.0)}
    for i, (kind, u) in enumerate(order):
        start = max(compute_free, ready[(kind, u)])
        nxt = order[i + 1] if i + 1 < len(order) else None
        kept = nxt is not None and nxt[1] == u  # the last unit's backward follows its forward: still gathered
        if kept:
            ready[nxt] = 0.0
        if nxt is not None and prefetch and not kept:
            ready[nxt] = gather(f"AG {nxt[1]}", start)
        dur = fwd if kind == "F" else bwd
        rows.append(("compute", start, dur, f"{kind} {u}"))
        compute_free = start + dur
        if kind == "B":  # the gradient goes out once the unit's backward is done
            start_rs = max(comm_free, compute_free)
            rows.append(("comm", start_rs, rs, f"RS {u}"))
            comm_free = start_rs + rs
        if nxt is not None and not prefetch and not kept:
            ready[nxt] = gather(f"AG {nxt[1]}", compute_free)
    return rows


@figure("ch06_zero3_step")
def zero3_step():
    """A ZeRO-3 step of 3 units: all-gather (AG), forward (F), backward (B), reduce-scatter (RS); without
    prefetch every gather waits, with it the gathers run beside the compute. Durations are schematic."""
    colors = {"AG": "#4C72B0", "RS": "#C44E52", "F": "#55A868", "B": "#8172B3"}
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
    for ax, prefetch in zip(axes, (False, True)):
        rows = _zero3_schedule(3, prefetch)
        for lane, start, dur, label in rows:
            y = 1 if lane == "comm" else 0
            ax.barh(y, dur, left=start, height=0.6, color=colors[label.split()[0]], edgecolor="white")
            ax.text(start + dur / 2, y, label, ha="center", va="center", fontsize=7, color="white")
        end = max(s + d for _, s, d, _ in rows)
        ax.set_yticks([0, 1], ["compute", "network"])
        ax.set_title(f"{'with' if prefetch else 'without'} prefetch: the step takes {end:.1f} time units",
                     fontsize=9)
        ax.axvline(end, c="k", lw=0.6, ls=":")
    axes[-1].set_xlabel("time (units: a unit's forward = 1, its backward = 2, one all-gather = 0.6)")
    fig.tight_layout()
    return fig
