"""Chapter 04 — mappings: every operator where a tensor crosses between parallel regions, in one place.

Tensor parallelism (ch04), sequence parallelism (ch05) and expert parallelism (ch10) are layers
written between *regions*: replicated, sharded along the hidden (last) dim, sharded along the
sequence, sharded along the heads. Each crossing is one collective forward and its conjugate
backward, wrapped in a ``torch.autograd.Function``. Megatron-Core keeps all of them in
``megatron/core/tensor_parallel/mappings.py``; this module follows its order: for each operator
the raw collective (no autograd), then the Function, then the public function. On t ranks of
``group``, rank r, with X_i rank i's tensor:

    operator                     forward                               backward
    copy_to_tp         (f)       Y = X                                 dX = sum_i dY_i        (all-reduce)
    reduce_from_tp     (g)       Y = sum_i X_i       (all-reduce)      dX_i = dY
    gather_from_tp               Y = [X_1 ... X_t]   (all-gather, last dim)   dX_r = dY[..., slice r]
    scatter_to_tp                X_r = X[..., slice r]                 dX = [dX_1 ... dX_t]   (all-gather)
    gather_from_sequence (g)     Y = [X^1; ...; X^t] (all-gather, s)   dX^r = (sum_i dY_i)^r  (reduce-scatter)
    reduce_scatter_to_sequence (ḡ)  Y^r = (sum_i X_i)^r  (reduce-scatter, s)   dX_i = [dY^1; ...; dY^t]
    scatter_to_sequence          X^r = X[:, slice r]                   dX = [dX^1; ...; dX^t] (all-gather)
    seq_to_heads                 (B, n, S/t, d) -> (B, n/t, S, d)  (all-to-all)    heads_to_seq of dY
    heads_to_seq                 (B, n/t, S, d) -> (B, n, S/t, d)  (all-to-all)    seq_to_heads of dY
    all_to_all                   rows of block j -> rank j  (all-to-all)     the same, splits swapped

f and g are Shoeybi et al. 2019 ("Megatron-LM") §3, Fig. 3: f sits before a column-parallel layer
(every rank used all of X, so dX sums the ranks' partial gradients), g after a row-parallel one
(the output is the sum of partial products). g and ḡ of sequence parallelism are Korthikanti et al.
2022 ("Reducing Activation Recomputation in Large Transformer Models") §4.2.2, Fig. 6: an
all-reduce is a reduce-scatter then an all-gather, so splitting f / g into that pair keeps TP's
bytes while the regions between them hold s/t positions. seq_to_heads / heads_to_seq are
DeepSpeed-Ulysses (Jacobs et al. 2023, §3): an all-to-all is a permutation of the elements over
the ranks, so its backward is the inverse all-to-all. ``all_to_all`` with uneven splits is the
dispatch / combine of expert parallelism (Lepikhin et al. 2021, "GShard", §2.2).

The sequence is dim 1 of a (b, s, h) activation. Every collective goes through the metered
wrappers of :mod:`minitorch_dist.runtime.comm`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..runtime import comm, require_process_group

__all__ = ["size_and_rank", "divide", "heads_per_rank", "refuse_dropout", "all_reduce_copy",
           "copy_to_tp", "reduce_from_tp", "gather_from_tp", "scatter_to_tp",
           "gather_along_seq", "reduce_scatter_along_seq",
           "gather_from_sequence", "reduce_scatter_to_sequence", "scatter_to_sequence",
           "seq_to_heads", "heads_to_seq", "AllToAll", "all_to_all"]


def size_and_rank(group: dist.ProcessGroup | None = None,
                  what: str = "tensor parallelism") -> tuple[int, int]:
    """(t, this rank's index) in ``group``; a clear error naming ``what`` outside a process group."""
    require_process_group(what)
    return dist.get_world_size(group), dist.get_rank(group)


def divide(n: int, t: int, what: str) -> int:
    """n / t, or a ``ValueError`` naming ``what`` and the fix when t does not divide n."""
    if n % t:
        raise ValueError(f"{what} {n} is not divisible by tp={t}; choose {what} as a multiple of {t} "
                         f"(or a tensor-parallel degree that divides {n})")
    return n // t


def heads_per_rank(n_head: int, t: int) -> int:
    """n_head / t for Ulysses (heads are split over the ranks for attention), or a clear error."""
    if n_head % t:
        raise ValueError(f"n_head {n_head} is not divisible by the sequence-parallel degree {t}: Ulysses "
                         f"splits heads over the ranks for attention, so t must divide n_head; choose t "
                         f"among the divisors of {n_head} (or combine Ulysses with ring attention)")
    return n_head // t


def refuse_dropout(p: float, why: str) -> None:
    """A ``ValueError`` for dropout ``p`` > 0 in a parallel layer, saying ``why`` it would not match the
    dense model, and the fix (every split layer would draw its masks from another random stream)."""
    if p:
        raise ValueError(f"dropout {p} is not supported here: {why}; use GPTConfig(dropout=0.0)")


def _tokens_per_rank(seq: int, t: int) -> int:
    if seq % t:
        raise ValueError(f"sequence length {seq} is not divisible by the sequence-parallel degree {t}: "
                         f"each rank holds S/t tokens; pad the sequence to a multiple of {t}")
    return seq // t


# --- f and g: tensor parallelism's all-reduce pair ------------------------------------------------


def all_reduce_copy(x, group: dist.ProcessGroup | None = None, op=dist.ReduceOp.SUM):
    """A new tensor: ``x`` all-reduced with ``op`` over ``group`` (raw, no autograd). The collective
    is in place, so it runs on a copy: autograd must not see its input change."""
    out = x.contiguous().clone()
    comm.all_reduce(out, op=op, group=group)
    return out


class _CopyToTP(torch.autograd.Function):
    """f: identity forward; all-reduce of dL/dX backward (each rank's column slice saw the whole X)."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce_copy(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward (Y = sum_i Y_i); identity backward (dL/dY_i = dL/dY)."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        return all_reduce_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group: dist.ProcessGroup | None = None):
    """f (Megatron's ``copy_to_tensor_parallel_region``): identity forward, all-reduce backward."""
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x, group: dist.ProcessGroup | None = None):
    """g (Megatron's ``reduce_from_tensor_parallel_region``): all-reduce forward, identity backward."""
    return _ReduceFromTP.apply(x, group)


# --- the last dim: gather and split ----------------------------------------------------------------


def _gather_along_last_dim(x, group: dist.ProcessGroup | None):
    """[x_0, ..., x_{t-1}] concatenated along the last dim (all_gather_into_tensor stacks on dim 0)."""
    t, _ = size_and_rank(group)
    out = torch.empty((t * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, x.contiguous(), group=group)
    return torch.cat(out.chunk(t, dim=0), dim=-1)


def _split_along_last_dim(x, group: dist.ProcessGroup | None):
    t, r = size_and_rank(group)
    n = divide(x.size(-1), t, "last dimension")
    return x[..., r * n:(r + 1) * n].contiguous()


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim forward; keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return _gather_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _split_along_last_dim(grad, ctx.group), None


class _ScatterToTP(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return _split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_along_last_dim(grad, ctx.group), None


def gather_from_tp(x, group: dist.ProcessGroup | None = None):
    """[x_1 ... x_t] along the last dim (e.g. the full logits from their vocabulary shards)."""
    return _GatherFromTP.apply(x, group)


def scatter_to_tp(x, group: dist.ProcessGroup | None = None):
    """This rank's slice of the last dim; the gradient is all-gathered."""
    return _ScatterToTP.apply(x, group)


# --- the sequence dim: sequence parallelism's g and ḡ ----------------------------------------------


def gather_along_seq(x, group: dist.ProcessGroup | None = None):
    """(b, s/t, h) slices -> (b, s, h), rank r's slice at positions [r·s/t, (r+1)·s/t) (raw, no
    autograd). all_gather_into_tensor stacks along dim 0, so the sequence is moved first and back
    (Megatron keeps activations as (s, b, h) to skip these copies; our GPT is batch-first)."""
    t, _ = size_and_rank(group, "sequence parallelism")
    inp = x.transpose(0, 1).contiguous()
    out = torch.empty((t * inp.size(0), *inp.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather(out, inp, group=group)
    return out.transpose(0, 1).contiguous()


def reduce_scatter_along_seq(x, group: dist.ProcessGroup | None = None):
    """(b, s, h) partial sums -> this rank's (b, s/t, h) slice of their sum over the group (raw)."""
    t, _ = size_and_rank(group, "sequence parallelism")
    inp = x.transpose(0, 1).contiguous()
    out = torch.empty((divide(inp.size(0), t, "sequence length"), *inp.shape[1:]), dtype=x.dtype,
                      device=x.device)
    comm.reduce_scatter(out, inp, op=dist.ReduceOp.SUM, group=group)
    return out.transpose(0, 1).contiguous()


def _split_along_seq(x, group: dist.ProcessGroup | None):
    t, r = size_and_rank(group, "sequence parallelism")
    n = divide(x.size(1), t, "sequence length")
    return x[:, r * n:(r + 1) * n].contiguous()


class _GatherFromSequence(torch.autograd.Function):
    """g: all-gather along s forward; reduce-scatter of dL/dY backward (each rank used all of Y)."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return gather_along_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along_seq(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    """ḡ: reduce-scatter along s forward; all-gather of dL/dW^s backward (dL/dW_i = dL/dW)."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return reduce_scatter_along_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_seq(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    """This rank's s/t positions forward; all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return _split_along_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_along_seq(grad, ctx.group), None


def gather_from_sequence(x, group: dist.ProcessGroup | None = None):
    """g: (b, s/t, h) -> (b, s, h) by all-gather; backward reduce-scatter."""
    return _GatherFromSequence.apply(x, group)


def reduce_scatter_to_sequence(x, group: dist.ProcessGroup | None = None):
    """ḡ: (b, s, h) partial sums -> (b, s/t, h) slice of the sum; backward all-gather."""
    return _ReduceScatterToSequence.apply(x, group)


def scatter_to_sequence(x, group: dist.ProcessGroup | None = None):
    """This rank's (b, s/t, h) positions of a replicated (b, s, h); backward all-gather."""
    return _ScatterToSequence.apply(x, group)


# --- the heads: DeepSpeed-Ulysses's all-to-all pair ------------------------------------------------


def _ulysses_size(group: dist.ProcessGroup | None) -> int:
    return size_and_rank(group, "Ulysses sequence parallelism")[0]


def _seq_to_heads(x, group: dist.ProcessGroup | None):
    """(B, n, S/t, d) sequence shard -> (B, n/t, S, d) head shard, by one all_to_all_single."""
    t = _ulysses_size(group)
    B, n, s, d = x.shape
    per = heads_per_rank(n, t)
    # all_to_all_single sends input block j (of dim 0) to rank j: put the head blocks first.
    inp = x.reshape(B, t, per, s, d).permute(1, 0, 2, 3, 4).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    # out[i] came from rank i: its tokens (sequence chunk i) of our heads -> concatenate along S.
    return out.permute(1, 2, 0, 3, 4).reshape(B, per, t * s, d)


def _heads_to_seq(y, group: dist.ProcessGroup | None):
    """(B, n/t, S, d) head shard -> (B, n, S/t, d) sequence shard: the inverse all-to-all."""
    t = _ulysses_size(group)
    B, per, S, d = y.shape
    s = _tokens_per_rank(S, t)
    # Block j of dim 0 = sequence chunk j (rank j's tokens) of our heads.
    inp = y.reshape(B, per, t, s, d).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    # out[i] came from rank i: heads block i of our tokens -> concatenate along the heads.
    return out.permute(1, 0, 2, 3, 4).reshape(B, t * per, s, d)


class _SeqToHeads(torch.autograd.Function):
    """Forward: sequence-sharded -> head-sharded. Backward: the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, group: dist.ProcessGroup | None):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    """Forward: head-sharded -> sequence-sharded. Backward: the inverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, y, group: dist.ProcessGroup | None):
        ctx.group = group
        return _heads_to_seq(y, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _check_4d(x, name):
    if x.dim() != 4:
        raise ValueError(f"{name} must be (batch, n_head, seq_shard, head_dim), got shape {tuple(x.shape)}")


def seq_to_heads(x, group: dist.ProcessGroup | None = None):
    """(B, n_head, S/t, d), this rank's tokens of all heads -> (B, n_head/t, S, d), all tokens of
    this rank's heads (heads [r·n_head/t, (r+1)·n_head/t)). One all-to-all forward, one backward."""
    _check_4d(x, "x")
    heads_per_rank(x.size(1), _ulysses_size(group))
    return _SeqToHeads.apply(x, group)


def heads_to_seq(y, group: dist.ProcessGroup | None = None):
    """(B, n_head/t, S, d) -> (B, n_head, S/t, d): the inverse of :func:`seq_to_heads`."""
    _check_4d(y, "y")
    _tokens_per_rank(y.size(2), _ulysses_size(group))
    return _HeadsToSeq.apply(y, group)


# --- rows to their owners: expert parallelism's all-to-all with uneven splits ----------------------


def _all_to_all_rows(x, out_splits, in_splits, group: dist.ProcessGroup | None):
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    comm.all_to_all(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits, differentiable: backward is the reverse all-to-all
    (``out_splits`` and ``in_splits`` swapped) of the gradient."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group: dist.ProcessGroup | None):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all_rows(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all_rows(grad, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x, out_splits, in_splits, group: dist.ProcessGroup | None = None):
    """Rows ``[Σ in_splits[:j], +in_splits[j])`` of x go to rank j; ``out_splits[i]`` rows arrive from
    rank i. Backward: the same all-to-all of the gradient with the splits swapped."""
    return AllToAll.apply(x, list(out_splits), list(in_splits), group)
