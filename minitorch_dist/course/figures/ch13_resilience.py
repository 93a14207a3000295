"""Chapter 13 — figures: where each rank's elements sit, a job's life between failures, how often to save."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ... import costmodel
from ...resilience.placement import Placement
from .base import figure, holdings

RANK_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


def _owner_grid(shape, placements) -> np.ndarray:
    """For each element of a dense tensor of ``shape``, the rank whose placement holds it (-1: none)."""
    owner = np.full(int(np.prod(shape)), -1)
    for r, pl in enumerate(placements):
        owner[pl.positions().numpy()] = r
    return owner.reshape(shape)


@figure("ch13_placements")
def placements():
    """One 8 x 8 tensor on 4 ranks in four layouts, each element coloured by the rank that holds it."""
    shape, n = (8, 8), 4
    # FSDP: the tensor sits at offset 5 of its unit's flat buffer of 4 x 18 elements; rank r keeps
    # [18r, 18r + 18) of the buffer, so its run of this tensor is that range shifted by 5, clipped
    runs = [(max(18 * r - 5, 0), min(18 * r + 13, 64)) for r in range(n)]
    layouts = {
        "DDP: every rank, whole": None,
        "TP, row-parallel:\na cut of columns": [Placement(shape, (1, ((2 * r, 2 * r + 2),)))
                                               for r in range(n)],
        "FSDP: a flat run [u, v)\nwhere the unit's shards fall": [Placement(shape, flat=(u, 1, v - u))
                                                                  for u, v in runs],
        "ZeRO-1/2 state: every\n4th element from r": [Placement(shape, flat=(r, 4, 16)) for r in range(n)],
    }
    fig, axes = plt.subplots(1, 4, figsize=(9.5, 2.8))
    for ax, (title, pls) in zip(axes, layouts.items()):
        grid = np.zeros(shape, dtype=int) if pls is None else _owner_grid(shape, pls)
        for (i, j), r in np.ndenumerate(grid):
            color = RANK_COLORS[r] if pls else "#bbbbbb"
            ax.add_patch(Rectangle((j, shape[0] - 1 - i), 1, 1, facecolor=color, edgecolor="white", lw=1))
            if pls is not None:
                ax.text(j + 0.5, shape[0] - 0.5 - i, str(r), ha="center", va="center", fontsize=7,
                        color="white")
        ax.set_xlim(0, shape[1]), ax.set_ylim(0, shape[0]), ax.set_aspect("equal")
        ax.set_xticks([]), ax.set_yticks([])
        for side in ("left", "bottom"):
            ax.spines[side].set_visible(False)
        ax.set_title(title, fontsize=8)
    fig.suptitle("Which rank holds which element of one dense 8 x 8 tensor (4 ranks; numbers: the rank)",
                 fontsize=9, y=1.08)
    return fig


@figure("ch13_job_timeline")
def job_timeline():
    """A job's wall clock: work, saves, a failure, the work lost since the last save, the restart."""
    fig, ax = plt.subplots(figsize=(9, 1.9))
    tau, C, R, fail_at = 3.0, 0.6, 1.4, 2.1  # shapes only: a schematic
    t, rows = 0.0, []
    for _ in range(2):  # two intervals of work, each followed by a save
        rows += [("work", t, tau), ("save", t + tau, C)]
        t += tau + C
    rows += [("lost", t, fail_at), ("restart", t + fail_at, R)]
    t += fail_at + R
    rows += [("work", t, tau), ("save", t + tau, C)]
    colors = {"work": "#55A868", "save": "#4C72B0", "lost": "#C44E52", "restart": "#bbbbbb"}
    labels = {"work": "training (τ of work)", "save": "checkpoint (C)", "lost": "work lost: redone",
              "restart": "restart (R): start, load, reshard"}
    seen = set()
    for kind, start, width in rows:
        ax.barh(0, width, left=start, color=colors[kind], edgecolor="white",
                label=labels[kind] if kind not in seen else None)
        seen.add(kind)
    fail = 2 * (tau + C) + fail_at
    ax.annotate("a rank fails", xy=(fail, 0.42), xytext=(fail, 0.95), ha="center", fontsize=8,
                arrowprops={"arrowstyle": "->", "color": "#C44E52"})
    ax.set_ylim(-0.6, 1.2), ax.set_yticks([]), ax.set_xticks([])
    ax.spines["left"].set_visible(False)
    ax.set_xlabel("wall-clock time →")
    ax.legend(ncol=4, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.25), frameon=False)
    ax.set_title("Save every τ seconds of work: a failure costs the work since the last save, plus R")
    return fig


@figure("ch13_interval")
def interval():
    """Time lost against the checkpoint interval, for Llama 3's failure rate and checkpoint (costmodel)."""
    M = costmodel.mtbf_seconds()
    nbytes = costmodel.checkpoint_bytes(405e9)
    C = costmodel.checkpoint_seconds(nbytes, costmodel.LLAMA3_STORAGE_BYTES_PER_S)
    R = 600.0
    taus = np.geomspace(20, 4 * 3600, 300)
    fig, ax = plt.subplots(figsize=(6.2, 3.2))
    ax.plot(taus / 60, [100 * costmodel.first_order_waste(t, M, C, R) for t in taus], c="C1",
            label="Young: C/τ + (τ/2 + R)/M")
    ax.plot(taus / 60, [100 * (costmodel.expected_runtime(1e6, t, M, C, R) / 1e6 - 1) for t in taus], c="C0",
            label="Daly: expected run time − 1")
    best = costmodel.young_interval(M, C)
    ax.axvline(best / 60, c="k", alpha=0.3)
    ax.annotate(f"√(2MC) = {best / 60:.1f} min", xy=(best / 60, 9), xytext=(best / 60 * 2.2, 20), fontsize=8,
                arrowprops={"arrowstyle": "->", "alpha": 0.5})
    ax.set_xscale("log"), ax.set_ylim(0, 40)
    ax.set_xlabel("checkpoint interval τ (minutes of work)"), ax.set_ylabel("time lost (% of the work)")
    ax.set_title(f"Llama 3 405B: M = {M / 3600:.2f} h, C = {C:.1f} s ({nbytes / 1e12:.1f} TB at "
                 f"{costmodel.LLAMA3_STORAGE_BYTES_PER_S / 1e12:g} TB/s), R = {R / 60:g} min")
    ax.legend(fontsize=7)
    return fig


@figure("ch13_who_holds_what")
def who_holds_what():
    """Resharding a checkpoint: FSDP on 4 ranks holds each tensor as a quarter of its flattened elements;
    the checkpoint holds every piece once, with a metadata file of shapes, dtypes, placements and
    SHA-256s; TP on 2 ranks loads W_in[D, F_tp], half of F each, by gathering its own positions."""
    before, after = 4, 2
    fig, ax = plt.subplots(figsize=(11.0, 3.8))
    quarters = [(f"flat part {r}", 1 / before) for r in range(before)]
    holdings(ax, [f"FSDP rank {r}" for r in range(before)] + ["checkpoint"]
             + [f"TP rank {r}" for r in range(after)], [
        ("W_in[D, F]", [("W_in[D_dp, F]", 1 / before)] * before + [("all 4 parts", 1.0)]
         + [("W_in[D, F_tp]", 1 / after)] * after),
        ("Adam m, v of W_in", quarters + [("all 4 parts", 1.0)]
         + [(f"F_tp half {r}", 1 / after) for r in range(after)]),
        ("LayerNorm w[D]", quarters + [("all 4 parts", 1.0)] + [("whole", 1.0)] * after),
        ("step, RNG state", [("whole, equal", 1.0)] * before + [("written once", 1.0)]
         + [("whole, equal", 1.0)] * after),
        ("metadata", [("its own pieces", 1 / before)] * before + [("shapes, dtypes,\nplacements, SHA", 1.0)]
         + [("read whole", 1.0)] * after),
    ], ["save: the ranks swap their piece lists (all_gather_object); each distinct piece is written once,",
        "by its least-loaded holder, into that rank's file; rank 0 writes the metadata and commits",
        "load on 2 ranks: dense[positions(saved piece)] = saved values, then local = dense[positions(mine)]"])
    ax.set_title("Resharding a checkpoint from FSDP on 4 ranks to TP on 2: who holds what "
                 "(bar: share of the whole)", fontsize=10)
    return fig
