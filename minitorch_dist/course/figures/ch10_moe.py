"""Chapter 10 — figures: one batch routed under a capacity, drops and padding against the capacity factor,
the expert-parallel all-to-all's send matrix and bytes."""
from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import torch

from ... import costmodel
from ...sparsity.routers import expert_choice_routing, top_k_routing
from .base import figure

KEPT, DROPPED, EMPTY = "#4C72B0", "#C44E52", "#dddddd"


def _skewed_logits(T: int, E: int, seed: int = 0) -> torch.Tensor:
    """Router scores with a preference: expert i's logits shifted by a fixed amount (0.6 down to -0.6),
    so the first experts are asked for more than their share, as by a router that has begun to collapse."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, E, generator=g) + torch.linspace(0.6, -0.6, E)


@figure("ch10_routing_capacity")
def routing_capacity():
    """One batch, two routers: Switch (token choice, capacity C, overflow dropped) and expert choice."""
    T, E, cf = 64, 8, 1.0
    logits = _skewed_logits(T, E)
    C = costmodel.moe_capacity(T, E, 1, cf)
    asked = torch.bincount(logits.argmax(-1), minlength=E).numpy()
    switch = top_k_routing(logits, 1, C, normalize=False)
    kept = switch.counts.numpy()
    Cec = costmodel.expert_choice_capacity(T, E, cf)
    ec = expert_choice_routing(logits, Cec)
    per_token = torch.bincount(ec.tokens, minlength=T)
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(9.5, 2.9), gridspec_kw={"width_ratios": [1.2, 1.2, 1]})
    x = np.arange(E)
    a1.bar(x, kept, color=KEPT, label="kept")
    a1.bar(x, asked - kept, bottom=kept, color=DROPPED, label="dropped")
    a1.bar(x, np.maximum(C - asked, 0), bottom=asked, color=EMPTY, label="empty slot")
    a1.axhline(C, c="k", lw=0.8, ls="--")
    a1.text(E - 0.5, C + 0.4, f"C = {C}", ha="right", va="bottom", fontsize=8)
    a1.set(xticks=x, xlabel="expert", ylabel="assignments", ylim=(0, max(asked) * 1.25))
    a1.set_title(f"Switch top-1: {switch.dropped} of {T} dropped", fontsize=9)
    a1.legend(fontsize=7, loc="upper right", frameon=False)
    a2.bar(x, ec.counts.numpy(), color=KEPT)
    a2.axhline(Cec, c="k", lw=0.8, ls="--")
    a2.set(xticks=x, xlabel="expert", ylim=(0, max(asked) * 1.25))
    a2.set_title(f"expert choice: every expert takes {Cec}", fontsize=9)
    picks = np.bincount(np.minimum(per_token.numpy(), 3), minlength=4)
    a3.bar(np.arange(4), picks, color=[DROPPED, KEPT, KEPT, KEPT])
    a3.set(xticks=np.arange(4), xticklabels=["0", "1", "2", "3+"], xlabel="experts that picked the token",
           ylabel="tokens")
    a3.set_title(f"expert choice: {picks[0]} tokens get none", fontsize=9)
    fig.suptitle(f"{T} tokens, {E} experts, capacity factor {cf}: the same router scores, two rules",
                 fontsize=10, y=1.03)
    fig.tight_layout()
    return fig


@figure("ch10_drops_vs_cf")
def drops_vs_cf():
    """Expected drops and empty slots against the capacity factor, for a router spreading tokens at random."""
    cfs = np.round(np.arange(0.5, 2.01, 0.05), 2)
    cases = [(4096, 8), (4096, 128), (4096, 1024)]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.5, 3.0))
    for (T, E), color in zip(cases, ("C0", "C1", "C2")):
        drops, empty = [], []
        for cf in cfs:
            C = costmodel.moe_capacity(T, E, 1, float(cf))
            d = costmodel.expected_dropped_tokens(T, E, 1, float(cf))
            drops.append(100 * d / T)
            empty.append(100 * (E * C - (T - d)) / (E * C))  # slots computed on padding
        label = f"E = {E}: {T // E} tokens per expert"
        a1.plot(cfs, drops, c=color, label=label)
        a2.plot(cfs, empty, c=color, label=label)
    a1.set(xlabel="capacity factor", ylabel="tokens dropped (% of T)", ylim=(0, None))
    a1.set_title("expected drops (costmodel.expected_dropped_tokens)", fontsize=9)
    a2.set(xlabel="capacity factor", ylabel="empty slots (% of E·C)", ylim=(0, None))
    a2.set_title("slots computed on padding", fontsize=9)
    a1.legend(fontsize=7, frameon=False)
    fig.suptitle(f"Capacity trades drops for padding ({cases[0][0]} tokens, uniform random top-1 routing)",
                 fontsize=10, y=1.02)
    fig.tight_layout()
    return fig


@figure("ch10_ep_all_to_all")
def ep_all_to_all():
    """The dispatch all-to-all on 4 ranks: who sends how many rows to whom, and each rank's bytes."""
    n, E, T, h = 4, 8, 256, 1024
    counts = []
    for r in range(n):  # each rank routes its own tokens (Switch, cf 1.25): its own batch of scores
        logits = _skewed_logits(T, E, seed=r + 1)
        counts.append(top_k_routing(logits, 1, costmodel.moe_capacity(T, E, 1, 1.25)).counts.tolist())
    S = np.array(costmodel.expert_parallel_send_matrix(counts, n))
    got = costmodel.all_to_all_bytes_moe(S.tolist(), h, bytes_per_element=2, include_self=True)
    uniform = costmodel.all_to_all_bytes_moe(T, h, n, bytes_per_element=2, include_self=True)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(8.5, 3.1), gridspec_kw={"width_ratios": [1, 1.3]})
    a1.imshow(S, cmap="Blues", vmin=0, vmax=S.max() * 1.3)
    for (i, j), v in np.ndenumerate(S):
        a1.text(j, i, str(v), ha="center", va="center", fontsize=8,
                color="white" if v > 0.6 * S.max() else "black")
    a1.set(xticks=range(n), yticks=range(n), xlabel="to rank (owner of experts 2j, 2j+1)", ylabel="from rank")
    a1.set_title("rows sent in the dispatch", fontsize=9)
    for side in ("top", "right"):
        a1.spines[side].set_visible(True)
    x = np.arange(n)
    a2.bar(x, np.array(got) / 1e6, color=KEPT, label="this routing (send matrix)")
    a2.axhline(uniform / 1e6, c="k", ls="--", lw=0.8, label="every token kept, even split")
    a2.set(xticks=x, xlabel="rank", ylabel="MB per forward", ylim=(0, uniform / 1e6 * 1.35))
    a2.set_title("dispatch + combine bytes per rank (bf16, h = 1024)", fontsize=9)
    a2.legend(fontsize=7, frameon=False, loc="upper right")
    fig.suptitle(f"Expert parallelism on {n} ranks, {E} experts, {T} tokens per rank (Switch, cf 1.25)",
                 fontsize=10, y=1.03)
    fig.tight_layout()
    return fig
