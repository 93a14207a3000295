"""Chapter 12 — 3D parallelism: the tiny GPT trained with data, tensor and pipeline parallelism at once.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), §2 and §3 ("PTD-P"): on n = d·t·p ranks (the grid of :mod:`.mesh`) each
rank holds a 1/t slice (ch04, Shoeybi et al. 2019 §3) of one of p pipeline stages (ch03) and
trains on a 1/d share of the batch (ch01). One optimizer step, on every rank:

    x, y  = rows [dp·B/d, (dp+1)·B/d) of the global batch            (the DP shard: MarkovCorpus)
    pipeline step over the PP group, m microbatches (1F1B, ...)      point-to-point b·s·h per mb
        inside every layer: Megatron's f / g over the TP group         4 all-reduces of b·s·h per mb
    tied word embedding: all-reduce its gradient between the first    (Megatron's embedding group)
        and the last stage
    gradients averaged over the DP group, then the optimizer step    all-reduce of this rank's shard
        (``zero1=True``: reduce-scatter, step 1/d of it, all-gather:  ZeRO-1, Rajbhandari et al. 2020 §5.1)

Why this is exactly the single-process step. The loss is the mean over the B·s tokens of the
global batch. TP computes each layer's output exactly (a sum split over ranks, then all-reduced);
the pipeline sums the m microbatches' gradients of (mean loss)/m, which is the gradient of the
mean over the DP shard; averaging the d shards' gradients gives the global mean's gradient. So,
up to the order of floating-point sums, every parameter gets the gradient the one process computes,
and the same optimizer gives the same update. Replicated copies -- a LayerNorm on the t ranks of a
TP group, the tied embedding on the first and last stage, a shard on the d DP ranks -- receive
identical gradients and stay identical (``merge_full_params`` checks it).

ZeRO-2 (``zero_stage=2``, Rajbhandari et al. §5.2): ch06's stage 2 reduce-scatters each gradient bucket
as backward produces it, so under a pipeline it would reduce every one of the m microbatches ((m + 1)·Psi
on the wire, ``costmodel.zero_dp_bytes_per_step``) and do it before the tied-embedding all-reduce has
summed the word embedding's two parts. Here the pipeline runs under the optimizer's ``no_sync()`` and,
after the embedding sync, ``reduce_accumulated()`` passes the accumulated gradients through autograd once
(``torch.autograd.backward`` on the parameters themselves), which fires stage 2's hooks: its bucketed
reduce-scatter runs once, after the last microbatch, and the full gradients are freed bucket by bucket
(2·Psi, as stage 1).
ZeRO-3 is not implemented here. Under a pipeline it must either all-gather the stage's parameters for
every microbatch's forward and backward (3m collectives a step), or keep them gathered from the first
forward to the last backward, which holds the whole stage as ZeRO-1 does (Llama 3 ran FSDP beside pipeline
parallelism, not resharding the parameters after the forward: Dubey et al. 2024, §3.3.2). The planner
scores both (``costmodel.zero_stage_under_pipeline``); this step would gain nothing over ``zero_stage=1``
from the second, and the first is chapter 06's ``fully_shard`` run m times.

Options: ``checkpoint=True`` (``recompute="full"``) recomputes every block in backward (ch07, "full"
recomputation: Korthikanti et al. 2022 §5; with TP the recomputed forward repeats its two all-reduces);
``recompute="selective"`` recomputes only the attention core (Korthikanti §5: no extra communication);
``virtual_stages=v`` with ``schedule="interleaved"`` (Narayanan et al. §2.2.2); ``sequence_parallel=True``
(t > 1) slices the TP group's replicated regions along the sequence (ch05, Korthikanti et al. 2022 §4.2.2):
each TP all-reduce becomes a reduce-scatter and an all-gather, a stage sends its (b, s/t, h) slice, and the
LayerNorm, row-bias and wpe gradients, partial sums over the slice, are all-reduced over the TP group
before the DP step.
"""
from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..memory.checkpointing import checkpoint as _checkpoint
from ..memory.zero import ZeroDataParallel
from ..models.data import MarkovCorpus
from ..models.gpt import GPT, GPTConfig
from ..models.init import materialize, rebind
from ..models.llama import Llama, LlamaConfig
from ..runtime import comm, require_process_group
from ..runtime.launch import device as rank_device
from .mappings import divide
from .mesh import Coords, ParallelGroups, RankGrid, check_model, init_groups
from .pipeline import GPTStage, make_schedule, run_schedule, split_gpt
from .pipeline.executor import sync_tied_embedding
from .replicas import broadcast_from_first_rank
from .sequence_parallel.megatron_sp import (
    SequenceParallelGPT,
    allreduce_sequence_parallel_grads,
    parallelize_gpt_sp,
)
from .tensor_parallel import parallelize_gpt, shard_dense_tensors
from .tensor_parallel_llama import parallelize_llama, shard_dense_llama_tensors
from .tensor_parallel_vocab import vocab_parallel_cross_entropy

__all__ = ["Stage3D", "Model3D", "Result3D", "train_3d", "merge_full_params", "global_losses",
           "reference_run", "local_param_count", "zero_stage_of", "dense_class",
           "recompute_of", "RECOMPUTE"]


RECOMPUTE = ("none", "selective", "full")


def dense_class(cfg: GPTConfig | LlamaConfig) -> type[nn.Module]:
    """The dense model a config describes: the course GPT, or the Llama-shaped model for a ``LlamaConfig``
    (the same layout — ``wte``, ``blocks``, ``ln_f``, ``lm_head`` —, rotary positions instead of ``wpe``)."""
    return Llama if isinstance(cfg, LlamaConfig) else GPT


def _slice_tp(dense, group: dist.ProcessGroup | None, sequence_parallel: bool):
    """ch04's tensor-parallel model of ``dense`` over ``group`` (with ch05's sequence parallelism)."""
    if isinstance(dense, Llama):
        return parallelize_llama(dense, group, sequence_parallel=sequence_parallel, broadcast_weights=False)
    slicer = parallelize_gpt_sp if sequence_parallel else parallelize_gpt
    return slicer(dense, group, broadcast_weights=False)


def _shard_dense(tensors: dict, cfg, group: dist.ProcessGroup | None) -> dict:
    """This rank's TP shards of per-parameter dense tensors, in the layout :func:`_slice_tp` gives."""
    if isinstance(cfg, LlamaConfig):
        return shard_dense_llama_tensors(tensors, cfg, group)
    return shard_dense_tensors(tensors, cfg, group)


class _SelectiveAttention(TorchFunctionMode):
    """Selective recomputation (Korthikanti et al. 2022 §5): ``F.scaled_dot_product_attention`` inside
    ch07's ``checkpoint``: backward keeps q, k, v and recomputes the attention core (scores, softmax,
    their product with v), the a·s² part of a layer's activations; the rest of the block is kept."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            return _checkpoint(functools.partial(F.scaled_dot_product_attention, **kwargs), *args,
                               preserve_rng_state=kwargs.get("dropout_p", 0.0) > 0)
        return func(*args, **kwargs)


def recompute_of(checkpoint: bool = False, recompute: str | None = None) -> str:
    """``recompute`` ("none", "selective" or "full") when given, else "full" with ``checkpoint``."""
    mode = ("full" if checkpoint else "none") if recompute is None else recompute
    if mode not in RECOMPUTE:
        raise ValueError(f"recompute {mode!r}: choose one of {', '.join(RECOMPUTE)}")
    return mode


class Stage3D(GPTStage):
    """A pipeline stage of the (tensor-parallel) GPT: :class:`GPTStage` whose loss is the
    vocabulary-parallel cross-entropy when the logits are sharded over ``vocab_group`` (None: whole
    logits, the dense loss), and whose blocks are recomputed in backward: ``recompute`` "full" (or True)
    whole blocks, "selective" the attention core only, "none" (or False) nothing.

    ``sequence_parallel`` (the model is ch05's :class:`SequenceParallelGPT` over ``vocab_group``): the
    stage's hidden states are this rank's (b, s/t, h) sequence slice, so the embedding is the sequence-
    parallel one and the message to the next stage is t times smaller (Korthikanti et al. 2022 §4.2.3:
    the scatter/gather of Narayanan et al. §4.1 comes for free)."""

    def __init__(self, model: GPT, index: int, n_stages: int, layers: range,
                 vocab_group: dist.ProcessGroup | None = None, recompute: bool | str = False,
                 sequence_parallel: bool = False) -> None:
        super().__init__(model, index, n_stages, layers)
        self.vocab_group = vocab_group
        self.recompute = ("full" if recompute else "none") if isinstance(recompute, bool) else recompute
        self.sequence_parallel = sequence_parallel and vocab_group is not None

    def boundary_shape(self, rows: int, seq: int) -> tuple:
        """(rows, seq, n_embd), or (rows, seq/t, n_embd) with sequence parallelism."""
        if not self.sequence_parallel:
            return super().boundary_shape(rows, seq)
        return (rows, divide(seq, dist.get_world_size(self.vocab_group), "sequence length"), self.cfg.n_embd)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_first and not hasattr(self, "wpe"):  # rotary positions (Llama): the token embedding only,
            h = self.wte(x)  # whose sequence-parallel form scatters the (b, s/t, h) slice itself
        else:
            embed: Any = SequenceParallelGPT.embed if self.sequence_parallel else GPT.embed  # on our modules
            h = embed(self, x) if self.is_first else x  # (b, s, h), or (b, s/t, h) with sequence parallelism
        with _SelectiveAttention() if self.recompute == "selective" else contextlib.nullcontext():
            for block in self.blocks.values():
                h = _checkpoint(block, h) if self.recompute == "full" else block(h)
        if not self.is_last:
            return h
        logits = GPT.head(self, h)  # type: ignore[arg-type]  # GPT's code on the modules the stage shares
        if targets is None:
            return logits
        if self.vocab_group is None:
            return GPT.loss_fn(self, logits, targets)  # type: ignore[arg-type]  # as above
        return vocab_parallel_cross_entropy(logits, targets, self.vocab_group)


def _check_batch(batch, dp, microbatches):
    if batch % dp or (batch // dp) % microbatches:
        raise ValueError(f"the global batch of {batch} rows must split into dp={dp} shards of "
                         f"m={microbatches} equal microbatches: choose batch as a multiple of "
                         f"dp·m = {dp * microbatches}")


def zero_stage_of(zero1: bool = False, zero_stage: int | None = None) -> int:
    """The ZeRO stage: ``zero_stage`` (0, 1 or 2) when given, else 1 with ``zero1`` and 0 without."""
    stage = (1 if zero1 else 0) if zero_stage is None else zero_stage
    if stage == 3:
        raise ValueError("ZeRO-3 is not implemented in the 3D step: under a pipeline it would all-gather the "
                         "parameters for every microbatch's forward and backward, or, kept gathered across "
                         "the microbatches, hold what zero_stage=1 holds; use zero_stage 0, 1 or 2")
    if isinstance(stage, bool) or stage not in (0, 1, 2):
        raise ValueError(f"zero_stage must be 0, 1 or 2, got {stage!r}")
    return stage


def _check_options(schedule, pp, microbatches, virtual_stages, checkpoint):
    """The schedule (a clear error for an unknown one); recomputation needs a fused backward."""
    sched = make_schedule(schedule, pp, microbatches, virtual_stages)
    if checkpoint and sched.splits_backward:
        raise ValueError(f"recomputation runs inside loss.backward(), which the split B/W backward "
                         f"of {schedule!r} does not use; choose a schedule without W (e.g. '1f1b')")
    return sched


class Model3D:
    """This rank's part of the 3D model: its (virtual) stages, sliced over TP, and its optimizer.

    Every rank builds the whole dense GPT from ``seed``, takes global rank 0's weights (one broadcast
    over all ranks, so a rank-dependent ``seed`` still gives one model), makes its TP slice
    (:func:`parallelize_gpt`, skipped when t = 1), and keeps the stages of its pipeline position.
    The optimizer and the DP gradient reduction are ch06's :class:`ZeroDataParallel` on the
    stages' parameters over the DP group: stage 0 (one all-reduce of a flat buffer, as Megatron's
    contiguous gradient buffer) or stage 1 with ``zero1``. ``device``: where the model lives (None:
    this rank's device); ``"meta"`` builds it on meta tensors, shapes without values (the fake process
    group's stand-in for a GPU at any scale: :func:`~..replicas.broadcast_from_first_rank` and every
    step follow the parameters there). ``materialize_on``: deferred initialisation (ch12): build on meta,
    then give only this rank's stages storage on that device, initialised by
    :func:`..models.init.materialize` with ``seed`` (the dense model is never whole anywhere).
    """

    def __init__(self, cfg: GPTConfig | LlamaConfig, groups: ParallelGroups, microbatches: int,
                 schedule: str = "1f1b", virtual_stages: int = 1, zero1: bool = False,
                 checkpoint: bool = False, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                 lr: float = 0.1, seed: int = 0,
                 device: torch.device | str | None = None, materialize_on: torch.device | str | None = None,
                 zero_stage: int | None = None, recompute: str | None = None,
                 sequence_parallel: bool = False) -> None:
        grid = groups.grid
        stage = zero_stage_of(zero1, zero_stage)
        recompute = recompute_of(checkpoint, recompute)
        checkpoint = recompute != "none"
        check_model(cfg, grid.tp, grid.pp, virtual_stages)
        self.cfg, self.groups = cfg, groups
        self.schedule = _check_options(schedule, grid.pp, microbatches, virtual_stages, checkpoint)
        where = torch.device(rank_device() if device is None else device)
        where = torch.device("meta") if materialize_on is not None else where
        torch.manual_seed(seed)  # on the CPU, then moved: the same weights on every rank and device
        if materialize_on is not None and isinstance(cfg, LlamaConfig):
            raise ValueError("deferred initialisation (materialize_on) follows the GPT's init rules; build "
                             "the Llama-shaped model with device=None (or 'meta' for shapes only)")
        with torch.device("meta") if where.type == "meta" else contextlib.nullcontext():
            dense = dense_class(cfg)(cfg)  # on meta: shapes only, never a whole model's values
        dense = broadcast_from_first_rank(dense)  # every TP, PP and DP copy is rank 0's
        self.sequence_parallel = sequence_parallel and grid.tp > 1  # over t = 1 it is the dense model
        tp_model: Any = _slice_tp(dense, groups.tp_group, self.sequence_parallel) if grid.tp > 1 else dense
        self.model = tp_model.to(where)  # GPT or Llama, or its TP (and SP) form: one layout
        vocab_group = groups.tp_group if grid.tp > 1 else None
        cut = split_gpt(self.model, grid.pp * virtual_stages)  # ch03's rule for which blocks go where
        self.stages: dict[int, Stage3D] = {}
        memo: dict = {}  # a tensor two of this rank's stages share stays one
        for c in range(virtual_stages):  # chunk c of this rank is virtual stage c·p + (its pp coordinate)
            s = cut[self.schedule.virtual_stage(groups.coords.pp, c)]
            layers = [int(k) for k in s.blocks]
            self.stages[c] = Stage3D(self.model, s.index, s.n_stages, range(layers[0], layers[-1] + 1),
                                     vocab_group, recompute, self.sequence_parallel)
            if materialize_on is not None:  # this rank's layers only, each shard drawn as its dense slice
                materialize(self.stages[c], materialize_on, seed, memo=memo)
        rebind(self.model, memo)  # the model around the stages shares their new tensors (a tied embedding)
        factory = optimizer or (lambda ps: torch.optim.SGD(ps, lr=lr))
        self.zero = ZeroDataParallel(nn.ModuleDict({str(c): s for c, s in self.stages.items()}), factory,
                                     stage=stage, group=groups.dp_group)

    def parameters(self) -> list[nn.Parameter]:
        return list(self.zero.module.parameters())

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float | None, dict[str, list]]:
        """One optimizer step on this DP shard ``(x, y)``. Returns (loss or None, comm events by phase):
        the loss is the shard's mean on the last stage's ranks. Phases: "pipeline", "embedding",
        "sequence" (sequence parallelism: the LayerNorm / bias / wpe partial gradients summed over the
        TP group; empty without it) and "dp"."""
        self.zero.zero_grad()
        with comm.meter() as pipe, self.zero.sharded.no_sync():  # ZeRO-2: accumulate the m microbatches
            res = run_schedule(self.schedule, self.stages, x, y, group=self.groups.pp_group, sync_tied=False)
        with comm.meter() as emb:  # Megatron-LM's _allreduce_word_embedding_grads, over the mesh's group
            sync_tied_embedding(self.stages, self.schedule, self.groups.pp_group, self.groups.embedding_group)
        with comm.meter() as seq:  # Megatron's all-reduce of the grads flagged sequence_parallel
            if self.sequence_parallel:
                allreduce_sequence_parallel_grads(self.zero.module, self.groups.tp_group)
        with comm.meter() as dp:
            self.zero.sharded.reduce_accumulated()  # ZeRO-2: its bucketed reduce-scatter, once
            self.zero.step()  # DP average (all-reduce, or ZeRO-1 reduce-scatter) and the update
        return res.loss, {"pipeline": pipe.events, "embedding": emb.events, "sequence": seq.events,
                          "dp": dp.events}

    @torch.no_grad()
    def full_param_pieces(self) -> dict:
        """``{dense name: (flat indices into the dense tensor, values)}`` for this rank's parameters.

        Where a TP shard's elements sit in the dense tensor is found by sharding the dense tensors
        of *indices* (0..numel-1, exact in float64) with ch04's own :func:`shard_dense_tensors`, so no
        layout (column, row, vocabulary, per-head q|k|v) is written down twice.
        """
        with torch.random.fork_rng(), _default_dtype(torch.float64):
            with torch.device("meta"):
                shapes = {k: p.shape for k, p in dense_class(self.cfg)(self.cfg).named_parameters()}
            index = {k: torch.arange(torch.Size(s).numel(), dtype=torch.float64).view(s)  # (numel,) -> shape
                     for k, s in shapes.items()}
            if self.groups.grid.tp > 1:
                index = _shard_dense(index, self.cfg, self.groups.tp_group)
        names = {id(p): k for k, p in self.model.named_parameters()}
        return {names[id(p)]: (index[names[id(p)]].reshape(-1).long(),  # (local numel,) flat dense positions
                               p.detach().reshape(-1).cpu().clone())  # (local numel,) values
                for p in self.parameters()}


@contextlib.contextmanager
def _default_dtype(dtype):
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@dataclass
class Result3D:
    """What one rank returns from :func:`train_3d` (plain data)."""

    rank: int
    coords: Coords
    losses: list  # per step: the DP shard's mean loss on last-stage ranks, None elsewhere
    events: dict  # phase ("pipeline", "embedding", "dp") -> comm.CommEvent list of the last step
    pieces: dict = field(default_factory=dict)  # Model3D.full_param_pieces() after the last step
    ranks: dict = field(default_factory=dict)  # axis -> global ranks of this rank's group
    microbatch_rows: int = 0


def train_3d(cfg: GPTConfig | LlamaConfig, dp: int, tp: int, pp: int, steps: int, batch: int, seq: int,
             microbatches: int, schedule: str = "1f1b", zero1: bool = False, checkpoint: bool = False,
             lr: float = 0.1, seed: int = 0, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
             virtual_stages: int = 1, data: MarkovCorpus | None = None, order: str = "tp-dp-pp",
             use_device_mesh: bool = False, zero_stage: int | None = None, recompute: str | None = None,
             sequence_parallel: bool = False) -> Result3D:
    """``steps`` optimizer steps of the GPT ``cfg`` (or of the Llama-shaped model, for a ``LlamaConfig``) on
    d x t x p ranks; run it with
    ``launch(train_3d, dp*tp*pp, cfg, dp, tp, pp, steps, batch, seq, microbatches, ...)``.

    Step s trains on ``data.batch(s, batch, seq)`` (default: the corpus of ``cfg.vocab_size``,
    seed 0), each DP replica on its rows. ``optimizer(params)`` builds the optimizer (default
    SGD with ``lr``). Returns this rank's :class:`Result3D`; :func:`global_losses` and
    :func:`merge_full_params` turn the list of all ranks' results into the single-process view.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    check_model(cfg, tp, pp, virtual_stages)
    _check_batch(batch, dp, microbatches)
    if sequence_parallel and seq % tp:
        raise ValueError(f"sequence parallelism splits the {seq} tokens of a sequence over tp={tp} ranks: "
                         f"choose seq as a multiple of {tp}")
    zero_stage_of(zero1, zero_stage)
    _check_options(schedule, pp, microbatches, virtual_stages, recompute_of(checkpoint, recompute) != "none")
    require_process_group("train_3d")
    grid = RankGrid(dist.get_world_size(), dp, tp, pp, order)  # checks dp·tp·pp = world size
    groups = init_groups(grid, use_device_mesh)
    model = Model3D(cfg, groups, microbatches, schedule, virtual_stages, zero1, checkpoint, optimizer, lr,
                    seed, zero_stage=zero_stage, recompute=recompute, sequence_parallel=sequence_parallel)
    data = data or MarkovCorpus(cfg.vocab_size, seed=0)
    losses = []
    for step in range(steps):
        x, y = data.batch(step, batch, seq, rank=groups.coords.dp, world_size=dp, device=rank_device())
        loss, events = model.step(x, y)
        losses.append(loss)
    return Result3D(groups.rank, groups.coords, losses, events, model.full_param_pieces(), groups.ranks,
                    batch // dp // microbatches)


# --- the single-process view ---------------------------------------------------------------------


def global_losses(results: Iterable[Result3D]) -> list[float]:
    """Loss of each step over the global batch: the mean of the DP shards' losses (last stage, tp 0)."""
    shards = [r.losses for r in results if r.coords.tp == 0 and r.losses[0] is not None]
    return [sum(step) / len(shards) for step in zip(*shards)]


def merge_full_params(results: Iterable[Result3D], cfg: GPTConfig | LlamaConfig) -> tuple[dict, float]:
    """The dense parameters (the single-process model's names and shapes) from every rank's pieces,
    and the largest difference between two copies of one element (replicas must agree: 0)."""
    with torch.device("meta"):
        shapes = {k: p.shape for k, p in dense_class(cfg)(cfg).named_parameters()}
    pieces = [val for res in results for _, val in res.pieces.values()]
    like = pieces[0] if pieces else torch.empty(0)  # the pieces' dtype and device, not the default ones
    full = {k: like.new_full((torch.Size(s).numel(),), float("nan")) for k, s in shapes.items()}  # (numel,)
    spread = 0.0
    for res in results:
        for k, (idx, val) in res.pieces.items():
            cur = full[k][idx]
            seen = ~cur.isnan()
            if seen.any():
                spread = max(spread, (cur[seen] - val[seen]).abs().max().item())
            full[k][idx] = val
    missing = [k for k, v in full.items() if v.isnan().any()]
    if missing:
        raise ValueError(f"no rank holds some elements of {missing}: pass the results of every rank")
    return {k: v.view(shapes[k]) for k, v in full.items()}, spread  # (numel,) -> the dense shape


def reference_run(cfg: GPTConfig | LlamaConfig, steps: int, batch: int, seq: int, lr: float = 0.1,
                  seed: int = 0, optimizer: Callable[..., torch.optim.Optimizer] | None = None,
                  data: MarkovCorpus | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-process run :func:`train_3d` must equal: ``models.train.train_steps`` for
    ``steps + 1`` steps (its last step computes a loss and gradient but no update), so the weights
    have taken ``steps`` updates. Returns (``steps`` losses, {name: weight})."""
    from ..models.train import train_steps
    from ..runtime.env import single_thread

    with single_thread():  # one intra-op thread, like a rank: the same summation order in each op
        torch.manual_seed(seed)
        model = dense_class(cfg)(cfg)
        run = train_steps(model, steps + 1, batch, seq, optimizer=optimizer, lr=lr, data=data)
    return run.losses[:steps], {k: p.detach().clone() for k, p in model.named_parameters()}


def local_param_count(cfg: GPTConfig, tp: int, pp: int, stage: int, virtual_stages: int = 1) -> int:
    """Parameters one rank holds at pipeline position ``stage`` (chunks ``c·p + stage``), counted
    from the dense model: a tensor that Megatron shards (q|k|v, fc and their biases, the two output
    projections' weights, the word embedding) counts 1/t, the rest whole; the tied word embedding
    counts on both the first and the last stage."""
    with torch.device("meta"):
        model = GPT(cfg)
    n_vs = pp * virtual_stages
    parts = split_gpt(model, n_vs)
    # split t ways (Shoeybi et al. §3): column-parallel weights and biases, row-parallel weights,
    # the vocabulary-parallel embedding; LayerNorms, row-parallel biases and wpe are replicated
    sharded = ("c_attn.weight", "c_attn.bias", "c_fc.weight", "c_fc.bias", "c_proj.weight", "wte.weight",
               "lm_head.weight")
    mine = {id(p): (name, p) for c in range(virtual_stages)
            for name, p in parts[c * pp + stage].named_parameters()}
    return sum(p.numel() // tp if name.endswith(sharded) else p.numel() for name, p in mine.values())
