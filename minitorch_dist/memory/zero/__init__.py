"""ZeRO and fully sharded data parallelism (chapter 06): shard the optimizer state, the gradients
and the parameters of data parallelism over its n ranks (Rajbhandari et al. 2020; Zhao et al. 2023).

:mod:`.flat` — the flat, padded parameter buffer every stage shards. :mod:`.zero12` — stages 0
(plain data parallelism on the flat buffer), 1 (optimizer state sharded) and 2 (and gradients,
reduce-scattered bucket by bucket during backward). :mod:`.fsdp` — stage 3 / FSDP: parameters
sharded per transformer block, gathered just in time, prefetched, and hybrid sharding on a 2-D
grid. :mod:`.offload` — the optimizer step and state on the host or in memory-mapped files
(ZeRO-Offload, ZeRO-Infinity's NVMe tier).
"""
from __future__ import annotations

import torch

from .flat import FlatParams, shard_range, shard_size
from .fsdp import FullyShardedGPT, fully_shard, hybrid_groups
from .offload import OffloadedOptimizer
from .zero12 import ZeroDataParallel

__all__ = ["FlatParams", "shard_range", "shard_size", "FullyShardedGPT", "fully_shard", "hybrid_groups",
           "OffloadedOptimizer", "ZeroDataParallel", "headline"]


# --- the tour's rows ---------------------------------------------------------------------------


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _headline_rank(cfg, steps, batch, seq):
    import torch.distributed as dist

    from ...analysis.meters import MemoryMeter
    from ...models.gpt import GPT
    from ...models.train import train_steps
    from ...runtime import comm

    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sharded = fully_shard(GPT(cfg))
    opt = _adamw(sharded.parameters())
    run = train_steps(sharded, steps, batch, seq, optimizer=lambda _: opt, rank=r, world_size=n)
    wire3 = sum(m.total_wire_bytes for m in run.meters)  # stage 3 communicates in forward and backward
    states = MemoryMeter(sharded, opt).current()
    torch.manual_seed(0)
    zero1 = ZeroDataParallel(GPT(cfg), _adamw, stage=1)
    train_steps(zero1, 1, batch, seq, optimizer=lambda _: zero1, rank=r, world_size=n)  # the wrapper steps itself
    with comm.meter() as m:  # stage 1 communicates in the step: reduce-scatter, then all-gather
        zero1.step()
    return {"weights": sharded.full_state_dict(), "wire3": wire3, "wire1": m.total_wire_bytes,
            "states": states["parameters"] + states["gradients"] + states["optimizer_state"]}


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 06's rows for the tour: ZeRO-3 == one process, 1.5x the bytes of stage 1, 16Psi/n."""
    from ...analysis import costmodel
    from ...models.gpt import GPT, GPTConfig
    from ...models.train import train_steps
    from ...runtime.env import single_thread
    from ...runtime.launch import launch

    n, batch, seq = 4, 8, 32
    steps = 3 if smoke else 5
    cfg = GPTConfig.tiny(block_size=seq)
    with single_thread():  # the reference: one process on the global batch, one thread like a rank
        torch.manual_seed(0)
        dense = GPT(cfg)
        train_steps(dense, steps, batch, seq, optimizer=_adamw)
    per_rank = launch(_headline_rank, n, cfg, steps, batch, seq, timeout_s=300)
    ref = dict(dense.named_parameters())
    diff = max((w - ref[k].detach()).abs().max().item() for p in per_rank for k, w in p["weights"].items())
    ratio = max(p["wire3"] for p in per_rank) / max(p["wire1"] for p in per_rank)
    psi = costmodel.transformer_params(cfg)
    want = costmodel.zero_memory_bytes(psi, n, 3, k=8, param_bytes=4, grad_bytes=4)
    states = max(p["states"] for p in per_rank)
    return [
        {"chapter": "ch06", "experiment": f"ZeRO-3 on n={n} ranks == 1 process after {steps} AdamW steps, max |Δw|",
         "theory": 1e-5, "measured": diff, "ok": diff < 1e-5},
        {"chapter": "ch06", "experiment": "bytes per step, stage 3 / stage 1 (3Ψ vs 2Ψ; padding aside)",
         "theory": 1.5, "measured": ratio, "ok": abs(ratio - 1.5) < 0.01},
        {"chapter": "ch06", "experiment": f"model states per rank, ZeRO-3 fp32 AdamW = 16Ψ/n (n={n}; padding, step counters)",
         "theory": want, "measured": states, "ok": abs(states - want) <= 0.01 * want},
    ]
