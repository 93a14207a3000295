"""Chapter 05 — sequence and context parallelism: split the *sequence* dimension over ranks.

:mod:`.megatron_sp` — Megatron sequence parallelism (Korthikanti et al. 2022): the LayerNorm
and dropout regions that tensor parallelism leaves replicated are sharded along the sequence.
:mod:`.ulysses` — DeepSpeed-Ulysses (Jacobs et al. 2023): all-to-all from sequence-sharded to
head-sharded around attention. :mod:`.ring_attention` — ring attention (Liu et al. 2023):
blockwise attention with K/V blocks passed around a ring and an online-softmax merge
(the function is ``ring_attention.ring_attention``; the module keeps the name). Both take the Llama's
grouped-query attention (fewer k/v heads): Ulysses up to t = n_kv_head, ring attention at any t. The
Llama's Megatron SP is ``tensor_parallel_llama.parallelize_llama(..., sequence_parallel=True)``.
"""
from __future__ import annotations

from . import megatron_sp, ring_attention, ulysses
from .megatron_sp import (
    SequenceParallelAttention,
    SequenceParallelBlock,
    SequenceParallelColumnLinear,
    SequenceParallelGPT,
    SequenceParallelMLP,
    SequenceParallelRowLinear,
    allreduce_sequence_parallel_grads,
    gather_from_sequence,
    parallelize_gpt_sp,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
    sequence_parallel_block,
)
from .ring_attention import (
    LAYOUTS,
    attention_block,
    merge_attention,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
    zigzag_shard,
    zigzag_unshard,
)
from .ulysses import (
    UlyssesAttention,
    UlyssesGQAAttention,
    check_ulysses_degree,
    heads_to_seq,
    seq_to_heads,
    ulysses_attention,
)

__all__ = [
    "megatron_sp", "ring_attention", "ulysses",
    "SequenceParallelAttention", "SequenceParallelBlock", "SequenceParallelColumnLinear",
    "SequenceParallelGPT", "SequenceParallelMLP", "SequenceParallelRowLinear",
    "allreduce_sequence_parallel_grads", "gather_from_sequence", "parallelize_gpt_sp",
    "reduce_scatter_to_sequence", "scatter_to_sequence", "sequence_parallel_block", "LAYOUTS",
    "attention_block", "merge_attention", "sequence_positions", "shard_sequence",
    "unshard_sequence", "zigzag_shard", "zigzag_unshard", "UlyssesAttention", "UlyssesGQAAttention",
    "check_ulysses_degree", "heads_to_seq", "seq_to_heads", "ulysses_attention",
]
