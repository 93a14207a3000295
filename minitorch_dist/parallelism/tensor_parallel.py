"""Chapter 04 — tensor (intra-layer) model parallelism: the layers built on Megatron-LM's f / g.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism", §3 (Fig. 3: the MLP and self-attention split with the f and g operators; Fig. 4:
a layer's four communication operations; the vocab-parallel embedding and the cross-entropy
fused with the output layer). Narayanan et al.
2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §3.2
(tensor parallelism costs four all-reduces of b·s·h per layer per step, forward and backward).

A linear layer Y = X A splits two ways over t ranks:

    column parallel   A = [A_1 ... A_t]      Y_i = X A_i          (each rank: a slice of Y's columns)
    row parallel      A = [A_1; ...; A_t]    Y = sum_i X_i A_i    (each rank: a partial sum of Y)

An MLP is column-then-row: GeLU(X A_i) is elementwise, so it runs on the column slice with no
communication, and the row-parallel B_i finishes with one all-reduce. Attention is the same with
heads as the columns. Two conjugate operators carry all the communication (Fig. 3):

    f: forward identity,   backward all-reduce   (before a column-parallel layer: dL/dX = sum_i dL/dX_i)
    g: forward all-reduce, backward identity     (after a row-parallel layer:   Y = sum_i Y_i)

so a transformer layer costs 2 all-reduces forward (g after attention, g after MLP) and 2 backward
(f before each). The embedding is split by vocabulary rows (an all-reduce combines the ranks'
lookups) and the loss is computed on the vocabulary-sharded logits with three all-reduces of b·s
numbers, never gathering the b·s·V logits (those two live in :mod:`.tensor_parallel_vocab`).
f, g and the other region-crossing operators live in :mod:`.mappings` (re-exported here). The Llama's
layers (grouped-query attention with split or replicated kv heads, SwiGLU) are built on these in
:mod:`.tensor_parallel_llama`.

Every rank must slice the *same* dense weights. Each constructor that takes a dense module
(``from_dense``, :class:`ParallelMLP`, :class:`ParallelAttention`, :func:`parallelize_gpt`) first
broadcasts it from the group's first rank (:func:`.replicas.broadcast_from_first_rank`, as DDP
does), so a model built under a different seed on each rank still becomes one dense model's
tensor-parallel version. ``broadcast_weights=False`` skips that when the caller already did it.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.init import record_cut
from .mappings import (
    copy_to_tp,
    divide,
    gather_from_tp,
    reduce_from_tp,
    refuse_dropout,
    scatter_to_tp,
    size_and_rank,
)
from .replicas import broadcast_from_first_rank
from .tensor_parallel_vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from typing import Self  # typing's since 3.11; annotations are never evaluated here

    from ..models.gpt import GPT, MLP, CausalSelfAttention, GPTConfig

# --- layers ------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i^T + b_i with this rank's out_features/t rows of the weight (and of the bias).

    ``gather_output=True`` all-gathers Y = [Y_1 ... Y_t]; by default Y_i stays sharded, ready for
    a row-parallel layer (Megatron's MLP and attention never gather).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = False,
                 group: dist.ProcessGroup | None = None, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        t, _ = size_and_rank(group)
        like: dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.weight = nn.Parameter(torch.empty(divide(out_features, t, "out_features"), in_features, **like))
        self.bias = nn.Parameter(torch.zeros(self.weight.size(0), **like)) if bias else None
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None,
                   gather_output: bool = False, rows: torch.Tensor | None = None, *,
                   broadcast_weights: bool = True) -> Self:
        """This rank's shard of ``linear`` (first made the group's first rank's, unless
        ``broadcast_weights=False``): rows ``rows`` (default: the r-th contiguous block)."""
        t, r = size_and_rank(group)
        w = linear.weight
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group,
                device=w.device, dtype=w.dtype)
        if broadcast_weights:
            broadcast_from_first_rank(linear, group)
        n = m.weight.size(0)
        rows = torch.arange(r * n, (r + 1) * n) if rows is None else rows
        record_cut(m.weight, w.shape, 0, rows)  # where the shard comes from: deferred init (ch12)
        if m.bias is not None:
            record_cut(m.bias, linear.bias.shape, 0, rows)
        rows = rows.to(w.device)
        with torch.no_grad():
            m.weight.copy_(linear.weight[rows])
            if m.bias is not None:
                m.bias.copy_(linear.bias[rows])
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = g(X_i A_i^T) + b with this rank's in_features/t columns of the weight; b replicated
    (added once, after the sum). ``input_is_parallel=False`` first takes X_i from a full X."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = True,
                 group: dist.ProcessGroup | None = None, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        t, _ = size_and_rank(group)
        like: dict[str, Any] = {"device": device, "dtype": dtype}
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.weight = nn.Parameter(torch.empty(out_features, divide(in_features, t, "in_features"), **like))
        self.bias = nn.Parameter(torch.zeros(out_features, **like)) if bias else None
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group: dist.ProcessGroup | None = None,
                   input_is_parallel: bool = True, *, broadcast_weights: bool = True) -> Self:
        """This rank's columns of ``linear`` (first made the group's first rank's, unless
        ``broadcast_weights=False``); the bias whole."""
        t, r = size_and_rank(group)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group,
                device=linear.weight.device, dtype=linear.weight.dtype)
        if broadcast_weights:
            broadcast_from_first_rank(linear, group)
        n = m.weight.size(1)
        record_cut(m.weight, linear.weight.shape, 1, range(r * n, (r + 1) * n))  # deferred init (ch12)
        with torch.no_grad():
            m.weight.copy_(linear.weight[:, r * n:(r + 1) * n])
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """Megatron's MLP (§3, Fig. 3a): c_fc column-parallel, GeLU on the slice, c_proj row-parallel.
    One f (backward all-reduce) and one g (forward all-reduce); names as in the dense ``MLP``.
    ``mlp`` is first made the group's first rank's (``broadcast_weights=False``: already is)."""

    def __init__(self, mlp: MLP, group: dist.ProcessGroup | None = None, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        divide(mlp.c_fc.out_features, size_and_rank(group)[0], "MLP hidden width (mlp_ratio * n_embd)")
        if broadcast_weights:
            broadcast_from_first_rank(mlp, group)
        self.c_fc = ColumnParallelLinear.from_dense(mlp.c_fc, group, broadcast_weights=False)
        self.gelu = mlp.gelu
        self.c_proj = RowParallelLinear.from_dense(mlp.c_proj, group, broadcast_weights=False)
        self.dropout = mlp.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


def head_rows(n_head: int, head_dim: int, t: int, r: int) -> torch.Tensor:
    """Rows of the fused q|k|v weight (3·n_head·head_dim rows) holding rank r's n_head/t heads, in
    the order q_r | k_r | v_r, so that ``chunk(3)`` of the local output splits q, k, v again."""
    per = n_head // t
    heads = torch.arange(r * per, (r + 1) * per)
    within = (heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)  # one of q, k, v
    return torch.cat([part * n_head * head_dim + within for part in range(3)])


class ParallelAttention(nn.Module):
    """Megatron's self-attention (§3, Fig. 3b): each rank runs n_head/t heads. c_attn (the fused
    q|k|v) is column-parallel per head; c_proj is row-parallel over the heads' outputs.
    ``attn`` is first made the group's first rank's (``broadcast_weights=False``: already is)."""

    def __init__(self, attn: CausalSelfAttention, group: dist.ProcessGroup | None = None, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        t, r = size_and_rank(group)
        n_head = attn.c_attn.in_features // attn.head_dim
        divide(n_head, t, "n_head")
        if broadcast_weights:
            broadcast_from_first_rank(attn, group)
        self.head_dim, self.dropout = attn.head_dim, attn.dropout
        rows = head_rows(n_head, attn.head_dim, t, r)
        self.c_attn = ColumnParallelLinear.from_dense(attn.c_attn, group, rows=rows, broadcast_weights=False)
        self.c_proj = RowParallelLinear.from_dense(attn.c_proj, group, broadcast_weights=False)
        self.resid_dropout = attn.resid_dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (u.view(B, T, -1, self.head_dim).transpose(1, 2) for u in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


# --- the whole GPT -----------------------------------------------------------------------------


class TensorParallelGPT(nn.Module):
    """The GPT with Megatron's layers: ``model(idx, targets) -> (logits_local, loss)``.

    ``logits_local`` is this rank's (B, T, V/t) vocabulary shard (``gather_from_tp`` makes the
    full logits); ``loss`` is the same number on every rank. Parameter names are the dense
    model's, each holding this rank's shard; LayerNorms, wpe and row-parallel biases are
    replicated and receive identical gradients on every rank (their inputs are replicated).
    ``dense`` is first made the group's first rank's (``broadcast_weights=False``: already is).
    """

    def __init__(self, dense: GPT, group: dist.ProcessGroup | None = None, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        cfg = dense.cfg
        t, _ = size_and_rank(group)
        divide(cfg.n_head, t, "n_head")  # hence n_embd and the MLP width divide too
        divide(cfg.vocab_size, t, "vocab_size")
        refuse_dropout(cfg.dropout, "tensor-parallel dropout needs Megatron's two RNG streams (same mask in "
                                    "replicated regions, different in sharded ones)")
        self.cfg, self.group = cfg, group
        if broadcast_weights:  # once, for the whole model: every rank slices the same dense weights
            broadcast_from_first_rank(dense, group)
        self.wte = VocabParallelEmbedding.from_dense(dense.wte, group, broadcast_weights=False)
        # copies: the dense model stays as it was; replicated pieces keep their full weights
        self.wpe, self.drop, self.ln_f = (copy.deepcopy(m) for m in (dense.wpe, dense.drop, dense.ln_f))
        self.blocks = copy.deepcopy(dense.blocks)
        block: Any  # a copied dense Block, until its attention and MLP are swapped
        for block in self.blocks:  # attention and MLP swapped for their TP versions, the rest replicated
            block.attn = ParallelAttention(block.attn, group, broadcast_weights=False)
            block.mlp = ParallelMLP(block.mlp, group, broadcast_weights=False)
        # output layer: column-parallel over the vocabulary, sharing wte's shard when tied
        self.lm_head = ColumnParallelLinear.from_dense(dense.lm_head, group, broadcast_weights=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        T = idx.size(1)
        h = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))  # (B, T, V/t): this rank's vocabulary shard
        return logits, None if targets is None else self.loss_fn(logits, targets)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy from the vocabulary-sharded logits, without gathering them."""
        return vocab_parallel_cross_entropy(logits, targets, self.group)


def parallelize_gpt(model: GPT, group: dist.ProcessGroup | None = None, *,
                    broadcast_weights: bool = True) -> TensorParallelGPT:
    """Turn a dense ``GPT`` into its tensor-parallel version with the same weights: each rank keeps
    its slice. Like DDP, ``model``'s parameters are first overwritten with those of the group's first
    rank (one broadcast per tensor; otherwise ``model`` is left unchanged), so ranks that built it
    under different seeds still hold slices of one model: the first rank's."""
    return TensorParallelGPT(model, group, broadcast_weights=broadcast_weights)


def shard_dense_tensors(tensors: dict, cfg: GPTConfig, group: dist.ProcessGroup | None = None) -> dict:
    """This rank's shards of per-parameter dense tensors (weights, gradients, Adam moments), keyed
    by the dense GPT's parameter names, in ``TensorParallelGPT``'s layout: loaded into a dense GPT
    as its weights, which :func:`parallelize_gpt` then splits. Compare a TP model against a dense
    reference with ``shard_dense_tensors({k: p.grad ...}, cfg)``."""
    from ..models.gpt import GPT

    return shard_through(GPT(cfg), tensors, lambda m: parallelize_gpt(m, group, broadcast_weights=False))


def shard_through(holder: nn.Module, tensors: dict, parallelize: Callable[[Any], nn.Module]) -> dict:
    """Load ``tensors`` (dense, keyed by ``holder``'s parameter names) into ``holder`` as its weights and
    return what ``parallelize(holder)`` keeps on this rank, by name: the TP layout of any tensor, written
    once, in the parallelizer itself. ``parallelize`` must not broadcast: the tensors are this rank's own
    (e.g. its gradients), sliced as they are."""
    with torch.no_grad():
        for k, q in holder.named_parameters():
            q.copy_(tensors[k])
    return {k: q.detach() for k, q in parallelize(holder).named_parameters()}
