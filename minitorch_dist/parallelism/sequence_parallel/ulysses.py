"""DeepSpeed-Ulysses: sequence parallelism by an all-to-all from sequence shards to head shards.

Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long
Sequence Transformer Models", §3 (Fig. 2: the design; §3.2: communication analysis).

Each of t ranks holds S/t consecutive tokens of every sequence (rank r: tokens [r·S/t, (r+1)·S/t)).
Everything in a transformer layer is per token except attention, which needs every key for every
query. But attention is independent per *head*. So just before attention, one all-to-all turns
the sequence-sharded q, k, v into head-sharded ones, and one all-to-all after it turns the output
back::

    q, k, v   (B, n_head, S/t, d)   each rank: all heads, its tokens
      | seq_to_heads  (all-to-all: rank r sends heads block j of its tokens to rank j)
    q, k, v   (B, n_head/t, S, d)   each rank: n_head/t heads, every token
      | ordinary attention over the full sequence (causal or not): heads never interact
    out       (B, n_head/t, S, d)
      | heads_to_seq  (the inverse all-to-all)
    out       (B, n_head, S/t, d)

The backward of an all-to-all is the inverse all-to-all (it is a permutation of the elements
over the ranks), so backward runs the same four transfers in reverse. The q, k, v projections
and the output projection are per-token, so they run on the local tokens with replicated
weights and no communication (:class:`UlyssesAttention`); their weight gradients are partial
sums over each rank's tokens and are summed over the group, like data-parallel gradients.

Cost (per rank, per layer): four all-to-alls of B·n_head·(S/t)·d elements forward (q, k, v in,
out back) and four backward, each putting (t-1)/t of its input on the wire:
``costmodel.ulysses_bytes_per_layer``. That falls as 1/t at fixed S, where Megatron-SP's and
ring attention's per-rank volumes do not. The degree is capped by the head count: t | n_head.
q, k and v are sent by three calls for clarity; DeepSpeed fuses them into one (same bytes,
fewer latencies).
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...runtime import comm


def _sp(group) -> tuple[int, int]:
    """(t, rank in the group); a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError("Ulysses sequence parallelism needs a process group: run this inside launch(fn, t)")
    return dist.get_world_size(group), dist.get_rank(group)


def _check_heads(n_head: int, t: int) -> int:
    if n_head % t:
        raise ValueError(f"n_head {n_head} is not divisible by the sequence-parallel degree {t}: Ulysses "
                         f"splits heads over the ranks for attention, so t must divide n_head; choose t "
                         f"among the divisors of {n_head} (or combine Ulysses with ring attention)")
    return n_head // t


def _check_seq(seq: int, t: int) -> int:
    if seq % t:
        raise ValueError(f"sequence length {seq} is not divisible by the sequence-parallel degree {t}: "
                         f"each rank holds S/t tokens; pad the sequence to a multiple of {t}")
    return seq // t


# --- the layout transform: one all-to-all each way ------------------------------------------------


def _seq_to_heads(x, group):
    """(B, n, S/t, d) sequence shard -> (B, n/t, S, d) head shard, by one all_to_all_single."""
    t, _ = _sp(group)
    B, n, s, d = x.shape
    per = _check_heads(n, t)
    # all_to_all_single sends input block j (of dim 0) to rank j: put the head blocks first.
    inp = x.reshape(B, t, per, s, d).permute(1, 0, 2, 3, 4).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    # out[i] came from rank i: its tokens (sequence chunk i) of our heads -> concatenate along S.
    return out.permute(1, 2, 0, 3, 4).reshape(B, per, t * s, d)


def _heads_to_seq(y, group):
    """(B, n/t, S, d) head shard -> (B, n, S/t, d) sequence shard: the inverse all-to-all."""
    t, _ = _sp(group)
    B, per, S, d = y.shape
    s = _check_seq(S, t)
    # Block j of dim 0 = sequence chunk j (rank j's tokens) of our heads.
    inp = y.reshape(B, per, t, s, d).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    # out[i] came from rank i: heads block i of our tokens -> concatenate along the heads.
    return out.permute(1, 0, 2, 3, 4).reshape(B, t * per, s, d)


class _SeqToHeads(torch.autograd.Function):
    """Forward: sequence-sharded -> head-sharded. Backward: the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: head-sharded -> sequence-sharded. Backward: the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _check_4d(x, name):
    if x.dim() != 4:
        raise ValueError(f"{name} must be (batch, n_head, seq_shard, head_dim), got shape {tuple(x.shape)}")


def seq_to_heads(x, group=None):
    """(B, n_head, S/t, d), this rank's tokens of all heads -> (B, n_head/t, S, d), all tokens of
    this rank's heads (heads [r·n_head/t, (r+1)·n_head/t)). One all-to-all forward, one backward."""
    _check_4d(x, "x")
    _check_heads(x.size(1), _sp(group)[0])
    return _SeqToHeads.apply(x, group)


def heads_to_seq(y, group=None):
    """(B, n_head/t, S, d) -> (B, n_head, S/t, d): the inverse of :func:`seq_to_heads`."""
    _check_4d(y, "y")
    _check_seq(y.size(2), _sp(group)[0])
    return _HeadsToSeq.apply(y, group)


def ulysses_attention(q, k, v, group=None, causal=False):
    """Attention of the full sequence from sequence shards (Jacobs et al. 2023, §3, Fig. 2).

    q, k, v: (B, n_head, S/t, d), this rank's S/t consecutive tokens (rank order = sequence
    order). Returns (B, n_head, S/t, d): this rank's rows of softmax(q kᵀ/√d [+ causal mask]) v
    computed over all S tokens. Four all-to-alls forward (q, k, v to heads; out back to the
    sequence), four backward. With ``causal`` the mask is the full sequence's (token i sees
    tokens <= i), which is right because the heads-sharded tensors hold the whole sequence in order.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(x, name)
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape (B, n_head, S/t, d); got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    t, _ = _sp(group)
    _check_heads(q.size(1), t)
    qh, kh, vh = (_SeqToHeads.apply(x, group) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal)
    return _HeadsToSeq.apply(out, group)


# --- the attention layer ---------------------------------------------------------------------------


class UlyssesAttention(nn.Module):
    """Causal self-attention on a sequence shard (B, S/t, H) -> (B, S/t, H).

    Built from a dense ``models.gpt.CausalSelfAttention`` with *replicated* weights (copies): the
    fused q|k|v projection and the output projection are per token, so each rank applies them to
    its own tokens; only attention itself goes through :func:`ulysses_attention`. Each rank's
    weight gradients cover its tokens only: the dense gradient is their sum over the group, which
    :meth:`allreduce_gradients` computes (in a full model this all-reduce is folded into the
    data-parallel one, over the data x sequence ranks: DeepSpeed's ZeRO does exactly that).
    """

    def __init__(self, c_attn: nn.Linear, c_proj: nn.Linear, head_dim: int, group=None):
        super().__init__()
        t, _ = _sp(group)
        self.n_head = c_attn.in_features // head_dim
        _check_heads(self.n_head, t)
        self.head_dim, self.group = head_dim, group
        self.c_attn, self.c_proj = c_attn, c_proj

    @classmethod
    def from_dense(cls, attn: nn.Module, group=None) -> "UlyssesAttention":
        if getattr(attn, "dropout", 0.0):
            raise ValueError(f"dropout {attn.dropout} is not supported here: attention dropout on head shards "
                             f"would draw different masks from the dense layer's; use GPTConfig(dropout=0.0)")
        return cls(copy.deepcopy(attn.c_attn), copy.deepcopy(attn.c_proj), attn.head_dim, group)

    def forward(self, x):
        B, s, _ = x.shape  # s = S/t local tokens
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (u.view(B, s, self.n_head, self.head_dim).transpose(1, 2) for u in (q, k, v))
        y = ulysses_attention(q, k, v, self.group, causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, s, -1))

    def allreduce_gradients(self):
        """Sum the replicated weights' gradients over the sequence-parallel group (in place)."""
        for p in self.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, group=self.group)
