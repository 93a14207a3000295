"""Chapter 05 — Megatron sequence parallelism: the regions TP leaves replicated, split along the sequence.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.2.2
(Fig. 5: the layer with tensor + sequence parallelism; Fig. 6: the MLP with the conjugate
operators g and ḡ) and §4.1 / Table 2 (activation memory per layer). Built on chapter 04's
column- and row-parallel layers (:mod:`..tensor_parallel`, Shoeybi et al. 2019 §3).

Tensor parallelism (TP) shards attention and the MLP over t ranks, but the LayerNorms, the
dropouts and the residual adds between them run on the whole (b, s, h) activation on every rank:
10·s·b·h of the 34·s·b·h bytes a layer stores (16-bit) are not divided by t. These ops are
independent along the sequence, so sequence parallelism (SP) runs them on s/t positions per rank.
The two regions meet at the layers' edges, where TP's f / g become (sequence is dim 1 of (b, s, h)):

    g: forward all-gather  along s  (Y_1^s ... Y_t^s -> Y),   backward reduce-scatter  (replaces f)
    ḡ: forward reduce-scatter along s (sum_i W_i -> W_r^s),   backward all-gather      (replaces g)

so a layer is  Y^s = LN(X^s);  Z_i = ColumnLinear(g(Y^s));  W_r^s = ḡ(RowLinear(Z_i)) + bias;
residual  X^s + W^s  — all on the slice. An all-reduce *is* a reduce-scatter followed by an
all-gather, each moving (t-1)/t of the buffer on a ring: 2 all-gathers + 2 reduce-scatters per
layer forward (and backward) send exactly the bytes of TP's 2 + 2 all-reduces, while every
activation outside attention/MLP shrinks by t. Per layer (16-bit, selective recompute):

    TP:       s·b·h·(10 + 24/t)        TP + SP:  34·s·b·h / t

The 34/t needs one more trick (§4.2.2): the column-parallel layer's weight
gradient needs the gathered input Y, so instead of storing Y (2·s·b·h, *not* divided by t) it
stores Y^s and all-gathers it again in backward (``regather=True``, Megatron's choice: one extra
all-gather per column layer in backward, overlappable with the input-gradient matmul). With
``regather=False`` the gathered input is saved: backward moves exactly TP's bytes, and activations
are s·b·h·(4 + 30/t).

Parameters whose input is the sequence slice — LayerNorm weight / bias, the row-parallel bias
added after ḡ (and ln_f, wpe in the whole model) — get only the gradient of this rank's s/t
positions: dL/dγ = sum over positions of the slice. Their full gradient is the sum over the t
ranks, so :func:`allreduce_sequence_parallel_grads` all-reduces them (Megatron does the same,
flagging them ``sequence_parallel``) before the optimizer steps.

The operators g, ḡ and the scatter live in :mod:`..mappings` with every other region crossing
(re-exported here); this module builds the layers on them. As in chapter 04, every constructor
that takes a dense module first broadcasts it from the group's first rank
(:func:`..replicas.broadcast_from_first_rank`; ``broadcast_weights=False`` when already done), so
every rank slices the same dense weights whatever seed it built them under.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...runtime import comm
from ..mappings import (
    divide,
    gather_along_seq,
    gather_from_sequence,
    reduce_scatter_along_seq,
    reduce_scatter_to_sequence,
    refuse_dropout,
    scatter_to_sequence,
    size_and_rank,
)
from ..replicas import broadcast_from_first_rank
from ..tensor_parallel import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelMLP,
    RowParallelLinear,
    head_rows,
)
from ..tensor_parallel_vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from typing import Self  # typing's since 3.11; annotations are never evaluated here

    from ...models.gpt import GPT, MLP, Block, CausalSelfAttention

SP_ATTR = "sequence_parallel"  # set on parameters whose gradient is a per-slice partial sum


class _GatheredLinear(torch.autograd.Function):
    """Z^(j) = g(Y^s) A_j^T (+ b_j) for n column weights A_j reading the same input, storing only Y^s
    (§4.2.2): backward all-gathers Y again for dL/dA_j = dZ^(j)T Y, and reduce-scatters
    dL/dY = sum_j dZ^(j) A_j (summed over ranks, sliced). The GPT's layers pass one weight; the
    Llama's q, k, v (and gate, up) pass three (two): one all-gather for all of them."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None, n, *params):  # params: n weights, n biases (or None)
        weights, biases = params[:n], params[n:]
        ctx.group, ctx.has_bias = group, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)
        full = gather_along_seq(x, group)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = gather_along_seq(x, ctx.group)  # the extra all-gather: memory traded for bandwidth
        full = full.reshape(-1, full.size(-1))
        dy = grads[0].matmul(weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            dy = dy + g.matmul(w)
        dx = reduce_scatter_along_seq(dy, ctx.group)
        g2 = [g.reshape(-1, g.size(-1)) for g in grads]
        dws = [g.t().matmul(full) for g in g2]
        dbs = [g.sum(0) if has else None for g, has in zip(g2, ctx.has_bias)]
        return (dx, None, None, *dws, *dbs)


def gathered_linear(x: torch.Tensor, weights: Iterable[torch.Tensor],
                    biases: Iterable[torch.Tensor | None] | None = None,
                    group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, ...]:
    """(Z^(1), ..., Z^(n)), Z^(j) = g(Y^s) A_j^T + b_j, from this rank's slice Y^s, storing only the slice
    (``regather=True``): the functional form of :class:`SequenceParallelColumnLinear` for several column
    weights that read one input (the Llama's q|k|v and gate|up: :mod:`..tensor_parallel_llama`)."""
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    return _GatheredLinear.apply(x, group, len(weights), *weights, *biases)


def mark_sequence_parallel(module: nn.Module) -> nn.Module:
    """Flag every parameter of ``module`` as living in the sequence-sharded region: its gradient is a
    partial sum over this rank's positions, completed by :func:`allreduce_sequence_parallel_grads`."""
    for p in module.parameters():
        setattr(p, SP_ATTR, True)
    return module


# --- layers: chapter 04's, with f / g replaced by g / ḡ -------------------------------------------


class SequenceParallelColumnLinear(ColumnParallelLinear):
    """Column-parallel linear whose input is the sequence slice: Z_i = g(Y^s) A_i^T + b_i.
    Same weights as :class:`ColumnParallelLinear` (``from_dense(..., regather=)``)."""

    regather = True

    @classmethod
    def from_dense(cls,  # type: ignore[override]  # regather, not gather_output: the output stays sharded
                   linear: nn.Linear, group: dist.ProcessGroup | None = None,
                   rows: torch.Tensor | None = None, regather: bool = True, *,
                   broadcast_weights: bool = True) -> Self:
        m = super().from_dense(linear, group, gather_output=False, rows=rows,
                               broadcast_weights=broadcast_weights)
        m.regather = regather
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.regather:
            return gathered_linear(x, [self.weight], [self.bias], self.group)[0]
        return F.linear(gather_from_sequence(x, self.group), self.weight, self.bias)


class SequenceParallelRowLinear(RowParallelLinear):
    """Row-parallel linear ending on the sequence slice: W^s = ḡ(Z_i B_i^T) + b. The bias is added
    once, on the slice, so its gradient is partial (flagged for the all-reduce)."""

    @classmethod
    def from_dense(cls,  # type: ignore[override]  # no input_is_parallel: the input is always the slice
                   linear: nn.Linear, group: dist.ProcessGroup | None = None, *,
                   broadcast_weights: bool = True) -> Self:
        m = super().from_dense(linear, group, input_is_parallel=True, broadcast_weights=broadcast_weights)
        if m.bias is not None:
            setattr(m.bias, SP_ATTR, True)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_scatter_to_sequence(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class SequenceParallelAttention(ParallelAttention):
    """Chapter 04's attention (n_head/t heads per rank) between g and ḡ: (b, s/t, h) -> (b, s/t, h).
    Attention itself sees the whole sequence (after g) for this rank's heads."""

    def __init__(self, attn: CausalSelfAttention, group: dist.ProcessGroup | None = None,
                 regather: bool = True, *, broadcast_weights: bool = True) -> None:
        # checks n_head % t, broadcasts attn, keeps head_dim / dropout / resid_dropout
        super().__init__(attn, group, broadcast_weights=broadcast_weights)
        t, r = size_and_rank(group, "sequence parallelism")
        rows = head_rows(attn.c_attn.in_features // attn.head_dim, attn.head_dim, t, r)
        self.c_attn = SequenceParallelColumnLinear.from_dense(attn.c_attn, group, rows=rows,
                                                              regather=regather, broadcast_weights=False)
        self.c_proj = SequenceParallelRowLinear.from_dense(attn.c_proj, group, broadcast_weights=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (b, s, 3h/t): the full sequence, this rank's heads
        B, T, _ = qkv.shape
        q, k, v = (u.view(B, T, -1, self.head_dim).transpose(1, 2) for u in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(B, T, -1)))


class SequenceParallelMLP(ParallelMLP):
    """Chapter 04's MLP between g and ḡ (§4.2.2, Fig. 6): GeLU on the (b, s, 4h/t) column slice."""

    def __init__(self, mlp: MLP, group: dist.ProcessGroup | None = None, regather: bool = True, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__(mlp, group, broadcast_weights=broadcast_weights)
        self.c_fc = SequenceParallelColumnLinear.from_dense(mlp.c_fc, group, regather=regather,
                                                            broadcast_weights=False)
        self.c_proj = SequenceParallelRowLinear.from_dense(mlp.c_proj, group, broadcast_weights=False)


def _refuse_dropout(p):
    refuse_dropout(p, "sequence-parallel dropout needs a different mask per sequence slice and the same "
                      "mask inside the tensor-parallel region (Megatron's two RNG streams)")


class SequenceParallelBlock(nn.Module):
    """Pre-LN block on the sequence slice (Fig. 5): x^s + ḡ(attn(g(ln_1(x^s)))), then the MLP alike.
    LayerNorms and residual adds run on s/t positions; LayerNorm parameters are flagged for
    :func:`allreduce_sequence_parallel_grads`. ``block`` is first made the group's first rank's
    (``broadcast_weights=False``: already is)."""

    def __init__(self, block: Block, group: dist.ProcessGroup | None = None, regather: bool = True, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        _refuse_dropout(block.attn.dropout)
        size_and_rank(group, "sequence parallelism")
        self.group = group
        if broadcast_weights:
            broadcast_from_first_rank(block, group)
        self.ln_1, self.ln_2 = (mark_sequence_parallel(copy.deepcopy(m)) for m in (block.ln_1, block.ln_2))
        self.attn = SequenceParallelAttention(block.attn, group, regather, broadcast_weights=False)
        self.mlp = SequenceParallelMLP(block.mlp, group, regather, broadcast_weights=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def sequence_parallel_block(block: Block, group: dist.ProcessGroup | None = None, regather: bool = True, *,
                            broadcast_weights: bool = True) -> SequenceParallelBlock:
    """This rank's sequence-parallel copy of a dense ``Block``: the weights of the group's first rank
    (broadcast into ``block`` first, as DDP does; otherwise ``block`` is unchanged). Input and output
    are this rank's (b, s/t, h) slice (:func:`scatter_to_sequence` makes one)."""
    return SequenceParallelBlock(block, group, regather, broadcast_weights=broadcast_weights)


def allreduce_sequence_parallel_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum over the group the gradients of the parameters flagged ``sequence_parallel`` (their
    inputs were sequence slices, so each rank holds a partial sum): one coalesced all-reduce."""
    grads = [p.grad for p in module.parameters() if getattr(p, SP_ATTR, False) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(part.view_as(g))


# --- the whole GPT ---------------------------------------------------------------------------------


class SequenceParallelEmbedding(VocabParallelEmbedding):
    """Vocab-parallel lookup whose g (all-reduce) becomes ḡ: each rank's partial lookups are
    reduce-scattered straight onto the sequence slice (Megatron does the same)."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_scatter_to_sequence(out, self.group)


class SequenceParallelGPT(nn.Module):
    """The GPT with TP + SP: ``model(idx, targets) -> (logits_local, loss)`` with ``logits_local``
    this rank's (b, s, V/t) vocabulary shard over the whole sequence, as in ``TensorParallelGPT``.

    h^s = ḡ(wte_r[idx]) + wpe[positions of the slice]; blocks on the slice; ln_f on the slice;
    g before the vocab-parallel lm_head, the loss fused with it. Parameter names are the dense
    model's. Call :func:`allreduce_sequence_parallel_grads` after backward (LayerNorms, row
    biases, wpe and ln_f hold partial gradients until then). ``dense`` is first made the group's
    first rank's (``broadcast_weights=False``: already is)."""

    def __init__(self, dense: GPT, group: dist.ProcessGroup | None = None, regather: bool = True, *,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        cfg = dense.cfg
        t, _ = size_and_rank(group, "sequence parallelism")
        divide(cfg.n_head, t, "n_head")
        divide(cfg.vocab_size, t, "vocab_size")
        _refuse_dropout(cfg.dropout)
        self.cfg, self.group = cfg, group
        if broadcast_weights:  # once, for the whole model
            broadcast_from_first_rank(dense, group)
        self.wte = SequenceParallelEmbedding.from_dense(dense.wte, group, broadcast_weights=False)
        self.wpe, self.ln_f = (mark_sequence_parallel(copy.deepcopy(m)) for m in (dense.wpe, dense.ln_f))
        self.blocks = nn.ModuleList(SequenceParallelBlock(b, group, regather,  # type: ignore[arg-type]  # Blocks
                                                          broadcast_weights=False)
                                    for b in dense.blocks)
        self.lm_head = SequenceParallelColumnLinear.from_dense(dense.lm_head, group, regather=regather,
                                                               broadcast_weights=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s/t, h): this rank's slice of token + position embeddings,
        ḡ(wte_r[idx]) + wpe[r·s/t : (r+1)·s/t]. Uses only ``wte`` and ``wpe``, so a pipeline stage
        holding those two modules calls it as ``SequenceParallelGPT.embed(stage, idx)``."""
        t, r = size_and_rank(self.wte.group, "sequence parallelism")
        n = divide(idx.size(1), t, "sequence length")
        return self.wte(idx) + self.wpe(torch.arange(r * n, (r + 1) * n, device=idx.device))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.embed(idx)  # (b, s/t, h)
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))  # (b, s, V/t)
        return logits, None if targets is None else vocab_parallel_cross_entropy(logits, targets, self.group)


def parallelize_gpt_sp(model: GPT, group: dist.ProcessGroup | None = None, regather: bool = True, *,
                       broadcast_weights: bool = True) -> SequenceParallelGPT:
    """A dense ``GPT`` as TP + SP with the same weights: the group's first rank's, broadcast into
    ``model`` first (as DDP does; otherwise ``model`` is unchanged). The loss ignores targets equal
    to -100, as the dense GPT's ``F.cross_entropy`` does."""
    return SequenceParallelGPT(model, group, regather, broadcast_weights=broadcast_weights)


__all__ = ["gather_from_sequence", "reduce_scatter_to_sequence", "scatter_to_sequence", "gathered_linear",
           "mark_sequence_parallel", "SequenceParallelEmbedding", "SequenceParallelColumnLinear",
           "SequenceParallelRowLinear", "SequenceParallelAttention",
           "SequenceParallelMLP", "SequenceParallelBlock", "sequence_parallel_block",
           "allreduce_sequence_parallel_grads", "SequenceParallelGPT", "parallelize_gpt_sp"]
