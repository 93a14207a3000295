"""Chapter 05 — sequence / context parallelism: the communication of Megatron-SP, DeepSpeed-Ulysses and
ring attention.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2
(sequence parallelism: all-gather + reduce-scatter in place of each all-reduce). Jacobs et al.
2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence
Transformer Models", §3.2 (communication analysis). Liu et al. 2023, "Ring Attention with
Blockwise Transformers for Near-Infinite Context", §3 (K/V blocks passed around a ring).

Every function counts the bytes **one rank puts on the wire per transformer layer** under the
ring model of :func:`bus_bytes` (all-gather, reduce-scatter, all-to-all: (t-1)/t of the full
buffer; a send: its message), b = batch, s = the full sequence, h = hidden = n_head·head_dim,
t = the parallel degree, e = bytes per element. At fixed s, as t grows:

    Megatron-SP   8 b s h e (t-1)/t        ~ O(s h), flat in t     (same as tensor parallelism)
    Ulysses       8 b s h e (t-1)/t^2      ~ O(s h / t)            (four all-to-alls each way)
    ring          (6t-4) b (s/t) h e       ~ O(s h), flat in t     (K, V forward; K, V, dK, dV backward)

Ulysses is the only one whose per-rank volume falls with t; it is capped at t <= n_head.
Ring attention's traffic overlaps with the blockwise compute (Liu et al. §3), which is its point.
"""
from __future__ import annotations

from .collectives import bus_bytes


def _check(batch, seq, hidden, t):
    if t < 1 or min(batch, seq, hidden) < 1:
        raise ValueError(f"need t >= 1 and positive batch, seq, hidden; got t={t}, "
                         f"b={batch}, s={seq}, h={hidden}")


def _check_seq(seq, t):
    if seq % t:
        raise ValueError(f"sequence length {seq} is not divisible by the sequence-parallel degree {t}: "
                         f"each rank holds s/t tokens; pad the sequence to a multiple of {t}")


# --- Megatron sequence parallelism ---------------------------------------------------------------


def sequence_parallel_collectives_per_layer(regather=False, recompute=False) -> dict:
    """Collectives of b·s·h activations per transformer layer with tensor + sequence parallelism
    (Korthikanti et al. 2022, §4.2.2, Fig. 5): each of tensor parallelism's f / g becomes a g / ḡ
    pair: an all-gather (sequence shards -> full sequence) before each column-parallel layer and a
    reduce-scatter (partial sums -> summed sequence shards) after each row-parallel one; backward
    swaps them. "Tensor parallelism requires four all-reduces in a single forward and backward
    pass whereas tensor together with sequence parallelism requires four all-gathers and four
    reduce-scatters." ``regather``: the column-parallel layers keep only their input's sequence
    shard and all-gather it again for the weight gradient (Megatron's choice, ch05's default): +2
    all-gathers backward. ``recompute`` (full recomputation): the forward's 2 + 2 run again in backward."""
    backward = {"all_gather": 2 + (2 if regather else 0), "reduce_scatter": 2}
    if recompute:
        backward = {op: n + 2 for op, n in backward.items()}
    return {"forward": {"all_gather": 2, "reduce_scatter": 2}, "backward": backward}


def sequence_parallel_bytes_per_layer(batch, seq, hidden, t, bytes_per_element=2, regather=False,
                                      recompute=False) -> float:
    """Bytes one rank sends per layer per step with Megatron sequence parallelism, forward and
    backward: four all-gathers and four reduce-scatters of b·s·h elements, each (t-1)/t of its
    buffer under the ring model, i.e. ``8 b s h e (t-1)/t`` — exactly
    :func:`tensor_parallel_bytes_per_layer`, because a ring all-reduce *is* a reduce-scatter
    followed by an all-gather (Korthikanti et al. 2022, §4.2.2: "the communication bandwidth
    used for tensor parallelism and tensor together with sequence parallelism are the same").
    ``regather`` / ``recompute`` add the collectives of :func:`sequence_parallel_collectives_per_layer`.
    Computed from :func:`bus_bytes` of the two collectives, not from the all-reduce's factor."""
    _check(batch, seq, hidden, t)
    nbytes = batch * seq * hidden * bytes_per_element
    counts = sequence_parallel_collectives_per_layer(regather, recompute)
    return sum(n * bus_bytes(op, nbytes, t) for phase in counts.values() for op, n in phase.items())


# --- DeepSpeed-Ulysses ----------------------------------------------------------------------------


def ulysses_all_to_alls_per_layer() -> dict:
    """All-to-alls per attention layer (Jacobs et al. 2023, §3, Fig. 2): q, k, v from sequence to
    head shards and the output back (4; DeepSpeed fuses q, k, v into one call of 3x the size: the
    same bytes), and the inverse of each in the backward (4)."""
    return {"forward": 4, "backward": 4}


def ulysses_bytes_per_layer(batch, seq, hidden, t, bytes_per_element=2) -> float:
    """Bytes one rank sends per layer per step with DeepSpeed-Ulysses, forward and backward.

    Each all-to-all's input is the rank's (b, n_head, s/t, d) shard, b·(s/t)·h elements, of
    which it keeps 1/t and sends (t-1)/t; eight of them (q, k, v, out forward, their gradients
    backward)::

        8 · b (s/t) h e · (t-1)/t  =  8 b s h e (t-1)/t^2

    Jacobs et al. §3.2 state it per link and forward only: an all-to-all of aggregate message M
    over P GPUs costs M/P per link; q, k, v make M = 3Nh and the output Nh, so "4Nh/P" (N
    tokens, batch 1, the (P-1)/P factor rounded to 1). Our forward half, 4 b s h e (t-1)/t^2,
    is that with the factor kept; the backward doubles it. Versus Megatron-SP's 4Nh per link
    "regardless of P" (forward): a factor t less (§3.2).

    At fixed s it falls as 1/t; at fixed s/t (weak scaling: each rank keeps its tokens as t
    grows) it is ``8 b (s/t) h e (t-1)/t``: bounded by 8 b (s/t) h e, nearly constant in t.
    """
    _check(batch, seq, hidden, t)
    _check_seq(seq, t)
    shard = batch * (seq // t) * hidden * bytes_per_element
    return sum(ulysses_all_to_alls_per_layer().values()) * bus_bytes("all_to_all", shard, t)


def ulysses_max_degree(n_head: int) -> int:
    """The largest Ulysses degree: attention runs on n_head/t heads per rank, so t must divide
    n_head, and t <= n_head (Jacobs et al. 2023, §3; beyond it, combine with ring attention)."""
    if n_head < 1:
        raise ValueError(f"n_head must be >= 1, got {n_head}")
    return n_head


# --- ring attention ------------------------------------------------------------------------------


def ring_attention_bytes_per_layer(batch, seq, hidden, t, bytes_per_element=2, acc_bytes=None) -> dict:
    """Bytes one rank sends per attention layer with ring attention: ``{"forward", "backward", "total"}``.

    Each rank holds one (b, s/t, h) block of q, k, v; ``blk = b (s/t) h`` elements. Forward: the
    K and V blocks travel the ring; at each of t-1 steps a rank sends the K and V block it holds
    to its neighbour (Liu et al. 2023, §3)::

        forward  = 2 (t-1) · blk · e

    Backward, as :mod:`minitorch_dist.parallelism.sequence_parallel.ring_attention` does it: K
    and V travel the ring again (t-1 hops), and each block's dK, dV accumulator follows one hop
    behind, collecting every rank's share and taking a t-th hop home to its owner::

        backward = 2 (t-1) · blk · e  +  2 t · blk · a

    with ``a = acc_bytes`` the accumulators' element size (default e; 4 when 16-bit inputs keep
    float32 accumulators). With a = e the total is (6t-4)·blk·e, about 6 b s h e: flat in t at
    fixed s. Ring attention buys memory (no rank holds the s x s scores or the full K, V) and
    overlap with compute, not less traffic. Causal masking does not change it (every block
    still visits every rank) unless fully masked blocks are skipped.
    """
    _check(batch, seq, hidden, t)
    _check_seq(seq, t)
    if t == 1:
        return {"forward": 0, "backward": 0, "total": 0}
    blk = batch * (seq // t) * hidden
    acc = bytes_per_element if acc_bytes is None else acc_bytes
    fwd = 2 * (t - 1) * blk * bytes_per_element  # a send puts its whole message on the wire
    bwd = 2 * (t - 1) * blk * bytes_per_element + 2 * t * blk * acc
    return {"forward": fwd, "backward": bwd, "total": fwd + bwd}


def ring_attention_min_block_tokens(flops_per_s, link_bytes_per_s, bytes_per_element=2,
                                    causal=False) -> float:
    """The shortest shard, in tokens per rank (c = s/t), for which ring attention hides its sends behind
    its compute (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
    Context", §3: the block must be long enough that computing on it outlasts passing it on).

    At each ring step a rank attends its c queries to one block of c keys, ``4 b c² h`` FLOPs (Q Kᵀ
    and P V, 2 b c² h each), while it sends that block's K and V on, ``2 b c h e`` bytes. With F the
    FLOP/s the device sustains and W the link's bytes/s, the send is hidden when
    ``4 b c² h / F >= 2 b c h e / W``, i.e.::

        c >= F e / (2 W)           (b and h cancel: only the device, the link and e matter)

    which is F/W for 16-bit K and V. Under a causal mask a rank computes half of the blocks' pairs on
    average, so c must be twice as long. Pass the *achieved* FLOP/s (peak × utilisation) for F.
    """
    if flops_per_s <= 0 or link_bytes_per_s <= 0 or bytes_per_element <= 0:
        raise ValueError(f"need positive flops_per_s, link_bytes_per_s and bytes_per_element; got "
                         f"{flops_per_s}, {link_bytes_per_s}, {bytes_per_element}")
    c = flops_per_s * bytes_per_element / (2 * link_bytes_per_s)
    return 2 * c if causal else c


def ring_attention_activation_bytes(batch, seq, n_head, head_dim, t, bytes_per_element=4) -> int:
    """Bytes one rank keeps for the backward of ring attention: its q, k, v and output shards and
    a float32 log-sum-exp per query, ``b·a·(s/t)·(4·d·e + 4)`` — linear in s/t. The (s/t)² score
    blocks are recomputed in the backward (FlashAttention's recipe, Dao et al. 2022 §3.1), so no
    s x s tensor is ever kept (Liu et al. 2023, §3)."""
    _check_seq(seq, t)
    return batch * n_head * (seq // t) * (4 * head_dim * bytes_per_element + 4)


def naive_attention_activation_bytes(batch, seq, n_head, head_dim, bytes_per_element=4) -> int:
    """Bytes ``softmax(q kᵀ/√d) v`` keeps for backward in one process without dropout: q, k and v
    (the two matmuls' inputs) and the s x s probabilities P, ``b·a·s·(3d + s)·e``. The s² term is
    Korthikanti et al. 2022's 5as²b (§4.1, 16-bit: QKᵀ 2, softmax 2, its dropout mask 1) without
    the dropout and with the softmax saving its output for the matmul as well."""
    return batch * n_head * seq * (3 * head_dim + seq) * bytes_per_element


def sequence_parallel_comparison(batch, seq, hidden, t, bytes_per_element=2) -> dict:
    """Bytes per rank per layer, forward + backward, of the three schemes side by side:
    ``{"megatron_sp", "ulysses", "ring"}`` (for the chapter's plot against sequence length)."""
    return {"megatron_sp": sequence_parallel_bytes_per_layer(batch, seq, hidden, t, bytes_per_element),
            "ulysses": ulysses_bytes_per_layer(batch, seq, hidden, t, bytes_per_element),
            "ring": ring_attention_bytes_per_layer(batch, seq, hidden, t, bytes_per_element)["total"]}
