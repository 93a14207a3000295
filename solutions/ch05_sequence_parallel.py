"""Chapter 05 exercises: sequence / context parallelism — the attention merge, zigzag sharding, Ulysses,
the activations of a layer, ring attention forward and backward, and the bytes of context parallelism.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch05_sequence_parallel.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch05 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

1. :func:`merge_partial_attention`: combine two partial attention results, each over a disjoint set of
   keys, using their log-sum-exps — the online-softmax merge (Milakov & Gimelshein 2018, "Online
   normalizer calculation for softmax", §3) that ring attention applies once per arriving K/V
   block (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
   Context", §3). The merge is associative and commutative, so the blocks may also be combined
   by a tree, like an all-reduce (Shyam et al. 2024, "Tree Attention", §3).
2. :func:`zigzag_rank_shard` / :func:`zigzag_reassemble` / :func:`causal_work`: the load-balanced layout
   of causal ring attention (context parallelism): cut the sequence into 2t chunks and give rank r
   chunks r and 2t-1-r, so every rank does the same causal work (Brandon et al. 2023, "Striped
   Attention", §3, for the problem; the zigzag layout is the one of Megatron-LM's context parallelism
   and of ring-flash-attention).
3. :func:`ulysses_seq_to_heads` / :func:`ulysses_heads_to_seq`: DeepSpeed-Ulysses's layout
   change around attention, one all-to-all from sequence-sharded to head-sharded and one back
   (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme
   Long Sequence Transformer Models", §3.1, Fig. 2). These run inside ranks (start them with
   ``minitorch_dist.launch(fn, t)``) and talk through ``minitorch_dist.runtime.comm``, whose
   meter the tests read.
4. :func:`activation_bytes_per_layer`: the activation memory of one layer, tensor by tensor, under
   tensor parallelism alone and with sequence parallelism (Korthikanti et al. 2022, "Reducing
   Activation Recomputation in Large Transformer Models", §4, eq. 1-5).
5. :class:`KVRingAttention`: ring attention, forward and backward — each rank keeps its
   queries, the K/V blocks travel round the ring and are merged one at a time, and in the backward
   the dK/dV of each block follow it round and come home to its owner (Liu et al. 2023, §3; the
   blockwise backward of Dao et al. 2022, "FlashAttention", §3.1 and Appendix B).
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


def merge_partial_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                            lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build

    Attention over the keys of A and B together, from attention over each alone.

    For one query row with scores ``s_j = q . k_j / sqrt(d)`` over a key set A, attention gives

        out_A = sum_{j in A} exp(s_j - lse_A) v_j,        lse_A = log sum_{j in A} exp(s_j)

    (``lse`` is the log of the softmax's denominator). For disjoint key sets A and B the
    denominator of A u B is the sum of theirs, and its softmax re-weights each part:

        lse = log(exp(lse_A) + exp(lse_B))
        out = exp(lse_A - lse) out_A + exp(lse_B - lse) out_B

    This is how ring attention adds one K/V block at a time without ever holding all the scores.
    Computed as written it overflows: with scores of a few hundred, ``exp(lse_A)`` is inf in
    float32. Subtract ``m = max(lse_A, lse_B)`` first (the weights then lie in [0, 1]).

    A row of a block that saw no key (every key masked, e.g. a causal block entirely in the
    future of the query) has ``lse = -inf``; its ``out`` row is meaningless (SDPA and
    ``softmax`` return NaN there) and must not reach the result: such a block has weight 0. A
    row that saw no key in *either* block gets ``out = 0`` and ``lse = -inf`` (so that merging
    it later with a third block still works). Beware ``-inf - -inf = nan``, and ``0 * nan = nan``.

    Shapes: ``out_*`` is ``(B, H, S, d)`` (batch, heads, queries, head dim), ``lse_*`` is
    ``(B, H, S)``. **Your task:** return ``(out, lse)`` with those shapes, ``out`` in
    ``out_a``'s dtype, free of NaN, and differentiable (torch ops only, no in-place writes into
    the inputs).
    """
    if out_a.shape != out_b.shape:
        raise ValueError(f"out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} must have the same "
                         "shape (B, H, S, d): both blocks attend from the same queries")
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != out_a.shape[:-1]:
            raise ValueError(f"{name} has shape {tuple(lse.shape)}; expected out's without its last (head "
                             f"dim) dimension, {tuple(out_a.shape[:-1])}: one log-sum-exp per query row")
    # BEGIN SOLUTION
    m = torch.maximum(lse_a, lse_b)
    # a row empty in both blocks: shift by 0, not by -inf (which would give -inf - -inf = nan)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a, w_b = torch.exp(lse_a - m), torch.exp(lse_b - m)  # in [0, 1]; exactly 0 for an empty block
    total = w_a + w_b
    lse = m + torch.log(total)  # log(0) = -inf where both are empty
    # zero the rows of an empty block *before* multiplying: 0 * nan would still be nan (also in backward)
    clean_a = torch.where((w_a > 0)[..., None], out_a, torch.zeros_like(out_a))
    clean_b = torch.where((w_b > 0)[..., None], out_b, torch.zeros_like(out_b))
    safe_total = torch.where(total > 0, total, torch.ones_like(total))  # no 0/0, not even in backward
    out = (w_a[..., None] * clean_a + w_b[..., None] * clean_b) / safe_total[..., None]
    return out.to(out_a.dtype), lse
    # END SOLUTION


# --- 2. zigzag sharding for causal load balance -----------------------------------------------

LAYOUTS = ("zigzag", "contiguous")


def zigzag_rank_shard(x: torch.Tensor, t: int, rank: int, dim: int = 1) -> torch.Tensor:
    """Kind: build

    Rank ``rank``'s part of ``x`` along its sequence dimension ``dim``, in the zigzag layout.

    With a causal mask, query i attends to keys 0..i: late queries do more work than early
    ones. Cut into t contiguous pieces, the last rank would do about 2t-1 times the work of the
    first (the ring waits for the slowest). Instead cut the sequence into 2t equal chunks
    ``c_0 .. c_{2t-1}`` and give rank r the pair

        (c_r, c_{2t-1-r})     concatenated in that order along ``dim``

    an early chunk and its mirror image from the end: every rank then gets the same number of
    (query, key) pairs under the mask (see :func:`causal_work`). With t = 2 and 8 positions:
    rank 0 holds positions 0 1 6 7, rank 1 holds 2 3 4 5.

    **Your task:** return that shard (``torch.cat`` of two slices, or ``index_select``). If the
    sequence length S is not a multiple of 2t, raise
    ``ValueError("sequence length 30 is not divisible by 2*t=8 (zigzag cuts it into 2t chunks); pad it")``
    (with the actual numbers), before anything else.
    """
    if t < 1 or not 0 <= rank < t:
        raise ValueError(f"need t >= 1 and 0 <= rank < t, got t={t}, rank={rank}")
    # BEGIN SOLUTION
    seq = x.shape[dim]
    if seq % (2 * t):
        raise ValueError(f"sequence length {seq} is not divisible by 2*t={2 * t} (zigzag cuts it into 2t "
                         "chunks); pad it")
    chunks = x.chunk(2 * t, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * t - 1 - rank]], dim=dim)
    # END SOLUTION


def zigzag_reassemble(shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """Kind: build

    The full sequence from the t zigzag shards ``shards[r] = zigzag_rank_shard(x, t, r, dim)``.

    Each shard is two chunks, ``(c_r, c_{2t-1-r})``; put chunk j back at position j.

    **Your task:** return ``x``, so that ``zigzag_reassemble([zigzag_rank_shard(x, t, r) for r in
    range(t)]) == x``.
    """
    if not shards:
        raise ValueError("zigzag_reassemble needs the t shards, got none")
    if any(s.shape != shards[0].shape for s in shards):
        raise ValueError(f"every zigzag shard has the same shape, got {[tuple(s.shape) for s in shards]}")
    if shards[0].shape[dim] % 2:
        raise ValueError(f"a zigzag shard holds two equal chunks, but its length along dim {dim} is "
                         f"{shards[0].shape[dim]}, odd")
    # BEGIN SOLUTION
    t = len(shards)
    chunks = [None] * (2 * t)
    for r, shard in enumerate(shards):
        chunks[r], chunks[2 * t - 1 - r] = shard.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
    # END SOLUTION


def causal_work(seq_len: int, t: int, layout: str = "zigzag") -> list[int]:
    """Kind: derive

    How many (query, key) pairs each rank scores in causal attention over ``seq_len`` tokens.

    In ring attention every rank keeps its own queries and sees every key block go by; under the
    causal mask query i scores the ``i + 1`` keys ``0..i`` (blocks wholly in the future are
    skipped). So rank r's work is the sum of ``i + 1`` over the positions i of its queries:

    - ``"contiguous"``: rank r holds positions ``[r*S/t, (r+1)*S/t)``;
    - ``"zigzag"``: rank r holds chunks r and 2t-1-r of 2t (:func:`zigzag_rank_shard`).

    The total is always ``S (S + 1) / 2``. **Your task:** return the t counts, rank order,
    as Python ints. Hint: shard ``torch.arange(seq_len)`` and sum. Raise a ``ValueError``
    naming the choices for any other ``layout``.
    """
    if seq_len < 1 or t < 1:
        raise ValueError(f"need seq_len >= 1 and t >= 1, got seq_len={seq_len}, t={t}")
    # BEGIN SOLUTION
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    positions = torch.arange(seq_len)
    if layout == "zigzag":
        shards = [zigzag_rank_shard(positions, t, r, dim=0) for r in range(t)]
    else:
        if seq_len % t:
            raise ValueError(f"sequence length {seq_len} is not divisible by t={t}")
        shards = list(positions.chunk(t))
    return [int((s + 1).sum()) for s in shards]
    # END SOLUTION


# --- 3. the Ulysses all-to-all ------------------------------------------------------------------


def ulysses_seq_to_heads(x_r: torch.Tensor, group=None) -> torch.Tensor:
    """Kind: build

    From sequence-sharded to head-sharded: ``(B, S/t, H, d)`` -> ``(B, S, H/t, d)``.

    Outside attention, DeepSpeed-Ulysses splits every activation along the sequence: rank r
    holds positions ``[r*S/t, (r+1)*S/t)`` of q (or k, or v), all H heads. Attention needs the
    whole sequence, but each head is independent, so before attention one all-to-all makes rank
    r hold *all* positions of heads ``[r*H/t, (r+1)*H/t)``. Rank r sends rank j its positions
    of j's heads, and receives from rank j j's positions of r's heads: each rank sends (t-1)/t
    of its input, whatever the number of ranks (the paper's constant-communication argument).

    ``comm.all_to_all(out, inp, group=group)`` is ``all_to_all_single``: ``inp`` is cut along
    dimension 0 into t equal pieces, piece j goes to rank j; ``out``'s piece j along dimension 0
    comes from rank j. Both must be contiguous. So lay the input out as
    ``(t, B, S/t, H/t, d)`` (piece j = this rank's positions of j's heads), exchange, and
    rearrange what arrives (piece j = rank j's positions of this rank's heads) into
    ``(B, S, H/t, d)``.

    **Your task:** return this rank's head-sharded tensor using exactly one ``comm.all_to_all``.
    If H is not a multiple of t raise ``ValueError("n_head 6 is not divisible by t=4")`` (with
    the actual numbers) before communicating.
    """
    _require_dist("ulysses_seq_to_heads")
    if x_r.dim() != 4:
        raise ValueError(f"x_r must be (B, S/t, n_head, head_dim), got shape {tuple(x_r.shape)}")
    t = dist.get_world_size(group)
    # BEGIN SOLUTION
    b, s_r, h, d = x_r.shape
    if h % t:
        raise ValueError(f"n_head {h} is not divisible by t={t}: "
                         "Ulysses gives each rank n_head/t whole heads")
    inp = x_r.reshape(b, s_r, t, h // t, d).permute(2, 0, 1, 3, 4).contiguous()  # piece j: j's heads
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    # out[j] is rank j's positions of this rank's heads: put the positions in order
    return out.permute(1, 0, 2, 3, 4).reshape(b, t * s_r, h // t, d)
    # END SOLUTION


def ulysses_heads_to_seq(y_r: torch.Tensor, group=None) -> torch.Tensor:
    """Kind: build

    The inverse, after attention: ``(B, S, H/t, d)`` -> ``(B, S/t, H, d)``.

    Rank r holds all positions of heads ``[r*H/t, (r+1)*H/t)`` (attention's output); afterwards
    it holds positions ``[r*S/t, (r+1)*S/t)`` of all H heads, ready for the output projection.
    It is also the backward of :func:`ulysses_seq_to_heads` (the all-to-all is a permutation of
    the ranks' data; its gradient is the inverse permutation).

    **Your task:** return this rank's sequence-sharded tensor using exactly one
    ``comm.all_to_all``. If S is not a multiple of t raise ``ValueError("sequence length 30 is
    not divisible by t=4")`` (with the actual numbers) before communicating.
    """
    _require_dist("ulysses_heads_to_seq")
    if y_r.dim() != 4:
        raise ValueError(f"y_r must be (B, S, n_head/t, head_dim), got shape {tuple(y_r.shape)}")
    t = dist.get_world_size(group)
    # BEGIN SOLUTION
    b, s, h_r, d = y_r.shape
    if s % t:
        raise ValueError(f"sequence length {s} is not divisible by t={t}")
    inp = y_r.reshape(b, t, s // t, h_r, d).transpose(0, 1).contiguous()  # piece j: rank j's positions
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    # out[j] is this rank's positions of rank j's heads: heads of rank j go to slots j*H/t..
    return out.permute(1, 2, 0, 3, 4).reshape(b, s // t, t * h_r, d)
    # END SOLUTION


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
    """Kind: derive

    Bytes each rank stores for backward, per saved tensor of one layer (no recomputation).

    The sizes above add up to ``sbh (34 + 5 a s / h)`` (the paper's eq. 1). With tensor
    parallelism over t ranks (chapter 04) the tensors *inside* the column-parallel / row-parallel
    pairs are split by heads or by the 4h hidden units and shrink by t: Q and K, the softmax and
    its mask, the dropped-out softmax and V, the output projection's input, GeLU's input and
    output (24 sbh + 5 as^2 b in all). The rest — the two LayerNorm inputs, the inputs of the QKV
    projection and of the first MLP layer, the two dropout masks, 10 sbh — sit between an
    all-reduce and the next layer and are replicated on every rank. Sequence parallelism splits
    exactly those along the sequence, so they shrink by t too (Korthikanti §4.2.2, eq. 4-5):

        TP:       sbh (10 + 24/t + 5as/(ht))
        TP + SP:  sbh/t (34 + 5as/h)

    **Your task:** return ``{name: bytes per rank}`` with one entry for each name of
    :data:`SAVED_TENSORS` (floats; divisions need not be exact).
    """
    for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads), ("t", t)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    # BEGIN SOLUTION
    s, b, h, a = seq, batch, hidden, heads
    sbh, as2b = s * b * h, a * s * s * b
    full = {  # bytes of each tensor for the whole layer, one rank, no parallelism
        "ln1_input": 2 * sbh, "qkv_input": 2 * sbh, "qk_input": 4 * sbh, "softmax_output": 2 * as2b,
        "softmax_dropout_mask": as2b, "av_input": 2 * as2b + 2 * sbh, "out_proj_input": 2 * sbh,
        "attn_dropout_mask": sbh, "ln2_input": 2 * sbh, "fc1_input": 2 * sbh, "gelu_input": 8 * sbh,
        "fc2_input": 8 * sbh, "mlp_dropout_mask": sbh,
    }
    # replicated under TP alone: outside the column/row-parallel pairs
    outside_tp = {"ln1_input", "qkv_input", "attn_dropout_mask", "ln2_input", "fc1_input", "mlp_dropout_mask"}
    return {name: size if name in outside_tp and not sequence_parallel else size / t
            for name, size in full.items()}
    # END SOLUTION


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


class KVRingAttention(torch.autograd.Function):
    """Kind: build

    Exact attention of this rank's queries to the whole sequence, with the keys and values passed
    round a ring (Liu et al. 2023, "Ring Attention with Blockwise Transformers for Near-Infinite
    Context", §3), forward and backward.

    The sequence of S tokens is cut into t contiguous shards; rank r holds tokens
    ``[r*S/t, (r+1)*S/t)`` of q, k and v, each ``(B, H, S/t, d)``, and must return its rows of
    ``softmax(Q K^T / sqrt(d) [+ causal mask]) V`` over all S tokens — without ever holding more
    than one K/V block besides its own.

    **Forward.** At step ``i = 0 .. t-1`` rank r holds the K/V block of rank ``j = (r - i) mod t``:
    its own at step 0; before each later step it passes the block it holds to the next rank and
    receives one from the previous (:func:`_pass_to_next`, so t - 1 hops of K and V). For each
    block compute the block's attention and its log-sum-exp,

        scores = q k_j^T / sqrt(d),   lse_j = logsumexp(scores),   out_j = exp(scores - lse_j) v_j

    and merge it into the running ``(out, lse)`` (the online softmax: ``lse = logaddexp(lse, lse_j)``,
    ``out = exp(lse_old - lse) out + exp(lse_j - lse) out_j``). With ``causal``, query position p
    sees keys 0..p: a block from an earlier rank (j < r) is attended fully, the own block (j = r)
    under the lower-triangular mask, a block from a later rank (j > r) not at all (skip it, but
    still pass it on). Save q, k, v, out and the final lse for the backward.

    **Backward** (FlashAttention's, Dao et al. 2022, §3.1 and Appendix B): with ``dO`` the gradient
    of this rank's output and ``D = rowsum(dO * out)``, for each block recompute the probabilities
    from the *final* lse and accumulate

        P = exp(scores - lse)  (0 where masked),      dV_j += P^T dO,
        dS = P * (dO v_j^T - D),   dq += dS k_j / sqrt(d),   dK_j += dS^T q / sqrt(d)

    dq stays home. dK_j and dV_j belong to rank j: give each K/V block a pair of accumulators that
    travels *with* it — K and V make the same t - 1 hops as in the forward, and before each later
    step the accumulators received from the previous rank are those of the block that arrives with
    them; every rank adds its share. After the last step one more hop (t hops of dK, dV in all)
    brings every block's finished accumulators home to its owner.

    So, per rank: forward 2(t - 1) sends (K and V, t - 1 times); backward 2(t - 1) + 2t sends, each
    a message of one shard's size. Nothing else communicates.

    **Your task:** ``forward`` and ``backward`` (return ``dq, dk, dv, None, None``). Call it through
    :func:`kv_ring_attention`. The tests compare the output and the gradients of q, k, v with
    PyTorch's ``F.scaled_dot_product_attention`` on the whole sequence (sliced to the rank's rows), at
    t = 2 and 4, causal and not, and count the sends with the comm meter.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        # BEGIN SOLUTION
        t, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        n = q.shape[-2]
        tril = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out = lse = None
        k_j, v_j = k, v
        for i in range(t):
            if i > 0:  # pass the block on, receive the previous rank's
                k_j, v_j = _pass_to_next([k_j, v_j], group)
            j = (r - i) % t
            if causal and j > r:  # wholly in the future of every query of this rank
                continue
            scores = q @ k_j.transpose(-1, -2) * scale
            if causal and j == r:
                scores = scores.masked_fill(~tril, float("-inf"))
            lse_j = torch.logsumexp(scores, dim=-1)
            out_j = torch.exp(scores - lse_j[..., None]) @ v_j
            if out is None:  # step 0, the own block: every query sees at least itself
                out, lse = out_j, lse_j
            else:
                new = torch.logaddexp(lse, lse_j)
                out = torch.exp(lse - new)[..., None] * out + torch.exp(lse_j - new)[..., None] * out_j
                lse = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, dout):
        # BEGIN SOLUTION
        q, k, v, out, lse = ctx.saved_tensors
        causal, group = ctx.causal, ctx.group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        n = q.shape[-2]
        tril = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        delta = (dout * out).sum(-1, keepdim=True)  # D = rowsum(dO * O)
        dq = torch.zeros_like(q)
        k_j, v_j = k, v
        dk_j, dv_j = torch.zeros_like(k), torch.zeros_like(v)
        for i in range(t):
            if i > 0:  # the block and its accumulators move one hop together
                k_j, v_j = _pass_to_next([k_j, v_j], group)
                dk_j, dv_j = _pass_to_next([dk_j, dv_j], group)
            j = (r - i) % t
            if causal and j > r:
                continue
            scores = q @ k_j.transpose(-1, -2) * scale
            if causal and j == r:
                scores = scores.masked_fill(~tril, float("-inf"))
            p = torch.exp(scores - lse[..., None])  # exp(-inf) = 0 where masked
            dv_j = dv_j + p.transpose(-1, -2) @ dout
            ds = p * (dout @ v_j.transpose(-1, -2) - delta)
            dq = dq + ds @ k_j * scale
            dk_j = dk_j + ds.transpose(-1, -2) @ q * scale
        dk, dv = _pass_to_next([dk_j, dv_j], group)  # the t-th hop: each block's gradients come home
        return dq, dk, dv, None, None
        # END SOLUTION


def kv_ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                      group=None) -> torch.Tensor:
    """This rank's rows of attention over the whole sequence (see :class:`KVRingAttention`),
    differentiable. q, k, v: this rank's contiguous shard, ``(B, H, S/t, d)`` each."""
    _require_dist("kv_ring_attention")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be this rank's (B, H, S/t, d) shards, all the same shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    return KVRingAttention.apply(q, k, v, bool(causal), group)


# --- 6. the bytes of context parallelism: predicted, then counted -----------------------------------


def context_parallel_traffic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> dict:
    """Kind: measure

    Predict the bytes one rank sends for an attention layer under DeepSpeed-Ulysses and under ring
    attention, then count them.

    ``q, k, v`` are this rank's contiguous shards, ``(B, H, S/t, d)`` each, the same shapes on the t
    ranks of ``group``; the layer's hidden size is h = H·d, its sequence S, its element size e.

    1. **Predict**, before running anything, with the cost model
       (``minitorch_dist.costmodel``, its sequence-parallel formulas): the bytes this rank
       puts on the wire, forward and backward together, for Ulysses (four all-to-alls each way,
       Jacobs et al. 2023, §3.2) and for ring attention (K/V forward; K/V and the dK/dV accumulators
       backward, Liu et al. 2023, §3).
    2. **Measure**: run the library's ``ulysses_attention`` (``parallelism.sequence_parallel.ulysses``)
       and ``ring_attention`` (``parallelism.sequence_parallel.ring_attention``), non-causal, on
       detached copies of q, k, v that require grad, each forward and backward (of ``out.sum()``)
       inside one ``comm.meter()``, and read the wire bytes the meter counts.

    Return ``{"ulysses": {"predicted": bytes, "measured": bytes}, "ring": {"predicted": bytes,
    "measured": bytes}}``. The tests check the predictions against the formulas worked by hand, the
    measurements against their own meter, and require each prediction within 0.1 % of its
    measurement.
    """
    _require_dist("context_parallel_traffic")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be this rank's (B, H, S/t, d) shards, all the same shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    # BEGIN SOLUTION
    from minitorch_dist.parallelism.sequence_parallel.ring_attention import ring_attention
    from minitorch_dist.parallelism.sequence_parallel.ulysses import ulysses_attention

    b, heads, s_r, d = q.shape
    t = dist.get_world_size(group)
    seq, hidden, e = s_r * t, heads * d, q.element_size()
    predicted = {"ulysses": costmodel.ulysses_bytes_per_layer(b, seq, hidden, t, e),
                 "ring": costmodel.ring_attention_bytes_per_layer(b, seq, hidden, t, e)["total"]}
    out = {}
    for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
        q_, k_, v_ = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        with comm.meter() as m:
            fn(q_, k_, v_, group=group).sum().backward()
        out[name] = {"predicted": predicted[name], "measured": m.total_wire_bytes}
    return out
    # END SOLUTION
