"""Chapter 12 exercises: 3D parallelism by hand — the rank grid, the memory filter, microbatches for a
bubble, training on a 2-D grid of ranks whose replicas hold unequal shares of the batch, and a 3D
step's traffic predicted, then measured.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch12_putting_it_together.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
the parameter count, error messages) is scaffolding the student keeps. Tests:
``pytest -m ch12 tests/exercises`` (``MTD_IMPL=exercises`` runs them against the stubs).

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
4. :func:`train_on_2d_grid_uneven`: SGD steps of the GPT on a data x tensor grid of ranks, built
   from the groups up, with a global batch that does not divide evenly over the replicas; it must
   equal the single-process run on the same global batches.
5. :func:`predict_rank_traffic`: the bytes one rank of a 3D step sends on the data-parallel and the
   pipeline axes, predicted from the cost model.
6. :func:`measure_rank_traffic`: run the library's 3D step on ranks, meter what this rank sent on
   each axis, and set the prediction beside it.
"""
from __future__ import annotations

from fractions import Fraction

import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT
from minitorch_dist.parallelism.tensor_parallel import parallelize_gpt
from minitorch_dist.parallelism.three_d import train_3d

AXES = ("dp", "tp", "pp")


def _positive_ints(**values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")


# --- 1. the rank grid ------------------------------------------------------------------------------


def rank_to_coords(rank: int, dp: int, tp: int, pp: int) -> tuple[int, int, int]:
    """Kind: derive · about 15 minutes

    ``(dp_rank, tp_rank, pp_rank)``: where ``rank`` sits in a ``dp x tp x pp`` grid, in Megatron's
    order (Narayanan et al. 2021 §3.2; Megatron-LM's ``initialize_model_parallel``): tensor
    parallelism varies fastest (a TP group is consecutive ranks, so with 8 GPUs per node and
    ``tp = 8`` a node is one TP group), then data parallelism, and the pipeline slowest. Work out the
    numbering from that order; the tests compare with the library's ``RankGrid`` and torch's
    ``DeviceMesh`` layout for every grid of up to 24 ranks.
    """
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp * tp * pp:
        raise ValueError(f"rank {rank!r} is outside the grid of dp·tp·pp = {dp * tp * pp} ranks "
                         f"(0..{dp * tp * pp - 1})")
    # BEGIN SOLUTION
    tp_rank = rank % tp
    dp_rank = rank // tp % dp
    pp_rank = rank // (tp * dp)
    return dp_rank, tp_rank, pp_rank
    # END SOLUTION


def coords_to_rank(coords: tuple[int, int, int], dp: int, tp: int, pp: int) -> int:
    """Kind: derive · about 10 minutes

    The rank at ``coords = (dp_rank, tp_rank, pp_rank)`` of a ``dp x tp x pp`` grid in Megatron's
    order: the inverse of :func:`rank_to_coords`, checked as such on every grid of up to 24 ranks."""
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if len(coords) != 3:
        raise ValueError(f"coords must be (dp_rank, tp_rank, pp_rank), got {coords!r}")
    for axis, c, size in zip(AXES, coords, (dp, tp, pp)):
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < size:
            raise ValueError(f"{axis} coordinate {c!r} is outside 0..{size - 1}")
    # BEGIN SOLUTION
    dp_rank, tp_rank, pp_rank = coords
    return tp_rank + tp * (dp_rank + dp * pp_rank)
    # END SOLUTION


def group_ranks(axis: str, dp: int, tp: int, pp: int) -> list[list[int]]:
    """Kind: derive · about 20 minutes

    Every process group along ``axis`` (``"dp"``, ``"tp"`` or ``"pp"``) of a ``dp x tp x pp`` grid in
    Megatron's order: the ranks that share the other two coordinates, each group listed by its
    coordinate on ``axis``, the groups sorted by their first rank. The groups of one axis partition
    the ranks. Every rank calls ``torch.distributed.new_group`` for every one of these lists, in this
    order (chapter 12's ``mesh.init_groups``), and keeps the three it belongs to.

    The tests compare with the library's ``RankGrid``, with torch's ``DeviceMesh`` layout and with
    the example in Megatron-LM's ``initialize_model_parallel`` docstring.
    """
    _positive_ints(dp=dp, tp=tp, pp=pp)
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; choose one of {AXES}")
    # BEGIN SOLUTION
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    stride = {"tp": 1, "dp": tp, "pp": tp * dp}  # the order: TP fastest, then DP, then PP
    groups = {}
    for rank in range(dp * tp * pp):  # in increasing rank, so each group comes out in axis order
        others = tuple(rank // stride[a] % sizes[a] for a in AXES if a != axis)
        groups.setdefault(others, []).append(rank)
    return sorted(groups.values())
    # END SOLUTION


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
    """Kind: derive · about 60 minutes

    ``(fits, parts)``: does one GPU of the first pipeline stage hold its share of training?

    ``cfg`` is a GPT config (``models.gpt.GPTConfig`` field names: ``n_layer`` L, ``n_embd`` h,
    ``n_head`` a, ``vocab_size``, ``block_size`` = the sequence length s) trained in mixed precision
    with AdamW, pipelined with 1F1B into ``pp`` stages of ``L/pp`` layers, each split ``tp`` ways,
    on ``dp`` replicas; a step is ``microbatches`` (m) microbatches of ``micro_batch`` (b) sequences.
    The first stage is the busiest (it holds the embeddings and the most activations), so it decides.
    ``Psi`` (given below) is the parameters one GPU of that stage holds.

    ``parts`` holds bytes, one entry each: ``weights`` (16-bit), ``gradients`` (``grad_bytes`` per
    parameter: 4 for Megatron-LM's fp32 ``main_grad``, 2 for 16-bit gradients), ``optimizer``
    (``OPTIMIZER_BYTES`` per parameter: fp32 master copy, momentum, variance), ``buffers`` (ZeRO-3
    gathers a layer's weights just in time and prefetches the next: two layers' 16-bit weights; 0
    otherwise), ``activations``, ``total`` (their sum), ``capacity = usable * memory_bytes``; and
    ``fits = total <= capacity``. Assumptions to derive each from:

    * ZeRO stage ``zero`` over the ``dp`` ranks (Rajbhandari et al. 2020, §5.1) shards which of the
      three model states? Under a pipeline (``pp > 1``) ZeRO-2 accumulates the m microbatches'
      gradients whole and reduce-scatters them once, after the last one (ZeRO-3 re-gathers the
      weights per microbatch and keeps its sharded memory).
    * Activations are 16-bit, per layer as Korthikanti et al. 2022 §4 (Table 2) count them, for the
      three ``recompute`` policies, with and without ``sequence_parallel`` (t = tp). 1F1B keeps
      ``min(pp, m)`` microbatches in flight on the first stage, each holding its ``L/pp`` layers'
      activations. With ``"full"`` recompute, backward rebuilds one layer at a time: add one layer
      of ``"none"`` activations (b sequences) as the working set.

    The tests compare with the library's planner on published configurations and on grids of
    options, with ZeRO §5.1 and Korthikanti's equation 1 written out, and with a published
    GPT-3 175B setup.
    """
    _positive_ints(dp=dp, tp=tp, pp=pp, micro_batch=micro_batch, microbatches=microbatches)
    _check_fits_arguments(cfg, memory_bytes, tp, pp, zero, recompute, sequence_parallel, usable, grad_bytes)
    psi = costmodel.pipeline_stage_params(cfg, tp, pp)[0]  # parameters on one GPU of the first stage
    s, b, h, a, t = cfg.block_size, micro_batch, cfg.n_embd, cfg.n_head, tp
    layers = cfg.n_layer // pp
    # BEGIN SOLUTION
    grads_sharded = zero == 3 or (zero == 2 and pp == 1)  # ZeRO-2 under a pipeline reduces once, at the end
    parts = {"weights": WEIGHT_BYTES * psi / (dp if zero >= 3 else 1),
             "gradients": grad_bytes * psi / (dp if grads_sharded else 1),
             "optimizer": OPTIMIZER_BYTES * psi / (dp if zero >= 1 else 1),
             "buffers": 2 * WEIGHT_BYTES * psi / layers if zero == 3 else 0.0}

    def per_layer(policy):  # Korthikanti Table 2
        sbh = s * b * h
        if policy == "full":
            return 2 * sbh / t if sequence_parallel else 2 * sbh
        attention = 5 * a * s / h if policy == "none" else 0  # scores, softmax, its dropout: O(s^2)
        if sequence_parallel:
            return sbh / t * (34 + attention)
        return sbh * (10 + 24 / t + attention / t)

    in_flight = min(pp, microbatches)  # 1F1B on the first stage
    parts["activations"] = in_flight * layers * per_layer(recompute)
    if recompute == "full":
        parts["activations"] += per_layer("none")  # the one layer being recomputed
    parts["total"] = sum(parts.values())
    parts["capacity"] = usable * memory_bytes
    return parts["total"] <= parts["capacity"], parts
    # END SOLUTION


# --- 3. microbatches for a bubble target -----------------------------------------------------------


def microbatches_for_bubble(p: int, target: float, global_batch: int, dp: int, micro_batch_size: int = 1,
                            v: int = 1) -> int:
    """Kind: derive · about 25 minutes

    The smallest number of microbatches ``m`` whose pipeline bubble (Narayanan et al. 2021 §2.2:
    the idle time of ``p`` stages under 1F1B as a ratio of the ideal step time; the interleaved
    schedule with ``v`` model chunks per GPU divides it by ``v``) is at most ``target``.

    Each data-parallel replica processes ``global_batch / dp`` sequences per step, split into ``m``
    equal microbatches of a whole number of units of ``micro_batch_size`` sequences. The interleaved
    schedule (``v > 1``) also needs ``m`` to be a multiple of ``p`` (Megatron-LM's interleaved
    1F1B). A bubble equal to the target meets it: compare exactly (``fractions.Fraction``), so that
    ``p = 4``, ``target = 0.1`` is met by the m that gives exactly a tenth.

    Raises ``ValueError`` naming the fix when no such ``m`` exists. The tests compare with an exact
    brute force, with ``costmodel``'s bubble, and on GPT-3 175B's published configuration.
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
    # BEGIN SOLUTION
    goal, m = Fraction(target), None
    for k in range(1, units + 1):
        if units % k or (v > 1 and k % p):
            continue
        if Fraction(p - 1, v * k) <= goal:
            m = k
            break
    # END SOLUTION
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
    """Validate the arguments of :func:`train_on_2d_grid_uneven`, on the ranks of a job of ``dp * tp``."""
    for name, v in (("dp", dp), ("tp", tp), ("steps", steps), ("batch", batch), ("seq", seq)):
        _positive_ints(**{name: v})
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("train_on_2d_grid_uneven runs on every rank: "
                           "launch(train_on_2d_grid_uneven, dp * tp, ...)")
    if dist.get_world_size() != dp * tp:
        raise ValueError(f"the grid has dp*tp = {dp * tp} ranks but the job has {dist.get_world_size()}")
    if batch < dp:
        raise ValueError(f"batch {batch} has fewer rows than dp={dp} replicas: every replica needs a row")
    if cfg.n_head % tp or cfg.vocab_size % tp:
        raise ValueError(f"n_head {cfg.n_head} and vocab_size {cfg.vocab_size} must be divisible by tp={tp}")


def train_on_2d_grid_uneven(cfg, dp: int, tp: int, steps: int, batch: int, seq: int, lr: float = 0.1):
    """Kind: build · about 60 minutes

    ``steps`` SGD steps of the GPT ``cfg`` on a ``dp x tp`` grid of ranks -- data parallelism around
    tensor parallelism, the first two axes of 3D training -- run on every rank of
    ``launch(train_on_2d_grid_uneven, dp * tp, cfg, dp, tp, steps, batch, seq)``, where the global
    ``batch`` need not be a multiple of ``dp``. It must train exactly the model one process trains on
    the same global batches (the mean loss over all ``batch`` rows).

    The interface and the rules:

    * **The grid.** Megatron's order with ``pp = 1`` (:func:`rank_to_coords`): a TP group is ``tp``
      consecutive ranks, a DP group the ``dp`` ranks with the same ``tp_rank``. Every rank of the
      job must enter ``torch.distributed.new_group`` for every group of both axes, in the same order.
    * **The model.** ``torch.manual_seed(0)`` then ``GPT(cfg)`` (``models.gpt``), the dense model
      the single process builds; with ``tp > 1`` this rank keeps its slice, chapter 04's
      ``parallelize_gpt(model, tp_group)``. ``model(x, y)`` returns ``(logits, loss)``, the mean loss
      over the rows given. Optimizer: ``torch.optim.SGD(params, lr=lr)``.
    * **The data.** Step ``k`` trains on the global batch ``MarkovCorpus(cfg.vocab_size,
      seed=0).batch(k, batch, seq)`` (``models.data``). Replica ``d`` (its DP coordinate) takes a
      contiguous block of its rows, in order, the blocks as even as possible: the first
      ``batch % dp`` replicas one row more than the others (``torch.tensor_split``'s split). The
      ``tp`` ranks of a TP group read the same rows.
    * **The step.** Forward, backward, one collective per parameter over the DP group only, then
      ``optimizer.step()``. Each replica's loss is the mean over *its* rows; work out what the DP
      collective must combine so that the update is the gradient of the mean over all rows.

    Return ``(losses, params)``: ``losses`` this replica's ``steps`` losses (floats, the mean over its
    rows, each before its update), ``params`` ``{name: tensor}`` over ``model.named_parameters()``
    after the last update, detached (the dense GPT's names; each tensor this rank's slice).

    The tests run it on 4 ranks (2 x 2) with a batch of 7 rows, in float64, against the
    single-process run cut to each rank's slice: every weight, the replicas bitwise identical, the
    row-weighted mean of the replicas' losses equal to the single process's loss; and bad input.

    Reference: ``minitorch_dist/parallelism/three_d.py`` (``train_3d`` builds the same grid from
    ``RankGrid`` and ``init_groups``, but needs the batch to divide evenly and averages by ``1/dp``).
    """
    _check_grid_arguments(cfg, dp, tp, steps, batch, seq)
    # BEGIN SOLUTION
    rank = dist.get_rank()
    dp_rank = rank // tp  # rank = tp_rank + tp * dp_rank
    tp_group = dp_group = None
    for first in range(0, dp * tp, tp):  # TP groups: consecutive ranks
        ranks = list(range(first, first + tp))
        g = dist.new_group(ranks)  # every rank makes every group
        if rank in ranks:
            tp_group = g
    for t in range(tp):  # DP groups: the same tp_rank, tp apart
        ranks = list(range(t, dp * tp, tp))
        g = dist.new_group(ranks)
        if rank in ranks:
            dp_group = g
    torch.manual_seed(0)
    model = GPT(cfg)
    if tp > 1:
        model = parallelize_gpt(model, tp_group)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=lr)
    data = MarkovCorpus(cfg.vocab_size, seed=0)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = data.batch(step, batch, seq)
        x, y = x.tensor_split(dp)[dp_rank], y.tensor_split(dp)[dp_rank]
        _, loss = model(x, y)
        loss.backward()
        share = x.size(0) / batch  # this replica's mean, weighted by its share of the rows
        for p in params:
            p.grad.mul_(share)
            dist.all_reduce(p.grad, group=dp_group)
        opt.step()
        losses.append(loss.item())
    return losses, {k: p.detach().clone() for k, p in model.named_parameters()}
    # END SOLUTION


# --- 5. a 3D step's bytes, predicted ------------------------------------------------------------------


def predict_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0, stage: int = 0) -> dict:
    """Kind: derive · about 40 minutes

    The bytes one rank at pipeline position ``stage`` sends in one step of the library's 3D step
    (chapter 12's ``train_3d``: fp32, 1F1B over ``pp`` stages, tensor parallelism over ``tp``, ZeRO
    ``zero`` over ``dp`` replicas), predicted before it runs. Returns ``{"dp": ..., "pp": ...}``:

    * ``"dp"``: the wire bytes of its data-parallel collectives in one step, in the ring model.
      Their buffer is the rank's parameters (``costmodel.pipeline_stage_params(cfg, tp, pp)[stage]``:
      the first stage holds the embeddings, the last the final LayerNorm and the tied output layer),
      4 bytes each. Which collectives each ZeRO stage runs, and how often under a pipeline, is for
      you to work out (ZeRO-2 under a pipeline accumulates the m microbatches and reduces once).
    * ``"pp"``: the bytes it sends to its pipeline neighbours: per microbatch an activation of
      ``b x seq x h`` floats forward and its gradient back, ``b = batch / (dp * microbatches)``;
      every TP rank of a stage sends the whole activation. 0 without a pipeline.

    The tests compare with ``costmodel`` on seeded random configurations, with numbers worked by hand
    for the tiny GPT, and with what the comm meter counts on 4 ranks (``"pp"`` exactly, ``"dp"``
    within 1%: ZeRO's one-byte has-gradient flags and the flat buffer's padding are not predicted).
    """
    _positive_ints(dp=dp, tp=tp, pp=pp, batch=batch, seq=seq, microbatches=microbatches)
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage!r} is outside 0..{pp - 1}")
    if zero not in (0, 1, 2):
        raise ValueError(f"zero must be 0, 1 or 2 (the 3D step has no ZeRO-3), got {zero!r}")
    if batch % (dp * microbatches):
        raise ValueError(f"batch {batch} is not divisible by dp * microbatches = {dp * microbatches}")
    # BEGIN SOLUTION
    psi = costmodel.pipeline_stage_params(cfg, tp, pp)[stage]
    z = costmodel.zero_stage_under_pipeline(zero, pp)
    dp_bytes = costmodel.zero_dp_bytes_per_step(psi, dp, z, microbatches, bytes_per_element=4)
    b = batch // (dp * microbatches)
    message = b * seq * cfg.n_embd * 4
    directions = (stage < pp - 1) + (stage > 0)  # activations forward, gradients back
    return {"dp": dp_bytes, "pp": microbatches * message * directions}
    # END SOLUTION


# --- 6. a 3D step's bytes, measured -------------------------------------------------------------------


def measure_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0) -> dict:
    """Kind: measure · about 30 minutes

    Run one step of the library's 3D step on this rank's share of ``dp * tp * pp`` ranks (inside
    ``launch``), measure the bytes this rank sent on the data-parallel and the pipeline axes, and set
    your prediction (:func:`predict_rank_traffic`, for this rank's stage) beside them. Returns::

        {"stage": this rank's pipeline stage,
         "measured": {"dp": ..., "pp": ...},
         "predicted": {"dp": ..., "pp": ...}}

    ``train_3d(cfg, dp, tp, pp, 1, batch, seq, microbatches, zero_stage=zero)`` runs the step and
    returns this rank's ``Result3D``: its grid coordinates and the comm events of its last step, by
    phase. Measure what the predictions predict: the *wire* bytes of the data-parallel collectives
    (what a ring puts on the wire, not the buffer size), and the bytes this rank *sent* to its
    pipeline neighbours (not what it received).

    The tests compare your measurements exactly with the same step metered by the tests on 4 ranks
    for two configurations (a pipeline with ZeRO-2; tensor parallelism with ZeRO-1), and your
    prediction with the measurement.

    Reference: ``minitorch_dist/parallelism/three_d.py`` (``train_3d``, ``Result3D``; the events
    come from ``runtime/comm.py``'s meter).
    """
    _positive_ints(dp=dp, tp=tp, pp=pp, batch=batch, seq=seq, microbatches=microbatches)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("measure_rank_traffic runs on every rank: "
                           "launch(measure_rank_traffic, dp * tp * pp, ...)")
    # BEGIN SOLUTION
    res = train_3d(cfg, dp, tp, pp, 1, batch, seq, microbatches, zero_stage=zero)
    stage = res.coords[2]
    measured = {"dp": sum(e.wire_bytes for e in res.events["dp"]),
                "pp": sum(e.nbytes for e in res.events["pipeline"] if e.op == "send")}
    predicted = predict_rank_traffic(cfg, dp, tp, pp, batch, seq, microbatches, zero=zero, stage=stage)
    return {"stage": stage, "measured": measured, "predicted": predicted}
    # END SOLUTION
