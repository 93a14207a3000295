"""Chapter 12 — one training step of every technique, on this rank: the registry that the step-time
predictor (which ops and collectives does a step run?), the measurement (how long does it take?) and
the calibration (fit one to the other) all call, so all three run the very same step.

A step is the course's own implementation of the technique, unchanged, on the GPT at one of two sizes,
fp32, AdamW(lr=1e-3) (the technique's own optimizer wrapper where it has one)::

    spec = make_step("zero2", "tiny")     # inside a rank: builds the model, the optimizer, the batch
    spec.step()                           # forward, backward, optimizer step; returns this rank's loss
    measure("zero2", "tiny", world=2)     # launches the ranks, times steps -> {"median_s", ...}

Sizes. ``"tiny"`` is ``GPTConfig.tiny()`` (0.11 M parameters) on a global batch of 16 sequences of
64 tokens; ``"10x"`` has 9.8x its parameters (4 layers of width 144, 4 heads, vocabulary 256) on 8
sequences of 128 tokens: the same 1024 tokens a step, about ten times the FLOPs. Both split over 2
and 4 ranks on every axis (heads, width, vocabulary, sequence; layers for "10x").

How each technique (a :class:`Technique` record: :func:`resolve` finds it by name, once) splits the world
of n ranks (``step_config`` writes it down, ``resolve`` refuses what cannot be split, with the fix):

    ddp, zero1, zero2, zero3, ep    data parallel: n shards of the batch (ep: experts over the n ranks,
                                    n_experts the smallest multiple of n that is >= 4)
    tp, sp                          the n ranks are the tensor-parallel group; every rank the whole batch
    pp-gpipe, pp-1f1b, pp-zbh1      n stages, m = 2n microbatches (n if the batch does not divide)
    3d                              ``grid_3d(n)`` = (dp, tp, pp), m = 2·pp microbatches, ZeRO-1

The batch is drawn once, when the step is built: a step times training, not the Markov chain's sampler.
"""
from __future__ import annotations

import dataclasses
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..memory.zero import ZeroDataParallel, fully_shard
from ..models.data import MarkovCorpus
from ..models.gpt import GPT, GPTConfig
from ..parallelism.data_parallel import DistributedDataParallel
from ..parallelism.mesh import RankGrid, check_model, init_groups
from ..parallelism.pipeline import local_stages, make_schedule, run_schedule
from ..parallelism.sequence_parallel.megatron_sp import allreduce_sequence_parallel_grads, parallelize_gpt_sp
from ..parallelism.tensor_parallel import parallelize_gpt
from ..parallelism.three_d import Model3D
from ..runtime import require_process_group
from ..runtime.launch import device as rank_device
from ..runtime.launch import launch
from ..runtime.timing import timed_runs
from ..sparsity.expert_parallel import expert_parallel, sync_replicated_grads
from ..sparsity.moe_gpt import MoEGPT, MoEGPTConfig

__all__ = ["TECHNIQUES", "TECHNIQUE", "Technique", "SIZES", "GLOBAL_BATCH", "LR", "StepSpec", "model_config",
           "grid_3d", "resolve", "step_config", "check", "make_step", "time_steps", "measure"]

SIZES = ("tiny", "10x")
GLOBAL_BATCH = {"tiny": 16, "10x": 8}  # sequences of block_size tokens per step
LR = 1e-3


@dataclass
class StepSpec:
    """One technique's training step on this rank.

    ``step()``: one full step (zero_grad, forward, backward, the technique's gradient synchronisation,
    optimizer step); returns this rank's loss as a float, or None on a rank that computes none (a
    pipeline stage other than the last). ``config``: plain data, :func:`step_config` plus the parameter
    counts. ``model``: the module holding this rank's parameters (the wrapper, or the stages).
    What a step does is announced through :mod:`runtime.observe` (a pipeline: each F/B/W action as a
    span): ``with observe.watching(Timeline()): spec.step()`` draws it.
    """

    step: Callable[[], float | None]
    config: dict
    model: nn.Module


def _whole_gpt(conf: dict) -> nn.Module:
    return GPT(model_config(conf["size"]))


_unshown = partial(dataclasses.field, repr=False)  # a function: its address says nothing in a repr


@dataclass(frozen=True)
class Technique:
    """One technique, resolved once from its name (:func:`resolve`): what the registry, the predictor and
    the calibration need to know of it, so that none of them tests its name."""

    name: str
    builder: Callable[[dict, int, torch.device], StepSpec] = _unshown()  # (conf, seed, device) -> its step
    degrees: Callable[[int], tuple[int, int, int]] = _unshown()  # world -> (dp, tp, pp)
    schedule: str | None = None  # the pipeline schedule its step runs, as pipeline.SCHEDULES spells it
    multi_rank: bool = False  # it splits the model: one rank has nothing to split
    marks_actions: bool = False  # one pipeline stage a rank: a recorded step marks each F, B, W action
    splits_sequence: bool = False  # the tokens of a sequence are split over the tp ranks
    settings: Callable[[int], dict] | None = _unshown(default=None)  # world -> config entries of its own
    whole_model: Callable[[dict], nn.Module] = _unshown(default=_whole_gpt)  # conf -> all ranks' parameters


def model_config(size: str) -> GPTConfig:
    """The GPT of ``size`` (one of :data:`SIZES`); dropout 0, as tensor and sequence parallelism require."""
    _check_size(size)
    if size == "tiny":
        return GPTConfig.tiny()
    return GPTConfig.tiny(n_layer=4, n_embd=144, n_head=4, block_size=128, vocab_size=256)


def grid_3d(world: int) -> tuple[int, int, int]:
    """``(dp, tp, pp)`` of technique "3d" on ``world`` ranks: pp = 2 (all of it when ``world`` is odd),
    tp = 2 once 4 ranks divide ``world``, dp the rest. 2 -> (1, 1, 2), 4 -> (1, 2, 2), 8 -> (2, 2, 2).

    Why this order: the pipeline axis is the one 3D adds to what "tp" and "ddp" already measure alone,
    and at world 2 it is the only split that runs Model3D's own machinery (stages sliced from the
    model, the tied embedding all-reduced between the first and last stage, ZeRO-1 over the stages'
    parameters); the tensor axis comes next, kept at 2 as Megatron keeps TP inside a node; data
    parallelism takes whatever is left, the axis that scales out."""
    pp = 2 if world % 2 == 0 else world
    tp = 2 if world % 4 == 0 else 1
    return world // (pp * tp), tp, pp


def _check_size(size) -> None:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")


def _on_axis(world: int, axis: int) -> tuple[int, int, int]:
    return tuple(world if a == axis else 1 for a in range(3))  # (dp, tp, pp): all ranks on one axis


_DP, _TP, _PP = (partial(_on_axis, axis=a) for a in range(3))


def _experts(world: int) -> dict:
    return {"n_experts": -(-4 // world) * world, "moe_every": 2}  # the smallest multiple of world >= 4


def _zero_stage_1(world: int) -> dict:
    return {"zero_stage": 1}


def resolve(technique: Technique | str, world: int | None = None, size: str | None = None) -> Technique:
    """The record of ``technique``, one of :data:`TECHNIQUES` (a record passes through, not looked up
    again); with ``world``, checked to run on ``world`` ranks at ``size`` (None: every size). Raises
    ``ValueError`` naming the fix. Needs no process group: call it once, before launching."""
    tech = technique
    if not isinstance(tech, Technique):
        if tech not in TECHNIQUES:
            raise ValueError(f"unknown technique {tech!r}; choose one of {', '.join(TECHNIQUES)}")
        tech = TECHNIQUE[tech]
    if size is not None:
        _check_size(size)
    if world is not None:
        for s in SIZES if size is None else (size,):
            _config(tech, s, world)
    return tech


def check(technique: Technique | str, world: int, size: str | None = None) -> Technique:
    """:func:`resolve` with the world required: its record, or ``ValueError`` naming the fix."""
    return resolve(technique, world, size)


def step_config(technique: Technique | str, size: str, world: int) -> dict:
    """How ``technique`` splits ``size``'s model and batch over ``world`` ranks, as plain data (no
    process group needed); raises ``ValueError`` naming the fix when it cannot (see :func:`resolve`)."""
    return _config(resolve(technique), size, world)


def _config(tech: Technique, size: str, world: int) -> dict:
    cfg, batch = model_config(size), GLOBAL_BATCH[size]  # the size first, then the world
    cores = os.cpu_count() or 1
    if isinstance(world, bool) or not isinstance(world, int) or not 1 <= world <= 4 * cores:
        raise ValueError(f"world must be an int from 1 to {4 * cores} (4 ranks per core of this machine's "
                         f"{cores}), got {world!r}; choose a world in that range")
    if world == 1 and tech.multi_rank:
        raise ValueError(f"{tech.name!r} splits the model over ranks and needs world >= 2: use world=2, "
                         f"or 'ddp' to time one process")
    dp, tp, pp = tech.degrees(world)
    m = 1 if pp == 1 else (2 * pp if (batch // dp) % (2 * pp) == 0 else pp)
    where = f"{tech.name!r} on {world} ranks, size {size!r}"
    try:
        check_model(cfg, tp, pp)  # heads, width, MLP width, vocabulary over tp; layers over pp
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if batch % dp or (batch // dp) % m:
        raise ValueError(f"{where}: the global batch of {batch} sequences must split into dp={dp} shards of "
                         f"m={m} microbatches; choose a world whose data-parallel degree divides {batch}")
    if tech.splits_sequence and cfg.block_size % tp:
        raise ValueError(f"{where}: sequence parallelism splits the {cfg.block_size} tokens of a sequence "
                         f"over tp={tp} ranks; choose a world that divides {cfg.block_size}")
    out = dict(technique=tech.name, size=size, world=world, model=dataclasses.asdict(cfg), global_batch=batch,
               seq_len=cfg.block_size, dp=dp, tp=tp, pp=pp, microbatches=m, rows_per_rank=batch // dp,
               rows_per_microbatch=batch // dp // m, optimizer=f"AdamW(lr={LR})", dtype="float32")
    if tech.schedule is not None:
        out["schedule"] = tech.schedule
    if tech.settings is not None:
        out.update(tech.settings(world))
    return out


# --- the steps ----------------------------------------------------------------------------------


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR)


def _dense(cfg, seed: int, dev) -> GPT:
    torch.manual_seed(seed)  # the same weights on every rank (the wrappers broadcast rank 0's anyway)
    return GPT(cfg).to(dev)


def _batch(conf: dict, shard: int, shards: int, dev):
    """Shard ``shard`` of ``shards`` of global batch 0: ``(x, y)``, (B/shards, T) int64 each."""
    corpus = MarkovCorpus(conf["model"]["vocab_size"], seed=0)
    return corpus.batch(0, conf["global_batch"], conf["seq_len"], rank=shard, world_size=shards, device=dev)


def _data_parallel(conf: dict, seed: int, dev, *, stage: int) -> StepSpec:
    """ZeRO ``stage`` 0 (ddp), 1, 2 (module wrappers) or 3 (fully_shard: a unit per block, then the root)."""
    model = _dense(model_config(conf["size"]), seed, dev)
    x, y = _batch(conf, dist.get_rank(), conf["world"], dev)
    if stage == 0:
        wrapped = DistributedDataParallel(model)
        opt = _adamw(model.parameters())
        zero_grad, update = opt.zero_grad, opt.step
    elif stage in (1, 2):
        wrapped = ZeroDataParallel(model, _adamw, stage=stage)
        zero_grad, update = wrapped.zero_grad, wrapped.step
    else:
        for block in model.blocks:
            fully_shard(block)
        wrapped = fully_shard(model)
        opt = _adamw(model.parameters())  # the shards
        zero_grad, update = opt.zero_grad, opt.step

    def step():
        zero_grad()
        _, loss = wrapped(x, y)  # this rank's rows: gradients are averaged over the ranks
        loss.backward()
        update()
        return loss.item()

    return StepSpec(step, conf, wrapped)


def _tensor_parallel(conf: dict, seed: int, dev, *, sequence: bool) -> StepSpec:
    """tp (Megatron's layers) and sp (``sequence``: plus sequence parallelism): the world is the TP group."""
    dense = _dense(model_config(conf["size"]), seed, dev)
    model = parallelize_gpt_sp(dense) if sequence else parallelize_gpt(dense)
    del dense
    opt = _adamw(model.parameters())
    x, y = _batch(conf, 0, 1, dev)  # every rank of the TP group sees the whole batch

    def step():
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        if sequence:  # LayerNorms, row biases, wpe: partial sums over the sequence slices
            allreduce_sequence_parallel_grads(model)
        opt.step()
        return loss.item()

    return StepSpec(step, conf, model)


def _pipeline(conf: dict, seed: int, dev) -> StepSpec:
    """pp-*: one stage per rank, the schedule's m microbatches; the optimizer over this rank's stage."""
    model = _dense(model_config(conf["size"]), seed, dev)
    schedule = make_schedule(conf["schedule"], conf["pp"], conf["microbatches"])
    stages = local_stages(model, schedule)
    holder = nn.ModuleDict({str(c): s for c, s in stages.items()})
    opt = _adamw(holder.parameters())
    x, y = _batch(conf, 0, 1, dev)  # stage 0 reads the tokens, the last stage the targets

    def step():
        opt.zero_grad()
        res = run_schedule(schedule, stages, x, y)  # + tied embedding sync
        opt.step()
        return res.loss

    return StepSpec(step, conf, holder)


def _moe_gpt(conf: dict) -> MoEGPT:
    return MoEGPT(MoEGPTConfig(**conf["model"], n_experts=conf["n_experts"], moe_every=conf["moe_every"]))


def _expert_parallel(conf: dict, seed: int, dev) -> StepSpec:
    """ep: the MoE GPT, experts sharded over the ranks, the rest data parallel (each rank its rows)."""
    torch.manual_seed(seed)
    model = expert_parallel(_moe_gpt(conf).to(dev))
    opt = _adamw(model.parameters())
    n = conf["world"]
    x, y = _batch(conf, dist.get_rank(), n, dev)

    def step():
        opt.zero_grad()
        _, loss = model(x, y)
        (loss / n).backward()  # experts: the mean's gradient already (their all-to-alls brought every rank's)
        sync_replicated_grads(model)  # the replicated rest: sum of the 1/n-scaled ranks = the mean's
        opt.step()
        return loss.item()

    return StepSpec(step, conf, model)


def _three_d(conf: dict, seed: int, dev) -> StepSpec:
    """3d: ch12's Model3D on ``grid_3d(world)``, 1F1B, ZeRO-1 over the DP group."""
    groups = init_groups(RankGrid(conf["world"], conf["dp"], conf["tp"], conf["pp"]))
    model = Model3D(model_config(conf["size"]), groups, conf["microbatches"], schedule=conf["schedule"],
                    zero1=True, optimizer=_adamw, seed=seed)
    x, y = _batch(conf, groups.coords.dp, conf["dp"], dev)

    def step():
        loss, _ = model.step(x, y)
        return loss

    return StepSpec(step, conf, model.zero)


#: Every technique's record, by name, in the course's order; :func:`resolve` is the one lookup.
TECHNIQUE: dict[str, Technique] = {t.name: t for t in (
    Technique("ddp", partial(_data_parallel, stage=0), _DP),
    Technique("zero1", partial(_data_parallel, stage=1), _DP),
    Technique("zero2", partial(_data_parallel, stage=2), _DP),
    Technique("zero3", partial(_data_parallel, stage=3), _DP),
    Technique("tp", partial(_tensor_parallel, sequence=False), _TP, multi_rank=True),
    Technique("sp", partial(_tensor_parallel, sequence=True), _TP, multi_rank=True, splits_sequence=True),
    Technique("pp-gpipe", _pipeline, _PP, "gpipe", multi_rank=True, marks_actions=True),
    Technique("pp-1f1b", _pipeline, _PP, "1f1b", multi_rank=True, marks_actions=True),
    Technique("pp-zbh1", _pipeline, _PP, "zb-h1", multi_rank=True, marks_actions=True),
    Technique("ep", _expert_parallel, _DP, multi_rank=True, settings=_experts, whole_model=_moe_gpt),
    Technique("3d", _three_d, grid_3d, schedule="1f1b", multi_rank=True, settings=_zero_stage_1),
)}
TECHNIQUES = tuple(TECHNIQUE)


def make_step(technique: Technique | str, size: str, world: int | None = None, seed: int = 0) -> StepSpec:
    """Build this rank's step of ``technique`` (a name or its record) at ``size``, on every rank of an
    initialised process group of ``world`` ranks (None: the group's size); ``seed`` draws the weights."""
    require_process_group("make_step")
    n = dist.get_world_size()
    world = n if world is None else world
    if world != n:
        raise ValueError(f"make_step(world={world}) but the process group has {n} ranks; "
                         f"pass world={n}, or launch {world} ranks")
    tech = resolve(technique)
    conf = step_config(tech, size, world)
    spec = tech.builder(conf, seed, rank_device())
    with torch.device("meta"):  # the whole model's parameters (ep: every expert), shapes only
        whole = tech.whole_model(conf)
    conf["n_params"] = whole.num_params()
    conf["local_params"] = sum(p.numel() for p in spec.model.parameters())
    return spec


# --- timing -------------------------------------------------------------------------------------


def time_steps(spec: StepSpec, reps: int, warmup: int = 1) -> list[float]:
    """Inside a rank: ``warmup`` untimed steps, then ``reps`` timed ones; each starts after a barrier,
    is timed on each rank by the course's one clock (:func:`..runtime.timing.timed_runs`: the wall
    clock, after waiting for a GPU), and takes the slowest rank's time (one all-reduce MAX after the
    last step). Returns the ``reps`` seconds, the same list on every rank. The barrier and the
    all-reduce bypass the comm meter: they are not the step's."""
    times = timed_runs(spec.step, reps, warmup, device=rank_device(), before=dist.barrier)
    slowest = torch.tensor(times, dtype=torch.float64, device=rank_device())  # (reps,)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.tolist()


def _timed(tech: Technique, size: str, reps: int, warmup: int) -> dict:
    spec = make_step(tech, size)
    return {"times_s": time_steps(spec, reps, warmup), "config": spec.config}


def measure(technique: Technique | str, size: str, world: int, reps: int = 5, warmup: int = 2,
            timeout_s: float = 300) -> dict:
    """Launch ``world`` ranks and time ``reps`` steps of ``technique`` (name or record) at ``size`` after
    ``warmup`` untimed ones (one intra-op thread per CPU rank, as ``launch`` sets). Returns ``{"median_s",
    "times_s" (per step, the slowest rank's), "config"}`` (rank 0's :attr:`StepSpec.config`)."""
    tech = resolve(technique, world, size)
    for name, v, low in (("reps", reps, 1), ("warmup", warmup, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
    res = launch(_timed, world, tech, size, reps, warmup, timeout_s=timeout_s)[0]
    return {"median_s": statistics.median(res["times_s"]), "times_s": res["times_s"], "config": res["config"]}
