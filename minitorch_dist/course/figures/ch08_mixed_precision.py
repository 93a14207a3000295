"""Chapter 08 — figures: the formats' bit layouts, the updates each format loses, the dynamic loss scale
probing for the largest safe scale."""
from __future__ import annotations

import math

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.patches import Rectangle

from ... import costmodel
from ...memory.mixed_precision import DynamicLossScaler
from .base import figure, holdings

PART_COLORS = {"sign": "#C44E52", "exponent": "#4C72B0", "mantissa": "#55A868"}


def _sci(x: float) -> str:
    """x as m·10^e with two significant digits (plain for numbers between 0.01 and 10^5)."""
    if 1e-2 <= x < 1e5:
        return f"{x:.6g}"
    e = math.floor(math.log10(x))
    return f"{x / 10 ** e:.2g}e{e}"


@figure("ch08_bit_layouts")
def bit_layouts():
    """Sign, exponent and mantissa bits of each format (costmodel.FORMATS), with its range and precision."""
    names = list(costmodel.FORMATS)
    fig, ax = plt.subplots(figsize=(9, 3.0))
    width = 0.19  # of one bit, in axis units: fp32's 32 bits span ~6 units
    for row, name in enumerate(names):
        info = costmodel.format_info(name)
        y = len(names) - 1 - row
        x = 0.0
        parts = (("sign", 1), ("exponent", info["exponent_bits"]), ("mantissa", info["mantissa_bits"]))
        for part, n in parts:
            for _ in range(n):
                ax.add_patch(Rectangle((x, y + 0.15), width, 0.6, facecolor=PART_COLORS[part],
                                       edgecolor="white", lw=0.8))
                x += width
        ax.text(-0.15, y + 0.45, f"{name}\n{info['bits']} bits", ha="right", va="center", fontsize=8)
        ax.text(32 * width + 0.3, y + 0.45,
                f"max {_sci(info['max'])}   min subnormal {_sci(info['min_subnormal'])}   "
                f"eps 2^-{info['mantissa_bits']}   {info['binades']:.1f} binades",
                ha="left", va="center", fontsize=8)
    for part, color in PART_COLORS.items():
        ax.bar(0, 0, color=color, label=part)
    ax.set_xlim(-1.4, 32 * width + 6.6), ax.set_ylim(-0.1, len(names))
    ax.set_xticks([]), ax.set_yticks([])
    for side in ("left", "bottom"):
        ax.spines[side].set_visible(False)
    ax.legend(ncol=3, fontsize=8, loc="upper center", bbox_to_anchor=(0.35, 1.12), frameon=False)
    ax.set_title("Exponent bits buy range, mantissa bits buy precision", y=1.1)
    return fig


@figure("ch08_lost_updates")
def lost_updates():
    """Half the gap above a weight (costmodel.ulp): updates smaller than it round away, per format."""
    w = np.geomspace(1e-3, 10, 600)
    fig, ax = plt.subplots(figsize=(6.5, 3.2))
    for name, color in (("fp32", "C0"), ("fp16", "C1"), ("bf16", "C3")):
        half_gap = costmodel.ulp(torch.tensor(w), name).numpy() / 2
        ax.step(w, half_gap, where="post", color=color, label=f"{name}: ulp(w) / 2")
    u = 1e-4
    ax.axhline(u, color="k", lw=0.8, ls="--")
    # the smallest power of two from which an update of +u is lost (update_lost rounds w + u and compares)
    first = {name: next(k for k in range(-30, 10) if costmodel.update_lost(2.0 ** k, u, name))
             for name in ("fp16", "bf16")}
    ax.text(1.2e-3, u * 3, f"an update of +{u:g} is lost in fp16 from |w| = $2^{{{first['fp16']}}}$,\n"
            f"in bf16 from |w| = $2^{{{first['bf16']}}}$", fontsize=7.5)
    ax.set_xscale("log"), ax.set_yscale("log")
    ax.set_xlabel("weight |w|"), ax.set_ylabel("smallest update that survives")
    ax.set_title("An update below half an ulp of its weight rounds away")
    ax.legend(fontsize=7.5, loc="lower right")
    return fig


@figure("ch08_loss_scale")
def loss_scale():
    """The dynamic loss scale on a scripted run: it climbs until S · max|g| passes fp16's max, then halves."""
    steps, interval = 120, 8
    fp16_max = costmodel.format_info("fp16")["max"]
    # the largest gradient of each step drifts down over the run, with a spike now and then
    amax = [2.0 ** -3 * 2.0 ** (-3 * t / steps) * (4.0 if t % 37 == 36 else 1.0) for t in range(steps)]
    scaler = DynamicLossScaler(init_scale=2.0 ** 12, growth_interval=interval)
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scales, skips = [], []
    for t, a in enumerate(amax):
        s = scaler.get_scale()
        scales.append(s)
        param.grad = torch.tensor([a * s]).half().float()  # the scaled gradient in fp16: inf past max
        before = scaler.skipped_steps
        scaler.step(opt)
        scaler.update()
        if scaler.skipped_steps > before:
            skips.append(t)
    bound = [math.log2(costmodel.loss_scale_range([a], "fp16")[1]) for a in amax]
    fig, ax = plt.subplots(figsize=(7, 3.0))
    ax.step(range(steps), np.log2(scales), where="post", label="log2 S (the scaler)")
    ax.step(range(steps), bound, where="post", color="gray", ls=":",
            label=f"largest S with S·max|g| ≤ {fp16_max:g}")
    ax.plot(skips, [math.log2(scales[t]) for t in skips], "rx",
            label=f"overflow: step skipped ({len(skips)})")
    ax.set_xlabel("step"), ax.set_ylabel("log2 loss scale")
    ax.set_title(f"Dynamic loss scaling (growth every {interval} clean steps, halve on overflow; "
                 f"fp16 max {fp16_max:g})", fontsize=9)
    ax.legend(fontsize=7.5, loc="lower right")
    return fig


@figure("ch08_who_holds_what")
def who_holds_what():
    """What one data-parallel rank holds, and in which dtype, under the three recipes of the chapter
    (MixedPrecisionTrainer in fp16 and in bf16; bf16 autocast with FP8Linear): the fp32 masters and Adam
    moments, the 16-bit working copy, the gradients, the scales; what moves is casts and the gradient
    all-reduce, in the gradient's dtype."""
    fig, ax = plt.subplots(figsize=(9.0, 3.6))
    holdings(ax, ["fp16 trainer", "bf16 trainer", "fp8 Linears (autocast)"], [
        ("master weights W[D, F]", [("fp32, 4 B", 1.0)] * 2 + [("fp32: parameters", 1.0)]),
        ("working weights W[D, F]", [("fp16 copy, 2 B", 0.5), ("bf16 copy, 2 B", 0.5),
                                     ("E4M3 per GEMM, 1 B", 0.25)]),
        ("saved activations", [("fp16, 2 B", 0.5), ("bf16, 2 B", 0.5), ("x in E4M3, 1 B", 0.25)]),
        ("gradient G[D, F]{U_dp}", [("fp16, times S, 2 B", 0.5), ("bf16, 2 B", 0.5), ("fp32, 4 B", 1.0)]),
        ("master gradient G[D, F]", [("fp32, divided by S", 1.0), ("fp32, 4 B", 1.0),
                                     ("G itself, fp32", 1.0)]),
        ("Adam m, v", [("fp32, 4 + 4 B", 1.0)] * 3),
        ("scales (fp32)", [("S, 2¹⁶ at start", 1.0), ("none needed", 0.0),
                          ("448/amax a tensor", 1.0)]),
    ], ["casts: after each step the fp32 masters are rounded into the 16-bit copy; "
        "fp8: x, W → E4M3, dy → E5M2 per GEMM",
        "all-reduce over dp in the gradient's dtype: G{U_dp} → G[D, F], "
        "2 B an element in fp16 or bf16, 4 in fp32",
        "then fold into fp32, divide by S, skip the step on inf or NaN, step the fp32 masters"])
    ax.set_title("Mixed precision on one rank: which dtype holds what, and what moves "
                 "(bar: bytes per element, of fp32's 4)", fontsize=10)
    return fig
