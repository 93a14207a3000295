"""Chapter 03 — run a pipeline schedule on real ranks: the tiny GPT cut into stages, activations sent
forward and their gradients sent back, point to point.

Papers and systems:
* GPipe, Huang et al. 2019, §2.2: cut the layers into consecutive stages and the batch into m
  microbatches; accumulate the microbatches' gradients and make one synchronous update, so the
  step computes exactly the gradient of the whole batch.
* Megatron-LM, Narayanan et al. 2021, §2.2: 1F1B and interleaved virtual stages (chunk c on rank r
  is virtual stage ``c*p + r`` of the ``p*v``-stage model); with tied input/output embeddings
  (Press & Wolf 2017) the last stage keeps its own copy of the word embedding and, after the
  backward, the first and last stage all-reduce its gradient (Megatron-LM's
  ``_allreduce_word_embedding_grads``, in ``megatron/core/distributed/finalize_model_grads.py``).
* Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §2: split the backward into B (gradient
  w.r.t. the stage input, which the previous stage waits for) and W (weight gradients, which
  nobody waits for), so W can fill bubbles (:mod:`.zero_bubble` computes them). ZB-V (ibid. §6) and
  DualPipeV (DeepSeek-V3 §3.2.1) place a rank's two chunks in a V (:mod:`.v_schedules`).

One rank per pipeline stage; rank r holds chunks ``c = 0..v-1`` = virtual stages
``vs = schedule.virtual_stage(r, c)`` (``c*p + r``; in a V, ``r`` and ``2p-1-r``). Every rank runs its own
action list in order (:mod:`.schedules`); ``rank(vs)`` is ``schedule.placement(vs)[0]``::

    F(mb, c):   x = tokens[mb] if vs == 0 else recv(activation from rank(vs-1))
                y = stage_vs(x)        # last stage: y = loss(mb) / m
                isend(y to rank(vs+1))                  (unless vs is the last)
    B(mb, c):   g = 1 if last else recv(gradient from rank(vs+1))
                backward(y, g)         # weight grads accumulate in .grad
                isend(dL/dx to rank(vs-1))              (unless vs == 0)

A message between two chunks of the same rank (the turn of a V) is handed over in memory, not sent.
A B is the whole backward unless the schedule has a W for its (mb, chunk) (``Schedule.split``): then B
computes the input gradient and W the weight gradients. An overlapped "F&B" pair (DualPipeV) waits
for both its inputs, then runs F and B one after the other: on a GPU DeepSeek-V3 interleaves the
pair's pieces so that one chunk's communication runs while the other computes; on a CPU rank there
is nothing to gain, and the arithmetic, hence the gradients, are the same.

Scaling each microbatch's mean loss by 1/m makes the accumulated gradients those of the mean over
the global batch (equal microbatches: the mean of the means is the mean). Sends are non-blocking
and waited for at the end of the step; a receive blocks only when its action needs it. Every
message carries a tag naming (microbatch, receiving virtual stage, activation|gradient), so gloo
matches it whatever order the ranks post in (NCCL ignores tags and matches in issue order).
"""
from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...models.gpt import GPT
from ...runtime import comm, observe, require_process_group
from ...runtime.devices import item_or_nan
from .actions import Schedule
from .messages import Messages
from .zero_bubble import LinearTap, b_params, backward_input, backward_weights

__all__ = ["GPTStage", "split_gpt", "local_stages", "run_schedule", "PipelineResult", "sync_tied_embedding"]


class GPTStage(nn.Module):
    """Virtual stage ``index`` of ``n_stages``: some of ``model``'s blocks, the embedding on the
    first stage, the final LayerNorm, unembedding and loss on the last.

    ``model`` is the course GPT or any model with its layout: ``wte`` (and, if it has them, ``wpe`` and
    ``drop``), ``blocks``, ``ln_f``, ``lm_head``, and the methods ``embed``, ``head`` and ``loss_fn``
    written against those names — the Llama-shaped model of :mod:`minitorch_dist.models.llama` is one
    (no ``wpe``: its positions are rotary, inside each block). The stage calls the model class's own
    methods on the modules it shares.

    The stage *shares* the model's modules (no copies), so gradients land on the model's own
    parameters, and ``stage.named_parameters()`` uses the model's names (``blocks.3.attn.c_attn.weight``).
    ``forward(x, targets=None)``: hidden states (or token ids on stage 0) in; hidden states out, or
    on the last stage logits (no targets) / the mean cross-entropy (with targets).
    """

    def __init__(self, model: GPT, index: int, n_stages: int, layers: range):
        super().__init__()
        self.cfg, self.index, self.n_stages = model.cfg, index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        own = all(hasattr(type(model), f) for f in ("embed", "head", "loss_fn"))
        self._model_class: Any = type(model) if own else GPT  # whose embed / head / loss_fn the stage runs
        if self.is_first:
            self.wte = model.wte
            if hasattr(model, "wpe"):  # learned positions (GPT); a rotary model has none
                self.wpe = model.wpe
            self.drop = getattr(model, "drop", nn.Identity())  # ch05's sequence-parallel GPT refuses dropout
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})  # keys keep the model's names
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def boundary_shape(self, rows: int, seq: int) -> tuple:
        """The shape of the hidden states a stage passes to the next, for a microbatch of ``rows``
        sequences of ``seq`` tokens: (rows, seq, n_embd)."""
        return (rows, seq, self.cfg.n_embd)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        kind = self._model_class
        h = kind.embed(self, x) if self.is_first else x  # the model's own code, on the modules we share
        for block in self.blocks.values():
            h = block(h)
        if not self.is_last:
            return h
        logits = kind.head(self, h)
        return logits if targets is None else kind.loss_fn(self, logits, targets)

    def extra_repr(self) -> str:
        return f"stage {self.index} of {self.n_stages}, blocks {list(self.blocks)}"


def split_gpt(model: GPT, n_stages: int) -> list[GPTStage]:
    """Cut ``model`` into ``n_stages`` (virtual) stages of consecutive blocks, as even as possible
    (the first ``n_layer % n_stages`` stages get one block more)."""
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or n_stages < 1:
        raise ValueError(f"n_stages must be a positive int, got {n_stages!r}")
    n_layer = model.cfg.n_layer
    if n_layer < n_stages:
        raise ValueError(f"n_layer={n_layer} cannot fill {n_stages} pipeline stages; "
                         f"use GPTConfig(n_layer>={n_stages})")
    sizes = [n_layer // n_stages + (i < n_layer % n_stages) for i in range(n_stages)]
    starts = [sum(sizes[:i]) for i in range(n_stages)]
    return [GPTStage(model, i, n_stages, range(s, s + k)) for i, (s, k) in enumerate(zip(starts, sizes))]


def local_stages(model: GPT, schedule: Schedule, rank: int | None = None) -> dict[int, GPTStage]:
    """``{chunk: stage}`` of ``rank`` (default: this rank) for ``schedule``: virtual stages ``c*p + rank``.

    Every rank builds the whole (tiny) model and keeps its stages; a real system builds only its
    own layers (e.g. on the ``meta`` device, then materialises them).
    """
    rank = dist.get_rank() if rank is None else rank
    stages = split_gpt(model, schedule.p * schedule.v)
    return {c: stages[schedule.virtual_stage(rank, c)] for c in range(schedule.v)}


@dataclass
class PipelineResult:
    """What one rank saw in one step. Plain data: returnable from a rank."""

    rank: int
    loss: float | None  # mean loss over the global batch, on the rank holding the last stage
    losses: list[float]  # per-microbatch mean losses (last stage's rank), unscaled; NaN on meta tensors
    actions: list[str]  # this rank's actions, in the order run


# --- tied embeddings: Megatron's embedding group ------------------------------------------------

# world group -> {(first, last): their group}. Weak: the entries die with the world they belong to, so
# a world made again (after destroy_process_group) makes its own groups, never a dead world's.
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _embedding_group(ranks: tuple[int, ...]) -> dist.ProcessGroup:
    """The 2-rank group of the first and last stage; created once per world (only its members call this)."""
    mine = _groups.setdefault(dist.group.WORLD, {})
    if ranks not in mine:
        mine[ranks] = dist.new_group(list(ranks), use_local_synchronization=True)
    return mine[ranks]


def sync_tied_embedding(stages: Mapping[int, Any], schedule: Schedule, group: dist.ProcessGroup | None = None,
                        embedding_group: dist.ProcessGroup | None = None) -> bool:
    """Sum the word-embedding gradient of the first stage (``wte``) and of the last (``lm_head``).

    With ``tie_embeddings`` one matrix E is both ``wte`` (stage 0) and ``lm_head`` (last stage), so
    ``dL/dE`` is the sum of the two uses. When those stages sit on different ranks each rank holds
    only its part in its copy of E; one all-reduce among the two ranks gives both the full sum, and
    since both copies started equal they stay equal after the same update. Returns whether it ran.

    ``stages``: ``{chunk: stage}`` (:func:`local_stages`, or any stages with ``cfg``, ``wte``, ``lm_head``).
    ``group``: the pipeline's process group (stage r = its rank r; default: the world).
    ``embedding_group``: the group of the first and last stage when the caller made one (3D: the
    mesh's embedding group); default: made here, once, by those two ranks.
    """
    n_vs = schedule.p * schedule.v
    first, last = schedule.placement(0)[0], schedule.placement(n_vs - 1)[0]
    if not next(iter(stages.values())).cfg.tie_embeddings or first == last:
        return False
    me = dist.get_rank(group)
    if me not in (first, last):
        return False
    if embedding_group is None:
        embedding_group = _embedding_group(tuple(r if group is None else dist.get_global_rank(group, r)
                                                 for r in (first, last)))
    stage = stages[0] if me == first else stages[schedule.placement(n_vs - 1)[1]]
    weight = stage.wte.weight if me == first else stage.lm_head.weight  # (vocab or vocab/t, n_embd)
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    comm.all_reduce(weight.grad, group=embedding_group)  # in place: may be a view of a flat buffer
    return True


# --- the executor ------------------------------------------------------------------------------------


def _check(schedule, stages, x, y, group: dist.ProcessGroup | None):
    require_process_group("run_schedule")
    n = dist.get_world_size(group)
    if n != schedule.p:
        raise ValueError(f"schedule {schedule.name!r} has p={schedule.p} stages but the pipeline group has "
                         f"{n} ranks; run it with launch(fn, {schedule.p}) or make the schedule with p={n}")
    if sorted(stages) != list(range(schedule.v)):
        raise ValueError(f"stages must map each chunk 0..{schedule.v - 1} to its module, got chunks "
                         f"{sorted(stages)}; use local_stages(model, schedule)")
    r, n_vs = dist.get_rank(group), schedule.p * schedule.v
    for c, s in stages.items():
        want = schedule.virtual_stage(r, c)
        if getattr(s, "index", want) != want or getattr(s, "n_stages", n_vs) != n_vs:
            raise ValueError(f"rank {r} chunk {c} must be virtual stage {want} of {n_vs}, "
                             f"got stage {s.index} of {s.n_stages}; use local_stages(model, schedule)")
    if x.shape[:1] != y.shape[:1] or x.shape[0] % schedule.m:
        raise ValueError(f"the global batch of {x.shape[0]} rows (targets: {y.shape[0]}) cannot be cut into "
                         f"m={schedule.m} equal microbatches; use a batch size that is a multiple of m")


class _Runner:
    """One rank's step: :meth:`run` executes an action; the F, B and W steps are methods.

    ``state[(mb, chunk)]`` holds what a microbatch's chunk keeps from F to B (stage input ``x``,
    output ``y``, the Linear taps) and, with a split backward, from B to W (``stash``).

    Announced (:mod:`runtime.observe`): each action as a span ``str(action)``, category F/B/W, meta
    ``mb``, ``chunk`` (its receive waited for before the span, so the gaps are the bubbles); and the
    stash, ``count("stash", ±1/v)``, as an F keeps a chunk's activations and the last backward step
    of that chunk (B, or W when split) frees them: in microbatches, a chunk holding 1/v of the rank's
    layers.
    """

    def __init__(self, schedule, stages, x, y, group: dist.ProcessGroup | None):
        self.schedule, self.stages = schedule, stages
        self.rank, self.n_vs, self.m = dist.get_rank(group), schedule.p * schedule.v, schedule.m
        param = next(next(iter(stages.values())).parameters())
        self.xs, self.ys = x.to(param.device).chunk(self.m), y.to(param.device).chunk(self.m)  # m x (B/m, T)
        shape = stages[0].boundary_shape(*self.xs[0].shape)  # (B/m, T, n_embd); T/t with sequence parallelism
        self.messages = Messages(schedule, group, shape, param)
        self.split = {(a.mb, a.chunk) for a in schedule[self.rank] if a.kind == "W"}  # B then W, not whole
        self.taps = LinearTap(stages.values()) if self.split else None
        self.b_params = {c: b_params(s) for c, s in stages.items()} if self.split else {}
        self.b_ids = {c: {id(q) for q in ps} for c, ps in self.b_params.items()}
        self.state: dict = {}
        self.losses: list[float] = []
        self.actions: list[str] = []
        self.unit = 1 / schedule.v  # a chunk's share of a microbatch, in the stash's count

    def run(self, a) -> None:
        step = {"F": self.forward, "B": self.backward, "W": self.weights}.get(a.kind)
        if step is None:
            raise ValueError(f"unknown action kind {a.kind!r} in {a}; expected F, B or W")
        name = str(a)
        step(a, self.schedule.virtual_stage(self.rank, a.chunk), name)
        self.actions.append(name)

    def _input(self, a):
        """``(vs_from, mb, vs, grad)`` of the message action ``a`` waits for, or None (tokens, loss)."""
        vs = self.schedule.virtual_stage(self.rank, a.chunk)
        if a.kind == "F" and vs > 0:
            return vs - 1, a.mb, vs, 0
        if a.kind == "B" and vs < self.n_vs - 1:
            return vs + 1, a.mb, vs, 1
        return None

    def prefetch(self, a) -> None:
        """Post the receive that action ``a`` will wait for (its input from another stage), if any."""
        key = self._input(a)
        if key is not None:
            self.messages.post(*key)

    def pair_inputs(self, a) -> None:
        """Before the F of an overlapped "F&B" pair: wait for its B's input too, as DualPipe launches a
        pair once both inputs are there (the simulator's rule for pairs)."""
        b = self.schedule.paired_backward(self.rank, a)
        key = None if b is None else self._input(b)
        if key is not None:
            self.messages.ready(*key)

    def forward(self, a, vs: int, name: str) -> None:
        """F: the stage input (tokens, or the previous stage's activation), the stage, send its output on."""
        inp = self.xs[a.mb] if vs == 0 else self.messages.recv(vs - 1, a.mb, vs, 0).requires_grad_(True)
        observe.count("stash", self.unit, mb=a.mb, chunk=a.chunk)  # kept until this chunk's backward
        with observe.span(name, a.kind, mb=a.mb, chunk=a.chunk):
            st = self.state[(a.mb, a.chunk)] = {"x": None if vs == 0 else inp, "taps": []}  # taps: split B/W
            if self.taps is not None and (a.mb, a.chunk) in self.split:  # split: taps exist
                self.taps.active = st["taps"]
            if vs == self.n_vs - 1:
                loss = self.stages[a.chunk](inp, self.ys[a.mb])
                self.losses.append(item_or_nan(loss))
                st["y"] = loss / self.m  # mean of the m microbatch means = the batch mean
            else:
                st["y"] = self.stages[a.chunk](inp)  # (B/m, T, n_embd)
            if self.taps is not None:
                self.taps.active = None
        if vs < self.n_vs - 1:
            self.messages.send(st["y"], vs + 1, a.mb, 0)

    def backward(self, a, vs: int, name: str) -> None:
        """B: the output's gradient (1 on the last stage), backward, send dL/dx back. When the schedule
        splits this (mb, chunk), only the input and non-Linear gradients
        (:func:`.zero_bubble.backward_input`); W the rest."""
        key = (a.mb, a.chunk)
        st = self.state[key]
        g = None if vs == self.n_vs - 1 else self.messages.recv(vs + 1, a.mb, vs, 1)
        split = key in self.split
        with observe.span(name, a.kind, mb=a.mb, chunk=a.chunk):
            if split:
                dx, st["stash"] = backward_input(st.pop("y"), g, st.pop("x"), st.pop("taps"),
                                                  self.b_params[a.chunk])
            else:
                torch.autograd.backward(st.pop("y"), g)
                dx = None if st["x"] is None else st["x"].grad
        if vs > 0:
            self.messages.send(dx, vs - 1, a.mb, 1)
        if not split:
            del self.state[key]
            observe.count("stash", -self.unit, mb=a.mb, chunk=a.chunk)

    def weights(self, a, vs: int, name: str) -> None:
        """W: the Linear weight gradients from the (x, dy) pairs B kept
        (:func:`.zero_bubble.backward_weights`)."""
        with observe.span(name, a.kind, mb=a.mb, chunk=a.chunk):
            backward_weights(self.state.pop((a.mb, a.chunk))["stash"], self.b_ids[a.chunk])
        observe.count("stash", -self.unit, mb=a.mb, chunk=a.chunk)

    def close(self) -> None:
        if self.taps is not None:
            self.taps.remove()

    def result(self) -> PipelineResult:
        if self.state:
            raise RuntimeError(f"rank {self.rank}: microbatches {sorted(self.state)} were never fully "
                               f"backpropagated; the schedule is missing their B (or W) actions")
        on_last = self.rank == self.schedule.placement(self.n_vs - 1)[0]
        return PipelineResult(
            rank=self.rank, loss=sum(self.losses) / self.m if on_last else None, losses=self.losses,
            actions=self.actions)


def run_schedule(schedule: Schedule, stages: Mapping[int, nn.Module], x: torch.Tensor, y: torch.Tensor,
                 group: dist.ProcessGroup | None = None, sync_tied: bool = True) -> PipelineResult:
    """Run this rank's actions of ``schedule`` for one step on the global batch ``(x, y)``.

    ``stages`` maps chunk -> module (:func:`local_stages`). Every rank passes the same global batch;
    it is cut into ``m`` microbatches, rank of stage 0 reads the tokens, the last stage's rank the
    targets. Gradients accumulate in the parameters' ``.grad`` (zero them before, step the optimizer
    after, as with any backward). With tied embeddings the embedding gradient is all-reduced between
    the first and last stage at the end (:func:`sync_tied_embedding`; ``sync_tied=False`` leaves it
    to the caller).
    ``group``: the pipeline's process group (default: the world), stage r = its rank r.

    Returns a :class:`PipelineResult`: ``loss`` (batch mean, on the last stage's rank), the losses of
    the microbatches, the actions run.

    The step announces each action as a span and each change of the activation stash as a count
    (:class:`_Runner`; :mod:`runtime.observe`): ``with observe.watching(Timeline()):`` draws its
    Gantt chart, ``analysis.pipeline_observers.StashCounter`` counts the microbatches held, and
    ``with meter.track():`` around the call meters the tensors autograd saves (the (x, dy) pairs
    zero-bubble keeps from B to W live outside autograd: the stash count has them, the meter not).

    Where the schedule has a W for a (mb, chunk) (zero-bubble schedules; some of DualPipeV's), B
    computes the input gradient and the non-Linear parameter gradients, W the Linear weight gradients
    (:mod:`.zero_bubble`). The V schedules (``layout="v"``) put the first and the last virtual stage on
    rank 0, which then reads the tokens *and* the targets, holds the loss, and owns both uses of a
    tied embedding (no all-reduce needed).
    """
    _check(schedule, stages, x, y, group)
    runner = _Runner(schedule, stages, x, y, group)
    try:
        actions = schedule[runner.rank]
        for i, a in enumerate(actions):
            for ahead in actions[i:i + 2]:  # post this action's receive and the next one's: the next
                runner.prefetch(ahead)      # action's input may arrive while this one computes
            runner.pair_inputs(a)
            runner.run(a)
        runner.messages.wait()
        if sync_tied:
            sync_tied_embedding(stages, schedule, group)
    finally:
        runner.close()
    return runner.result()
