"""Chapter 05 — the tour's rows: TP+SP GPT == dense, SP's bytes == TP's, ring attention == full attention."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ... import costmodel
from ...analysis.predict import tour_row
from ...models.gpt import GPT, GPTConfig
from ...models.train import train_steps
from ...parallelism.sequence_parallel import (
    allreduce_sequence_parallel_grads,
    parallelize_gpt_sp,
    sequence_parallel_block,
)
from ...parallelism.sequence_parallel.ring_attention import ring_attention, shard_sequence, unshard_sequence
from ...parallelism.tensor_parallel import shard_dense_tensors
from ...runtime import comm
from ...runtime.env import single_thread
from ...runtime.launch import launch


def _headline_rank(cfg, steps, batch, seq, ref_grads, qkv, grad_out):
    t, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = parallelize_gpt_sp(GPT(cfg))
    train_steps(model, steps, batch, seq, after_backward=lambda: allreduce_sequence_parallel_grads(model))
    want = shard_dense_tensors(ref_grads, cfg)
    gpt_diff = max((q.grad - want[k]).abs().max().item() for k, q in model.named_parameters())
    # one layer without the backward re-gather: the collectives and bytes of Korthikanti §4.2.2
    block = sequence_parallel_block(GPT(cfg).blocks[0], regather=False)
    x = torch.randn(batch, seq // t, cfg.n_embd, requires_grad=True)
    with comm.meter() as m:
        block(x).sum().backward()
    ops = sorted(e.op for e in m.events)
    # ring attention, causal, zigzag, float64, against full attention
    q, k, v = (shard_sequence(u, t, r, -2, "zigzag").requires_grad_(True) for u in qkv)
    out = ring_attention(q, k, v, causal=True, layout="zigzag")
    out.backward(shard_sequence(grad_out, t, r, -2, "zigzag"))
    return {"gpt": gpt_diff, "ops": ops, "wire": m.total_wire_bytes,
            "ring": [u.detach() for u in (out, q.grad, k.grad, v.grad)]}


def _dense_references(cfg, steps, batch, seq, qkv, grad_out):
    """The dense GPT after ``steps`` SGD steps, and full attention's output and input gradients."""
    with single_thread():  # the dense references, one thread like a rank
        torch.manual_seed(0)
        dense = GPT(cfg)
        train_steps(dense, steps, batch, seq)
        full = [u.clone().requires_grad_(True) for u in qkv]
        ref_out = F.scaled_dot_product_attention(*full, is_causal=True)
        ref_out.backward(grad_out)
    return dense, [ref_out.detach()] + [u.grad for u in full]


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 05's rows for the tour: TP+SP GPT == dense, SP's bytes == TP's, ring attention == full."""
    t, batch, seq = 4, 8, 32
    steps = 2 if smoke else 4
    cfg = GPTConfig.tiny(block_size=seq)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, 4, seq, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    grad_out = torch.randn(2, 4, seq, 16, generator=g, dtype=torch.float64)
    dense, ref = _dense_references(cfg, steps, batch, seq, qkv, grad_out)
    ref_grads = {k: q.grad for k, q in dense.named_parameters()}
    per_rank = launch(_headline_rank, t, cfg, steps, batch, seq, ref_grads, qkv, grad_out)
    gpt_diff = max(p["gpt"] for p in per_rank)
    want_ops = sorted(["all_gather"] * 4 + ["reduce_scatter"] * 4)
    want_bytes = costmodel.tensor_parallel_bytes_per_layer(batch, seq, cfg.n_embd, t, bytes_per_element=4)
    wire = max(p["wire"] for p in per_rank)
    ring = [unshard_sequence([p["ring"][i] for p in per_rank], -2, "zigzag") for i in range(4)]
    ring_diff = max((ring[i] - ref[i]).abs().max().item() for i in range(4))
    return [
        {"chapter": "ch05",
         "experiment": f"TP+SP GPT on t={t} ranks == dense after {steps} SGD steps, max |Δgrad|",
         "theory": 1e-5, "measured": gpt_diff, "ok": gpt_diff < 1e-5},
        {"chapter": "ch05",
         "experiment": "SP layer: 4 all-gathers + 4 reduce-scatters, wire bytes = TP's all-reduces",
         "theory": want_bytes, "measured": wire,
         "ok": all(p["ops"] == want_ops for p in per_rank) and abs(wire - want_bytes) <= 1e-9 * want_bytes},
        {"chapter": "ch05",
         "experiment": f"ring attention (causal, zigzag, t={t}, fp64) == full attention, max |Δ| out+grads",
         "theory": 1e-10, "measured": ring_diff, "ok": ring_diff < 1e-10},
        tour_row("ch05", "sp", smoke),
    ]
