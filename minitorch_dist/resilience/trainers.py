"""Chapter 13 — one training loop in every layout, so that a checkpoint can move between them.

A checkpoint written in one layout and loaded in another must continue *the same* run. To show it,
the course GPT is trained with AdamW on the Markov corpus in each layout the earlier chapters built,
each step on the same global batch (``MarkovCorpus.batch(step, B, T)``, which depends only on the
step), so every layout computes the single-process step up to float rounding:

==========  =================================================  ====================================
layout      what each rank runs                                 chapter
==========  =================================================  ====================================
single      the whole model, the whole batch (one process)      00
ddp         ``DistributedDataParallel``, rows of the batch      01
zero1/2     ``ZeroDataParallel(stage=1|2)``                     06
zero3       ``fully_shard`` on each block, then the root        06
tp          ``parallelize_gpt`` over every rank                 04
pp          1F1B over every rank, ``m`` microbatches            03
dpD-tpT-ppP ``Model3D`` on a D x T x P grid (ZeRO-1 over DP)    12
==========  =================================================  ====================================

``Trainer.step(s)`` runs step s and returns the global mean loss on every rank;
``Trainer.state(**extra)`` is :func:`.layouts.state_dict` of the model and its optimizer.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..memory.zero import ZeroDataParallel, fully_shard
from ..models.data import MarkovCorpus
from ..models.gpt import GPT
from ..parallelism.data_parallel import DistributedDataParallel
from ..parallelism.mesh import RankGrid, init_groups
from ..parallelism.pipeline import local_stages, make_schedule, run_schedule
from ..parallelism.tensor_parallel import parallelize_gpt
from ..parallelism.three_d import Model3D
from ..runtime import comm
from .layouts import state_dict, world

__all__ = ["LAYOUTS", "Layout", "parse_layout", "Trainer", "adamw"]

LAYOUTS = ("single", "ddp", "zero1", "zero2", "zero3", "tp", "pp")
_GRID = re.compile(r"^dp(\d+)-tp(\d+)(?:-pp(\d+))?$")


def adamw(params):
    """The optimizer of this chapter's runs: AdamW (state per element, a step count per tensor)."""
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-6, weight_decay=0.1)


@dataclass(frozen=True)
class Layout:
    """A layout name and its grid: ``dp`` data-parallel ranks (the batch's rows), ``tp``, ``pp``."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def __str__(self) -> str:
        return self.name


def parse_layout(name: str, world_size: int) -> Layout:
    """``"zero3"`` on n ranks (its one axis is the world), or a grid ``"dp2-tp2"`` / ``"dp1-tp2-pp2"``."""
    m = _GRID.match(name)
    if m:
        dp, tp, pp = int(m[1]), int(m[2]), int(m[3] or 1)
        if dp * tp * pp != world_size:
            raise ValueError(f"layout {name} needs {dp * tp * pp} ranks, not {world_size}")
        return Layout(name, dp, tp, pp)
    if name not in LAYOUTS:
        raise ValueError(f"unknown layout {name!r}: use one of {', '.join(LAYOUTS)} "
                         f"or a grid such as 'dp2-tp2'")
    if name == "single" and world_size != 1:
        raise ValueError(f"layout 'single' is one process, not {world_size} ranks")
    axis = {"tp": "tp", "pp": "pp"}.get(name, "dp")
    return Layout(name, **{axis: world_size})


class Trainer:
    """The course GPT ``cfg`` in ``layout`` on this rank, trained with ``optimizer`` (default
    :func:`adamw`) on global batches of ``batch`` sequences of ``seq`` tokens; ``microbatches`` for
    pipelines. Every rank builds the model from ``seed``; wrappers broadcast rank 0's weights."""

    def __init__(self, layout: str, cfg, batch: int, seq: int, microbatches: int = 2, optimizer=None, seed=0):
        r, n = world()
        self.layout = parse_layout(layout, n)
        self.cfg, self.batch, self.seq = cfg, batch, seq
        self.data = MarkovCorpus(cfg.vocab_size, seed=0)
        factory = optimizer or adamw
        if batch % (self.layout.dp * (microbatches if self.layout.pp > 1 else 1)):
            raise ValueError(f"batch {batch} is not divisible by dp={self.layout.dp}"
                             + (f" x {microbatches} microbatches" if self.layout.pp > 1 else ""))
        torch.manual_seed(seed)
        name = self.layout.name
        if _GRID.match(name):
            groups = init_groups(RankGrid(n, self.layout.dp, self.layout.tp, self.layout.pp))
            self.model = Model3D(cfg, groups, microbatches, optimizer=factory, seed=seed)
            self.dp_rank, self.opt = groups.coords.dp, None
            self._last = groups.coords.pp == self.layout.pp - 1 and groups.coords.tp == 0
            return
        model = GPT(cfg)
        self.dp_rank = r if self.layout.dp > 1 else 0
        if name == "pp":
            self.schedule = make_schedule("1f1b", n, microbatches)
            self.model = local_stages(model, self.schedule)
            params = {id(p): p for s in self.model.values() for p in s.parameters()}
            self.opt = factory(list(params.values()))
            return
        if name == "zero1" or name == "zero2":
            self.model = ZeroDataParallel(model, factory, stage=int(name[-1]))
            self.opt = None
            return
        if name == "ddp":
            model = DistributedDataParallel(model)
        elif name == "zero3":
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        elif name == "tp":
            model = parallelize_gpt(model)
        self.model, self.opt = model, factory(list(model.parameters()))

    def _rows(self, step: int):
        return self.data.batch(step, self.batch, self.seq, rank=self.dp_rank, world_size=self.layout.dp)

    def step(self, step: int, between=None) -> float:
        """Optimizer step number ``step`` on its global batch; the global mean loss, on every rank.
        ``between()`` runs after the backward, before the update (3D: before the step, which does
        both at once): where chapter 13 injects a failure."""
        x, y = self._rows(step)
        name, n = self.layout.name, world()[1]
        between = between or (lambda: None)
        if isinstance(self.model, Model3D):
            between()
            loss, _ = self.model.step(x, y)
            mine = torch.tensor(float(loss) / self.layout.dp if self._last else 0.0)
        elif name == "pp":
            self.opt.zero_grad()
            res = run_schedule(self.schedule, self.model, x, y)
            between()
            self.opt.step()
            mine = torch.tensor(float(res.loss) if res.loss is not None else 0.0)
        else:
            opt = self.opt or self.model
            opt.zero_grad()
            _, loss = self.model(x, y)
            loss.backward()
            between()
            opt.step()
            mine = loss.detach() / (self.layout.dp if name != "tp" else n)
        if n > 1:  # the shards' means averaged: the global mean, on every rank
            comm.all_reduce(mine)
        return float(mine)

    def state(self, **extra) -> dict:
        """:func:`.layouts.state_dict` of this rank's model and optimizer, plus ``extra``."""
        return state_dict(self.model, self.opt, **extra)


def barrier() -> None:
    if world()[1] > 1:
        dist.barrier()
