# generated from solutions/ch04_tensor_parallel.py by `make exercises`: fill in each NotImplementedError
# fingerprint 9ca403f5240de31c of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 04 exercises: tensor parallelism — a row-parallel matmul that scatters its output along the
sequence, Megatron's MLP on an uneven split, a label-smoothed vocab-parallel loss, SUMMA, GQA heads, and
a layer's traffic predicted then counted.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch04``.

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
        raise NotImplementedError("exercise: RowScatterMatmul.forward — see chapters/04_tensor_parallel.md")

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("exercise: RowScatterMatmul.backward — see chapters/04_tensor_parallel.md")


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
            raise NotImplementedError("exercise: UnevenMLP.f.forward — see chapters/04_tensor_parallel.md")

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("exercise: UnevenMLP.f.backward — see chapters/04_tensor_parallel.md")

    class g(torch.autograd.Function):
        """Megatron's g: all-reduce forward, identity backward."""

        @staticmethod
        def forward(ctx, y_r, group):
            raise NotImplementedError("exercise: UnevenMLP.g.forward — see chapters/04_tensor_parallel.md")

        @staticmethod
        def backward(ctx, grad):
            raise NotImplementedError("exercise: UnevenMLP.g.backward — see chapters/04_tensor_parallel.md")

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
        raise NotImplementedError("exercise: UnevenMLP.__init__ — see chapters/04_tensor_parallel.md")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("exercise: UnevenMLP.forward — see chapters/04_tensor_parallel.md")


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
    raise NotImplementedError("exercise: vocab_sharded_smoothed_ce — see chapters/04_tensor_parallel.md")


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
    raise NotImplementedError("exercise: summa_matmul — see chapters/04_tensor_parallel.md")


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
    raise NotImplementedError("exercise: gqa_head_shard — see chapters/04_tensor_parallel.md")


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
    raise NotImplementedError("exercise: tp_layer_traffic — see chapters/04_tensor_parallel.md")
