"""Chapter 05 — ring attention: exact attention over a sequence split over t ranks, K/V passed round a ring.

Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for Near-Infinite Context"
(arXiv:2310.01889), §3. Each of t ranks holds S/t consecutive tokens' q, k, v. Attention needs
every query against every key, so the K/V blocks travel round a ring: in step s rank r holds the
block that rank r-s owns, attends its own queries to it, and meanwhile passes it on to rank r+1.
After t steps every query has seen every key, and no rank ever held more than two K/V blocks or
built more than one (S/t) x (S/t) block of scores -- the S x S matrix is never materialised.

The blocks are combined with the online softmax (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"; FlashAttention, Dao et al. 2022, §3.1). Attention of query rows against
one key block j is (out_j, lse_j): ``lse_j = log sum_k exp(s_k)``, ``out_j = sum_k softmax_j(s)_k v_k``.
Two blocks merge exactly::

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b

an associative, commutative operation, so the ring may visit blocks in any order.

The attention of a query block to one key block is FlashAttention-2 itself (chapter 11): the Triton
kernel of :mod:`minitorch_dist.kernels.flash_attention` for CUDA tensors, its tiled PyTorch twin
:mod:`minitorch_dist.kernels.attention_tiled` elsewhere -- one implementation of the block math in
the library; the ring adds only the passing of blocks and the merge.

Backward (FlashAttention §3.1 and Appendix B.2): nothing of size S x S is saved; per block the
probabilities are recomputed from the saved q, k, v and the final lse, ``P = exp(qk^T·scale - lse)``,
and with ``D = rowsum(dO ∘ O)``::

    dV = P^T dO,   dP = dO V^T,   dS = P ∘ (dP - D),   dQ = dS K · scale,   dK = dS^T Q · scale

dQ stays on the query's rank. dK, dV of a block belong to the block's owner: the owner starts an
accumulator, every rank that holds the block adds its part and passes the accumulator one hop on
(behind the K/V it goes with), and after t hops it is home. Per rank, with ``blk = B·n_head·(S/t)·head_dim``
elements: the forward sends t-1 K/V pairs, ``2(t-1)·blk``; the backward sends the same t-1 K/V pairs
plus t dK/dV pairs, ``(4t-2)·blk`` (dK/dV in the accumulation dtype: float32 for half inputs).

Grouped-query attention (Ainslie et al. 2023; the Llama): k and v may have n_kv_head < n_head heads.
Nothing in the ring splits heads -- every rank keeps all of them and splits the *sequence* -- so any
n_kv_head dividing n_head works, at any t: the blocks travelling the ring are simply n_head/n_kv_head
times smaller (``blk`` above counts n_kv_head heads for K, V and dK, dV), and FlashAttention-2's block
math already reads kv head j // (n_head/n_kv_head) for query head j and sums a kv head's gradient over
its group. (Ulysses, which splits heads, is limited to t <= n_kv_head: :mod:`.ulysses`.)

Causal attention and load balance. With the *contiguous* layout rank r holds tokens
[r S/t, (r+1) S/t): it attends fully to the r blocks before it, to its own block under a lower
triangular mask, and skips the t-1-r blocks after it -- rank t-1 does t times the work of rank 0.
The *zigzag* layout splits the sequence into 2t chunks and gives rank r chunks r and 2t-1-r, an
early and a late one, so every rank computes the same 2t+1 chunk pairs (the layout of
zhuzilin/ring-flash-attention's "zigzag" ring attention, and, as we read it, of the 2×CP chunks
of Llama 3's context parallelism, Dubey et al. 2024 §3.3.2, which gathers K/V with an all-gather
rather than a ring; Brandon et al. 2023, "Striped Attention", balance the same work by striping
tokens round-robin instead). Both layouts apply one rule per (query chunk a,
key chunk b) of the global chunk order: b < a full, b == a diagonal mask, b > a skipped.

Every score block computed is announced (:mod:`runtime.observe`) as two counts, ``"forward
score entries"`` += Sq·Sk and ``"forward flops"`` += 4·B·h·Sq·Sk·d (``"backward ..."``: 10·B·h·Sq·Sk·d,
five matmuls); a :class:`analysis.observers.Recorder` sums them (its ``totals``), per rank.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...kernels.attention_tiled import tiled_attention_backward, tiled_attention_forward
from ...runtime import comm, observe, require_process_group

LAYOUTS = ("contiguous", "zigzag")

# --- one block: attention of a query block to a key block, and the merge ------------------------------


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # Half-precision inputs accumulate in float32, as FlashAttention does on chip.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (a row that saw no key) replaced by 0, so ``x - lse`` is never -inf - -inf = NaN."""
    return torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)


def _block_math(q):
    """(forward, backward) of chapter 11's FlashAttention-2 for these tensors: the Triton kernels when
    they are compiled for CUDA and take this dtype and head size, else the tiled PyTorch version."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16, torch.float32) and 16 <= q.shape[-1] <= 128:
        from ... import kernels  # Triton: imported only where it will run

        if kernels.backend() == "cuda":
            from ...kernels.flash_attention import flash_attention_backward, flash_attention_forward

            return flash_attention_forward, flash_attention_backward
    return tiled_attention_forward, tiled_attention_backward


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of query block q (..., Sq, d) to one key block k, v (..., Sk, d): ``(out, lse)``.

    ``s = q k^T · scale``, masked above the diagonal when ``causal`` (query i sees key j iff j <= i);
    ``lse = logsumexp_k s`` (..., Sq), -inf for a row that sees no key of this block; ``out =
    softmax(s) v``, 0 for such a row. Computed by FlashAttention-2 (:func:`_block_math`): no (Sq, Sk)
    block of scores is ever materialised, only tiles of it.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    forward, _ = _block_math(q)
    out, lse = forward(q, k, v, causal=causal, scale=scale)
    _announce_block("forward", q, k)
    return out, lse.to(out.dtype)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine the attention of the same queries to two disjoint key sets: ``(out, lse)``.

    ``lse = logaddexp(lse_a, lse_b)``, ``out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b``.
    Associative and commutative; a side with lse = -inf (it saw no key) has weight 0, and when
    both do the row stays (0, -inf) -- no NaN.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    safe = _finite(lse)
    w_a = torch.exp(lse_a - safe)[..., None]
    w_b = torch.exp(lse_b - safe)[..., None]
    return w_a * out_a + w_b * out_b, lse


def attention_block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                             dout: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one block, recomputed FlashAttention-style: ``(dq, dk, dv)``.

    ``lse`` is the *final* log-sum-exp of each query row over all keys and ``delta = rowsum(dO ∘ O)``
    with the final O, so ``P = exp(s - lse)`` is this block's slice of the full softmax and
    ``dS = P ∘ (dO V^T - delta)`` its slice of the softmax's Jacobian-vector product
    (FlashAttention-2's backward, :func:`_block_math`).
    """
    _, backward = _block_math(q)
    grads = backward(q, k, v, dout, lse, delta, causal=causal, scale=scale)
    _announce_block("backward", q, k)
    return grads


def _announce_block(which, q, k):
    """Announce one score block of pass ``which`` (module docstring): its Sq·Sk entries and its FLOPs,
    4·B·h·Sq·Sk·d forward (two matmuls), 10·B·h·Sq·Sk·d backward (five)."""
    if observe.watched():
        sq, sk, d = q.shape[-2], k.shape[-2], q.shape[-1]
        batch_heads = q.numel() // (sq * d)
        observe.count(f"{which} score entries", sq * sk)
        observe.count(f"{which} flops", (4 if which == "forward" else 10) * batch_heads * sq * sk * d)


# --- the layouts: which chunks of the sequence a rank holds ---------------------------------------------


def _check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")


def sequence_chunks(rank: int, t: int, layout: str = "contiguous") -> list:
    """Global chunk indices rank ``rank`` holds, in order: [r] of t chunks, or [r, 2t-1-r] of 2t (zigzag)."""
    _check_layout(layout)
    return [rank] if layout == "contiguous" else [rank, 2 * t - 1 - rank]


def _check_divisible(n, t, layout):
    parts = t if layout == "contiguous" else 2 * t
    if n % parts:
        what = f"t={t}" if layout == "contiguous" else f"2*t={parts}"
        raise ValueError(f"sequence length {n} is not divisible by {what} for the {layout} layout")
    return n // parts


def shard_sequence(x: torch.Tensor, t: int, rank: int, dim: int = -2,
                   layout: str = "contiguous") -> torch.Tensor:
    """Rank ``rank``'s part of the full sequence ``x`` along ``dim`` under ``layout``."""
    _check_layout(layout)
    _check_divisible(x.shape[dim], t, layout)
    parts = x.chunk(t if layout == "contiguous" else 2 * t, dim)
    return torch.cat([parts[c] for c in sequence_chunks(rank, t, layout)], dim)


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int = -2,
                     layout: str = "contiguous") -> torch.Tensor:
    """The full sequence from the list of every rank's shard (rank order): inverse of shard_sequence."""
    _check_layout(layout)
    t = len(shards)
    chunks: list[Any] = [None] * (t if layout == "contiguous" else 2 * t)  # every one filled below
    for r, s in enumerate(shards):
        for c, piece in zip(sequence_chunks(r, t, layout), s.chunk(len(sequence_chunks(r, t, layout)), dim)):
            chunks[c] = piece
    return torch.cat(chunks, dim)


def zigzag_shard(x: torch.Tensor, t: int, rank: int, dim: int = -2) -> torch.Tensor:
    """Chunks ``rank`` and ``2t-1-rank`` of ``x`` cut into 2t along ``dim``, concatenated."""
    return shard_sequence(x, t, rank, dim, "zigzag")


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = -2) -> torch.Tensor:
    return unshard_sequence(shards, dim, "zigzag")


def contiguous_shard(x: torch.Tensor, t: int, rank: int, dim: int = -2) -> torch.Tensor:
    return shard_sequence(x, t, rank, dim, "contiguous")


def contiguous_unshard(shards: Sequence[torch.Tensor], dim: int = -2) -> torch.Tensor:
    return unshard_sequence(shards, dim, "contiguous")


def sequence_positions(seq_len: int, t: int, rank: int, layout: str = "contiguous") -> torch.Tensor:
    """Global token positions of rank ``rank``'s shard (e.g. for position embeddings)."""
    return shard_sequence(torch.arange(seq_len), t, rank, 0, layout)


def block_plan(r: int, j: int, t: int, s_local: int, causal: bool,
               layout: str) -> list[tuple[slice, slice, bool]]:
    """(query slice, key slice, diagonal?) pieces of rank r's queries against rank j's keys.

    Non-causal: the whole block. Causal: per (query chunk a, key chunk b) in global chunk order,
    b < a attends fully, b == a under the lower-triangular mask, b > a (the future) is skipped.
    """
    if not causal:
        return [(slice(None), slice(None), False)]
    qc, kc = sequence_chunks(r, t, layout), sequence_chunks(j, t, layout)
    c = s_local // len(qc)
    pieces = []
    for ai, a in enumerate(qc):
        for bi, b in enumerate(kc):
            if b <= a:
                pieces.append((slice(ai * c, (ai + 1) * c), slice(bi * c, (bi + 1) * c), b == a))
    return pieces


# --- the ring ---------------------------------------------------------------------------------------------


def _ring_peers(group: dist.ProcessGroup | None):
    """(t, this rank's index in the ring, global rank of the next, of the previous)."""
    require_process_group("ring attention")
    t, r = dist.get_world_size(group), dist.get_rank(group)
    glob = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    return t, r, glob((r + 1) % t), glob((r - 1) % t)


def _pass_on(tensors, nxt, prv, group: dist.ProcessGroup | None):
    """Send ``tensors`` to the next rank, receive same-shaped ones from the previous: (received, works)."""
    received = [torch.empty_like(x) for x in tensors]
    ops = [dist.P2POp(dist.isend, x, nxt, group) for x in tensors]
    ops += [dist.P2POp(dist.irecv, y, prv, group) for y in received]
    return received, comm.batch_isend_irecv(ops)


def _wait(works):
    for w in works:
        w.wait()


class RingAttention(torch.autograd.Function):
    """softmax(q k^T · scale [+ causal mask]) v over the whole sequence, with q, k, v sharded by rank."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None,
                causal: bool, layout: str, scale: float) -> torch.Tensor:
        t, r, nxt, prv = _ring_peers(group)
        acc = _acc_dtype(q.dtype)
        B, h, n, d = q.shape
        plans = [block_plan(r, (r - s) % t, t, n, causal, layout) for s in range(t)]
        out = torch.zeros(B, h, n, d, dtype=acc, device=q.device)
        lse = torch.full((B, h, n), float("-inf"), dtype=acc, device=q.device)
        qa, k_cur, v_cur = q.to(acc), k, v
        for s in range(t):
            if s < t - 1:  # start passing the block on; the transfer overlaps the block's compute
                (k_nxt, v_nxt), works = _pass_on([k_cur, v_cur], nxt, prv, group)
            for qs, ks, diag in plans[s]:  # diag: the chunk pair on the diagonal, causally masked
                o, l = attention_block(qa[..., qs, :], k_cur[..., ks, :].to(acc), v_cur[..., ks, :].to(acc),
                                       diag, scale)
                out[..., qs, :], lse[..., qs] = merge_attention(out[..., qs, :], lse[..., qs], o, l)
            if s < t - 1:
                _wait(works)
                k_cur, v_cur = k_nxt, v_nxt
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.plans, ctx.scale = group, plans, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        t, r, nxt, prv = _ring_peers(ctx.group)
        acc, scale = _acc_dtype(q.dtype), ctx.scale
        qa, do = q.to(acc), dout.to(acc)
        delta = (do * out.to(acc)).sum(-1)  # D = rowsum(dO ∘ O)
        dq = torch.zeros_like(qa)
        k_cur, v_cur, dkv_in, dkv_works = k, v, None, None
        for s in range(t):
            if s < t - 1:
                (k_nxt, v_nxt), kv_works = _pass_on([k_cur, v_cur], nxt, prv, ctx.group)
            dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_blk = torch.zeros_like(dk_blk)
            for qs, ks, diag in ctx.plans[s]:
                g_q, g_k, g_v = attention_block_backward(
                    qa[..., qs, :], k_cur[..., ks, :].to(acc), v_cur[..., ks, :].to(acc),
                    diag, scale, do[..., qs, :], lse[..., qs], delta[..., qs])
                dq[..., qs, :] += g_q
                dk_blk[..., ks, :] += g_k
                dv_blk[..., ks, :] += g_v
            if s > 0:  # add what the ranks before us accumulated for this block, then pass it on
                _wait(dkv_works)
                dk_blk += dkv_in[0]
                dv_blk += dkv_in[1]
            if t > 1:
                dkv_in, dkv_works = _pass_on([dk_blk, dv_blk], nxt, prv, ctx.group)
            if s < t - 1:
                _wait(kv_works)
                k_cur, v_cur = k_nxt, v_nxt
        if t > 1:  # the t-th hop brings our own block's dK, dV home
            _wait(dkv_works)
            dk_blk, dv_blk = dkv_in
        return dq.to(q.dtype), dk_blk.to(k.dtype), dv_blk.to(v.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: dist.ProcessGroup | None = None,
                   causal: bool = False, layout: str = "contiguous",
                   scale: float | None = None) -> torch.Tensor:
    """Exact attention of this rank's shard of the sequence to the whole sequence, over a ring.

    q: this rank's shard, (B, n_head, S/t, head_dim), cut from the full sequence by
    ``shard_sequence(x, t, rank, -2, layout)``; k, v: (B, n_kv_head, S/t, head_dim), n_kv_head dividing
    n_head (grouped-query attention: query head j reads kv head j // (n_head / n_kv_head)). The result
    is this rank's shard of ``F.scaled_dot_product_attention(Q, K, V, is_causal=causal, scale=scale,
    enable_gqa=True)``.
    Every rank of ``group`` must call it with same-shaped shards; any strides (a transposed or
    sliced view is made contiguous first: the ring sends k and v, and a transfer needs one block).
    """
    _check_layout(layout)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be (B, n_head, S/t, head_dim); got dims {q.dim()}, "
                         f"{k.dim()}, {v.dim()}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"head_dim of q ({q.shape[-1]}) and k ({k.shape[-1]}) differ")
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q, k, v shards must share batch, local sequence and head_dim, and k, v the same "
                         f"shape (self-attention); got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_head {q.shape[1]} is not divisible by n_kv_head {k.shape[1]}: with "
                         f"grouped-query attention each key/value head serves a whole group of query heads")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"local sequence length {q.shape[-2]} is odd: a zigzag shard holds two equal "
                         f"chunks, so the sequence length must be divisible by 2*t")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    q, k, v = (x.contiguous() for x in (q, k, v))  # a no-op for contiguous shards
    return RingAttention.apply(q, k, v, group, causal, layout, scale)
