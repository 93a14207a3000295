"""Tensor (intra-layer) model parallelism: Megatron-LM's f / g operators and the layers built on them.

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
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime import comm


def _tp(group) -> tuple[int, int]:
    """(t, rank in the group); a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError("tensor parallelism needs a process group: run this inside launch(fn, t)")
    return dist.get_world_size(group), dist.get_rank(group)


def _divide(n: int, t: int, what: str) -> int:
    if n % t:
        raise ValueError(f"{what} {n} is not divisible by tp={t}; choose {what} as a multiple of {t} "
                         f"(or a tensor-parallel degree that divides {n})")
    return n // t


def _all_reduce(x, group, op=dist.ReduceOp.SUM):
    out = x.contiguous().clone()  # the collective is in place; autograd must not see its input change
    comm.all_reduce(out, op=op, group=group)
    return out


def _gather_last_dim(x, group):
    """[x_0, ..., x_{t-1}] concatenated along the last dim (all_gather_into_tensor stacks on dim 0)."""
    t, _ = _tp(group)
    out = torch.empty((t * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(t, dim=0), dim=-1)


def _my_slice_last_dim(x, group):
    t, r = _tp(group)
    n = _divide(x.size(-1), t, "last dimension")
    return x[..., r * n:(r + 1) * n].contiguous()


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of dL/dX backward (each rank's column slice saw the whole X)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (Y = sum_i Y_i); identity backward (dL/dY_i = dL/dY)."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _my_slice_last_dim(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _my_slice_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_last_dim(grad, ctx.group), None


def copy_to_tp(x, group=None):
    """f: identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group=None):
    """g: all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x, group=None):
    """[x_1 ... x_t] along the last dim (e.g. the full logits from their vocabulary shards)."""
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x, group=None):
    """This rank's slice of the last dim; the gradient is all-gathered."""
    return _ScatterToTP.apply(x, group)


# --- layers ------------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """Y_i = f(X) A_i^T + b_i with this rank's out_features/t rows of the weight (and of the bias).

    ``gather_output=True`` all-gathers Y = [Y_1 ... Y_t]; by default Y_i stays sharded, ready for
    a row-parallel layer (Megatron's MLP and attention never gather).
    """

    def __init__(self, in_features, out_features, bias=True, gather_output=False, group=None):
        super().__init__()
        t, _ = _tp(group)
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group = gather_output, group
        self.weight = nn.Parameter(torch.empty(_divide(out_features, t, "out_features"), in_features))
        self.bias = nn.Parameter(torch.zeros(self.weight.size(0))) if bias else None
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, gather_output=False, rows=None):
        """This rank's shard of ``linear``: rows ``rows`` (default: the r-th contiguous block)."""
        t, r = _tp(group)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, gather_output, group)
        rows = torch.arange(r * m.weight.size(0), (r + 1) * m.weight.size(0)) if rows is None else rows
        with torch.no_grad():
            m.weight.copy_(linear.weight[rows])
            if m.bias is not None:
                m.bias.copy_(linear.bias[rows])
        return m

    def forward(self, x):
        y = F.linear(copy_to_tp(x, self.group), self.weight, self.bias)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = g(X_i A_i^T) + b with this rank's in_features/t columns of the weight; b replicated
    (added once, after the sum). ``input_is_parallel=False`` first takes X_i from a full X."""

    def __init__(self, in_features, out_features, bias=True, input_is_parallel=True, group=None):
        super().__init__()
        t, _ = _tp(group)
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group = input_is_parallel, group
        self.weight = nn.Parameter(torch.empty(out_features, _divide(in_features, t, "in_features")))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_dense(cls, linear: nn.Linear, group=None, input_is_parallel=True):
        t, r = _tp(group)
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, input_is_parallel, group)
        n = m.weight.size(1)
        with torch.no_grad():
            m.weight.copy_(linear.weight[:, r * n:(r + 1) * n])
            if m.bias is not None:
                m.bias.copy_(linear.bias)
        return m

    def forward(self, x):
        if not self.input_is_parallel:
            x = scatter_to_tp(x, self.group)
        y = reduce_from_tp(F.linear(x, self.weight), self.group)
        return y if self.bias is None else y + self.bias


class ParallelMLP(nn.Module):
    """Megatron's MLP (§3, Fig. 3a): c_fc column-parallel, GeLU on the slice, c_proj row-parallel.
    One f (backward all-reduce) and one g (forward all-reduce); names as in the dense ``MLP``."""

    def __init__(self, mlp: nn.Module, group=None):
        super().__init__()
        _divide(mlp.c_fc.out_features, _tp(group)[0], "MLP hidden width (mlp_ratio * n_embd)")
        self.c_fc = ColumnParallelLinear.from_dense(mlp.c_fc, group)
        self.gelu = mlp.gelu
        self.c_proj = RowParallelLinear.from_dense(mlp.c_proj, group)
        self.dropout = mlp.dropout

    def forward(self, x):
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
    q|k|v) is column-parallel per head; c_proj is row-parallel over the heads' outputs."""

    def __init__(self, attn: nn.Module, group=None):
        super().__init__()
        t, r = _tp(group)
        n_head = attn.c_attn.in_features // attn.head_dim
        _divide(n_head, t, "n_head")
        self.head_dim, self.dropout = attn.head_dim, attn.dropout
        self.c_attn = ColumnParallelLinear.from_dense(attn.c_attn, group, rows=head_rows(n_head, attn.head_dim, t, r))
        self.c_proj = RowParallelLinear.from_dense(attn.c_proj, group)
        self.resid_dropout = attn.resid_dropout

    def forward(self, x):
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
    """

    def __init__(self, dense, group=None):
        super().__init__()
        from .tensor_parallel_vocab import VocabParallelEmbedding  # that module builds on this one

        cfg = dense.cfg
        t, _ = _tp(group)
        _divide(cfg.n_head, t, "n_head")  # hence n_embd and the MLP width divide too
        _divide(cfg.vocab_size, t, "vocab_size")
        if cfg.dropout:
            raise ValueError(f"dropout {cfg.dropout} is not supported here: tensor-parallel dropout needs "
                             f"Megatron's two RNG streams (same mask in replicated regions, different in "
                             f"sharded ones); use GPTConfig(dropout=0.0)")
        self.cfg, self.group = cfg, group
        self.wte = VocabParallelEmbedding.from_dense(dense.wte, group)
        # copies: the dense model stays as it was; replicated pieces keep their full weights
        self.wpe, self.drop, self.ln_f = (copy.deepcopy(m) for m in (dense.wpe, dense.drop, dense.ln_f))
        self.blocks = copy.deepcopy(dense.blocks)
        for block in self.blocks:  # attention and MLP swapped for their TP versions, the rest replicated
            block.attn = ParallelAttention(block.attn, group)
            block.mlp = ParallelMLP(block.mlp, group)
        # output layer: column-parallel over the vocabulary, sharing wte's shard when tied
        self.lm_head = ColumnParallelLinear.from_dense(dense.lm_head, group)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        T = idx.size(1)
        h = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            h = block(h)
        logits = self.lm_head(self.ln_f(h))  # (B, T, V/t): this rank's vocabulary shard
        return logits, None if targets is None else self.loss_fn(logits, targets)

    def loss_fn(self, logits, targets):
        """Mean cross-entropy from the vocabulary-sharded logits, without gathering them."""
        from .tensor_parallel_vocab import vocab_parallel_cross_entropy  # that module builds on this one

        return vocab_parallel_cross_entropy(logits, targets, self.group)


def parallelize_gpt(model, group=None) -> TensorParallelGPT:
    """Turn a dense ``GPT`` into its tensor-parallel version with the same weights: each rank keeps
    its slice (``model`` itself is left unchanged). Every rank must pass identical dense weights
    (build it under the same seed on every rank)."""
    return TensorParallelGPT(model, group)


def shard_dense_tensors(tensors: dict, cfg, group=None) -> dict:
    """This rank's shards of per-parameter dense tensors (weights, gradients, Adam moments), keyed
    by the dense GPT's parameter names, in ``TensorParallelGPT``'s layout: loaded into a dense GPT
    as its weights, which :func:`parallelize_gpt` then splits. Compare a TP model against a dense
    reference with ``shard_dense_tensors({k: p.grad ...}, cfg)``."""
    from ..models.gpt import GPT

    holder = GPT(cfg)
    with torch.no_grad():
        for k, q in holder.named_parameters():
            q.copy_(tensors[k])
    return {k: q.detach() for k, q in parallelize_gpt(holder, group).named_parameters()}


# --- the tour's rows ---------------------------------------------------------------------------


def _headline_rank(cfg, steps, batch, seq, ref_grads):
    from ..models.gpt import GPT
    from ..models.train import train_steps

    torch.manual_seed(0)
    model = parallelize_gpt(GPT(cfg))
    fwd, bwd = train_steps(model, steps, batch, seq).meters
    want = shard_dense_tensors(ref_grads, cfg)  # this rank's slices of the dense gradients
    diff = max((q.grad - want[k]).abs().max().item() for k, q in model.named_parameters())
    bsh = batch * seq * cfg.n_embd * 4
    counts = [sum(e.op == "all_reduce" and e.nbytes == bsh for e in m.events) for m in (fwd, bwd)]
    with comm.meter() as one:  # one transformer layer alone, forward and backward
        model.blocks[0](torch.randn(batch, seq, cfg.n_embd, requires_grad=True)).sum().backward()
    return {"diff": diff, "counts": counts, "layer_wire": one.total_wire_bytes}


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 04's rows for the tour: TP GPT == dense, 2 + 2 all-reduces per layer, the bytes."""
    from ..analysis import costmodel
    from ..models.gpt import GPT, GPTConfig
    from ..models.train import train_steps
    from ..runtime.env import single_thread
    from ..runtime.launch import launch

    t, batch, seq = 4, 8, 32
    steps = 2 if smoke else 4
    cfg = GPTConfig.tiny(block_size=seq)
    with single_thread():  # the dense reference, one thread like a rank
        torch.manual_seed(0)
        dense = GPT(cfg)
        train_steps(dense, steps, batch, seq)
    per_rank = launch(_headline_rank, t, cfg, steps, batch, seq, {k: q.grad for k, q in dense.named_parameters()})
    diff = max(p["diff"] for p in per_rank)
    # whole model: the embedding adds one forward all-reduce of b·s·h, the output layer's f one backward
    fwd = [(p["counts"][0] - 1) / cfg.n_layer for p in per_rank]
    bwd = [(p["counts"][1] - 1) / cfg.n_layer for p in per_rank]
    want = costmodel.tensor_parallel_allreduces_per_layer()
    want_bytes = costmodel.tensor_parallel_bytes_per_layer(batch, seq, cfg.n_embd, t, bytes_per_element=4)
    wire = max(p["layer_wire"] for p in per_rank)
    return [
        {"chapter": "ch04", "experiment": f"TP GPT on t={t} ranks == dense after {steps} SGD steps, max |Δgrad|",
         "theory": 1e-5, "measured": diff, "ok": diff < 1e-5},
        {"chapter": "ch04", "experiment": "all-reduces of b·s·h per layer, forward / backward",
         "theory": f"{want['forward']} / {want['backward']}", "measured": f"{max(fwd):g} / {max(bwd):g}",
         "ok": set(fwd) == {want["forward"]} and set(bwd) == {want["backward"]}},
        {"chapter": "ch04", "experiment": f"wire bytes per layer = 8·b·s·h·(t-1)/t x 4 B (b={batch}, s={seq})",
         "theory": want_bytes, "measured": wire, "ok": abs(wire - want_bytes) <= 1e-9 * want_bytes},
    ]
