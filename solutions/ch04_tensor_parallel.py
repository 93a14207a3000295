"""Chapter 04 exercises: tensor parallelism — a row-parallel matmul that scatters its output along the
sequence, Megatron's MLP on an uneven split, a label-smoothed vocab-parallel loss, SUMMA, GQA heads, and
a layer's traffic predicted then counted.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch04_tensor_parallel.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch04 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Every function here runs inside ranks (start it with ``minitorch_dist.launch(fn, t)``) and
talks through ``minitorch_dist.runtime.comm``, whose meter the tests read.

1. :class:`RowScatterMatmul`: ``Y = X W + b`` with W split along its rows over t ranks and Y
   left split along the sequence: one reduce-scatter forward, one all-gather backward (Shoeybi et
   al. 2019, "Megatron-LM", §3, Fig. 3a; Korthikanti et al. 2022, "Reducing Activation
   Recomputation in Large Transformer Models", §4.2.2, Fig. 6: the ḡ operator).
2. :class:`UnevenMLP`: the tensor-parallel MLP, ``GeLU(X A) B`` with A split by columns and
   B by rows, Megatron's f and g as autograd Functions, on an MLP width t need not divide (§3,
   Fig. 3a).
3. :func:`vocab_sharded_smoothed_ce`: the label-smoothed cross-entropy of logits split
   along the vocabulary, communicating a few numbers per row instead of b*s*V (Megatron-LM §3;
   Szegedy et al. 2016, "Rethinking the Inception Architecture", §7, for the smoothing).
4. :func:`summa_matmul`: 2D tensor parallelism, ``C = A B`` on a q x q grid of ranks (van de Geijn
   & Watts 1997, "SUMMA"; Xu et al. 2021, "Optimus", §3).
5. :func:`gqa_head_shard`: which query and key/value heads one rank of t holds for grouped-query
   attention (Ainslie et al. 2023, "GQA"). Plain arithmetic: no ranks needed.
6. :func:`tp_layer_traffic`: predict a tensor-parallel transformer layer's all-reduces and wire
   bytes with the cost model (Narayanan et al. 2021, §3.2), then count them with the comm meter.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.runtime import comm


def _require_dist(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{name} runs inside ranks: call it from a function started with "
                           "minitorch_dist.launch(fn, t)")


# --- 1. the row-parallel matmul, its output scattered along the sequence ------------------------


class RowScatterMatmul(torch.autograd.Function):
    """Kind: build · about 60 minutes

    ``Y = X W + b`` with X split along its columns and W along its rows over the t ranks of
    ``group``, and Y left *split along the sequence*: rank r gets only its s/t positions of Y.

    Megatron's row-parallel GEMM (Shoeybi et al. 2019, §3, Fig. 3a) all-reduces its full-sized
    partial products, so every rank ends with all of Y. Sequence parallelism (Korthikanti et al.
    2022, §4.2.2, Fig. 6) keeps only what the next, position-wise ops need: an all-reduce is a
    reduce-scatter followed by an all-gather, and the all-gather can wait until the next
    column-parallel layer. Build that operator, ḡ fused with the matmul, forward and backward.

    **Interface.** The paper's convention: ``W`` is ``(k, n)`` and activations are sequence-first,
    ``(s, b, ·)`` (Megatron's layout). Rank r holds ``x_r = X[..., r·k/t:(r+1)·k/t]``, shape
    ``(s, b, k/t)``; ``w_r = W[r·k/t:(r+1)·k/t, :]``, shape ``(k/t, n)``; ``bias`` (``(n,)`` or None),
    the same full bias on every rank. Forward returns ``Y[r·s/t:(r+1)·s/t]``, shape ``(s/t, b, n)``,
    bias included. Backward receives this rank's ``(s/t, b, n)`` slice of dY and returns one
    gradient per input of forward (``x_r, w_r, bias, group``, None where there is none): x_r's and
    w_r's exactly as the dense layer's slices, and for the bias the part from this rank's positions
    (a replicated parameter under sequence parallelism gets its ranks' parts summed later, by its
    optimizer's all-reduce; not here). Call it through :func:`row_scatter_matmul`.

    **What the tests check**, at t = 2 and 4: the output and every gradient against the dense layer
    and its autograd slices (float32, derived bounds), with and without bias; x_r left unchanged;
    and through the meter, exactly one ``comm.reduce_scatter`` of the full partial product forward
    and one ``comm.all_gather`` of dY backward, nothing else.

    Reference: ``minitorch_dist/parallelism/mappings.py`` (``reduce_scatter_to_sequence`` is the
    operator alone; the library's ``RowParallelLinear`` all-reduces instead).
    """

    @staticmethod
    def forward(ctx, x_r, w_r, bias, group):
        # BEGIN SOLUTION
        ctx.save_for_backward(x_r, w_r)
        ctx.has_bias, ctx.group = bias is not None, group
        t = dist.get_world_size(group)
        y = (x_r @ w_r).contiguous()  # a partial sum of all of Y, on every rank
        out = y.new_empty((y.shape[0] // t, *y.shape[1:]))
        comm.reduce_scatter(out, y, group=group)  # summed, and only this rank's positions kept
        if bias is not None:
            out = out + bias  # once, after the sum
        return out
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_out):
        # BEGIN SOLUTION
        x_r, w_r = ctx.saved_tensors
        t, n = dist.get_world_size(ctx.group), grad_out.shape[-1]
        grad_y = grad_out.new_empty((grad_out.shape[0] * t, *grad_out.shape[1:]))
        comm.all_gather(grad_y, grad_out.contiguous(), group=ctx.group)  # every position's dY
        grad_x = grad_y @ w_r.t()
        grad_w = x_r.reshape(-1, x_r.shape[-1]).t() @ grad_y.reshape(-1, n)
        grad_b = grad_out.reshape(-1, n).sum(0) if ctx.has_bias else None  # this rank's positions
        return grad_x, grad_w, grad_b, None
        # END SOLUTION


def row_scatter_matmul(x_r: torch.Tensor, w_r: torch.Tensor, bias: torch.Tensor | None = None,
                         group=None) -> torch.Tensor:
    """This rank's s/t positions of ``X W + b`` from its slices (see :class:`RowScatterMatmul`)."""
    _require_dist("row_scatter_matmul")
    if w_r.dim() != 2:
        raise ValueError("w_r must be 2-D (k/t input features, n output features), got shape "
                         f"{tuple(w_r.shape)}")
    if x_r.dim() != 3 or x_r.shape[-1] != w_r.shape[0]:
        raise ValueError(f"x_r must be (s, b, k/t) with k/t = {w_r.shape[0]} (w_r's rows), got shape "
                         f"{tuple(x_r.shape)}: rank r holds the same slice of X's columns and of W's rows")
    t = dist.get_world_size(group)
    if x_r.shape[0] % t:
        raise ValueError(f"the sequence length {x_r.shape[0]} is not divisible by t={t}: each rank keeps "
                         f"s/t positions; pad the sequence to a multiple of {t}")
    if bias is not None and tuple(bias.shape) != (w_r.shape[1],):
        raise ValueError(f"bias must have shape ({w_r.shape[1]},), one per output feature, got "
                         f"{tuple(bias.shape)}")
    return RowScatterMatmul.apply(x_r, w_r, bias, group)


# --- 2. Megatron's MLP on an uneven split ---------------------------------------------------------


class UnevenMLP(nn.Module):
    """Kind: build · about 60 minutes

    The MLP ``Y = GeLU(X A + a) B + b`` of a transformer layer split over the t ranks of ``group`` as
    Megatron-LM does it (Shoeybi et al. 2019, §3, Fig. 3a): A by *columns*, B by *rows*, with
    Megatron's conjugate operators ``f`` (before A) and ``g`` (after B) written as autograd
    Functions. Unlike Megatron, the MLP width f need not be a multiple of t.

    **Interface.** Built from a dense MLP (``minitorch_dist.models.gpt.MLP``: ``c_fc`` an
    ``nn.Linear(h, f)``, a tanh-approximated GeLU, ``c_proj`` an ``nn.Linear(f, h)``; nn.Linear
    stores its weight as (out, in)). Rank r of t owns a contiguous run of the f hidden units, in rank
    order, the first ``f % t`` ranks one unit more than the others (63 units on 4 ranks: 16, 16, 16, 15).
    It keeps four ``nn.Parameter`` s holding *copies* of the dense slices: ``w_fc`` (its units' rows
    of c_fc.weight), ``b_fc``, ``w_proj`` (its units' columns of c_proj.weight) and ``b_proj`` (the
    whole c_proj.bias). ``forward(x)`` takes the full input x (the same on every rank) and returns
    the full output. ``f`` and ``g`` each take ``(tensor, group)`` and return one gradient per input
    (None for the group).

    **What the tests check**, at t = 2 and 4 on a width of 63 (uneven) in float64: the parameters'
    shapes; the output, the input's gradient and every parameter's gradient against the dense MLP's
    slices; on an even width, PyTorch's DTensor tensor parallelism (``ColwiseParallel`` /
    ``RowwiseParallel``); and through the meter, one all-reduce of the (b, s, h) activation forward
    and one backward, nothing else.

    Reference: ``minitorch_dist/parallelism/tensor_parallel.py`` (``ParallelMLP``, which requires t to
    divide f) and ``minitorch_dist/parallelism/mappings.py`` (f and g).
    """

    class f(torch.autograd.Function):
        """Megatron's f: identity forward, all-reduce of the gradient backward."""

        @staticmethod
        def forward(ctx, x, group):
            # BEGIN SOLUTION
            ctx.group = group
            return x.view_as(x)  # a view, not x itself: autograd records this Function as its creator
            # END SOLUTION

        @staticmethod
        def backward(ctx, grad):
            # BEGIN SOLUTION
            grad = grad.contiguous().clone()
            comm.all_reduce(grad, group=ctx.group)
            return grad, None
            # END SOLUTION

    class g(torch.autograd.Function):
        """Megatron's g: all-reduce forward, identity backward."""

        @staticmethod
        def forward(ctx, y_r, group):
            # BEGIN SOLUTION
            y = y_r.contiguous().clone()
            comm.all_reduce(y, group=group)
            return y
            # END SOLUTION

        @staticmethod
        def backward(ctx, grad):
            # BEGIN SOLUTION
            return grad, None
            # END SOLUTION

    def __init__(self, mlp: nn.Module, group=None):
        super().__init__()
        _require_dist("UnevenMLP")
        for name in ("c_fc", "c_proj"):
            lin = getattr(mlp, name, None)
            if not isinstance(lin, nn.Linear) or lin.bias is None:
                raise ValueError(f"mlp.{name} must be an nn.Linear with a bias (a models.gpt.MLP), "
                                 f"got {lin!r}")
        t, r = dist.get_world_size(group), dist.get_rank(group)
        width = mlp.c_fc.out_features
        if width < t:
            raise ValueError(f"the MLP width {width} is smaller than t={t}: every rank needs at least one "
                             f"hidden unit; use t <= {width}")
        if getattr(getattr(mlp, "dropout", None), "p", 0.0):
            raise ValueError("dropout must be 0: a split region needs per-rank random streams "
                             "(see the chapter)")
        self.group = group
        # BEGIN SOLUTION
        base, extra = divmod(width, t)  # the first `extra` ranks hold one unit more
        start = r * base + min(r, extra)
        units = slice(start, start + base + (r < extra))
        self.w_fc = nn.Parameter(mlp.c_fc.weight.detach()[units].clone())
        self.b_fc = nn.Parameter(mlp.c_fc.bias.detach()[units].clone())
        self.w_proj = nn.Parameter(mlp.c_proj.weight.detach()[:, units].clone())
        self.b_proj = nn.Parameter(mlp.c_proj.bias.detach().clone())
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION
        h_r = F.gelu(F.linear(self.f.apply(x, self.group), self.w_fc, self.b_fc), approximate="tanh")
        y = self.g.apply(F.linear(h_r, self.w_proj), self.group)
        return y + self.b_proj  # once, after the sum
        # END SOLUTION


# --- 3. the vocab-parallel cross-entropy, label-smoothed -------------------------------------------


def vocab_sharded_smoothed_ce(logits_r: torch.Tensor, targets: torch.Tensor, smoothing: float,
                              group=None) -> torch.Tensor:
    """Kind: build · about 45 minutes

    The mean label-smoothed cross-entropy of logits split along the vocabulary, without gathering
    them.

    The output layer of a language model maps b·s hidden states to b·s·V logits, V ~ 50k. With the
    output embedding split column-wise over t ranks, rank r holds the logits of its vocab slice
    ``[r·V/t, (r+1)·V/t)``. All-gathering them for the loss would move b·s·V numbers; Megatron
    (Shoeybi et al. 2019, §3, last paragraphs) reduces each row to a few numbers first. Here the
    target distribution is also *smoothed* (Szegedy et al. 2016, §7): weight ``1 - smoothing`` on
    the target token plus ``smoothing`` spread uniformly over all V tokens (the target included),
    and the loss of a row is the cross-entropy of the softmax against that distribution: what
    ``F.cross_entropy(..., label_smoothing=smoothing)`` computes on the full logits.

    **Interface.** ``logits_r``, shape ``(..., V/t)``; ``targets``, shape ``logits_r.shape[:-1]``,
    *global* vocab ids, the same on every rank; ``smoothing`` in [0, 1]; the rank index is
    ``dist.get_rank(group)``. Return the mean over all rows, a 0-dim float32 tensor, the same on every
    rank, computed in float32 (``.float()``), using only ``comm.all_reduce``. No gradient is asked
    for. It must not overflow for logits in the thousands.

    **What the tests check**, at t = 2 and 4 and smoothing 0 and 0.1: the loss against
    ``F.cross_entropy`` with ``label_smoothing`` on the full logits in float64 (a derived float32
    bound), also with every logit shifted by 1000; targets on the slices' edges; and through the
    meter, only all-reduces, a few numbers per row, never the logits.

    Reference: ``minitorch_dist/parallelism/tensor_parallel_vocab.py`` (``vocab_parallel_cross_entropy``:
    no smoothing there).
    """
    _require_dist("vocab_sharded_smoothed_ce")
    if tuple(targets.shape) != tuple(logits_r.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}; expected logits_r's without its last "
                         f"(vocab) dimension, {tuple(logits_r.shape[:-1])}")
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 vocab ids, got {targets.dtype}")
    if not 0.0 <= smoothing <= 1.0:
        raise ValueError(f"smoothing must lie in [0, 1] (0: plain cross-entropy), got {smoothing!r}")
    vocab = logits_r.shape[-1] * dist.get_world_size(group)
    if targets.numel() and not (0 <= int(targets.min()) and int(targets.max()) < vocab):
        raise ValueError(f"targets must lie in [0, {vocab}) (V/t = {logits_r.shape[-1]} per rank times "
                         f"t = {dist.get_world_size(group)} ranks), got [{int(targets.min())}, "
                         f"{int(targets.max())}]")
    # BEGIN SOLUTION
    v_r = logits_r.shape[-1]
    lo = dist.get_rank(group) * v_r  # the first vocab id of this rank's slice
    z = logits_r.detach().float().reshape(-1, v_r)
    y = targets.reshape(-1)

    m = z.max(dim=-1).values
    comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group)
    sum_exp = (z - m[:, None]).exp().sum(dim=-1)
    comm.all_reduce(sum_exp, group=group)
    mine = (y >= lo) & (y < lo + v_r)
    z_y = z.gather(1, (y - lo).clamp(0, v_r - 1)[:, None]).squeeze(1)
    z_y = torch.where(mine, z_y, torch.zeros_like(z_y))  # only the owner of y contributes
    sum_z = z.sum(dim=-1)  # this rank's part of the sum of the row's V logits
    parts = torch.stack([z_y, sum_z])
    comm.all_reduce(parts, group=group)
    z_y, mean_z = parts[0], parts[1] / vocab
    lse = m + sum_exp.log()
    return (lse - (1 - smoothing) * z_y - smoothing * mean_z).mean()
    # END SOLUTION


# --- 4. SUMMA: a 2D-parallel matmul --------------------------------------------------------------


def summa_matmul(a_ij: torch.Tensor, b_ij: torch.Tensor) -> torch.Tensor:
    """Kind: build · about 60 minutes

    This rank's block of ``C = A B`` on a q x q grid of ranks, by SUMMA (van de Geijn & Watts 1997;
    for transformers, Xu et al. 2021, "Optimus", §3).

    1D tensor parallelism all-reduces a full activation in every layer; on a q x q grid each rank
    sends only along its grid row and its grid column, about 1/q of that. A, B and C are cut into
    q x q blocks; rank ``q·i + j`` (grid row i, column j) holds ``A_ij`` and ``B_ij`` (all A blocks one
    shape, all B blocks another) and must end with ``C_ij = Σ_k A_ik B_kj``, each block it needs
    arriving by a broadcast from the rank that holds it, along a grid row or a grid column.

    **Interface.** Return ``C_ij`` in the blocks' dtype, using ``comm.broadcast`` with groups from
    ``dist.new_group`` (collective over the *whole* world: every rank creates every group, in the
    same order). ``comm.broadcast(t, src, group=g)`` takes ``src`` as a *global* rank and overwrites
    ``t`` on the other ranks of g. The world size must be a square (scaffolded).

    **What the tests check**, on a 2 x 2 grid in float64: every block against the dense product
    (``reorder_bound`` of a K-term dot product); through the meter, 2q broadcasts per rank, each
    among q ranks, q of A's block size and q of B's.

    Reference: ``minitorch_dist/runtime/comm.py`` (the metered ``broadcast``; the library has no
    SUMMA: ``parallelism/mesh.py`` shows grid groups built on every rank).
    """
    _require_dist("summa_matmul")
    world = dist.get_world_size()
    q = math.isqrt(world)
    if q * q != world:
        raise ValueError(f"SUMMA needs a square grid of ranks: world size {world} is not q*q; "
                         "launch 1, 4, 9... ranks")
    if a_ij.dim() != 2 or b_ij.dim() != 2 or a_ij.shape[1] != b_ij.shape[0]:
        raise ValueError("blocks must be 2-D with A_ij's columns equal to B_ij's rows, got "
                         f"{tuple(a_ij.shape)} and {tuple(b_ij.shape)}")
    # BEGIN SOLUTION
    i, j = divmod(dist.get_rank(), q)
    rows = [dist.new_group([q * r + c for c in range(q)]) for r in range(q)]  # same order on every rank
    cols = [dist.new_group([q * r + c for r in range(q)]) for c in range(q)]
    c_ij = torch.zeros(a_ij.shape[0], b_ij.shape[1], dtype=torch.result_type(a_ij, b_ij), device=a_ij.device)
    for k in range(q):
        a_ik = a_ij.clone() if j == k else torch.empty_like(a_ij)
        comm.broadcast(a_ik, src=q * i + k, group=rows[i])
        b_kj = b_ij.clone() if i == k else torch.empty_like(b_ij)
        comm.broadcast(b_kj, src=q * k + j, group=cols[j])
        c_ij += a_ik @ b_kj
    return c_ij
    # END SOLUTION


# --- 5. grouped-query attention: which heads a rank holds ------------------------------------------


def gqa_head_shard(n_head: int, n_kv_head: int, t: int, r: int) -> tuple[range, range, bool]:
    """Kind: derive · about 25 minutes

    ``(query heads, kv heads, replicated)`` of rank ``r`` of ``t`` for attention with ``n_head``
    query heads sharing ``n_kv_head`` key/value heads (Ainslie et al. 2023, "GQA"): query head h
    reads kv head ``h // (n_head / n_kv_head)``.

    Assume the query heads are split evenly, in order, rank r holding a contiguous run of
    n_head / t of them, and that a rank holds exactly the kv heads its query heads read, each whole.
    Derive which kv heads that is, whether a rank's kv heads are also held by other ranks
    (``replicated``: their gradients must then be summed over those ranks), and for which t the
    scheme works at all. For a t where it does not (a rank's query heads would read part of a kv
    head, or t does not divide n_head), raise ``ValueError`` naming the degrees that work, e.g.
    "... use t in (1, 2, 4, 8)".

    Return the two ranges and the flag, or raise. The tests check every t on five head layouts
    against the library's layout (``tensor_parallel_llama.kv_layout``, ``kv_heads_of_rank``), every
    query head held once and every query head's kv head held by the same rank.
    """
    for name, v in (("n_head", n_head), ("n_kv_head", n_kv_head), ("t", t)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_head % n_kv_head:
        raise ValueError(f"n_head {n_head} is not a multiple of n_kv_head {n_kv_head}: every kv head serves "
                         f"a whole group of query heads")
    if not 0 <= r < t:
        raise ValueError(f"rank {r} is not one of the t={t} ranks")
    # BEGIN SOLUTION
    ok = [d for d in range(1, n_head + 1) if n_head % d == 0 and (n_kv_head % d == 0 or d % n_kv_head == 0)]
    if t not in ok:
        raise ValueError(f"t={t} cannot shard n_head={n_head} query heads over n_kv_head={n_kv_head} "
                         f"kv heads: use t in {tuple(ok)}")
    per_q = n_head // t
    queries = range(r * per_q, (r + 1) * per_q)
    group = n_head // n_kv_head  # query heads per kv head
    if n_kv_head % t == 0:
        per_kv = n_kv_head // t
        return queries, range(r * per_kv, (r + 1) * per_kv), False
    head = queries.start // group
    return queries, range(head, head + 1), True
    # END SOLUTION


# --- 6. a layer's traffic: predicted, then counted ---------------------------------------------------


def tp_layer_traffic(block: nn.Module, x: torch.Tensor, group=None) -> dict:
    """Kind: measure · about 30 minutes

    Predict what one tensor-parallel transformer layer sends, then count it.

    ``block`` is one layer of a tensor-parallel GPT on this rank (attention split by heads, the MLP
    column-then-row, f and g around both), ``x`` its input, of shape (b, s, h), the same on every
    rank of ``group`` (t ranks).

    1. **Predict**, before running anything and from the shapes alone, with the cost model
       (``minitorch_dist.costmodel``): how many all-reduces of the b·s·h activation Megatron's
       layer runs in its forward and in its backward, and how many bytes this rank puts on the
       wire for all of them under the ring model (Narayanan et al. 2021, §3.2), with the element
       size of ``x``.
    2. **Measure**: run ``block`` forward (on a detached copy of x that requires grad) and the
       backward of ``y.sum()``, each under its own ``comm.meter()``, and read the all-reduces of each
       pass and the wire bytes of both together.

    Return ``{"predicted": {"forward": n, "backward": n, "wire_bytes": bytes},
    "measured": {"forward": n, "backward": n, "wire_bytes": bytes}}``.

    **What the tests check**, at t = 2 and 4: the prediction against the formula worked by hand; the
    measurement against the test's own meter of the same layer; the two against each other (counts
    exactly, bytes within rel 1e-9); and, on a layer that sends one all-reduce more than Megatron's,
    a prediction that stays Megatron's while the measurement sees the extra one.

    Reference: ``minitorch_dist/costmodel/tensor_parallel.py`` (the counts and bytes to predict with) and
    ``minitorch_dist/runtime/comm.py`` (the meter).
    """
    _require_dist("tp_layer_traffic")
    if x.dim() != 3:
        raise ValueError(f"x must be the layer's (batch, seq, hidden) input, got shape {tuple(x.shape)}")
    # BEGIN SOLUTION
    b, s, h = x.shape
    t = dist.get_world_size(group)
    counts = costmodel.tensor_parallel_allreduces_per_layer()
    predicted = {"forward": counts["forward"], "backward": counts["backward"],
                 "wire_bytes": costmodel.tensor_parallel_bytes_per_layer(b, s, h, t, x.element_size())}
    x = x.detach().clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = block(x)
    with comm.meter() as bwd:
        y.sum().backward()
    measured = {"forward": fwd.calls["all_reduce"], "backward": bwd.calls["all_reduce"],
                "wire_bytes": fwd.total_wire_bytes + bwd.total_wire_bytes}
    return {"predicted": predicted, "measured": measured}
    # END SOLUTION
