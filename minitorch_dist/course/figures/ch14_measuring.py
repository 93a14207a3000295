"""Chapter 14 — figures: a benchmark's runs read properly, a replayed step on two ranks, an op timed hot and
over its step's footprint."""
from __future__ import annotations

import copy

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from ... import costmodel
from ...analysis.profiles import load_profile
from ...analysis.workload import Comm, Mark, Op
from .base import figure


@figure("ch14_benchmark_runs")
def benchmark_runs():
    """Forty runs of one step (seeded draws, an illustration): slow first runs, a busy moment, the median,
    the interquartile range, and the mean the outliers pull up."""
    rng = np.random.default_rng(14)
    runs = 15.0 * rng.lognormal(0.0, 0.05, 40)
    runs[:3] = [48.0, 24.0, 17.5]  # the first calls: allocation, lazy set-up
    runs[[17, 18, 31]] *= [2.6, 2.2, 1.9]  # another process took the core
    warm = runs[3:]
    q1, med, q3 = np.percentile(warm, [25, 50, 75])
    fig, (ax, hx) = plt.subplots(1, 2, figsize=(9, 3.0), gridspec_kw={"width_ratios": [3, 1]}, sharey=True)
    ax.axvspan(-0.5, 2.5, color="C3", alpha=0.1, label="warm-up: dropped")
    ax.axhspan(q1, q3, color="C0", alpha=0.18, label="interquartile range")
    ax.plot(np.arange(40), runs, "o-", ms=3, lw=0.7, c="C0")
    ax.axhline(med, c="k", lw=1, label="median")
    ax.axhline(warm.mean(), c="C1", lw=1, ls="--", label="mean (pulled up by the slow runs)")
    ax.set_xlabel("run"), ax.set_ylabel("ms"), ax.set_yscale("log")
    ax.legend(fontsize=7, loc="upper right")
    ax.set_title("One step timed 40 times (an illustration: seeded draws)")
    hx.hist(warm, bins=np.geomspace(warm.min(), warm.max(), 16), orientation="horizontal", color="C0",
            alpha=0.7)
    hx.axhline(med, c="k", lw=1), hx.axhline(warm.mean(), c="C1", lw=1, ls="--")
    hx.set_xlabel("runs"), hx.set_title("their distribution")
    return fig


def toy_replay() -> dict:
    """The notebook's hand-made step on two ranks (forward, backward, a blocking all-reduce of 4 MB, AdamW;
    rank 1's backward 5 ms instead of 3), each item between two marks, replayed on a hand-made profile."""
    prof = copy.deepcopy(load_profile("h100"))
    prof.kernels = {"forward": 2e-3, "backward": 3e-3, "slow backward": 5e-3, "AdamW": 1e-3}
    prof.framework_overhead_s, prof.python_line_s, prof.collective_overhead_s = 0.0, 1e-6, 0.0
    prof.collective_sweeps = {}
    prof.collectives = dict(prof.collectives, all_reduce={"alpha_s": 1e-4, "beta_s_per_byte": 1e-9})

    def rank(backward):
        items = [Op("forward", "other", 0.0, 0.0, "forward", key="forward", lines=200),
                 Op(backward, "other", 0.0, 0.0, "backward", key=backward, lines=300),
                 Comm("all_reduce", 4_000_000, 2, False, "backward", (0, 1)),
                 Op("AdamW", "other", 0.0, 0.0, "other", key="AdamW", lines=100)]
        out = []
        for i, item in enumerate(items):
            out += [Mark(str(i), "start"), item, Mark(str(i), "end")]
        return out
    return costmodel.replay_step({0: rank("backward"), 1: rank("slow backward")}, prof)


@figure("ch14_replay_timeline")
def replay_timeline():
    """The replay of the hand-made step: each rank's clock, its framework lines before each op, the wait
    for the slower rank at the all-reduce, the all-reduce itself."""
    res = toy_replay()
    colors = {"forward": "#4C72B0", "backward": "#55A868", "AdamW": "#8172B2", "framework": "#bbbbbb",
              "waiting for rank 1": "#ffffff", "all-reduce": "#DD8452"}
    names = {"0": "forward", "1": "backward", "3": "AdamW"}
    lines = {"0": 200, "1": 300, "3": 100}
    fig, ax = plt.subplots(figsize=(8.5, 2.2))
    seen = set()

    def bar(y, start, width, kind, hatch=None):
        ax.barh(y, width * 1e3, left=start * 1e3, color=colors[kind], edgecolor="#555555", lw=0.6,
                hatch=hatch, label=kind if kind not in seen else None)
        seen.add(kind)
    t_ar = costmodel.collective_time("all_reduce", 4_000_000, 2, 1e-4, 1e-9)
    for r, v in res["per_rank"].items():
        marks = {(name, edge): t for name, edge, t in v["spans"]}
        y = 1 - r
        for k, kind in names.items():
            start, end = marks[(k, "start")], marks[(k, "end")]
            fw = lines[k] * 1e-6
            bar(y, start, fw, "framework")
            bar(y, start + fw, end - start - fw, kind)
        start, end = marks[("2", "start")], marks[("2", "end")]
        if end - start - t_ar > 1e-9:
            bar(y, start, end - start - t_ar, "waiting for rank 1", hatch="//")
        bar(y, end - t_ar, t_ar, "all-reduce")
    ax.set_yticks([1, 0], ["rank 0", "rank 1"]), ax.set_xlabel("replayed clock (ms)")
    ax.set_title(f"A replayed step: the all-reduce starts when the last rank arrives; "
                 f"the step ends at {res['step_s'] * 1e3:.1f} ms")
    ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.35), frameon=False)
    return fig


@figure("ch14_hot_and_footprint")
def hot_and_footprint():
    """An op timed alone two ways: on one argument set again and again (hot: its inputs stay in the core's
    own caches), and on as many sets as the step's footprint holds, taken in turn (its inputs come from
    where the step leaves them)."""
    fig, axes = plt.subplots(2, 1, figsize=(8.5, 2.6))
    k = 6
    for ax, title, sets in ((axes[0], "hot: one argument set, called again and again", [0] * 12),
                            (axes[1], f"over the footprint: k = footprint / op bytes sets (here {k}), "
                                      f"taken in turn", [i % k for i in range(12)])):
        for call, s in enumerate(sets):
            ax.add_patch(Rectangle((call * 1.1, 0), 1, 1, facecolor=plt.cm.tab10(s), alpha=0.75,
                                   edgecolor="white"))
            ax.text(call * 1.1 + 0.5, 0.5, f"set {s + 1}", ha="center", va="center", fontsize=7,
                    color="white")
        ax.set_xlim(-0.1, 12 * 1.1), ax.set_ylim(-0.1, 1.1), ax.axis("off")
        ax.set_title(title, fontsize=8, loc="left")
    axes[1].annotate("", xy=(k * 1.1 + 0.5, -0.15), xytext=(0.5, -0.15),
                     arrowprops={"arrowstyle": "<->", "lw": 0.8})
    axes[1].text(k * 1.1 / 2 + 0.5, -0.45, "between two uses of one set: the step's footprint of other bytes",
                 ha="center", fontsize=7)
    fig.suptitle("Calls of one op in the kernel table's timing loop", fontsize=9)
    fig.subplots_adjust(hspace=0.6)
    return fig
