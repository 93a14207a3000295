# generated from solutions/ch12_putting_it_together.py by `make exercises`: fill in each NotImplementedError
# fingerprint 010246cdb3d6b172 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 12 exercises: 3D parallelism by hand — the rank grid, the memory filter, microbatches for a
bubble, one training step on a 2-D grid of ranks, and a 3D step's traffic predicted then counted.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch12``.

The first three are the arithmetic a 3D configuration rests on (Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21), the ones
:mod:`minitorch_dist.parallelism.mesh` and :mod:`minitorch_dist.analysis.planner` do for the
library; the last two run on ranks.

1. :func:`rank_to_coords`, :func:`coords_to_rank`, :func:`group_ranks`: which rank is which point
   ``(dp, tp, pp)`` of the grid, in Megatron's order -- tensor parallelism fastest-varying (a TP
   group is consecutive ranks: one node, NVLink), then data, then pipeline outermost (Narayanan
   §3.2; Megatron-LM ``parallel_state.initialize_model_parallel``) -- and the groups of each axis.
2. :func:`fits_in_memory`: the planner's memory filter for one GPU of the first pipeline stage:
   model states under ZeRO over the data-parallel ranks (Rajbhandari et al. 2020, "ZeRO", §5.1),
   plus the activations of the microbatches 1F1B keeps in flight, per Korthikanti et al. 2022,
   "Reducing Activation Recomputation in Large Transformer Models", §4 (Table 2).
3. :func:`microbatches_for_bubble`: the fewest microbatches whose pipeline bubble
   ``(p-1)/(v*m)`` (Narayanan §2.2) meets a target, given how the batch can be split.
4. :func:`train_on_2d_grid`: SGD steps of the GPT on a data x tensor grid of ranks, built from the
   groups up; it must equal the single-process run on the same global batches.
5. :func:`predict_rank_traffic`: the bytes one rank of a 3D step sends on the data-parallel and the
   pipeline axes, predicted from the cost model, then counted on 4 ranks.
"""
from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT
from minitorch_dist.parallelism.tensor_parallel import parallelize_gpt

AXES = ("dp", "tp", "pp")


def _positive_ints(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# --- 1. the rank grid ------------------------------------------------------------------------------


def rank_to_coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """Kind: derive

    ``(dp_rank, tp_rank, pp_rank)``: where ``rank`` sits in a ``dp x tp x pp`` grid, Megatron's order.

    The ranks are numbered with TP fastest-varying, then DP, then PP (the slowest)::

        rank = tp_rank + tp * (dp_rank + dp * pp_rank)

    so ``tp_rank`` is the last "digit" of ``rank`` in the mixed radix ``(pp, dp, tp)``. Example
    with dp = tp = pp = 2: rank 5 = 1 + 2·(0 + 2·1) is ``(0, 1, 1)``. With 8 GPUs per node and
    ``tp = 8`` a node is exactly one TP group, and pipeline neighbours are ``dp*tp`` ranks apart.
    """
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp * tp * pp:
        raise ValueError(f"rank {rank!r} is outside the grid of dp·tp·pp = {dp * tp * pp} ranks "
                         f"(0..{dp * tp * pp - 1})")
    raise NotImplementedError("exercise: rank_to_coords — see chapters/12_putting_it_together.md")


def coords_to_rank(coords: tuple[int, int, int], dp: int, tp: int, pp: int) -> int:
    """Kind: derive

    The rank at ``coords = (dp_rank, tp_rank, pp_rank)``: the inverse of :func:`rank_to_coords`,
    ``tp_rank + tp * (dp_rank + dp * pp_rank)``."""
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if len(coords) != 3:
        raise ValueError(f"coords must be (dp_rank, tp_rank, pp_rank), got {coords!r}")
    for axis, c, size in zip(AXES, coords, (dp, tp, pp)):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
            raise ValueError(f"{axis} coordinate {c!r} is outside 0..{size - 1}")
    raise NotImplementedError("exercise: coords_to_rank — see chapters/12_putting_it_together.md")


def group_ranks(axis: str, dp: int, tp: int, pp: int) -> list[list[int]]:
    """Kind: derive

    Every process group along ``axis`` (``"dp"``, ``"tp"`` or ``"pp"``): the ranks that share the
    other two coordinates, each group listed by its coordinate on ``axis`` (which is also increasing
    rank order), the groups sorted by their first rank. There are ``dp*tp*pp / size(axis)`` groups
    of ``size(axis)`` ranks, and they partition the ranks.

    dp = tp = pp = 2::

        tp: [[0, 1], [2, 3], [4, 5], [6, 7]]       consecutive: one node each
        dp: [[0, 2], [1, 3], [4, 6], [5, 7]]       stride tp
        pp: [[0, 4], [1, 5], [2, 6], [3, 7]]       stride tp*dp: the pipeline spans nodes

    Every rank calls ``torch.distributed.new_group`` for every one of these lists, in this order
    (chapter 12's ``mesh.init_groups``), and keeps the three it belongs to.
    """
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; choose one of {AXES}")
    raise NotImplementedError("exercise: group_ranks — see chapters/12_putting_it_together.md")


# --- 2. the memory-feasibility filter --------------------------------------------------------------

#: Mixed-precision AdamW: 16-bit weights, K = 12 bytes of optimizer state per parameter (fp32 master
#: copy, momentum and variance; ZeRO §3.1). The gradients are ``grad_bytes`` (below).
WEIGHT_BYTES, OPTIMIZER_BYTES = 2, 12


def _check_fits_arguments(cfg, memory_bytes, tp, pp, zero, recompute, sequence_parallel, usable,
                          grad_bytes) -> None:
    """Validate the arguments of :func:`fits_in_memory` (a ``ValueError`` naming the fix)."""
    if cfg.n_layer % pp:
        raise ValueError(f"n_layer {cfg.n_layer} is not divisible by pp={pp}; choose pp among the divisors "
                         f"of {cfg.n_layer}")
    if cfg.n_head % tp or cfg.vocab_size % tp:
        raise ValueError(f"n_head {cfg.n_head} and vocab_size {cfg.vocab_size} must both be divisible by "
                         f"tp={tp}; choose tp among their common divisors")
    if sequence_parallel and cfg.block_size % tp:
        raise ValueError(f"sequence parallelism needs block_size {cfg.block_size} divisible by tp={tp}")
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be a ZeRO stage 0, 1, 2 or 3, got {zero!r}")
    if recompute not in costmodel.RECOMPUTE:
        raise ValueError(f"recompute must be one of {costmodel.RECOMPUTE}, got {recompute!r}")
    if not memory_bytes > 0:
        raise ValueError(f"memory_bytes must be > 0 (the GPU's memory, e.g. 80e9), got {memory_bytes!r}")
    if not 0 < usable <= 1:
        raise ValueError(f"usable must be in (0, 1], got {usable!r}")
    if grad_bytes not in (2, 4):
        raise ValueError(f"grad_bytes must be 2 (16-bit gradients) or 4 (an fp32 main_grad), "
                         f"got {grad_bytes!r}")


def fits_in_memory(cfg, memory_bytes: float, *, dp: int, tp: int, pp: int, micro_batch: int,
                   microbatches: int, zero: int = 0, recompute: str = "none", sequence_parallel: bool = False,
                   usable: float = 0.9, grad_bytes: int = 4) -> tuple[bool, dict]:
    """Kind: derive

    ``(fits, parts)``: does one GPU of the first pipeline stage hold its share of training?

    ``cfg`` is a GPT config (``models.gpt.GPTConfig`` field names: ``n_layer`` L, ``n_embd`` h,
    ``n_head`` a, ``vocab_size``, ``block_size`` = the sequence length s) trained in mixed precision
    with AdamW, pipelined with 1F1B into ``pp`` stages of ``L/pp`` layers, each split ``tp`` ways,
    on ``dp`` replicas; a step is ``microbatches`` (m) microbatches of ``micro_batch`` (b) sequences.
    The first stage is the busiest (it holds the embeddings and the most activations), so it decides.

    ``Psi`` (given below) is the parameters one GPU of that stage holds: its ``L/pp`` layers split
    ``tp`` ways plus the embeddings (``costmodel.pipeline_stage_params``). ``parts`` holds bytes:

    * model states, ZeRO over the ``dp`` ranks (ZeRO §5.1), 2 / g / 12 bytes per parameter, with
      g = ``grad_bytes``: 4 for Megatron-LM's fp32 gradient buffer ``main_grad`` (18 bytes in all),
      2 for 16-bit gradients (the ZeRO paper's 16)::

          weights    2 Psi   (/dp at stage 3)
          gradients  g Psi   (/dp at stages 2, 3)
          optimizer 12 Psi   (/dp at stages 1, 2, 3)
          buffers    ZeRO-3 gathers a layer's weights just in time and prefetches the next: two
                     layers' worth, 2 * (2 Psi / (L/pp)); 0 for stages 0-2

      **Under a pipeline** (``pp > 1``) ZeRO-2 accumulates the m microbatches' gradients whole and
      reduce-scatters them once, after the last one: the whole gradient is held until then, so
      its gradients are ``g Psi``, as at stage 1. (ZeRO-3 re-gathers the weights for every
      microbatch and keeps its sharded memory.)

    * ``activations``: 16-bit activations, Korthikanti §4 Table 2, per layer (t = tp)::

          recompute      tensor parallel only               with sequence_parallel
          "none"         s b h (10 + 24/t + 5 a s/(h t))    s b h/t (34 + 5 a s/h)
          "selective"    s b h (10 + 24/t)                  34 s b h/t
          "full"         2 s b h   (the layer's input)      2 s b h/t

      The first stage holds ``L/pp`` layers for each of the ``min(pp, m)`` microbatches 1F1B keeps
      in flight there (warm-up forwards before its first backward). With ``"full"`` recompute,
      backward rebuilds one layer at a time, so add one layer of ``"none"`` activations (b
      sequences) as the working set.

    * ``total`` (the sum of the five above), ``capacity = usable * memory_bytes`` (the rest is the
      CUDA context, communication buffers and fragmentation), and ``fits = total <= capacity``.
    """
    _positive_ints(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, microbatches=microbatches)
    _check_fits_arguments(cfg, memory_bytes, tp, pp, zero, recompute, sequence_parallel, usable, grad_bytes)
    psi = costmodel.pipeline_stage_params(cfg, tp, pp)[0]  # parameters on one GPU of the first stage
    s, b, h, a, t = cfg.block_size, micro_batch, cfg.n_embd, cfg.n_head, tp
    layers = cfg.n_layer // pp
    raise NotImplementedError("exercise: fits_in_memory — see chapters/12_putting_it_together.md")


# --- 3. microbatches for a bubble target -----------------------------------------------------------


def microbatches_for_bubble(p: int, target: float, global_batch: int, dp: int, micro_batch_size: int = 1,
                            v: int = 1) -> int:
    """Kind: derive

    The smallest number of microbatches ``m`` whose pipeline bubble ``(p-1)/(v*m)`` is at most ``target``.

    Narayanan et al. 2021 §2.2: with ``p`` stages, 1F1B idles ``(p-1)`` microbatch-times per step
    out of ``m`` useful ones, a bubble of ``(p-1)/m`` of the ideal time; the interleaved schedule
    with ``v`` model chunks per GPU divides it by ``v``. (As a share of the whole step that is
    ``(p-1)/(v*m + p-1)``, less than the ratio.) More microbatches shrink the bubble but make each
    one smaller (worse GEMM efficiency, more messages), so take the fewest that meet the target.

    Each data-parallel replica processes ``global_batch / dp`` sequences per step, split into ``m``
    equal microbatches of a whole number of units of ``micro_batch_size`` sequences: ``m`` must
    divide ``global_batch / (dp * micro_batch_size)``. The interleaved schedule (``v > 1``) also
    needs ``m`` to be a multiple of ``p`` (Megatron-LM's interleaved 1F1B). A bubble equal to the
    target meets it: ``p = 4``, ``target = 0.1`` gives ``m = 30`` (compare exactly, e.g. with
    ``fractions.Fraction``, or with one division ``(p - 1) / (v * m)``, which rounds like ``0.1``).

    Raises ``ValueError`` naming the fix when no such ``m`` exists.
    """
    _positive_ints(p=p, global_batch=global_batch, dp=dp, micro_batch_size=micro_batch_size, v=v)
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 <= target < float("inf"):
        raise ValueError(f"target must be a bubble ratio >= 0 (e.g. 0.05 for 5%), got {target!r}")
    if global_batch % dp:
        raise ValueError(f"global batch {global_batch} is not divisible by dp={dp}: each replica needs the "
                         f"same number of sequences; choose dp among the divisors of {global_batch}")
    per_replica = global_batch // dp
    if per_replica % micro_batch_size:
        raise ValueError(f"the per-replica batch {per_replica} (= {global_batch}/{dp}) is not divisible by "
                         f"micro_batch_size={micro_batch_size}; choose a divisor of {per_replica}")
    units = per_replica // micro_batch_size  # the most microbatches there can be
    # set m to the smallest valid count, or to None if there is none (the error below names the fix)
    raise NotImplementedError("exercise: microbatches_for_bubble — see chapters/12_putting_it_together.md")
    if m is None:
        need = "p = 1 (no pipeline)" if target == 0 else \
            f"m >= {-(-Fraction(p - 1, v) // Fraction(target))} microbatches"
        raise ValueError(f"no microbatch count reaches a bubble (p-1)/(v*m) <= {target} with p={p}, v={v}: "
                         f"that needs {need}, but m must divide the {units} units of {micro_batch_size} "
                         f"sequence(s) each replica gets per step (global batch {global_batch} / dp {dp})"
                         + (f" and be a multiple of p={p} (interleaved)" if v > 1 else "")
                         + "; raise the global batch, lower dp or micro_batch_size, interleave (v > 1), "
                           "or accept a larger bubble")
    return m


# --- 4. one training step on a data x tensor grid ------------------------------------------------


def _check_grid_arguments(cfg, dp, tp, steps, batch, seq) -> None:
    """Validate the arguments of :func:`train_on_2d_grid`, on the ranks of a job of ``dp * tp``."""
    for name, v in (("dp", dp), ("tp", tp), ("steps", steps), ("batch", batch), ("seq", seq)):
        _positive_ints(**{name: v})
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("train_on_2d_grid runs on every rank: launch(train_on_2d_grid, dp * tp, ...)")
    if dist.get_world_size() != dp * tp:
        raise ValueError(f"the grid has dp*tp = {dp * tp} ranks but the job has {dist.get_world_size()}")
    if batch % dp:
        raise ValueError(f"batch {batch} is not divisible by dp={dp}: each replica needs the same rows")
    if cfg.n_head % tp or cfg.vocab_size % tp:
        raise ValueError(f"n_head {cfg.n_head} and vocab_size {cfg.vocab_size} must be divisible by tp={tp}")


def train_on_2d_grid(cfg, dp: int, tp: int, steps: int, batch: int, seq: int, lr: float = 0.1):
    """Kind: build

    ``steps`` SGD steps of the GPT ``cfg`` on a ``dp x tp`` grid of ranks -- data parallelism around
    tensor parallelism, the first two axes of 3D training -- run on every rank of
    ``launch(train_on_2d_grid, dp * tp, cfg, dp, tp, steps, batch, seq)``. It must train exactly the
    model one process trains on the same global batches.

    What each rank does, with ``rank = tp_rank + tp * dp_rank`` (Megatron's order, as in
    :func:`rank_to_coords` with ``pp = 1``):

    1. **Groups.** A TP group is ``tp`` consecutive ranks; a DP group is the ``dp`` ranks with the
       same ``tp_rank``. ``torch.distributed.new_group(ranks)`` must be entered by *every* rank of
       the job, for *every* group, in the same order (each call takes the next group number), so
       loop over all groups of both axes on every rank and keep the two this rank is in.
    2. **The model.** ``torch.manual_seed(0)`` then ``GPT(cfg)`` (``models.gpt``): the dense model
       the single process builds. With ``tp > 1`` keep this rank's slice of it with chapter 04's
       ``parallelize_gpt(model, tp_group)`` (``parallelism.tensor_parallel``); its forward
       ``model(x, y)`` returns ``(logits, loss)``, the loss of the whole vocabulary on every TP rank.
       The optimizer is ``torch.optim.SGD(params, lr=lr)``.
    3. **The data.** Step ``k`` trains on the global batch ``MarkovCorpus(cfg.vocab_size,
       seed=0).batch(k, batch, seq, ...)`` (``models.data``); this rank's replica takes its
       ``1/dp`` share of the rows: ``rank=dp_rank, world_size=dp`` -- its coordinate on the DP
       axis, not its global rank (the ``tp`` ranks of a TP group read the same rows).
    4. **The step.** Forward, backward, then average each parameter's gradient over the DP group
       only (sum with an all-reduce, divide by ``dp``), then ``optimizer.step()``.

    Why it is the single process's step: the TP slice computes the layer outputs exactly, the loss
    is the mean over this replica's rows, and the mean of the ``dp`` replicas' gradients is the
    gradient of the mean over the global batch. Replicated tensors (LayerNorms, ``wpe``) get the
    same gradient on the ``tp`` ranks of a group and stay equal.

    **Your task:** return ``(losses, params)``: ``losses`` the ``steps`` losses of this replica
    (floats, each before its update), and ``params`` ``{name: tensor}`` over
    ``model.named_parameters()`` after the last update, detached (the names are the dense GPT's;
    each tensor is this rank's slice).
    """
    _check_grid_arguments(cfg, dp, tp, steps, batch, seq)
    raise NotImplementedError("exercise: train_on_2d_grid — see chapters/12_putting_it_together.md")


# --- 5. a 3D step's bytes, predicted ------------------------------------------------------------------


def predict_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0, stage: int = 0) -> dict:
    """Kind: measure

    The bytes one rank at pipeline position ``stage`` sends in one step of the library's 3D step
    (chapter 12's ``train_3d``: fp32, 1F1B over ``pp`` stages, tensor parallelism over ``tp``, ZeRO
    ``zero`` over ``dp`` replicas), predicted before it runs. Returns ``{"dp": ..., "pp": ...}``:

    * ``"dp"``: the wire bytes of its data-parallel collectives in one step (ring model: a
      reduce-scatter or an all-gather of S bytes on n ranks sends S(n-1)/n, an all-reduce twice
      that). Its buffer is the rank's parameters, ``Psi = costmodel.pipeline_stage_params(cfg, tp,
      pp)[stage]`` (the first stage holds the embeddings, the last the final LayerNorm and the tied
      output layer), 4 bytes each. ZeRO 0 all-reduces it once a step; ZeRO-1 reduce-scatters the
      gradients and all-gathers the updated parameters; ZeRO-2 *under a pipeline* accumulates the m
      microbatches and reduce-scatters once after the last (not once per microbatch), then
      all-gathers. (``costmodel`` has the collectives of each stage and what a stage costs under a
      pipeline.)
    * ``"pp"``: the bytes it sends to its pipeline neighbours: per microbatch the activation of
      ``b x seq x h`` floats forward (every stage but the last) and its gradient back (every stage
      but the first), ``b = batch / (dp * microbatches)``; every TP rank of a stage sends the whole
      activation (no scatter/gather here). 0 without a pipeline.

    The test runs the step on 4 ranks and counts what each rank sent with the comm meter: ``"pp"``
    must equal the count exactly, ``"dp"`` within 1% (ZeRO's one-byte has-gradient masks and the
    padding of the flat buffer are not in the prediction).
    """
    _positive_ints(dp=dp, tp=tp, pp=pp, batch=batch, seq=seq, microbatches=microbatches)
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage!r} is outside 0..{pp - 1}")
    if zero not in (0, 1, 2):
        raise ValueError(f"zero must be 0, 1 or 2 (the 3D step has no ZeRO-3), got {zero!r}")
    if batch % (dp * microbatches):
        raise ValueError(f"batch {batch} is not divisible by dp * microbatches = {dp * microbatches}")
    raise NotImplementedError("exercise: predict_rank_traffic — see chapters/12_putting_it_together.md")
