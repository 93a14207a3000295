"""Chapter 04 — tensor parallelism for the Llama: grouped-query attention and SwiGLU split over t ranks,
and (``sequence_parallel=True``) chapter 05's Megatron sequence parallelism around them.

Shoeybi et al. 2019, "Megatron-LM", §3 (column- then row-parallel, the f and g operators); Ainslie et
al. 2023, "GQA", §2 (n_kv_head key/value heads, each read by a group of n_head/n_kv_head query heads);
Korthikanti et al. 2022, §4.2.2 (sequence parallelism: f/g become g/ḡ, the norms run on s/t positions).
The dense model is :class:`..models.llama.Llama`; the layers are :mod:`.tensor_parallel`'s.

**Query heads** split as the GPT's: rank r holds heads [r·a/t, (r+1)·a/t) (t | n_head = a). **Key/value
heads** (g = n_kv_head) follow the query heads that read them, two cases (:func:`kv_layout`)::

    split       t | g     rank r holds kv heads [r·g/t, (r+1)·g/t): exactly the ones its query heads read
    replicated  g | t     a group of a/g query heads spans t/g ranks: each holds a copy of its one kv head

Why this rule: t | a gives each rank whole query heads. They read the kv heads of the groups they fall
in. If t | g those are g/t whole kv heads no other rank reads; if g | t they all fall in one group, so
the rank needs exactly one kv head, shared with the t/g ranks of its group. In any other case (a = 12,
g = 6, t = 4: three query heads, groups of two) a rank's heads straddle groups and share a kv head with
a neighbour *partly*: neither a split nor a whole copy, so it is refused. Megatron-LM allows only the
split (``num_query_groups % tensor_model_parallel_size == 0``); replicating is what inference engines
do when t > g (vLLM), and what training must do when t exceeds the kv heads (Llama 3 70B: g = 8).

**Replicas must stay equal.** A replicated k_proj / v_proj gets, on each rank, only the part of its
gradient that this rank's query heads produce: dW_k,j = sum over the t/g ranks of kv head j of their
parts. So the weights pass through :class:`_SumKVReplicas` (identity forward): in backward every
rank writes its k and v weight gradients into a zero buffer of all g kv heads' rows at its head, one
all-reduce over the tensor-parallel group sums them, and each rank keeps its head's rows -- the sum
over its replicas. Cost: one extra all-reduce of 2·g·d·h elements per layer per backward (weights,
not activations: independent of b·s), against b·s·h per f. Without it each replica would follow
its own 1/(t/g) of the gradient and the copies of one kv head would drift apart after the first step.

**One f per region.** q, k and v read the same input, so they share one f (one all-reduce backward, as
the GPT's fused c_attn), and so do SwiGLU's gate and up; with SP, one all-gather g (and one re-gather in
backward) serves each group (Megatron fuses the weights themselves: ``linear_qkv``, ``linear_fc1``).
A layer costs the GPT's 2 + 2 all-reduces of b·s·h per step (f before q|k|v and gate|up, g after
o_proj and down_proj)::

    attention   q|k|v = f(x) [W_q,r; W_k,r; W_v,r]ᵀ -> RoPE, causal GQA attention -> g(y W_o,rᵀ)
    SwiGLU      gate|up = f(x) [W_gate,r; W_up,r]ᵀ   -> g((SiLU(gate) ∘ up) W_down,rᵀ)

With ``sequence_parallel=True`` f becomes g (all-gather of the (b, s/t, h) slice; ``regather`` as in
:mod:`.sequence_parallel.megatron_sp`) and g becomes ḡ (reduce-scatter), the embedding's all-reduce a
reduce-scatter, and the RMSNorms run on the slice: their gains get partial gradients, flagged for
:func:`.sequence_parallel.megatron_sp.allreduce_sequence_parallel_grads`, as the GPT's LayerNorms.
"""
from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.init import record_cut
from ..models.llama import causal_attention, split_heads
from ..runtime import comm
from .mappings import (
    copy_to_tp,
    divide,
    gather_from_sequence,
    reduce_from_tp,
    reduce_scatter_to_sequence,
    size_and_rank,
)
from .replicas import broadcast_from_first_rank
from .sequence_parallel.megatron_sp import (
    SequenceParallelColumnLinear,
    SequenceParallelEmbedding,
    gathered_linear,
    mark_sequence_parallel,
)
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, shard_through
from .tensor_parallel_vocab import VocabParallelEmbedding, vocab_parallel_cross_entropy

if TYPE_CHECKING:
    from ..models.llama import Llama, LlamaAttention, LlamaBlock, LlamaConfig, SwiGLU

__all__ = ["kv_layout", "kv_heads_of_rank", "ParallelGQAAttention", "ParallelSwiGLU", "ParallelLlamaBlock",
           "TensorParallelLlama", "parallelize_llama", "shard_dense_llama_tensors"]


# --- which kv heads a rank holds ---------------------------------------------------------------------


def kv_layout(n_head: int, n_kv_head: int, t: int) -> str:
    """How t ranks hold the kv heads: ``"split"`` (t | n_kv_head) or ``"replicated"`` (n_kv_head | t); a
    ``ValueError`` naming the degrees that work otherwise. t must divide n_head in both cases (module
    docstring: why)."""
    ok = [d for d in range(1, n_head + 1) if n_head % d == 0 and (n_kv_head % d == 0 or d % n_kv_head == 0)]
    if n_head % t or (n_kv_head % t and t % n_kv_head):
        raise ValueError(f"tensor parallelism with grouped-query attention needs t dividing n_head, and "
                         f"t dividing n_kv_head (kv heads split) or n_kv_head dividing t (kv heads "
                         f"replicated): n_head={n_head}, n_kv_head={n_kv_head}, t={t}; use t in {tuple(ok)}")
    return "split" if n_kv_head % t == 0 else "replicated"


def kv_heads_of_rank(n_head: int, n_kv_head: int, t: int, r: int) -> range:
    """The kv heads rank r holds: [r·g/t, (r+1)·g/t) when split, the one head r // (t/g) when replicated."""
    if kv_layout(n_head, n_kv_head, t) == "split":
        per = n_kv_head // t
        return range(r * per, (r + 1) * per)
    head = r // (t // n_kv_head)
    return range(head, head + 1)


def _head_rows(heads: range, head_dim: int) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim)


def _rows_of(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A bias-free Linear holding ``rows`` of ``linear``'s weight (a kv head's copy), its cut recorded."""
    w = linear.weight
    m = nn.Linear(linear.in_features, rows.numel(), bias=False, device=w.device, dtype=w.dtype)
    record_cut(m.weight, w.shape, 0, rows)  # deferred init (ch12)
    with torch.no_grad():
        m.weight.copy_(w[rows.to(w.device)])
    return m


class _SumKVReplicas(torch.autograd.Function):
    """Identity on the replicated (w_k, w_v) forward; backward: each kv head's gradient summed over
    the ranks holding a copy of it (one all-reduce over the group of a buffer of every kv head's rows)."""

    @staticmethod
    def forward(ctx, w_k, w_v, head, n_kv_head, group: dist.ProcessGroup | None):
        ctx.head, ctx.n_kv_head, ctx.group = head, n_kv_head, group
        return w_k.view_as(w_k), w_v.view_as(w_v)

    @staticmethod
    def backward(ctx, g_k, g_v):
        buf = g_k.new_zeros((2, ctx.n_kv_head, *g_k.shape))  # (k|v, kv head, d, h)
        buf[0, ctx.head], buf[1, ctx.head] = g_k, g_v
        comm.all_reduce(buf, group=ctx.group)
        return buf[0, ctx.head], buf[1, ctx.head], None, None, None


# --- the two regions' edges, with or without sequence parallelism ------------------------------------


def _column(x, weights, group: dist.ProcessGroup | None, sequence_parallel, regather):
    """(f(x) W_1ᵀ, ..., f(x) W_nᵀ): several column-parallel weights reading the same input behind one
    f (with SP: one all-gather g of the slice, ``regather`` as :mod:`.sequence_parallel.megatron_sp`)."""
    if sequence_parallel and regather:
        return gathered_linear(x, weights, None, group)
    x = gather_from_sequence(x, group) if sequence_parallel else copy_to_tp(x, group)
    return tuple(F.linear(x, w) for w in weights)


def _row(y, weight, group: dist.ProcessGroup | None, sequence_parallel):
    """g(y W_rᵀ): all-reduce of the partial products (with SP: reduce-scatter ḡ onto the slice)."""
    partial = F.linear(y, weight)
    return reduce_scatter_to_sequence(partial, group) if sequence_parallel else reduce_from_tp(partial, group)


# --- layers ---------------------------------------------------------------------------------------------


class ParallelGQAAttention(nn.Module):
    """The Llama's attention on n_head/t query heads and their kv heads (split or replicated, module
    docstring); o_proj row-parallel. ``attn`` is first made the group's first rank's
    (``broadcast_weights=False``: already is). Input and output: (b, s, h), or (b, s/t, h) with SP."""

    def __init__(self, attn: LlamaAttention, group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False, regather: bool = True,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        t, r = size_and_rank(group)
        d = attn.head_dim
        n_head, n_kv_head = attn.q_proj.out_features // d, attn.k_proj.out_features // d
        self.kv_layout = kv_layout(n_head, n_kv_head, t)
        if broadcast_weights:
            broadcast_from_first_rank(attn, group)
        self.head_dim, self.rope_theta, self.group = d, attn.rope_theta, group
        self.sequence_parallel, self.regather = sequence_parallel, regather
        self.n_kv_head, self.kv_heads = n_kv_head, kv_heads_of_rank(n_head, n_kv_head, t, r)
        self.q_proj = ColumnParallelLinear.from_dense(attn.q_proj, group, broadcast_weights=False)
        rows = _head_rows(self.kv_heads, d)
        self.k_proj, self.v_proj = _rows_of(attn.k_proj, rows), _rows_of(attn.v_proj, rows)
        self.o_proj = RowParallelLinear.from_dense(attn.o_proj, group, broadcast_weights=False)

    def kv_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_k, W_v) as the forward uses them: replicated copies go through the replica gradient sum."""
        w_k, w_v = self.k_proj.weight, self.v_proj.weight
        if self.kv_layout == "replicated":
            return _SumKVReplicas.apply(w_k, w_v, self.kv_heads.start, self.n_kv_head, self.group)
        return w_k, w_v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _column(x, [self.q_proj.weight, *self.kv_weights()], self.group, self.sequence_parallel,
                          self.regather)  # (b, s, ·): the whole sequence, this rank's heads
        q, k, v = (split_heads(u, self.head_dim) for u in (q, k, v))
        positions = torch.arange(q.size(2), device=q.device)
        y = causal_attention(q, k, v, positions, self.rope_theta).transpose(1, 2).flatten(2)
        return _row(y, self.o_proj.weight, self.group, self.sequence_parallel)


class ParallelSwiGLU(nn.Module):
    """SwiGLU with gate_proj and up_proj column-parallel (f/t columns each, one fused GEMM) and
    down_proj row-parallel: SiLU(gate) ∘ up is elementwise, so it runs on the slice."""

    def __init__(self, mlp: SwiGLU, group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False, regather: bool = True,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        divide(mlp.gate_proj.out_features, size_and_rank(group)[0], "ffn_hidden")
        if broadcast_weights:
            broadcast_from_first_rank(mlp, group)
        self.group, self.sequence_parallel, self.regather = group, sequence_parallel, regather
        self.gate_proj = ColumnParallelLinear.from_dense(mlp.gate_proj, group, broadcast_weights=False)
        self.up_proj = ColumnParallelLinear.from_dense(mlp.up_proj, group, broadcast_weights=False)
        self.down_proj = RowParallelLinear.from_dense(mlp.down_proj, group, broadcast_weights=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = [self.gate_proj.weight, self.up_proj.weight]
        gate, up = _column(x, weights, self.group, self.sequence_parallel, self.regather)
        return _row(F.silu(gate) * up, self.down_proj.weight, self.group, self.sequence_parallel)


class ParallelLlamaBlock(nn.Module):
    """x + attn(ln_1(x)), x + mlp(ln_2(x)) with the parallel layers; the RMSNorms replicated (TP) or on
    the sequence slice and flagged for the gradient all-reduce (SP)."""

    def __init__(self, block: LlamaBlock, group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False, regather: bool = True,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        if broadcast_weights:
            broadcast_from_first_rank(block, group)
        kw = dict(sequence_parallel=sequence_parallel, regather=regather, broadcast_weights=False)
        self.ln_1, self.ln_2 = copy.deepcopy(block.ln_1), copy.deepcopy(block.ln_2)
        for norm in (self.ln_1, self.ln_2) if sequence_parallel else ():
            mark_sequence_parallel(norm)
        self.attn = ParallelGQAAttention(block.attn, group, **kw)
        self.mlp = ParallelSwiGLU(block.mlp, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


# --- the whole Llama -----------------------------------------------------------------------------------


class TensorParallelLlama(nn.Module):
    """The Llama with Megatron's layers: ``model(idx, targets) -> (logits_local, loss)``, the logits this
    rank's (b, s, V/t) vocabulary shard, the loss the same number on every rank. Parameter names are the
    dense model's. With ``sequence_parallel`` call ``allreduce_sequence_parallel_grads(model, group)``
    after backward (the RMSNorm gains hold partial gradients until then). ``dense`` is first made the
    group's first rank's (``broadcast_weights=False``: already is)."""

    def __init__(self, dense: Llama, group: dist.ProcessGroup | None = None, *,
                 sequence_parallel: bool = False, regather: bool = True,
                 broadcast_weights: bool = True) -> None:
        super().__init__()
        cfg = dense.cfg
        t, _ = size_and_rank(group)
        kv_layout(cfg.n_head, cfg.n_kv_head, t)
        divide(cfg.vocab_size, t, "vocab_size")
        assert cfg.ffn_hidden is not None  # LlamaConfig.__post_init__ sets it
        divide(cfg.ffn_hidden, t, "ffn_hidden")
        self.cfg, self.group, self.sequence_parallel = cfg, group, sequence_parallel
        if broadcast_weights:  # once, for the whole model: every rank slices the same dense weights
            broadcast_from_first_rank(dense, group)
        emb = SequenceParallelEmbedding if sequence_parallel else VocabParallelEmbedding
        self.wte = emb.from_dense(dense.wte, group, broadcast_weights=False)
        kw = dict(sequence_parallel=sequence_parallel, regather=regather, broadcast_weights=False)
        self.blocks = nn.ModuleList(ParallelLlamaBlock(b, group, **kw)  # type: ignore[arg-type]  # LlamaBlocks
                                    for b in dense.blocks)
        self.ln_f = copy.deepcopy(dense.ln_f)
        self.lm_head: ColumnParallelLinear
        if sequence_parallel:
            mark_sequence_parallel(self.ln_f)
            self.lm_head = SequenceParallelColumnLinear.from_dense(dense.lm_head, group, regather=regather,
                                                                   broadcast_weights=False)
        else:
            self.lm_head = ColumnParallelLinear.from_dense(dense.lm_head, group, broadcast_weights=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(b, s) token ids -> (b, s, h), or this rank's (b, s/t, h) slice with SP."""
        if self.sequence_parallel:
            divide(idx.size(1), size_and_rank(self.group)[0], "sequence length")
        return self.wte(idx)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))  # (b, s, V/t): this rank's vocabulary shard
        return logits, None if targets is None else vocab_parallel_cross_entropy(logits, targets, self.group)


def parallelize_llama(model: Llama, group: dist.ProcessGroup | None = None, *,
                      sequence_parallel: bool = False, regather: bool = True,
                      broadcast_weights: bool = True) -> TensorParallelLlama:
    """A dense ``Llama`` as tensor parallelism (and, with ``sequence_parallel``, Megatron sequence
    parallelism) over ``group``, with the group's first rank's weights (broadcast into ``model`` first,
    as DDP does; otherwise ``model`` is unchanged)."""
    return TensorParallelLlama(model, group, sequence_parallel=sequence_parallel, regather=regather,
                               broadcast_weights=broadcast_weights)


def shard_dense_llama_tensors(tensors: dict, cfg: LlamaConfig,
                              group: dist.ProcessGroup | None = None) -> dict:
    """This rank's shards of per-parameter dense tensors (weights, gradients), keyed by the dense Llama's
    names, in ``TensorParallelLlama``'s layout (a replicated kv head: its rows of the dense tensor)."""
    from ..models.llama import Llama

    return shard_through(Llama(cfg), tensors, lambda m: parallelize_llama(m, group, broadcast_weights=False))
