"""Chapter 12 — figures: the 3D rank grid and its groups, what ZeRO costs under a pipeline, and where a
step's seconds go for GPT-3 175B on 1024 A100s."""
from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

from ... import costmodel
from ...analysis import planner as P
from ...analysis.planner_presets import GPUS, PUBLISHED, get_model
from ...parallelism.mesh import RankGrid
from .base import figure

GROUP_COLORS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52")


@figure("ch12_rank_grid")
def rank_grid():
    """The 8 ranks of d x t x p = 2 x 2 x 2 in Megatron's order, coloured by their group on each axis."""
    grid = RankGrid(8, dp=2, tp=2, pp=2)
    titles = {"tp": "tensor groups: consecutive ranks\n(one node, NVLink)",
              "dp": "data groups: t apart", "pp": "pipeline groups: d·t apart\n(across nodes)"}
    fig, axes = plt.subplots(1, 3, figsize=(9, 2.9))
    for ax, axis in zip(axes, ("tp", "dp", "pp")):
        colour = {r: i for i, g in enumerate(grid.groups(axis)) for r in g}
        for rank in range(grid.world_size):
            c = grid.coords(rank)
            x, y = c.pp * 2.6 + c.tp * 1.1, (grid.dp - 1 - c.dp) * 1.1  # a stage is a block of dp x tp
            ax.add_patch(Rectangle((x, y), 1, 1, facecolor=GROUP_COLORS[colour[rank]], edgecolor="white"))
            ax.text(x + 0.5, y + 0.5, str(rank), ha="center", va="center", color="white", fontsize=10)
        for stage in range(grid.pp):
            ax.text(stage * 2.6 + 1.05, -0.35, f"stage {stage}", ha="center", va="center", fontsize=8)
        ax.set_xlim(-0.2, 4.9), ax.set_ylim(-0.6, 2.3), ax.set_aspect("equal"), ax.axis("off")
        ax.set_title(titles[axis], fontsize=8)
    fig.suptitle("d × t × p = 2 × 2 × 2: rank = tp + t·(dp + d·pp); rows dp, columns tp; "
                 "a colour is one group", fontsize=9, y=1.04)
    return fig


def _zero_variants():
    """GPT-3 175B's first stage at t = 8, p = 8, d = 16, m = 96, Megatron's recipe: (name, stage it
    costs, model-state bytes, DP bytes per step)."""
    model, (t, p, d, m) = get_model("gpt3-175b"), (8, 8, 16, 96)
    psi, g = model.stage_params(t, p)[0], costmodel.MAIN_GRAD_BYTES
    rows = [("ZeRO-1", costmodel.zero_stage_under_pipeline(1, p)),
            ("ZeRO-2, reduced once\nafter the last microbatch", costmodel.zero_stage_under_pipeline(2, p)),
            ("ZeRO-2, reduced every\nmicrobatch", 2),
            ("ZeRO-3, re-gathered every\nmicrobatch", costmodel.zero_stage_under_pipeline(3, p)),
            ("ZeRO-3, kept gathered\nacross the microbatches",
             costmodel.zero_stage_under_pipeline(3, p, keep_gathered=True))]
    return [(name, z, costmodel.zero_memory_bytes(psi, d, z, grad_bytes=g),
             costmodel.zero_dp_bytes_per_step(psi, d, z, m, 2, g)) for name, z in rows]


@figure("ch12_zero_pipeline")
def zero_pipeline():
    """Model-state memory and data-parallel bytes per step of each way to run ZeRO under a pipeline."""
    rows = _zero_variants()
    fig, (mem, wire) = plt.subplots(1, 2, figsize=(9, 3.2), sharey=True)
    ys = range(len(rows))[::-1]
    for y, (_name, z, states, sent) in zip(ys, rows):
        mem.barh(y, states / 1e9, color=GROUP_COLORS[z])
        mem.text(states / 1e9 + 0.5, y, f"{states / 1e9:.1f}", va="center", fontsize=8)
        wire.barh(y, sent / 1e9, color=GROUP_COLORS[z])
        wire.text(sent / 1e9 * 1.15, y, f"{sent / 1e9:,.0f}", va="center", fontsize=8)
    mem.set_yticks(list(ys), [name for name, *_ in rows], fontsize=8)
    mem.set_xlabel("model states per GPU, GB (18 B/param)")
    mem.set_xlim(0, max(r[2] for r in rows) / 1e9 * 1.25)
    wire.set_xscale("log"), wire.set_xlabel("data-parallel bytes per GPU per step, GB (log)")
    wire.set_xlim(min(r[3] for r in rows) / 1e9 / 2, max(r[3] for r in rows) / 1e9 * 6)
    fig.suptitle("GPT-3 175B, first stage, t = 8, p = 8, d = 16, m = 96 microbatches: "
                 "a colour is the ZeRO stage a variant costs", fontsize=9)
    return fig


@figure("ch12_step_parts")
def step_parts():
    """Where the predicted seconds of a step go, for three configurations on 1024 A100s."""
    model, cluster = get_model("gpt3-175b"), P.Cluster(GPUS["a100"], 1024)
    pub = PUBLISHED["gpt3-175b"]
    configs = [(f"published 2021: t={pub.tp} p={pub.pp}\nZeRO-0, full recompute (fp16)",
                P.Config(pub.tp, pub.pp, 8, 1, 192, 0, "full"), P.Assumptions(main_grad=False)),
               ("same grid, ZeRO-1,\nno recompute", P.Config(8, 16, 8, 1, 192, 1, "none"), P.Assumptions()),
               ("ZeRO-3 with a pipeline:\nt=8 p=2 d=64 b=4, full", P.Config(8, 2, 64, 4, 6, 3, "full"),
                P.Assumptions())]
    parts = (("gemm", "GEMMs"), ("elementwise", "elementwise"), ("tp_comm", "TP all-reduces"),
             ("pp_comm", "pipeline sends"), ("bubble", "bubble"), ("dp_comm", "exposed DP"),
             ("optimizer", "optimizer"))
    colours = ("#4C72B0", "#8172B3", "#DD8452", "#937860", "#bbbbbb", "#C44E52", "#55A868")
    fig, ax = plt.subplots(figsize=(8, 2.8))
    for y, (_name, c, a) in enumerate(configs[::-1]):
        plan, left = P.evaluate(c, model, cluster, a), 0.0
        for (key, label), colour in zip(parts, colours):
            ax.barh(y, plan.time[key], left=left, color=colour, label=label if y == 0 else None)
            left += plan.time[key]
        ax.text(left + 0.3, y, f"{plan.step_time:.1f} s", va="center", fontsize=8)
    ax.set_yticks(range(len(configs)), [n for n, *_ in configs[::-1]], fontsize=8)
    ax.set_xlabel("predicted seconds per step (A100 profile)")
    ax.set_xlim(0, ax.get_xlim()[1] * 1.08)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.45, -0.28), frameon=False)
    ax.set_title("GPT-3 175B, batch 1536, 1024 A100s: the planner's parts of a step", fontsize=9)
    return fig



#: the cheatsheet's decision, top to bottom: (question, the answer that adds a technique, what it adds)
DECISIONS = (
    ("Do the model states (16 B/param)\nfit on one device?", "no",
     "shard them over dp:\nZeRO-1 → 2 → 3 / FSDP (06)"),
    ("Do one microbatch's\nactivations fit?", "no",
     "recompute (07); SP with TP,\nCP for long sequences (05)"),
    ("Does ZeRO-3's all-gather hide\nbehind compute at this scale?", "no",
     "add tensor parallelism\ninside a node, t ≤ 8 (04)"),
    ("Does one node's share\nof the model fit?", "no", "add pipeline stages\nacross nodes (03)"),
    ("Is it a mixture\nof experts?", "yes", "add expert parallelism\nfor the experts (10)"),
)


@figure("ch12_which_technique")
def which_technique():
    """The cheatsheet's flowchart: start from data parallelism; each question asks whether something
    fits, and each answer that says it does not adds the cheapest technique that makes it fit."""
    fig, ax = plt.subplots(figsize=(8, 6.2))
    grey = {"arrowstyle": "->", "color": "#555"}
    start = {"boxstyle": "round,pad=0.4", "facecolor": "#E8F4EA", "edgecolor": "#55A868"}
    ask = {"boxstyle": "round,pad=0.4", "facecolor": "#EAF0F8", "edgecolor": "#4C72B0"}
    add = {"boxstyle": "round,pad=0.4", "facecolor": "#FDF0E6", "edgecolor": "#DD8452"}
    top = len(DECISIONS) + 1
    ax.text(0, top, "Start: data parallelism over every rank,\naccumulation for the batch you want (01)",
            ha="center", va="center", fontsize=8, bbox=start)
    for i, (question, answer, action) in enumerate(DECISIONS):
        y = top - 1 - i
        ax.annotate("", xy=(0, y + 0.32), xytext=(0, y + 0.68), arrowprops=grey)
        ax.text(0, y, question, ha="center", va="center", fontsize=8, bbox=ask)
        ax.annotate("", xy=(1.35, y), xytext=(0.95, y), arrowprops=grey)
        ax.text(1.15, y + 0.08, answer, ha="center", va="bottom", fontsize=7, color="#555")
        ax.text(2.1, y, action, ha="center", va="center", fontsize=8, bbox=add)
    ax.text(0.9, 0.3, "Always: mixed precision (08), fused kernels (11), a checkpoint interval (13).\n"
            "Then let the planner (12) price every combination with the same formulas.",
            ha="center", va="center", fontsize=8)
    ax.set_xlim(-1.2, 3.0), ax.set_ylim(-0.1, top + 0.6), ax.axis("off")
    ax.set_title("Which technique, when: a question down, the technique it adds to the right", fontsize=10)
    return fig
