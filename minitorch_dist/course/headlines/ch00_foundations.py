"""Chapter 00 — the tour's rows: ring all-reduce == torch, bytes == 2(n-1)/n*S, an alpha-beta fit."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ... import costmodel
from ...runtime.collectives import metered, ring_all_reduce, time_collective
from ...runtime.launch import launch


def _rank_headline(numel: int, sizes: list[int], reps: int):
    """One rank's part of :func:`headline`: check the ring against torch, count bytes, time sizes."""
    r, n = dist.get_rank(), dist.get_world_size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(r))
    expected = x.clone()
    dist.all_reduce(expected)
    ours, sent, _ = metered(ring_all_reduce, x.clone())
    abs_sum = x.abs()
    dist.all_reduce(abs_sum)
    # twice the two-orders bound of the collectives module's docstring
    tol = 2 * (n - 1) * torch.finfo(x.dtype).eps * abs_sum
    diff = (ours - expected).abs()
    times = time_collective(dist.all_reduce, [4 * k for k in sizes], reps)
    return dict(ok=bool((diff <= tol).all()), diff=diff.max().item(), tol=tol.max().item(),
                sent=sent, times=times)


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 00's rows for the course tour: ring == torch, bytes == 2(n-1)/n*S, an alpha-beta fit."""
    n = 4
    numel = (1 << 14) if smoke else (1 << 18)  # 64 KiB or 1 MiB of float32
    # Up to 4 / 16 MiB: with several ranks per core, scheduling latency (~1 ms a step) hides beta
    # until messages reach megabytes.
    sizes = [1 << k for k in ((6, 12, 18, 20) if smoke else (6, 9, 12, 15, 18, 20, 22))]  # elements
    reps = 10 if smoke else 20
    per_rank = launch(_rank_headline, n, numel, sizes, reps)
    S = 4 * numel
    want = costmodel.bus_bytes("all_reduce", S, n)
    sent = [p["sent"] for p in per_rank]
    times = [max(p["times"][i] for p in per_rank) for i in range(len(sizes))]  # the slowest rank
    sizes_b = [4 * k for k in sizes]
    alpha, beta = costmodel.fit_alpha_beta(sizes_b, times, n)
    predicted = costmodel.allreduce_time(sizes_b[-1], n, alpha, beta)
    bw = f"{1 / beta / 1e9:.2f}GB/s" if beta > 0 else "inf"
    return [
        {"chapter": "ch00", "experiment": f"ring all-reduce == torch (n={n}), max |diff|",
         "theory": max(p["tol"] for p in per_rank), "measured": max(p["diff"] for p in per_rank),
         "ok": all(p["ok"] for p in per_rank)},
        {"chapter": "ch00", "experiment": f"bytes sent per rank, ring, S={S // 1024} KiB",
         "theory": want, "measured": float(max(sent)), "ok": all(s == want for s in sent)},
        {"chapter": "ch00",
         "experiment": f"α-β fit: α={alpha * 1e6:.1f}µs 1/β={bw}; t({sizes_b[-1] >> 20} MiB) ms",
         "theory": predicted * 1e3, "measured": times[-1] * 1e3, "timing": True,
         "ok": beta > 0 and abs(math.log(predicted / times[-1])) < math.log(2),
         "note": f"ratio {predicted / times[-1]:.2f}, within 2x: the fit and the time from one run"},
    ]
