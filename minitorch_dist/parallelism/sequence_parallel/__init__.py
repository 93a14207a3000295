"""Sequence and context parallelism (chapter 05): split the *sequence* dimension over ranks.

:mod:`.megatron_sp` — Megatron sequence parallelism (Korthikanti et al. 2022): the LayerNorm
and dropout regions that tensor parallelism leaves replicated are sharded along the sequence.
:mod:`.ulysses` — DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence-sharded to
head-sharded around attention. :mod:`.ring_attention` — ring attention (Liu et al. 2023):
blockwise attention with K/V blocks passed around a ring and an online-softmax merge
(the function is ``ring_attention.ring_attention``; the module keeps the name).
"""
from __future__ import annotations

import torch

from . import megatron_sp, ring_attention, ulysses
from .megatron_sp import (
    SequenceParallelAttention, SequenceParallelBlock, SequenceParallelColumnLinear, SequenceParallelGPT,
    SequenceParallelMLP, SequenceParallelRowLinear, allreduce_sequence_parallel_grads, gather_from_sequence,
    parallelize_gpt_sp, reduce_scatter_to_sequence, scatter_to_sequence, sequence_parallel_block,
)
from .ring_attention import (
    LAYOUTS, attention_block, count_block_work, merge_attention, sequence_positions, shard_sequence, unshard_sequence, zigzag_shard, zigzag_unshard,
)
from .ulysses import UlyssesAttention, heads_to_seq, seq_to_heads, ulysses_attention

__all__ = [
    "SequenceParallelAttention", "SequenceParallelBlock", "SequenceParallelColumnLinear", "SequenceParallelGPT",
    "SequenceParallelMLP", "SequenceParallelRowLinear", "allreduce_sequence_parallel_grads", "gather_from_sequence",
    "parallelize_gpt_sp", "reduce_scatter_to_sequence", "scatter_to_sequence", "sequence_parallel_block",
    "LAYOUTS", "attention_block", "count_block_work", "merge_attention", "sequence_positions",
    "shard_sequence", "unshard_sequence", "zigzag_shard", "zigzag_unshard",
    "UlyssesAttention", "heads_to_seq", "seq_to_heads", "ulysses_attention", "headline",
]


# --- the tour's rows ---------------------------------------------------------------------------


def _headline_rank(cfg, steps, batch, seq, ref_grads, qkv, grad_out):
    import torch.distributed as dist

    from ...models.gpt import GPT
    from ...models.train import train_steps
    from ...runtime import comm
    from ..tensor_parallel import shard_dense_tensors

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
    out = ring_attention.ring_attention(q, k, v, causal=True, layout="zigzag")
    out.backward(shard_sequence(grad_out, t, r, -2, "zigzag"))
    return {"gpt": gpt_diff, "ops": ops, "wire": m.total_wire_bytes,
            "ring": [u.detach() for u in (out, q.grad, k.grad, v.grad)]}


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 05's rows for the tour: TP+SP GPT == dense, SP's bytes == TP's, ring attention == full."""
    import torch.nn.functional as F

    from ...analysis import costmodel
    from ...models.gpt import GPT, GPTConfig
    from ...models.train import train_steps
    from ...runtime.env import single_thread
    from ...runtime.launch import launch

    t, batch, seq = 4, 8, 32
    steps = 2 if smoke else 4
    cfg = GPTConfig.tiny(block_size=seq)
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(2, 4, seq, 16, generator=g, dtype=torch.float64) for _ in range(3)]
    grad_out = torch.randn(2, 4, seq, 16, generator=g, dtype=torch.float64)
    with single_thread():  # the dense references, one thread like a rank
        torch.manual_seed(0)
        dense = GPT(cfg)
        train_steps(dense, steps, batch, seq)
        full = [u.clone().requires_grad_(True) for u in qkv]
        ref_out = F.scaled_dot_product_attention(*full, is_causal=True)
        ref_out.backward(grad_out)
        ref = [ref_out.detach()] + [u.grad for u in full]
    per_rank = launch(_headline_rank, t, cfg, steps, batch, seq, {k: q.grad for k, q in dense.named_parameters()},
                      qkv, grad_out)
    gpt_diff = max(p["gpt"] for p in per_rank)
    want_ops = sorted(["all_gather"] * 4 + ["reduce_scatter"] * 4)
    want_bytes = costmodel.tensor_parallel_bytes_per_layer(batch, seq, cfg.n_embd, t, bytes_per_element=4)
    wire = max(p["wire"] for p in per_rank)
    ring_diff = max((unshard_sequence([p["ring"][i] for p in per_rank], -2, "zigzag") - ref[i]).abs().max().item()
                    for i in range(4))
    return [
        {"chapter": "ch05", "experiment": f"TP+SP GPT on t={t} ranks == dense after {steps} SGD steps, max |Δgrad|",
         "theory": 1e-5, "measured": gpt_diff, "ok": gpt_diff < 1e-5},
        {"chapter": "ch05", "experiment": "SP layer: 4 all-gathers + 4 reduce-scatters, wire bytes = TP's all-reduces",
         "theory": want_bytes, "measured": wire,
         "ok": all(p["ops"] == want_ops for p in per_rank) and abs(wire - want_bytes) <= 1e-9 * want_bytes},
        {"chapter": "ch05", "experiment": f"ring attention (causal, zigzag, t={t}, fp64) == full attention, max |Δ| out+grads",
         "theory": 1e-10, "measured": ring_diff, "ok": ring_diff < 1e-10},
    ]
