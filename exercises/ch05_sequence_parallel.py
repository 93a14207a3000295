# generated from solutions/ch05_sequence_parallel.py by `make exercises`: fill in each NotImplementedError
# fingerprint 631f9c98ccaff328 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 05 exercises: sequence / context parallelism — the attention merge, zigzag sharding, Ulysses,
the activations of a layer, ring attention forward and backward, and the bytes of context parallelism.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch05``.

1. :func:`merge_partial_attention`: combine K partial attention results, each over a disjoint set of
   keys, using their log-sum-exps — the online-softmax merge (Milakov & Gimelshein 2018, "Online
   normalizer calculation for softmax", §3) that ring attention applies once per arriving K/V
   block (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
   Context", §3), and that Flash-Decoding and tree attention apply to K splits at once (Shyam et
   al. 2024, "Tree Attention", §3).
2. :func:`striped_rank_shard` / :func:`striped_reassemble` / :func:`causal_work`: Striped Attention's
   load-balanced layout for causal ring attention: rank r holds positions r, r + t, r + 2t, ...
   (Brandon et al. 2023, "Striped Attention: Faster Ring Attention for Causal Transformers", §3),
   and the causal work each rank does under the contiguous, zigzag and striped layouts.
3. :func:`ulysses_seq_to_heads` / :func:`ulysses_heads_to_seq`: DeepSpeed-Ulysses's layout
   change around attention, one all-to-all from sequence-sharded to head-sharded and one back
   (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
   Long Sequence Transformer Models", §3.1, Fig. 2), for (B, S, H, d) activations. These run inside
   ranks (start them with ``minitorch_dist.launch(fn, t)``) and talk through
   ``minitorch_dist.runtime.comm``, whose meter the tests read.
4. :func:`activation_bytes_per_layer`: the activation memory of one layer, tensor by tensor, under
   tensor parallelism alone and with sequence parallelism (Korthikanti et al. 2022, "Reducing
   Activation Recomputation in Large Transformer Models", §4, eq. 1-5).
5. :class:`StripedRingAttn`: ring attention, forward and backward, on striped shards — each rank
   keeps its queries, the K/V blocks travel round the ring and are merged one at a time, and in the
   backward the dK/dV of each block follow it round and come home to its owner (Liu et al. 2023, §3;
   Brandon et al. 2023, §3; the blockwise backward of Dao et al. 2022, "FlashAttention", §3.1 and
   Appendix B).
6. :func:`context_parallel_traffic`: predict with the cost model the bytes one rank sends for an
   attention layer under Ulysses and under ring attention, then count them with the comm meter.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.runtime import comm


def _require_dist(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{name} runs inside ranks: call it from a function started with "
                           "minitorch_dist.launch(fn, t)")


# --- 1. merging two partial attention results -------------------------------------------------


def merge_partial_attention(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build · about 40 minutes

    Attention over the union of K disjoint key sets, from attention over each set alone.

    Block i's attention of the same queries over its keys gives ``outs[i]`` (the softmax-weighted
    values) and ``lses[i]`` (the log of the softmax's denominator, one per query row). Return the
    attention over all the keys together and its log-sum-exp — what Flash-Decoding does with the K
    splits of a long KV cache, and what ring attention does one arriving block at a time (Liu et
    al. 2023, §3; the online softmax of Milakov & Gimelshein 2018, §3). Derive the combination from
    the definition of softmax.

    Interface: ``outs`` a sequence of K >= 1 tensors ``(B, H, S, d)``, ``lses`` the K matching
    ``(B, H, S)``. Returns ``(out, lse)`` with those shapes, ``out`` in ``outs[0]``'s dtype.
    Requirements, each tested:

    - equal (to a derived float64 bound) to softmax attention over all the keys, for any K and
      any order of the blocks;
    - no overflow: scores of a few thousand in float32 are fine (``exp(lse)`` is inf there);
    - a block whose row saw no key (every key masked: ``lse = -inf``, ``out`` NaN, as SDPA and
      ``softmax`` give) contributes nothing; a row that saw no key in *any* block gets ``out = 0``
      and ``lse = -inf``, so that the result can be merged again; no NaN anywhere, in the
      forward or in the backward;
    - differentiable (torch operations only, no in-place writes into the inputs).

    Reference: ``minitorch_dist/parallelism/sequence_parallel/ring_attention.py`` (``merge_attention``
    merges two; the exercise merges any number at once).
    """
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"need one lse per partial output and at least one of each, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    for i, (out, lse) in enumerate(zip(outs, lses)):
        if out.shape != outs[0].shape:
            raise ValueError(f"outs[{i}] has shape {tuple(out.shape)}, outs[0] {tuple(outs[0].shape)}: every "
                             "block attends from the same queries, (B, H, S, d)")
        if lse.shape != outs[0].shape[:-1]:
            raise ValueError(f"lses[{i}] has shape {tuple(lse.shape)}; expected out's without its last (head "
                             f"dim) dimension, {tuple(outs[0].shape[:-1])}: one log-sum-exp per query row")
    raise NotImplementedError("exercise: merge_partial_attention — see chapters/05_sequence_parallel.md")


# --- 2. striped sharding for causal load balance -----------------------------------------------

LAYOUTS = ("contiguous", "zigzag", "striped")


def striped_rank_shard(x: torch.Tensor, t: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Kind: build · about 15 minutes

    Rank ``rank``'s part of ``x`` along its sequence dimension ``dim`` in the *striped* layout:
    positions ``rank, rank + t, rank + 2t, ...``, in that order.

    Under a causal mask late queries do more work than early ones, so contiguous shards leave the
    last rank of the ring with about 2t - 1 times the work of the first. Striped Attention (Brandon
    et al. 2023, §3) deals the positions out like cards instead: every rank gets early and late
    positions alike, and in every step of the ring each rank's block is about half masked.

    Interface: ``x`` any tensor, ``dim`` any of its dimensions (negative too), ``t >= 1``,
    ``0 <= rank < t``. Returns a new contiguous tensor with ``x``'s shape but ``S / t`` along
    ``dim``. If the sequence length S is not a multiple of t, raise
    ``ValueError("sequence length 30 is not divisible by t=4 (striping deals it out evenly); pad it")``
    (with the actual numbers), before anything else. The tests check index lists built position by
    position for t = 1..4 along dims 0, 1 and -1, a hand-worked case and the refusal.

    Reference: ``minitorch_dist/parallelism/sequence_parallel/ring_attention.py`` (``shard_sequence``:
    the contiguous and zigzag layouts; striped is the third).
    """
    if t < 1 or not 0 <= rank < t:
        raise ValueError(f"need t >= 1 and 0 <= rank < t, got t={t}, rank={rank}")
    raise NotImplementedError("exercise: striped_rank_shard — see chapters/05_sequence_parallel.md")


def striped_reassemble(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Kind: build · about 15 minutes

    The full sequence from the t striped shards ``shards[r] = striped_rank_shard(x, t, r, dim)``.

    Interface: ``shards`` the t shards in rank order, all of one shape; ``dim`` the sequence
    dimension, negative too. Returns ``x``: ``striped_reassemble([striped_rank_shard(x, t, r, dim)
    for r in range(t)], dim) == x`` exactly. The tests check the round trip for t = 1..4 along
    dims 0, 1 and -1, and shards built independently of your :func:`striped_rank_shard`.

    Reference: ``minitorch_dist/parallelism/sequence_parallel/ring_attention.py``
    (``unshard_sequence``: the contiguous and zigzag layouts).
    """
    if not shards:
        raise ValueError("striped_reassemble needs the t shards, got none")
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"every striped shard has the same shape, got {[tuple(s.shape) for s in shards]}")
    raise NotImplementedError("exercise: striped_reassemble — see chapters/05_sequence_parallel.md")


def causal_work(seq_len: int, t: int, layout: str = "striped") -> list[int]:
    """Kind: derive · about 20 minutes

    How many (query, key) pairs each rank scores in causal attention over ``seq_len`` tokens when
    the sequence is sharded over t ranks in ``layout``.

    Assumptions: ring attention, where every rank keeps its own queries and sees every key; under
    the causal mask a query at position i scores the keys at positions 0..i and nothing else (what
    is masked costs nothing). The layouts: ``"contiguous"`` (rank r holds the r-th of t equal
    pieces), ``"zigzag"`` (the sequence cut into 2t equal chunks, rank r holding chunks r and
    2t - 1 - r), ``"striped"`` (:func:`striped_rank_shard`).

    Return the t counts in rank order, as Python ints. Raise a ``ValueError`` naming the choices for
    any other ``layout``, and one for a length the layout cannot cut evenly. The tests check, over
    seeded random lengths and degrees and hand-worked cases, the counts against the causal mask
    counted entry by entry, the total, and the balance of each layout.
    """
    if seq_len < 1 or t < 1:
        raise ValueError(f"need seq_len >= 1 and t >= 1, got seq_len={seq_len}, t={t}")
    raise NotImplementedError("exercise: causal_work — see chapters/05_sequence_parallel.md")


# --- 3. the Ulysses all-to-all ------------------------------------------------------------------


def ulysses_seq_to_heads(x_r: torch.Tensor, group=None) -> torch.Tensor:
    """Kind: build · about 30 minutes

    From sequence-sharded to head-sharded: ``(B, S/t, H, d)`` -> ``(B, S, H/t, d)``, with one
    all-to-all (Jacobs et al. 2023, §3.1, Fig. 2).

    Outside attention DeepSpeed-Ulysses splits every activation along the sequence: rank r holds
    positions ``[r*S/t, (r+1)*S/t)`` of q (or k, or v), all H heads. Attention needs the whole
    sequence, but heads are independent: afterwards rank r holds *all* positions of heads
    ``[r*H/t, (r+1)*H/t)``, in order. Each rank sends (t-1)/t of its input, whatever t (the paper's
    constant-communication argument).

    Interface: ``x_r`` this rank's ``(B, S/t, H, d)`` shard (not modified); the ranks of ``group``.
    Returns ``(B, S, H/t, d)``. Use exactly one ``comm.all_to_all(out, inp, group=group)`` (torch's
    ``all_to_all_single``: ``inp`` cut along dimension 0 into t equal pieces, piece j to rank j;
    ``out``'s piece j from rank j; both contiguous) and nothing else that communicates. If H is not
    a multiple of t, raise ``ValueError("n_head 6 is not divisible by t=4")`` (the actual numbers)
    before communicating. The tests check, on 2 and 4 ranks, slices of the global tensor exactly,
    the one all-to-all (this rank's whole input, among all t ranks), the input untouched, the
    refusal.

    Reference: ``minitorch_dist/parallelism/sequence_parallel/ulysses.py`` (the same exchange for
    ``(B, H, S/t, d)`` tensors; here the sequence dimension comes before the heads).
    """
    _require_dist("ulysses_seq_to_heads")
    if x_r.dim() != 4:
        raise ValueError(f"x_r must be (B, S/t, n_head, head_dim), got shape {tuple(x_r.shape)}")
    t = dist.get_world_size(group)
    raise NotImplementedError("exercise: ulysses_seq_to_heads — see chapters/05_sequence_parallel.md")


def ulysses_heads_to_seq(y_r: torch.Tensor, group=None) -> torch.Tensor:
    """Kind: build · about 20 minutes

    The inverse, after attention: ``(B, S, H/t, d)`` -> ``(B, S/t, H, d)``, with one all-to-all.

    Rank r holds all positions of heads ``[r*H/t, (r+1)*H/t)`` (attention's output); afterwards it
    holds positions ``[r*S/t, (r+1)*S/t)`` of all H heads, in order, ready for the output
    projection. It is also the backward of :func:`ulysses_seq_to_heads`.

    Interface: ``y_r`` this rank's ``(B, S, H/t, d)`` block. Returns ``(B, S/t, H, d)`` using exactly
    one ``comm.all_to_all``. If S is not a multiple of t, raise ``ValueError("sequence length 30 is
    not divisible by t=4")`` (the actual numbers) before communicating. The tests check, on 2 and 4
    ranks, slices of the global tensor exactly, the one all-to-all, and the round trip
    ``heads_to_seq(seq_to_heads(x_r)) == x_r``.

    Reference: ``minitorch_dist/parallelism/sequence_parallel/ulysses.py`` (the same exchange for
    ``(B, H/t, S, d)`` tensors).
    """
    _require_dist("ulysses_heads_to_seq")
    if y_r.dim() != 4:
        raise ValueError(f"y_r must be (B, S, n_head/t, head_dim), got shape {tuple(y_r.shape)}")
    t = dist.get_world_size(group)
    raise NotImplementedError("exercise: ulysses_heads_to_seq — see chapters/05_sequence_parallel.md")


# --- 4. activation memory per layer: TP vs TP + SP ----------------------------------------------

#: The tensors one transformer layer saves for backward (Korthikanti et al. 2022, "Reducing
#: Activation Recomputation in Large Transformer Models", §4.1), in the paper's order, with 16-bit
#: activations and 1-byte dropout masks; s = seq, b = batch, h = hidden, a = heads.
SAVED_TENSORS = (
    "ln1_input",             # 2sbh   LayerNorm before attention
    "qkv_input",             # 2sbh   the input of the QKV projection
    "qk_input",              # 4sbh   Q and K, for Q K^T
    "softmax_output",        # 2as^2b
    "softmax_dropout_mask",  # as^2b
    "av_input",              # 2as^2b + 2sbh   the dropped-out softmax and V
    "out_proj_input",        # 2sbh   the input of attention's output projection
    "attn_dropout_mask",     # sbh    dropout after attention
    "ln2_input",             # 2sbh   LayerNorm before the MLP
    "fc1_input",             # 2sbh   the input of the MLP's first linear layer
    "gelu_input",            # 8sbh   the 4h-wide input of GeLU
    "fc2_input",             # 8sbh   GeLU's output, the input of the second linear layer
    "mlp_dropout_mask",      # sbh    dropout after the MLP
)


def activation_bytes_per_layer(seq: int, batch: int, hidden: int, heads: int, t: int = 1,
                               sequence_parallel: bool = False) -> dict[str, float]:
    """Kind: derive · about 30 minutes

    Bytes each rank stores for backward, per saved tensor of one transformer layer, under tensor
    parallelism over t ranks, with or without sequence parallelism (Korthikanti et al. 2022, §4).

    Assumptions (the paper's): no recomputation; 16-bit activations and 1-byte dropout masks; the
    tensors of :data:`SAVED_TENSORS` with their sizes for the whole layer on one rank (the comments
    there); tensor parallelism as in chapter 04 (column-parallel q, k, v and first MLP layer,
    row-parallel output projections, an all-reduce after each pair); sequence parallelism as in
    §4.2.2 (the regions between those pairs split along the sequence). Decide, tensor by tensor,
    which of them t ranks split and which every rank keeps whole.

    Return ``{name: bytes per rank}``, one entry per name of :data:`SAVED_TENSORS` (floats; divisions
    need not be exact). The tests check the totals against ``costmodel.activation_memory_bytes``
    over seeded random shapes and degrees, the paper's eq. 1 at t = 1, and which tensors TP leaves
    whole and SP splits, tensor by tensor.
    """
    for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads), ("t", t)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    raise NotImplementedError("exercise: activation_bytes_per_layer — see chapters/05_sequence_parallel.md")


# --- 5. ring attention, forward and backward -----------------------------------------------------


def _pass_to_next(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Send each of ``tensors`` to the next rank of the ring and receive same-shaped tensors from the
    previous one (rank r sends to r + 1 and receives from r - 1, mod t); returns what arrived. Every
    rank must call it at the same point, with the same shapes. One send and one receive per tensor,
    posted together (``comm.batch_isend_irecv``, so that no rank waits for its neighbour's receive
    before its own), then waited for."""
    t, r = dist.get_world_size(group), dist.get_rank(group)
    if t == 1:
        return list(tensors)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    nxt, prv = glob((r + 1) % t), glob((r - 1) % t)
    received = [torch.empty_like(x) for x in tensors]
    ops = [dist.P2POp(dist.isend, x.contiguous(), nxt, group) for x in tensors]
    ops += [dist.P2POp(dist.irecv, y, prv, group) for y in received]
    for work in comm.batch_isend_irecv(ops):
        work.wait()
    return received


class StripedRingAttn(torch.autograd.Function):
    """Kind: build · about 90 minutes

    Exact attention of this rank's queries to the whole sequence, with the keys and values passed
    round a ring (Liu et al. 2023, §3), forward and backward, on *striped* shards (Brandon et al.
    2023, "Striped Attention", §3): rank r holds positions ``r, r + t, r + 2t, ...`` of q, k and v
    (:func:`striped_rank_shard` along the sequence dimension), each ``(B, H, S/t, d)``.

    Return this rank's rows of ``softmax(Q K^T / sqrt(d) [+ causal mask]) V`` over all S tokens,
    in its striped order, and in the backward the gradients of this rank's q, k and v shards —
    never holding more than one K/V block besides its own. With ``causal``, the query at position
    p sees the keys at positions 0..p: work out which entries of each block that leaves under the
    striped layout (no block is wholly in the future any more, and some rows of some blocks see no
    key at all).

    Communication, per rank, and nothing else: the K/V blocks travel to the next rank of the ring
    (rank r sends to r + 1 and receives from r - 1, with :func:`_pass_to_next`), t - 1 hops of K
    and V in the forward; in the backward the same t - 1 hops again, and each block's dK/dV
    accumulators travel *with* it and take a t-th hop home to its owner (2(t - 1) + 2t messages,
    each of one shard's size). Save what the backward needs; recompute the probabilities there
    from the final log-sum-exp (FlashAttention's backward, Dao et al. 2022, §3.1 and Appendix B).

    Interface: ``forward(ctx, q, k, v, causal, group)`` returns the output; ``backward(ctx, dout)``
    returns ``dq, dk, dv, None, None``. Call it through :func:`striped_ring_attention`. The tests
    compare the output and the gradients of q, k, v with PyTorch's ``F.scaled_dot_product_attention``
    on the whole sequence (taken at this rank's striped positions), at t = 2 and 4, causal and not,
    in float64, and count the messages with the comm meter.

    Reference: ``minitorch_dist/parallelism/sequence_parallel/ring_attention.py`` (``RingAttention``
    on contiguous and zigzag shards, which skip the blocks in the future; striped shards skip none
    and mask each block differently).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        raise NotImplementedError("exercise: StripedRingAttn.forward — see chapters/05_sequence_parallel.md")

    @staticmethod
    def backward(ctx, dout):
        raise NotImplementedError("exercise: StripedRingAttn.backward — see chapters/05_sequence_parallel.md")


def striped_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                           group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence (see :class:`StripedRingAttn`),
    differentiable. q, k, v: this rank's striped shard, ``(B, H, S/t, d)`` each."""
    _require_dist("striped_ring_attention")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be this rank's (B, H, S/t, d) shards, all the same shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return StripedRingAttn.apply(q, k, v, bool(causal), group)


# --- 6. the bytes of context parallelism: predicted, then counted -----------------------------------


def context_parallel_traffic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> dict:
    """Kind: measure · about 30 minutes

    Predict the bytes one rank sends for an attention layer under DeepSpeed-Ulysses and under ring
    attention, then run both layers and count them.

    ``q, k, v`` are this rank's contiguous shards, ``(B, H, S/t, d)`` each, the same shapes on the t
    ranks of ``group``; the layer's hidden size is h = H·d, its sequence S, its element size e.

    - **Predict**, before running anything, with the cost model (``minitorch_dist.costmodel``, its
      sequence-parallel formulas): the bytes this rank puts on the wire, forward and backward
      together, for Ulysses (Jacobs et al. 2023, §3.2) and for ring attention (Liu et al. 2023, §3).
    - **Measure**: run the library's ``ulysses_attention`` (``parallelism.sequence_parallel.ulysses``)
      and ``ring_attention`` (``parallelism.sequence_parallel.ring_attention``), non-causal, on
      detached copies of q, k, v that require grad, forward and backward (of ``out.sum()``), and
      read the wire bytes of each from a ``comm.meter()`` around it.

    Return ``{"ulysses": {"predicted": bytes, "measured": bytes}, "ring": {"predicted": bytes,
    "measured": bytes}}``. The tests check the predictions against the formulas worked by hand, the
    measurements against their own meter and against a meter around your call (the layers must
    really run), and each prediction against its measurement.

    Reference: ``minitorch_dist/costmodel/sequence_parallel.py`` (the two formulas; the exercise
    checks them against a metered run).
    """
    _require_dist("context_parallel_traffic")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be this rank's (B, H, S/t, d) shards, all the same shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    raise NotImplementedError("exercise: context_parallel_traffic — see chapters/05_sequence_parallel.md")
