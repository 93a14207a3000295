"""Chapter 03 — figures: GPipe against 1F1B in time and memory, interleaving and zero bubble, the bubble
and the stash of every schedule, and the two V schedules."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Patch, Rectangle

from ... import costmodel
from ...parallelism.pipeline.schedules import make_schedule
from ...parallelism.pipeline.simulator import COLORS, gantt, simulate
from .base import figure


def _gantts(rows, figsize, title_of):
    """One simulated Gantt chart per (name, p, m, v), sharing the x axis; one legend, at the bottom."""
    fig, axes = plt.subplots(len(rows), 1, figsize=figsize, sharex=True)
    sims = []
    for ax, (name, p, m, v) in zip(axes, rows):
        sim = simulate(make_schedule(name, p, m, v), t_f=1, t_b=1, t_w=1)
        sims.append(sim)
        gantt(sim, ax=ax, title=title_of(name, sim))
        ax.get_legend().remove()
        ax.title.set_fontsize(8.5)
        ax.title.set_horizontalalignment("left")
        ax.title.set_x(0.0)
        ax.tick_params(axis="y", labelsize=7)
        ax.set_xlabel("")
        for t in ax.texts:
            t.set_fontsize(5.5)
    axes[-1].set_xlabel("time (units of t_F; t_B = t_W = t_F, a whole backward 2 t_F)")
    axes[-1].set_xlim(0, max(s.makespan for s in sims))
    present = {e.category for s in sims for e in s.events}
    b_label = "B: backward (the input gradient only, when a W follows)" if "W" in present else "B: backward"
    names = {"F": "F: forward", "B": b_label, "W": "W: weight gradient"}
    fig.legend(handles=[Patch(color=COLORS[k], label=names[k]) for k in "FBW" if k in present],
               loc="lower center", ncol=3, fontsize=7, frameon=False, bbox_to_anchor=(0.5, -0.04))
    fig.tight_layout(rect=(0, 0.04, 1, 1), h_pad=0.3)
    return fig


@figure("ch03_gpipe_1f1b")
def gpipe_1f1b():
    """GPipe and 1F1B on 4 stages, 8 microbatches (simulator, equal stage times): the same bubble, and the
    peak number of microbatches whose activations each stage holds."""
    def title(name, sim):
        stash = ", ".join(f"{s:g}" for s in sim.peak_stashed)
        return (f"{name}: bubble {sim.bubble_fraction:.1%} of the step; microbatches stashed per stage at "
                f"the peak: {stash}")
    return _gantts([("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1)], (9, 3.4), title)


@figure("ch03_interleaved_zb")
def interleaved_zb():
    """1F1B, interleaved 1F1B with v = 2 chunks per rank, and ZB-H1 on 4 stages, 8 microbatches."""
    def title(name, sim):
        v = f", v = {sim.schedule.v} chunks per rank" if sim.schedule.v > 1 else ""
        idle = max(sim.idle)
        return f"{name}{v}: bubble {sim.bubble_fraction:.1%}, idle per stage {idle:g} t_F"
    return _gantts([("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 4, 8, 1)], (9, 4.4), title)


@figure("ch03_bubble_and_stash")
def bubble_and_stash():
    """Left: the bubble against m for p = 8 (costmodel.pipeline_bubble_fraction, equal stage times).
    Right: the microbatches each stage stashes at m = 32 (costmodel.pipeline_stashed_microbatches)."""
    p = 8
    ms = list(range(8, 129, 4))
    rows = [("gpipe / 1f1b", "1f1b", 1, "C0", "-"), ("interleaved, v = 2", "interleaved", 2, "C1", "-"),
            ("interleaved, v = 4", "interleaved", 4, "C1", "--"), ("zb-h1", "zb-h1", 1, "C2", "-"),
            ("zbv", "zbv", 1, "C3", "-")]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.3))
    for label, name, v, c, ls in rows:
        least = costmodel.v_min_microbatches(name, p) if name == "zbv" else 1
        ok = [m for m in ms if (name != "interleaved" or m % p == 0) and m >= least]
        a1.plot(ok, [100 * costmodel.pipeline_bubble_fraction(name, p, m, v) for m in ok], c=c, ls=ls,
                label=label)
    a1.axhline(5, c="k", lw=0.6, alpha=0.4)
    a1.text(ms[-1], 5.6, "5%", ha="right", fontsize=7, alpha=0.7)
    a1.set_xlabel("microbatches m"), a1.set_ylabel("bubble (% of the step)")
    a1.set_ylim(0, 50), a1.set_title(f"p = {p} stages, t_F = t_B = t_W", fontsize=9)
    a1.legend(fontsize=7)
    m = 32
    stages = range(p)
    for k, (label, name, v, c) in enumerate([("gpipe", "gpipe", 1, "C4"), ("1f1b", "1f1b", 1, "C0"),
                                             ("interleaved, v = 2", "interleaved", 2, "C1"),
                                             ("zb-h1", "zb-h1", 1, "C2")]):
        a2.bar([r + (k - 1.5) * 0.2 for r in stages],
               [costmodel.pipeline_stashed_microbatches(name, p, m, r, v) for r in stages], 0.2, color=c,
               label=label)
    a2.set_yscale("log", base=2)
    a2.set_yticks([1, 2, 4, 8, 16, 32], ["1", "2", "4", "8", "16", "32"])
    a2.set_xlabel("stage r"), a2.set_ylabel("microbatches stashed (peak)")
    a2.set_title(f"p = {p}, m = {m}: activations held at once", fontsize=9)
    a2.legend(fontsize=7, ncol=4, loc="upper center", columnspacing=0.8, handlelength=1.2)
    a2.set_ylim(0.8, 150)
    fig.tight_layout()
    return fig


@figure("ch03_v_schedules")
def v_schedules():
    """ZB-V and DualPipeV on 4 ranks, 8 microbatches (simulator, equal times); DualPipeV's overlapped F&B
    pairs outlined."""
    p, m = 4, 8

    def title(name, sim):
        return (f"{name}: bubble {sim.bubble_fraction:.1%}, idle per rank {max(sim.idle):g} t_F, "
                f"stash {max(sim.peak_stashed):g} microbatches per rank")
    fig = _gantts([("zbv", p, m, 2), ("dualpipev", p, m, 2)], (9, 3.6), title)
    zbv = simulate(make_schedule("zbv", p, m), t_f=1, t_b=1, t_w=1)
    top = fig.axes[0]
    for e in zbv.events:  # each half-unit block with its microbatch: too narrow for the Gantt's own labels
        top.text((e.t_start + e.t_end) / 2, e.rank, e.name[1:], ha="center", va="center", fontsize=4.5)
    for ax in fig.axes:  # a V puts two chunks on each rank: the rows are ranks, not stages
        ax.set_yticks(range(p), [f"rank {r}" for r in range(p)])
    top.set_title(top.get_title() + " (labels: microbatch; .1 its second chunk, run back up the ranks)",
                  fontsize=8.5, loc="left")
    sched = make_schedule("dualpipev", p, m)
    sim = simulate(sched, t_f=1, t_b=1, t_w=1)
    ax = fig.axes[1]
    for r, positions in enumerate(sched.overlapped):
        ev = {e.name: e for e in sim.stage_events(r)}
        for i in positions:
            f, b = ev[str(sched[r][i])], ev[str(sched[r][i + 1])]
            ax.add_patch(Rectangle((f.t_start, r - 0.45), b.t_end - f.t_start, 0.9, fill=False,
                                   edgecolor="red", linewidth=1.0))
    return fig
