"""Chapter 06 — the tour's rows: ZeRO-3 == one process, 1.5x the bytes of stage 1, 16Ψ/n of model states,
and a ZeRO-3 step predicted from this machine's profile next to the clock."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import costmodel
from ...analysis.meters import MemoryMeter
from ...analysis.predict import tour_row
from ...memory.zero import ZeroDataParallel, fully_shard
from ...models.gpt import GPT, GPTConfig
from ...models.train import train_steps
from ...runtime import comm
from ...runtime.env import single_thread
from ...runtime.launch import launch


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def _headline_rank(cfg, steps, batch, seq):
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    sharded = GPT(cfg)
    for block in sharded.blocks:  # a unit per block, then the root's unit: wte, wpe, ln_f (lm_head tied)
        fully_shard(block)
    fully_shard(sharded)
    opt = _adamw(sharded.parameters())
    run = train_steps(sharded, steps, batch, seq, optimizer=lambda _: opt, rank=r, world_size=n)
    wire3 = sum(m.total_wire_bytes for m in run.meters)  # stage 3 communicates in forward and backward
    states = MemoryMeter(sharded, opt).current()
    torch.manual_seed(0)
    zero1 = ZeroDataParallel(GPT(cfg), _adamw, stage=1)
    # the wrapper steps itself
    train_steps(zero1, 1, batch, seq, optimizer=lambda _: zero1, rank=r, world_size=n)
    with comm.meter() as m:  # stage 1 communicates in the step: reduce-scatter, then all-gather
        zero1.step()
    return {"weights": sharded.full_state_dict(), "wire3": wire3, "wire1": m.total_wire_bytes,
            "states": states["parameters"] + states["gradients"] + states["optimizer_state"]}


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 06's rows for the tour: ZeRO-3 == one process, 1.5x the bytes of stage 1, 16Psi/n,
    and the predicted ZeRO-3 step against the measured one."""
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
        {"chapter": "ch06",
         "experiment": f"ZeRO-3 on n={n} ranks == 1 process after {steps} AdamW steps, max |Δw|",
         "theory": 1e-5, "measured": diff, "ok": diff < 1e-5},
        {"chapter": "ch06", "experiment": "bytes per step, stage 3 / stage 1 (3Ψ vs 2Ψ; padding aside)",
         "theory": 1.5, "measured": ratio, "ok": abs(ratio - 1.5) < 0.01},
        {"chapter": "ch06",
         "experiment": f"model states per rank, ZeRO-3 fp32 AdamW = 16Ψ/n (n={n}; padding, step counters)",
         "theory": want, "measured": states, "ok": abs(states - want) <= 0.01 * want},
        tour_row("ch06", "zero3", smoke, size="10x"),
    ]
