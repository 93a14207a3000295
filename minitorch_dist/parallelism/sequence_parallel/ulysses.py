"""Chapter 05 — DeepSpeed-Ulysses: sequence parallelism by an all-to-all from sequence to head shards.

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

Grouped-query attention (Ainslie et al. 2023; the Llama, :class:`UlyssesGQAAttention`): k and v have
n_kv_head < n_head heads, and query head j reads kv head j // (n_head/n_kv_head). The all-to-all of
q hands rank r query heads [r·n_head/t, (r+1)·n_head/t); the all-to-all of k and v can only hand out
*whole kv heads*, n_kv_head/t of them -- which are exactly the kv heads those query heads read when t
divides n_kv_head. So the degree is capped by the kv heads, not the query heads: **t <= n_kv_head,
t | n_kv_head** (Llama 3: 8 kv heads, so Ulysses alone stops at t = 8 where its 32 to 128 query heads
would allow more). Beyond it each kv head would have to be copied to t/n_kv_head ranks before the
all-to-all (more bytes, and their gradients summed back), or the sequence split by ring attention
instead, which splits no heads. The k, v all-to-alls are n_head/n_kv_head times smaller than q's.

The two all-to-alls, :func:`seq_to_heads` and :func:`heads_to_seq`, live in :mod:`..mappings` with
every other region crossing (re-exported here).
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...models.llama import causal_attention, split_heads
from ...runtime import comm
from ..mappings import heads_per_rank, heads_to_seq, refuse_dropout, seq_to_heads, size_and_rank
from ..replicas import broadcast_from_first_rank

if TYPE_CHECKING:
    from ...models.gpt import CausalSelfAttention
    from ...models.llama import LlamaAttention

__all__ = ["seq_to_heads", "heads_to_seq", "ulysses_attention", "check_ulysses_degree", "UlyssesAttention",
           "UlyssesGQAAttention"]


def _check_4d(x, name):
    if x.dim() != 4:
        raise ValueError(f"{name} must be (batch, n_head, seq_shard, head_dim), got shape {tuple(x.shape)}")


def check_ulysses_degree(n_head: int, n_kv_head: int, t: int) -> None:
    """A ``ValueError`` naming the allowed degrees unless Ulysses can split these heads over t ranks:
    t | n_head, and with grouped-query attention (n_kv_head < n_head) t | n_kv_head too."""
    if n_kv_head == n_head:
        heads_per_rank(n_head, t)
        return
    if n_kv_head % t:
        ok = tuple(d for d in range(1, n_kv_head + 1) if n_kv_head % d == 0)
        raise ValueError(f"Ulysses needs t <= n_kv_head and t dividing n_kv_head: n_kv_head={n_kv_head}, "
                         f"t={t}; use t in {ok} or ring attention (its all-to-all of k, v can only hand out "
                         f"whole kv heads)")


# --- attention on sequence shards ------------------------------------------------------------------


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      group: dist.ProcessGroup | None = None, causal: bool = False) -> torch.Tensor:
    """Attention of the full sequence from sequence shards (Jacobs et al. 2023, §3, Fig. 2).

    q, k, v: (B, n_head, S/t, d), this rank's S/t consecutive tokens (rank order = sequence
    order); with grouped-query attention k, v are (B, n_kv_head, S/t, d) and t must divide n_kv_head.
    Returns (B, n_head, S/t, d): this rank's rows of softmax(q kᵀ/√d [+ causal mask]) v computed
    over all S tokens. Four all-to-alls forward (q, k, v to heads; out back to the
    sequence), four backward. With ``causal`` the mask is the full sequence's (token i sees
    tokens <= i), which is right because the heads-sharded tensors hold the whole sequence in order.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_4d(x, name)
    gqa = k.size(1) != q.size(1)
    same_tokens = q.size(0) == k.size(0) and q.size(2) == k.size(2) and q.size(3) == k.size(3)
    if k.shape != v.shape or not same_tokens or q.size(1) % k.size(1):
        raise ValueError(f"q, k, v must have the same shape (B, n_head, S/t, d), or k, v (B, n_kv_head, S/t, "
                         f"d) with n_kv_head dividing n_head; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    t, _ = size_and_rank(group, "Ulysses sequence parallelism")
    check_ulysses_degree(q.size(1), k.size(1), t)
    qh, kh, vh = (seq_to_heads(x, group) for x in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=causal, enable_gqa=gqa)
    return heads_to_seq(out, group)


# --- the attention layer ---------------------------------------------------------------------------


class UlyssesAttention(nn.Module):
    """Causal self-attention on a sequence shard (B, S/t, H) -> (B, S/t, H).

    Built from a dense ``models.gpt.CausalSelfAttention`` with *replicated* weights (copies): the
    fused q|k|v projection and the output projection are per token, so each rank applies them to
    its own tokens; only attention itself goes through :func:`ulysses_attention`. Each rank's
    weight gradients cover its tokens only: the dense gradient is their sum over the group, which
    :meth:`allreduce_gradients` computes (in a full model this all-reduce is folded into the
    data-parallel one, over the data x sequence ranks: DeepSpeed's ZeRO does exactly that).

    The replicas must start equal: the projections are made the group's first rank's (one
    broadcast per tensor, as DDP does; ``broadcast_weights=False`` when they already are), so
    ranks that built the dense layer under different seeds still compute one layer.
    """

    def __init__(self, c_attn: nn.Linear, c_proj: nn.Linear, head_dim: int,
                 group: dist.ProcessGroup | None = None, *, broadcast_weights: bool = True) -> None:
        super().__init__()
        t, _ = size_and_rank(group, "Ulysses sequence parallelism")
        self.n_head = c_attn.in_features // head_dim
        heads_per_rank(self.n_head, t)
        self.head_dim, self.group = head_dim, group
        self.c_attn, self.c_proj = c_attn, c_proj
        if broadcast_weights:
            broadcast_from_first_rank(self, group)

    @classmethod
    def from_dense(cls, attn: CausalSelfAttention, group: dist.ProcessGroup | None = None, *,
                   broadcast_weights: bool = True) -> UlyssesAttention:
        """Copies of ``attn``'s projections (``attn`` itself is left unchanged), the first rank's."""
        refuse_dropout(getattr(attn, "dropout", 0.0), "attention dropout on head shards would draw "
                                                       "different masks from the dense layer's")
        return cls(copy.deepcopy(attn.c_attn), copy.deepcopy(attn.c_proj), attn.head_dim, group,
                   broadcast_weights=broadcast_weights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, s, _ = x.shape  # s = S/t local tokens
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (u.view(B, s, self.n_head, self.head_dim).transpose(1, 2) for u in (q, k, v))
        y = ulysses_attention(q, k, v, self.group, causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, s, -1))

    def allreduce_gradients(self) -> None:
        """Sum the replicated weights' gradients over the sequence-parallel group (in place)."""
        for p in self.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, group=self.group)


class UlyssesGQAAttention(nn.Module):
    """The Llama's grouped-query attention with RoPE on a sequence shard (B, S/t, H) -> (B, S/t, H).

    Built from a dense ``models.llama.LlamaAttention`` with replicated copies of q_proj, k_proj, v_proj
    and o_proj (the first rank's: broadcast unless ``broadcast_weights=False``), as
    :class:`UlyssesAttention`. After the all-to-alls each rank holds n_head/t query heads and the
    n_kv_head/t kv heads they read over the *whole* sequence, so RoPE is applied there at positions
    0..S-1 and the dense layer's own ``causal_attention`` runs unchanged. Needs t | n_kv_head
    (:func:`check_ulysses_degree`); :meth:`allreduce_gradients` sums the replicas' weight gradients.
    """

    q_proj: nn.Linear; k_proj: nn.Linear; v_proj: nn.Linear; o_proj: nn.Linear  # copies, set in __init__

    def __init__(self, attn: LlamaAttention, group: dist.ProcessGroup | None = None, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        t, _ = size_and_rank(group, "Ulysses sequence parallelism")
        self.head_dim, self.rope_theta, self.group = attn.head_dim, attn.rope_theta, group
        self.n_head = attn.q_proj.out_features // self.head_dim
        self.n_kv_head = attn.k_proj.out_features // self.head_dim
        check_ulysses_degree(self.n_head, self.n_kv_head, t)
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, copy.deepcopy(getattr(attn, name)))
        if broadcast_weights:
            broadcast_from_first_rank(self, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (split_heads(p(x), self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        qh, kh, vh = (seq_to_heads(u, self.group) for u in (q, k, v))  # (B, heads/t, S, d)
        positions = torch.arange(qh.size(2), device=x.device)  # the whole sequence, in order
        y = heads_to_seq(causal_attention(qh, kh, vh, positions, self.rope_theta), self.group)
        return self.o_proj(y.transpose(1, 2).flatten(2))

    def allreduce_gradients(self) -> None:
        """Sum the replicated weights' gradients over the sequence-parallel group (in place)."""
        for p in self.parameters():
            if p.grad is not None:
                comm.all_reduce(p.grad, group=self.group)
