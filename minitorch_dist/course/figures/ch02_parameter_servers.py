"""Chapter 02 — figures: a parameter server against a ring, the three consistency rules in time, the
traffic of each design, and how often HOGWILD!'s updates collide."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import FancyArrowPatch, Rectangle

from ... import costmodel
from ...parallelism.parameter_server import key_ranges
from .base import figure

SERVER_C, WORKER_C, WAIT_C = "#4C72B0", "#55A868", "#dddddd"


def _box(ax, x, y, w, h, text, color, fontsize=8):
    ax.add_patch(Rectangle((x - w / 2, y - h / 2), w, h, facecolor=color, edgecolor="none", alpha=0.9))
    ax.text(x, y, text, ha="center", va="center", fontsize=fontsize, color="white")


def _power(x: int) -> str:
    """An integer as the figure prints keys: 0, 5·10⁸, 10⁹."""
    if x == 0:
        return "0"
    e = int(math.floor(math.log10(x)))
    m = x / 10**e
    sup = str(e).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))
    return f"10{sup}" if m == 1 else f"{m:g}·10{sup}"


def _arrow(ax, a, b, color="#555555", rad=0.0):
    ax.add_patch(FancyArrowPatch(a, b, arrowstyle="-|>", mutation_scale=8, color=color, lw=0.9,
                                 connectionstyle=f"arc3,rad={rad}"))


@figure("ch02_topology")
def topology():
    """S = 2 servers holding key ranges, n = 4 workers pushing and pulling; the ring of the same workers.
    Bytes per step for a 10⁹-parameter fp32 model, from costmodel.ps_bytes_per_step."""
    n_params, n, S = 10**9, 4, 2
    ps = costmodel.ps_bytes_per_step(n_params, n, S)
    ranges = key_ranges(n_params, S)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4), gridspec_kw={"width_ratios": [1.5, 1]})
    server_x, worker_x = [1.5, 4.5], [0.0, 2.0, 4.0, 6.0]
    for k, (x, (lo, hi)) in enumerate(zip(server_x, ranges)):
        _box(a1, x, 3.0, 2.3, 0.8, f"server {k}\nkeys [{_power(lo)}, {_power(hi)})", SERVER_C)
    for w, x in enumerate(worker_x):
        _box(a1, x, 0.0, 1.3, 0.6, f"worker {w}", WORKER_C)
        for sx in server_x:
            _arrow(a1, (x - 0.12, 0.32), (sx - 0.12, 2.58), color="#C44E52")
            _arrow(a1, (sx + 0.12, 2.58), (x + 0.12, 0.32), color="#4C72B0")
    a1.text(3.0, 1.45, f"each worker pushes Ψ = {ps['worker_send'] / 1e9:.0f} GB (red, Ψ/S to each server)\n"
                       f"and pulls Ψ = {ps['worker_recv'] / 1e9:.0f} GB (blue)",
            ha="center", va="center", fontsize=7.5, bbox={"facecolor": "white", "edgecolor": "none"})
    a1.text(3.0, 3.75, f"each server receives nΨ/S = {ps['server_recv'] / 1e9:.0f} GB and sends as much",
            ha="center", fontsize=7.5)
    a1.set_xlim(-0.9, 6.9), a1.set_ylim(-0.5, 4.1), a1.axis("off")
    a1.set_title(f"Parameter server: S = {S} servers, n = {n} workers", fontsize=9)
    # the ring of the same four workers
    ang = [math.pi / 2 - 2 * math.pi * i / n for i in range(n)]
    pts = [(1.6 * math.cos(t), 1.6 * math.sin(t)) for t in ang]
    for i, (x, y) in enumerate(pts):
        _box(a2, x, y, 1.1, 0.5, f"worker {i}", WORKER_C)
    for i in range(n):
        (x0, y0), (x1, y1) = pts[i], pts[(i + 1) % n]
        dx, dy = x1 - x0, y1 - y0
        _arrow(a2, (x0 + 0.25 * dx, y0 + 0.25 * dy), (x0 + 0.75 * dx, y0 + 0.75 * dy), rad=-0.2)
    a2.text(0, 0, f"each sends\n2(n−1)/n·Ψ\n= {ps['allreduce_per_rank'] / 1e9:.0f} GB", ha="center",
            va="center", fontsize=7.5)
    a2.set_xlim(-2.4, 2.4), a2.set_ylim(-2.2, 2.2), a2.set_aspect("equal"), a2.axis("off")
    a2.set_title("Ring all-reduce: no servers", fontsize=9)
    psi = ps["worker_send"] / 1e9
    fig.suptitle(f"One step of a {n_params / 1e9:.0f}B-parameter fp32 model (Ψ = {psi:.0f} GB)",
                 fontsize=9.5, y=1.0)
    return fig


def _ssp_starts(durations, s):
    """Start times under the SSP rule: worker w starts clock c when it finished c - 1 and every worker
    has finished clock c - s - 1 (s = 0: BSP, math.inf: ASP). Pushes are instantaneous."""
    n, iters = len(durations), len(durations[0])
    start, finish = np.zeros((n, iters)), np.zeros((n, iters))
    for c in range(iters):
        gate = c - s - 1
        ready = max(finish[v][int(gate)] for v in range(n)) if gate >= 0 else 0.0
        for w in range(n):
            start[w][c] = max(finish[w][c - 1] if c else 0.0, ready)
            finish[w][c] = start[w][c] + durations[w][c]
    return start, finish


@figure("ch02_ssp_timeline")
def ssp_timeline():
    """Three workers, worker 2 persistently 1.8x slower, under BSP, SSP(s = 2) and ASP: each bar is one
    clock (its number inside), grey is waiting for the rule to admit the next read."""
    iters = 8
    durations = [[1.0] * iters, [1.1] * iters, [1.8] * iters]
    rules = [("BSP (s = 0)", 0), ("SSP (s = 2)", 2), ("ASP (s = ∞)", math.inf)]
    fig, axes = plt.subplots(len(rules), 1, figsize=(8, 3.9), sharex=True)
    end = sum(durations[2])
    for ax, (name, s) in zip(axes, rules):
        start, finish = _ssp_starts(durations, s)
        for w in range(len(durations)):
            prev = 0.0
            for c in range(iters):
                if start[w][c] > prev + 1e-9:
                    ax.barh(w, start[w][c] - prev, left=prev, color=WAIT_C, height=0.7)
                ax.barh(w, durations[w][c], left=start[w][c], color=WORKER_C if w < 2 else "#C44E52",
                        edgecolor="white", height=0.7)
                ax.text(start[w][c] + durations[w][c] / 2, w, str(c), ha="center", va="center", fontsize=6.5,
                        color="white")
                prev = finish[w][c]
        # staleness of a start: its clock minus the slowest worker's finished clocks at that instant
        lead = max(c - int((finish[2] <= start[0][c] + 1e-9).sum()) for c in range(iters))
        waited = float(sum(start[0][c] - (finish[0][c - 1] if c else 0.0) for c in range(iters)))
        ax.set_yticks(range(3), ["worker 0", "worker 1", "worker 2 (slow)"], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{name}: worker 0 waits {waited:.1f} time units in all, "
                     f"reads up to {lead} clocks stale", fontsize=8, loc="left")
        ax.set_xlim(0, end + 0.2)
    axes[-1].set_xlabel("time (units of worker 0's clock)")
    fig.tight_layout(h_pad=0.4)
    return fig


@figure("ch02_traffic")
def traffic():
    """Left: the busiest link of a parameter server against the number of servers, for 8 workers, next to
    a ring all-reduce. Right: BytePS's optimal split with k extra CPU machines. Both from costmodel."""
    n_params, n = 10**9, 8
    servers = np.arange(1, 17)
    busiest = [costmodel.ps_bytes_per_step(n_params, n, int(s))["bottleneck"] / 1e9 for s in servers]
    ring = costmodel.ps_bytes_per_step(n_params, n, 1)["allreduce_per_rank"] / 1e9
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.5, 3.0))
    a1.plot(servers, busiest, "o-", ms=3, c=SERVER_C, label="parameter server: busiest link")
    a1.axhline(ring, c="#C44E52", ls="--", label=f"ring all-reduce: {ring:.1f} GB per rank")
    a1.set_xlabel("server machines S"), a1.set_ylabel("GB each way, one step")
    a1.set_ylim(0, 34)
    a1.annotate(f"S = 1: {busiest[0]:.0f} GB\ninto one server", xy=(1, busiest[0]), xytext=(3, 27),
                fontsize=7.5, arrowprops={"arrowstyle": "->", "alpha": 0.5})
    a1.set_title(f"n = {n} workers, Ψ = {n_params * 4 / 1e9:.0f} GB", fontsize=9)
    a1.legend(fontsize=7, loc="center right")
    ks = np.arange(0, 13)
    b = [costmodel.byteps_optimal_bytes(n_params, n, int(k))["bottleneck"] / 1e9 for k in ks]
    a2.plot(ks, b, "o-", ms=3, c="#8172B2")
    a2.axhline(ring, c="#C44E52", ls="--", lw=0.8)
    a2.axvline(n, c="k", alpha=0.25)
    a2.text(0.2, ring - 0.35, f"k = 0: the ring, {b[0]:.1f} GB", fontsize=7.5)
    a2.text(n + 0.2, b[n] + 0.2, f"k = n: {b[n]:.1f} GB,\nno better beyond", fontsize=7.5)
    a2.set_xlabel("extra CPU machines k"), a2.set_ylabel("GB on the busiest link")
    a2.set_ylim(3, 7.6)
    a2.set_title(f"BytePS: {n} GPU machines + k CPU machines", fontsize=9)
    fig.tight_layout()
    return fig


@figure("ch02_hogwild_conflicts")
def hogwild_conflicts():
    """How likely an update shares a coordinate with another in flight, against its support size ω, for
    d = 10,000 coordinates and p processes (costmodel.hogwild_conflict_probability), next to (p−1)ω²/d."""
    d = 10_000
    omegas = np.unique(np.geomspace(1, 1000, 60).astype(int))
    fig, ax = plt.subplots(figsize=(6.2, 3.0))
    for p, c in ((2, "C0"), (4, "C1"), (16, "C2")):
        ax.plot(omegas, [costmodel.hogwild_conflict_probability(int(w), d, p) for w in omegas], c=c,
                label=f"p = {p} processes")
        ax.plot(omegas, np.minimum((p - 1) * omegas**2 / d, 1.0), c=c, ls=":", lw=1)
    ax.axvline(10, c="k", alpha=0.25)
    at = costmodel.hogwild_conflict_probability(10, d, 2)
    ax.annotate(f"the notebook's sparse problem:\nω = 10, p = 2: {at:.3f}", xy=(10, at), xytext=(130, 0.3),
                fontsize=7.5, arrowprops={"arrowstyle": "->", "alpha": 0.5})
    ax.set_xscale("log"), ax.set_xlabel("support size ω (coordinates an update touches)")
    ax.set_ylabel("P(conflict)")
    ax.set_title(f"d = {d:,} coordinates; dotted: the small-ω approximation (p−1)ω²/d", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return fig
