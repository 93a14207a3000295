# generated from solutions/ch12_putting_it_together.py by `make exercises`: fill in each NotImplementedError
# fingerprint 7a90a93e4875f0e2 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 12 exercises: 3D parallelism by hand — the rank grid, the memory filter, microbatches for a bubble.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch12``.

Nothing here needs ranks: these are the three pieces of arithmetic a 3D configuration rests on
(Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", SC'21), the ones :mod:`minitorch_dist.parallelism.mesh` and
:mod:`minitorch_dist.analysis.planner` do for the library.

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
"""
from __future__ import annotations

from fractions import Fraction

from minitorch_dist.analysis import costmodel

AXES = ("dp", "tp", "pp")


def _positive_ints(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# --- 1. the rank grid ------------------------------------------------------------------------------


def rank_to_coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """``(dp_rank, tp_rank, pp_rank)``: where ``rank`` sits in a ``dp x tp x pp`` grid, Megatron's order.

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
    """The rank at ``coords = (dp_rank, tp_rank, pp_rank)``: the inverse of :func:`rank_to_coords`,
    ``tp_rank + tp * (dp_rank + dp * pp_rank)``."""
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if len(coords) != 3:
        raise ValueError(f"coords must be (dp_rank, tp_rank, pp_rank), got {coords!r}")
    for axis, c, size in zip(AXES, coords, (dp, tp, pp)):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
            raise ValueError(f"{axis} coordinate {c!r} is outside 0..{size - 1}")
    raise NotImplementedError("exercise: coords_to_rank — see chapters/12_putting_it_together.md")


def group_ranks(axis: str, dp: int, tp: int, pp: int) -> list[list[int]]:
    """Every process group along ``axis`` (``"dp"``, ``"tp"`` or ``"pp"``): the ranks that share the
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

#: Mixed-precision AdamW (ZeRO §3.1): 16-bit weights and gradients, K = 12 bytes of optimizer
#: state per parameter (fp32 master copy, momentum and variance).
WEIGHT_BYTES, GRAD_BYTES, OPTIMIZER_BYTES = 2, 2, 12


def fits_in_memory(cfg, memory_bytes: float, *, dp: int, tp: int, pp: int, micro_batch: int,
                   microbatches: int, zero: int = 0, recompute: str = "none", sequence_parallel: bool = False,
                   usable: float = 0.9) -> tuple[bool, dict]:
    """``(fits, parts)``: does one GPU of the first pipeline stage hold its share of training?

    ``cfg`` is a GPT config (``models.gpt.GPTConfig`` field names: ``n_layer`` L, ``n_embd`` h,
    ``n_head`` a, ``vocab_size``, ``block_size`` = the sequence length s) trained in mixed precision
    with AdamW, pipelined with 1F1B into ``pp`` stages of ``L/pp`` layers, each split ``tp`` ways,
    on ``dp`` replicas; a step is ``microbatches`` (m) microbatches of ``micro_batch`` (b) sequences.
    The first stage is the busiest (it holds the embeddings and the most activations), so it decides.

    ``Psi`` (given below) is the parameters one GPU of that stage holds: its ``L/pp`` layers split
    ``tp`` ways plus the embeddings (``costmodel.pipeline_stage_params``). ``parts`` holds bytes:

    * model states, ZeRO over the ``dp`` ranks (ZeRO §5.1), 2 / 2 / 12 bytes per parameter::

          weights    2 Psi   (/dp at stage 3)
          gradients  2 Psi   (/dp at stages 2, 3)
          optimizer 12 Psi   (/dp at stages 1, 2, 3)
          buffers    ZeRO-3 gathers a layer's weights just in time and prefetches the next: two
                     layers' worth, 2 * (2 Psi / (L/pp)); 0 for stages 0-2

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
    psi = costmodel.pipeline_stage_params(cfg, tp, pp)[0]  # parameters on one GPU of the first stage
    s, b, h, a, t = cfg.block_size, micro_batch, cfg.n_embd, cfg.n_head, tp
    layers = cfg.n_layer // pp
    raise NotImplementedError("exercise: fits_in_memory — see chapters/12_putting_it_together.md")


# --- 3. microbatches for a bubble target -----------------------------------------------------------


def microbatches_for_bubble(p: int, target: float, global_batch: int, dp: int, micro_batch_size: int = 1,
                            v: int = 1) -> int:
    """The smallest number of microbatches ``m`` whose pipeline bubble ``(p-1)/(v*m)`` is at most ``target``.

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
