"""Chapter 01 — figures: gradient buckets all-reduced while backward runs, and what the bucket size costs."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from ... import costmodel
from ...models import GPT, GPTConfig
from ...parallelism.data_parallel import MiB
from .base import figure

#: GPT-2 small (124M): the model of the figures, built on the meta device (shapes only, no memory)
GPT2_SMALL = GPTConfig(vocab_size=50257, block_size=1024, n_layer=12, n_head=12, n_embd=768)
LINK = "InfiniBand NDR 400 Gb/s"
N_RANKS, TOKENS_PER_RANK, MFU = 8, 8 * 1024, 0.4  # 8 GPUs, 8 sequences of 1024 tokens each, 40% of peak


def _setup():
    """GPT-2 small's gradient sizes in the order backward produces them (fp32), and its forward and
    backward seconds per rank on an H100 at MFU 40%: 2N FLOPs per token forward, 4N backward."""
    with torch.device("meta"):
        model = GPT(GPT2_SMALL)
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * 4 for p in params][::-1]
    n_params = sum(p.numel() for p in params)
    rate = costmodel.device_spec("h100").peak_flops["bf16"] * MFU
    t_f = 2 * n_params * TOKENS_PER_RANK / rate
    return sizes, n_params, t_f, 2 * t_f


@figure("ch01_bucket_overlap")
def bucket_overlap():
    """Forward, backward and each bucket's all-reduce on one rank: overlapped (DDP) and after backward."""
    sizes, n_params, t_f, t_b = _setup()
    buckets = costmodel.bucket_sizes(sizes, 25 * MiB, 1 * MiB)
    alpha, beta = costmodel.LINKS[LINK]
    sched = costmodel.ddp_allreduce_schedule(t_f, t_b, buckets, N_RANKS, alpha, beta)
    fig, ax = plt.subplots(figsize=(8.5, 2.6))
    ms = 1e3
    rows = {"overlap": 1.0, "after": 0.0}
    for y in rows.values():
        ax.barh(y + 0.18, t_f * ms, left=0, height=0.3, color="#4C72B0")
        ax.barh(y + 0.18, t_b * ms, left=t_f * ms, height=0.3, color="#DD8452")
    colors = plt.cm.viridis(np.linspace(0.15, 0.85, len(buckets)))
    t = t_f + t_b
    for i, ((_, start, end), b) in enumerate(zip(sched, buckets)):
        ax.barh(rows["overlap"] - 0.18, (end - start) * ms, left=start * ms, height=0.3, color=colors[i],
                edgecolor="white", lw=0.5)
        d = costmodel.allreduce_time(b, N_RANKS, alpha, beta)
        ax.barh(rows["after"] - 0.18, d * ms, left=t * ms, height=0.3, color=colors[i], edgecolor="white",
                lw=0.5)
        t += d
    overlap = costmodel.ddp_step_time(t_f, t_b, buckets, N_RANKS, alpha, beta)
    serial = costmodel.ddp_step_time(t_f, t_b, buckets, N_RANKS, alpha, beta, overlap=False)
    for y, total in ((rows["overlap"], overlap), (rows["after"], serial)):
        ax.text(total * ms + 1, y, f"{total * ms:.0f} ms", va="center", fontsize=8)
    ax.set_yticks(list(rows.values()),
                  ["buckets during\nbackward (DDP)", "one after another,\nafter backward"])
    ax.set_xlabel("time in the step (ms)")
    ax.set_xlim(0, serial * ms * 1.12)
    ax.barh(0, 0, color="#4C72B0", label="forward"), ax.barh(0, 0, color="#DD8452", label="backward")
    ax.barh(0, 0, color=colors[len(colors) // 2], label=f"all-reduce of one bucket ({len(buckets)} buckets)")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    ax.set_title(f"GPT-2 small ({n_params / 1e6:.0f}M, fp32 gradients) on {N_RANKS} H100s over {LINK}; "
                 f"{TOKENS_PER_RANK} tokens per rank at {MFU:.0%} MFU; buckets 1 MiB, then 25 MiB",
                 fontsize=8)
    return fig


@figure("ch01_bucket_cap")
def bucket_cap():
    """Modelled step time against the bucket cap on two networks: overlapped with backward, and after it."""
    sizes, n_params, t_f, t_b = _setup()
    caps = np.geomspace(MiB / 4, 1024 * MiB, 60)
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    ms = 1e3
    for link, style in ((LINK, "-"), ("Ethernet 100 Gb/s", "--")):
        alpha, beta = costmodel.LINKS[link]
        plans = [costmodel.bucket_sizes(sizes, int(c)) for c in caps]
        over = [costmodel.ddp_step_time(t_f, t_b, b, N_RANKS, alpha, beta) * ms for b in plans]
        after = [costmodel.ddp_step_time(t_f, t_b, b, N_RANKS, alpha, beta, overlap=False) * ms
                 for b in plans]
        short = link.split(" ")[0]
        ax.plot(caps / MiB, over, style, c="C0", label=f"overlapped, {short}")
        ax.plot(caps / MiB, after, style, c="C3", label=f"after backward, {short}")
    ax.axhline((t_f + t_b) * ms, c="gray", lw=0.8)
    ax.text(caps[0] / MiB, (t_f + t_b) * ms, " forward + backward alone", va="bottom", fontsize=7,
            color="gray")
    ax.axvline(25, c="k", lw=0.6, ls=":")
    ax.set_ylim(0, None)
    ax.text(25, ax.get_ylim()[1], " 25 MiB (torch's default)", va="top", fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("bucket cap (MiB)"), ax.set_ylabel("modelled step time (ms)")
    ax.set_title(f"GPT-2 small on {N_RANKS} H100s: one step against the bucket cap "
                 f"({len(sizes)} gradient tensors)", fontsize=9)
    ax.legend(fontsize=7, loc="center right")
    return fig


@figure("ch01_who_holds_what")
def who_holds_what():
    """DDP on 4 ranks in chapter 00's notation: every rank the whole model and optimizer, its own quarter
    of the batch, a gradient that is a partial sum until the all-reduce."""
    from .base import holdings

    n = 4
    fig, ax = plt.subplots(figsize=(8.5, 3.0))
    holdings(ax, [f"rank {r}" for r in range(n)], [
        ("weights W[D, F]", [("whole", 1.0)] * n),
        ("optimizer state", [("whole", 1.0)] * n),
        ("batch X[B_dp, S, D]", [(f"part {r} of B", 1 / n) for r in range(n)]),
        ("gradient after backward", [("partial, {U_dp}", 1.0)] * n),
        ("gradient after all-reduce", [("G[D, F]: equal", 1.0)] * n),
    ], ["all-reduce over dp, bucket by bucket during backward: G{U_dp} → G[D, F] on every rank",
        "then every rank takes the same optimizer step on the same weights"])
    ax.set_title("Data parallelism: who holds what, and what moves (bar: share of the whole)", fontsize=10)
    return fig
