"""Chapter 04 exercises: tensor parallelism — a row-parallel matmul, Megatron's MLP, a vocab-parallel loss,
SUMMA, GQA heads, and a layer's traffic predicted then counted.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch04_tensor_parallel.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch04 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Every function here runs inside ranks (start it with ``minitorch_dist.launch(fn, t)``) and
talks through ``minitorch_dist.runtime.comm``, whose meter the tests read.

1. :class:`RowParallelMatmul`: ``Y = X W`` with W split along its rows (its input dimension)
   over t ranks; one all-reduce in forward, none in backward (Shoeybi et al. 2019, "Megatron-LM:
   Training Multi-Billion Parameter Language Models Using Model Parallelism", §3, Fig. 3a: the
   second GEMM of the MLP, and the ``g`` operator).
2. :class:`MegatronMLP`: the whole tensor-parallel MLP, ``GeLU(X A) B`` with A split by columns
   and B by rows, and Megatron's two conjugate operators ``f`` and ``g`` written as autograd
   Functions (§3, Fig. 3a): one all-reduce forward, one backward.
3. :func:`vocab_sharded_cross_entropy`: the cross-entropy of logits split along the vocabulary,
   communicating b*s numbers instead of b*s*V (Megatron-LM §3, last paragraphs: "we fuse the
   output of the parallel GEMM with the cross-entropy loss").
4. :func:`summa_matmul`: 2D tensor parallelism, ``C = A B`` on a q x q grid of ranks with
   broadcasts along rows and columns (van de Geijn & Watts 1997, "SUMMA: Scalable Universal
   Matrix Multiplication Algorithm"; used for transformers by Xu et al. 2021, "An Efficient 2D
   Method for Training Super-Large Deep Learning Models", Optimus, §3).
5. :func:`gqa_head_shard`: which query and key/value heads one rank of t holds for grouped-query
   attention (Ainslie et al. 2023, "GQA"): kv heads split when t divides ``n_kv_head``, replicated
   when ``n_kv_head`` divides t (chapter 04, "Tensor parallelism with grouped-query attention").
   Plain arithmetic: no ranks needed.
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


# --- 1. the row-parallel matmul ----------------------------------------------------------


class RowParallelMatmul(torch.autograd.Function):
    """Kind: build

    ``Y = X W + b`` with X split along its columns and W along its rows over the t ranks.

    Convention (the paper's, not ``nn.Linear``'s): ``W`` has shape ``(k, n)``, input features by
    output features, and ``Y = X @ W``. Split the k input features into t equal slices; rank r
    holds

    - ``x_r = X[..., r*k/t : (r+1)*k/t]``, shape ``(..., k/t)`` — in Megatron's MLP this is the
      output of the column-parallel first GEMM, already split this way, so no scatter is needed;
    - ``w_r = W[r*k/t : (r+1)*k/t, :]``, shape ``(k/t, n)``;
    - ``bias``, shape ``(n,)`` or None, the *same* full bias on every rank.

    Block matrix multiplication gives ``X W = sum_r x_r w_r``: each rank computes a full-sized
    partial product, and one all-reduce sums them (Megatron's ``g``: all-reduce in forward,
    identity in backward). The bias is added once, *after* the sum (added before, it would be
    counted t times).

    Backward needs no communication: with ``dY`` the (full, replicated) gradient of Y,

        grad x_r = dY w_r^T            (this rank's slice of dX = dY W^T)
        grad w_r = x_r^T dY            (this rank's rows of dW = X^T dY; leading dims flattened)
        grad b   = dY summed over all leading dims

    **Your task:** write ``forward`` (save what backward needs with ``ctx.save_for_backward``,
    one ``comm.all_reduce`` on the partial product) and ``backward`` (return one gradient per
    input of forward: ``x_r, w_r, bias, group``, None where there is none). Call it through
    :func:`row_parallel_linear` (``Function.apply`` takes no keyword arguments).
    """

    @staticmethod
    def forward(ctx, x_r, w_r, bias, group):
        # BEGIN SOLUTION
        ctx.save_for_backward(x_r, w_r)
        ctx.has_bias = bias is not None
        y = x_r @ w_r  # a partial sum of Y, full-sized, on every rank
        comm.all_reduce(y, group=group)
        if bias is not None:
            y = y + bias  # once, after the sum
        return y
        # END SOLUTION

    @staticmethod
    def backward(ctx, grad_y):
        # BEGIN SOLUTION
        x_r, w_r = ctx.saved_tensors
        n = grad_y.shape[-1]
        grad_x = grad_y @ w_r.t()
        grad_w = x_r.reshape(-1, x_r.shape[-1]).t() @ grad_y.reshape(-1, n)
        grad_b = grad_y.reshape(-1, n).sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None
        # END SOLUTION


def row_parallel_linear(x_r: torch.Tensor, w_r: torch.Tensor, bias: torch.Tensor | None = None,
                        group=None) -> torch.Tensor:
    """``X W + b`` from this rank's slices (see :class:`RowParallelMatmul`), differentiable."""
    _require_dist("row_parallel_linear")
    if w_r.dim() != 2:
        raise ValueError("w_r must be 2-D (k/t input features, n output features), got shape "
                         f"{tuple(w_r.shape)}")
    if x_r.shape[-1] != w_r.shape[0]:
        raise ValueError(f"x_r has {x_r.shape[-1]} columns but w_r has {w_r.shape[0]} rows: rank r must hold "
                         "the same slice r*k/t:(r+1)*k/t of X's columns and of W's rows")
    if bias is not None and tuple(bias.shape) != (w_r.shape[1],):
        raise ValueError(f"bias must have shape ({w_r.shape[1]},), one per output feature, got "
                         f"{tuple(bias.shape)}")
    return RowParallelMatmul.apply(x_r, w_r, bias, group)


# --- 2. Megatron's MLP: column-parallel, GeLU, row-parallel, with f and g ---------------------------


class MegatronMLP(nn.Module):
    """Kind: build

    The MLP ``Y = GeLU(X A + a) B + b`` of a transformer layer, split over the t ranks of ``group``
    as Megatron-LM does it (Shoeybi et al. 2019, §3, Fig. 3a): A by *columns*, B by *rows*.

    Built from a dense MLP (``minitorch_dist.models.gpt.MLP``: ``c_fc`` an ``nn.Linear(h, f)``,
    a tanh-approximated GeLU, ``c_proj`` an ``nn.Linear(f, h)``; nn.Linear stores its weight as
    (out, in)), rank r of t keeps, with ``rows = slice(r*f/t, (r+1)*f/t)``:

    - ``w_fc = c_fc.weight[rows]`` (f/t, h) and ``b_fc = c_fc.bias[rows]`` (f/t,): its columns of A;
    - ``w_proj = c_proj.weight[:, rows]`` (h, f/t): its rows of B;
    - ``b_proj = c_proj.bias`` (h,): the whole bias, the same on every rank.

    Each an ``nn.Parameter`` holding a *copy* (``.detach().clone()``) of the dense slice. Forward,
    on the full input x (the same on every rank)::

        x -> f -> GeLU(x w_fc^T + b_fc) -> (.) w_proj^T -> g -> + b_proj

    GeLU is elementwise, so it runs on the rank's f/t columns with no communication, and those
    columns are exactly the input slice the row-parallel B needs. Two operators carry all the
    communication; write each as a ``torch.autograd.Function``:

    - ``f`` (before the column-parallel A): identity forward; backward **all-reduce** of the
      input's gradient, because x fed every rank's slice, so ``dL/dx = sum_r dL/dx_r``;
    - ``g`` (after the row-parallel B): forward **all-reduce** (``Y = sum_r Y_r``, each rank's
      product is a full-sized partial sum); backward identity (each Y_r enters Y with weight 1).

    ``comm.all_reduce`` works in place: all-reduce a clone, never a tensor autograd has saved.
    Add ``b_proj`` once, after g. One all-reduce of the (b, s, h) activation forward and one
    backward, nothing else.

    **Your task:** ``f.forward`` / ``f.backward``, ``g.forward`` / ``g.backward`` (return one gradient
    per input of forward: the tensor's, then None for ``group``), the shards in ``__init__`` and
    ``forward``. The tests compare the output and every gradient (the parameters' and the input's)
    with the dense MLP at t = 2 and 4, and with PyTorch's DTensor tensor parallelism
    (``parallelize_module`` with ``ColwiseParallel`` on ``c_fc`` and ``RowwiseParallel`` on
    ``c_proj``), and count the collectives of each pass with the comm meter.
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
        _require_dist("MegatronMLP")
        for name in ("c_fc", "c_proj"):
            lin = getattr(mlp, name, None)
            if not isinstance(lin, nn.Linear) or lin.bias is None:
                raise ValueError(f"mlp.{name} must be an nn.Linear with a bias (a models.gpt.MLP), "
                                 f"got {lin!r}")
        t, r = dist.get_world_size(group), dist.get_rank(group)
        width = mlp.c_fc.out_features
        if width % t:
            raise ValueError(f"the MLP width {width} is not divisible by t={t}: each rank needs a whole "
                             f"number of A's columns and B's rows")
        if getattr(getattr(mlp, "dropout", None), "p", 0.0):
            raise ValueError("dropout must be 0: a split region needs per-rank random streams "
                             "(see the chapter)")
        self.group = group
        # BEGIN SOLUTION
        rows = slice(r * width // t, (r + 1) * width // t)
        self.w_fc = nn.Parameter(mlp.c_fc.weight.detach()[rows].clone())
        self.b_fc = nn.Parameter(mlp.c_fc.bias.detach()[rows].clone())
        self.w_proj = nn.Parameter(mlp.c_proj.weight.detach()[:, rows].clone())
        self.b_proj = nn.Parameter(mlp.c_proj.bias.detach().clone())
        # END SOLUTION

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BEGIN SOLUTION
        h_r = F.gelu(F.linear(self.f.apply(x, self.group), self.w_fc, self.b_fc), approximate="tanh")
        y = self.g.apply(F.linear(h_r, self.w_proj), self.group)
        return y + self.b_proj  # once, after the sum
        # END SOLUTION


# --- 3. the vocab-parallel cross-entropy --------------------------------------------------------


def vocab_sharded_cross_entropy(logits_r: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Kind: build

    The mean cross-entropy of logits split along the vocabulary, without gathering them.

    The output layer of a language model maps b*s hidden states to b*s*V logits, V ~ 50k. With
    the output embedding split column-wise over t ranks, rank r holds the logits of its vocab
    slice ``[r*V/t, (r+1)*V/t)``: ``logits_r`` of shape ``(..., V/t)``. All-gathering them for
    the loss would move b*s*V numbers. Megatron (§3) instead reduces each row to a few numbers
    first. For one row with logits z and target y,

        loss = log sum_v exp(z_v) - z_y
             = M + log sum_v exp(z_v - M) - z_y,      M = max_v z_v  (no overflow)

    and every term is a reduction over v, so over the ranks:

    - ``M``: the max over ranks of each rank's row max (all-reduce with ``comm.ReduceOp.MAX``);
    - ``sum_v exp(z_v - M)``: the sum over ranks of each rank's partial sum (all-reduce, SUM);
    - ``z_y``: the rank whose slice holds y contributes the logit, the others 0 (all-reduce, SUM).

    Three all-reduces of b*s numbers each, whatever V. ``targets`` (shape ``logits_r.shape[:-1]``)
    holds *global* vocab ids and is the same on every rank; the rank index r is
    ``dist.get_rank(group)``.

    **Your task:** return the mean over all rows of the loss, a 0-dim float tensor, the same on
    every rank, using only ``comm.all_reduce``. Compute in float32 (``.float()``); no gradient
    is asked for (the chapter's module gives this function its backward, ``softmax - onehot``
    on the rank's own slice).
    """
    _require_dist("vocab_sharded_cross_entropy")
    if tuple(targets.shape) != tuple(logits_r.shape[:-1]):
        raise ValueError(f"targets has shape {tuple(targets.shape)}; expected logits_r's without its last "
                         f"(vocab) dimension, {tuple(logits_r.shape[:-1])}")
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be int64 vocab ids, got {targets.dtype}")
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
    comm.all_reduce(z_y, group=group)
    return (m + sum_exp.log() - z_y).mean()
    # END SOLUTION


# --- 4. SUMMA: a 2D-parallel matmul --------------------------------------------------------------


def summa_matmul(a_ij: torch.Tensor, b_ij: torch.Tensor) -> torch.Tensor:
    """Kind: build

    This rank's block of ``C = A B`` on a q x q grid of ranks (SUMMA).

    1D tensor parallelism (exercises 1 and 2) all-reduces a full activation in every layer; on a
    q x q grid each rank sends only along its row and its column, about 1/q of that. A, B and C
    are cut into q x q blocks; rank ``q*i + j`` (grid row i, column j) holds ``A_ij`` and
    ``B_ij`` and computes

        C_ij = sum_k A_ik B_kj

    in q steps: at step k the owner of ``A_ik`` (rank ``q*i + k``) broadcasts it along grid row
    i, the owner of ``B_kj`` (rank ``q*k + j``) broadcasts it along grid column j, and every rank
    adds ``A_ik @ B_kj`` to its C block. All A blocks have one shape, all B blocks another.

    The row and column groups come from ``dist.new_group(ranks)``. new_group is collective over
    the *whole* world: every rank must call it for every group, its own or not, in the same
    order, or the ranks hang. So build all q row groups, then all q column groups, on every
    rank. ``comm.broadcast(t, src, group=g)`` takes ``src`` as a *global* rank and overwrites
    ``t`` on the other ranks of g (receive into a fresh buffer: do not overwrite your own block).

    **Your task:** return ``C_ij``, using ``comm.broadcast`` with the row and column groups
    (2q broadcasts per rank, each among q ranks).
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
    """Kind: derive

    ``(query heads, kv heads, replicated)`` of rank ``r`` of ``t`` for attention with ``n_head``
    query heads sharing ``n_kv_head`` key/value heads (query head h reads kv head h // (n_head / n_kv_head)).

    Query heads are always split: rank r holds the n_head / t consecutive heads from r·n_head/t. The kv
    heads a rank needs are those its query heads read. When t divides ``n_kv_head`` each rank holds its
    own n_kv_head / t of them (``replicated`` False). When ``n_kv_head`` divides t, a kv head serves
    t / n_kv_head ranks, each holding a copy (``replicated`` True: their gradients must be summed over
    those ranks). Otherwise a rank's query heads would read part of a kv head, or kv heads other ranks
    also split: raise ``ValueError`` naming the degrees that work (every d dividing n_head for which d
    divides n_kv_head or n_kv_head divides d), e.g. "... use t in (1, 2, 4, 8)". t must divide n_head too.

    **Your task:** return the two ranges and the flag, or raise.
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
    """Kind: measure

    Predict what one tensor-parallel transformer layer sends, then count it.

    ``block`` is one layer of a tensor-parallel GPT on this rank (attention split by heads, the
    MLP column-then-row, f and g around both), ``x`` its input, of shape (b, s, h), the same on
    every rank of ``group`` (t ranks).

    1. **Predict**, before running anything, with the cost model
       (``minitorch_dist.costmodel``): how many all-reduces of the b·s·h activation the
       layer runs in its forward and in its backward, and how many bytes this rank puts on the
       wire for all of them under the ring model (Narayanan et al. 2021, §3.2), with the element
       size of ``x``.
    2. **Measure**: run the layer forward (on a detached copy of x that requires grad) inside one
       ``comm.meter()`` and the backward of ``y.sum()`` inside another, and read the number of
       all-reduces in each pass and the wire bytes of both together.

    Return ``{"predicted": {"forward": n, "backward": n, "wire_bytes": bytes},
    "measured": {"forward": n, "backward": n, "wire_bytes": bytes}}``. The tests check the
    prediction against the formula worked by hand and the measurement against their own meter, and
    require the two to agree: the counts exactly, the wire bytes within 0.1 %.
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
