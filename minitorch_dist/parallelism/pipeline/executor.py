"""Run a pipeline schedule on real ranks: the tiny GPT cut into stages, activations sent forward
and their gradients sent back, point to point.

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
  nobody waits for), so W can fill bubbles. See :func:`run_schedule` for how B/W are computed.

One rank per pipeline stage; rank r holds chunks ``c = 0..v-1`` = virtual stages ``c*p + r``. Every
rank runs its own action list in order (:mod:`.schedules`)::

    F(mb, c), vs = c*p + r:   x = tokens[mb] if vs == 0 else recv(activation from rank (vs-1) % p)
                              y = stage_vs(x)        # last stage: y = loss(mb) / m
                              isend(y to rank (vs+1) % p)            (unless vs is the last)
    B(mb, c):                 g = 1 if last else recv(gradient from rank (vs+1) % p)
                              backward(y, g)         # weight grads accumulate in .grad
                              isend(dL/dx to rank (vs-1) % p)         (unless vs == 0)

Scaling each microbatch's mean loss by 1/m makes the accumulated gradients those of the mean over
the global batch (equal microbatches: the mean of the means is the mean). Sends are non-blocking
and waited for at the end of the step; a receive blocks only when its action needs it. Every
message carries a tag naming (microbatch, receiving virtual stage, activation|gradient), so gloo
matches it whatever order the ranks post in (NCCL ignores tags and matches in issue order).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ...models.gpt import GPT
from ...runtime import comm

__all__ = ["GPTStage", "split_gpt", "local_stages", "run_schedule", "PipelineResult", "sync_tied_embedding"]


class GPTStage(nn.Module):
    """Virtual stage ``index`` of ``n_stages``: some of ``model``'s blocks, the embedding on the
    first stage, the final LayerNorm, unembedding and loss on the last.

    The stage *shares* the model's modules (no copies), so gradients land on the model's own
    parameters, and ``stage.named_parameters()`` uses the model's names (``blocks.3.attn.c_attn.weight``).
    ``forward(x, targets=None)``: hidden states (or token ids on stage 0) in; hidden states out, or
    on the last stage logits (no targets) / the mean cross-entropy (with targets).
    """

    def __init__(self, model: GPT, index: int, n_stages: int, layers: range):
        super().__init__()
        self.cfg, self.index, self.n_stages = model.cfg, index, n_stages
        self.is_first, self.is_last = index == 0, index == n_stages - 1
        if self.is_first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})  # keys keep the model's names
        if self.is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = GPT.embed(self, x) if self.is_first else x  # the model's own code, on the modules we share
        for block in self.blocks.values():
            h = block(h)
        if not self.is_last:
            return h
        logits = GPT.head(self, h)
        return logits if targets is None else GPT.loss_fn(self, logits, targets)

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


def local_stages(model: GPT, schedule, rank: int | None = None) -> dict[int, GPTStage]:
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
    losses: list[float]  # per-microbatch mean losses (last stage's rank), unscaled
    actions: list[str]  # this rank's actions, in the order run
    stashed: list[float]  # microbatches whose activations were held while each action ran
    peak_stashed: float  # max(stashed), in microbatch units (a chunk counts 1/v)
    events: list = field(default_factory=list)  # timeline Events of this step (when a Timeline was given)
    peak_activation_bytes: int | None = None  # MemoryMeter peak, when one was given


# --- tied embeddings: Megatron's embedding group ------------------------------------------------

_groups: dict = {}


def _embedding_group(ranks: tuple[int, int]):
    """The 2-rank group of the first and last stage; created once (only its members call this)."""
    key = (ranks, id(dist.group.WORLD))
    if key not in _groups:
        _groups[key] = dist.new_group(list(ranks), use_local_synchronization=True)
    return _groups[key]


def sync_tied_embedding(stages: dict[int, GPTStage], schedule, group=None) -> bool:
    """Sum the word-embedding gradient of the first stage (``wte``) and of the last (``lm_head``).

    With ``tie_embeddings`` one matrix E is both ``wte`` (stage 0) and ``lm_head`` (last stage), so
    ``dL/dE`` is the sum of the two uses. When those stages sit on different ranks each rank holds
    only its part in its copy of E; one all-reduce among the two ranks gives both the full sum, and
    since both copies started equal they stay equal after the same update. Returns whether it ran.
    """
    n_vs = schedule.p * schedule.v
    first, last = schedule.placement(0)[0], schedule.placement(n_vs - 1)[0]
    if not next(iter(stages.values())).cfg.tie_embeddings or first == last:
        return False
    me = dist.get_rank(group)
    if me not in (first, last):
        return False
    ranks = tuple(r if group is None else dist.get_global_rank(group, r) for r in (first, last))
    stage = stages[0] if me == first else stages[schedule.placement(n_vs - 1)[1]]
    weight = stage.wte.weight if me == first else stage.lm_head.weight
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    comm.all_reduce(weight.grad, group=_embedding_group(ranks))
    return True


# --- zero bubble: B = input gradient, W = weight gradient -----------------------------------------


class _LinearTap:
    """Forward hooks on every nn.Linear of a stage: while ``active`` holds a list, each call appends
    ``(module, input, output)``. The output stays in the graph (B takes the gradient w.r.t. it)."""

    def __init__(self, stages):
        self.active = None
        self.handles = [m.register_forward_hook(self._hook)
                        for s in stages for m in s.modules() if isinstance(m, nn.Linear)]

    def _hook(self, module, inputs, output):
        if self.active is not None:
            self.active.append((module, inputs[0].detach(), output))

    def remove(self):
        for h in self.handles:
            h.remove()


def _b_params(stage: nn.Module) -> list[nn.Parameter]:
    """Parameters whose gradient B computes itself: those of non-Linear modules (LayerNorm,
    embeddings). A tied weight that is also an Embedding's belongs here, not to W."""
    seen = {}
    for m in stage.modules():
        if not isinstance(m, nn.Linear):
            for p in m.parameters(recurse=False):
                if p.requires_grad:
                    seen[id(p)] = p
    return list(seen.values())


def _accumulate(p: torch.Tensor, g: torch.Tensor | None) -> None:
    if g is not None:
        p.grad = g.clone() if p.grad is None else p.grad.add_(g)


def _backward_input(y, g, x, taps, b_params):
    """Qi et al. 2024 §2's B: dL/dx, plus the (cheap) non-Linear parameter gradients; no dW of any Linear.

    ``torch.autograd.grad`` runs only the graph nodes on a path from ``y`` to the tensors asked for,
    and inside a node computes only the gradients needed. Asking for the stage input, the output of
    every Linear and the LayerNorm/embedding parameters leaves every Linear's weight and bias
    unreached: each ``addmm`` backward computes ``dX = dY W`` and skips ``dW = dY^T X``. The Linear
    outputs' gradients dY are returned, kept with the Linear's input X, and W computes ``dW``, ``db``
    from them later: the same arithmetic as the fused backward, done at another time.
    """
    outs = [o for _, _, o in taps]
    wants = ([x] if x is not None else []) + outs + b_params
    grads = torch.autograd.grad(y, wants, g, allow_unused=True)
    dx = grads[0] if x is not None else None
    k = len(wants) - len(b_params)
    dys = grads[k - len(outs):k]
    for p, gp in zip(b_params, grads[k:]):
        _accumulate(p, gp)
    return dx, [(mod, xin, dy) for (mod, xin, _), dy in zip(taps, dys) if dy is not None]


def _backward_weights(stash, b_ids: set) -> None:
    """Qi et al. 2024 §2's W: for ``y = x W^T + b``, ``dW = dy^T x`` and ``db = sum(dy)`` over tokens."""
    for mod, xin, dy in stash:
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), xin.reshape(-1, xin.shape[-1])
        if mod.weight.requires_grad and id(mod.weight) not in b_ids:
            _accumulate(mod.weight, dy2.t() @ x2)
        if mod.bias is not None and mod.bias.requires_grad and id(mod.bias) not in b_ids:
            _accumulate(mod.bias, dy2.sum(0))


# --- the executor ------------------------------------------------------------------------------------


def _check(schedule, stages, x, y, group):
    if not dist.is_initialized():
        raise RuntimeError("run_schedule needs torch.distributed initialised: call it inside a function "
                           "run by launch(fn, schedule.p) (or under torchrun)")
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


def run_schedule(schedule, stages: dict[int, nn.Module], x: torch.Tensor, y: torch.Tensor,
                 timeline=None, memory=None, group=None, sync_tied: bool = True) -> PipelineResult:
    """Run this rank's actions of ``schedule`` for one step on the global batch ``(x, y)``.

    ``stages`` maps chunk -> module (:func:`local_stages`). Every rank passes the same global batch;
    it is cut into ``m`` microbatches, rank of stage 0 reads the tokens, the last stage's rank the
    targets. Gradients accumulate in the parameters' ``.grad`` (zero them before, step the optimizer
    after, as with any backward). ``timeline`` (:class:`analysis.timeline.Timeline`) gets one span
    per action, named ``str(action)``, category F/B/W, meta ``mb``, ``chunk``; receives are waited
    for *outside* the spans, so the gaps are the bubbles. ``memory`` (:class:`analysis.meters.MemoryMeter`)
    tracks the tensors autograd saves over the step (the (x, dy) pairs zero-bubble keeps from B to
    W live outside autograd and are not counted; ``peak_stashed`` counts them, in microbatches).
    With tied embeddings the embedding gradient is all-reduced between the first and last stage
    at the end (:func:`sync_tied_embedding`; ``sync_tied=False`` leaves it to the caller).
    ``group``: the pipeline's process group (default: the world), stage r = its rank r.

    Returns a :class:`PipelineResult`: ``loss`` (batch mean, on the last stage's rank),
    ``peak_stashed`` and the per-action ``stashed`` counts, this step's timeline ``events``.

    When ``schedule.splits_backward`` (zero-bubble schedules), B computes the input gradient
    and the non-Linear parameter gradients, W the Linear weight gradients (see ``_backward_input``).
    """
    _check(schedule, stages, x, y, group)
    p, m, v = schedule.p, schedule.m, schedule.v
    n_vs, r = p * v, dist.get_rank(group)
    peer = (lambda q: q) if group is None else (lambda q: dist.get_global_rank(group, q))
    param = next(next(iter(stages.values())).parameters())
    xs, ys = x.to(param.device).chunk(m), y.to(param.device).chunk(m)
    shape = (xs[0].shape[0], xs[0].shape[1], stages[0].cfg.n_embd)
    split = schedule.splits_backward
    taps = _LinearTap(stages.values()) if split else None
    b_params = {c: _b_params(s) for c, s in stages.items()} if split else {}
    b_ids = {c: {id(q) for q in ps} for c, ps in b_params.items()}

    def tag(mb, vs, grad):  # one tag per message: (microbatch, receiving virtual stage, direction)
        return 2 * (mb * n_vs + vs) + grad

    sends: list = []

    def send(t, vs_to, mb, grad):
        t = t.detach().contiguous()
        op = dist.P2POp(dist.isend, t, peer(schedule.placement(vs_to)[0]), group, tag(mb, vs_to, grad))
        sends.extend((w, t) for w in comm.batch_isend_irecv([op]))  # keep t alive until sent
        sends[:] = [(w, t) for w, t in sends if not w.is_completed()]

    def recv(vs_from, mb, vs, grad):
        buf = torch.empty(shape, dtype=param.dtype, device=param.device)
        op = dist.P2POp(dist.irecv, buf, peer(schedule.placement(vs_from)[0]), group, tag(mb, vs, grad))
        for w in comm.batch_isend_irecv([op]):
            w.wait()
        return buf

    state: dict = {}  # (mb, chunk) -> dict(x=stage input, y=output, taps=..., stash=...)
    units, peak, held, losses, actions = 0, 0, [], [], []
    t0 = len(timeline.events) if timeline is not None else 0
    with contextlib.ExitStack() as cleanup:
        if memory is not None:
            cleanup.enter_context(memory.track())
        if taps is not None:
            cleanup.callback(taps.remove)
        for a in schedule[r]:
            vs = schedule.virtual_stage(r, a.chunk)
            key = (a.mb, a.chunk)
            if a.kind == "F":
                inp = xs[a.mb] if vs == 0 else recv(vs - 1, a.mb, vs, 0).requires_grad_(True)
                units += 1
                held.append(units / v)
                peak = max(peak, units)
                with _span(timeline, a):
                    st = state[key] = {"x": None if vs == 0 else inp, "taps": []}  # taps: zero bubble only
                    if taps is not None:
                        taps.active = st["taps"]
                    if vs == n_vs - 1:
                        loss = stages[a.chunk](inp, ys[a.mb])
                        losses.append(loss.item())
                        st["y"] = loss / m  # mean of the m microbatch means = the batch mean
                    else:
                        st["y"] = stages[a.chunk](inp)
                    if taps is not None:
                        taps.active = None
                if vs < n_vs - 1:
                    send(st["y"], vs + 1, a.mb, 0)
            elif a.kind == "B":
                st = state[key]
                g = None if vs == n_vs - 1 else recv(vs + 1, a.mb, vs, 1)
                held.append(units / v)
                with _span(timeline, a):
                    if split:
                        dx, st["stash"] = _backward_input(st.pop("y"), g, st.pop("x"), st.pop("taps"),
                                                          b_params[a.chunk])
                    else:
                        torch.autograd.backward(st.pop("y"), g)
                        dx = None if st["x"] is None else st["x"].grad
                if vs > 0:
                    send(dx, vs - 1, a.mb, 1)
                if not split:
                    del state[key]
                    units -= 1
            elif a.kind == "W":
                held.append(units / v)
                with _span(timeline, a):
                    _backward_weights(state.pop(key)["stash"], b_ids[a.chunk])
                units -= 1
            else:
                raise ValueError(f"unknown action kind {a.kind!r} in {a}; expected F, B or W")
            actions.append(str(a))
        for w, _ in sends:
            w.wait()
        if sync_tied:
            sync_tied_embedding(stages, schedule, group)
    if state:
        raise RuntimeError(f"rank {r}: microbatches {sorted(state)} were never fully backpropagated; "
                           f"the schedule is missing their B (or W) actions")
    last_rank = schedule.placement(n_vs - 1)[0]
    return PipelineResult(
        rank=r, loss=sum(losses) / m if r == last_rank else None, losses=losses, actions=actions,
        stashed=held, peak_stashed=peak / v, events=list(timeline.events[t0:]) if timeline is not None else [],
        peak_activation_bytes=memory.peak["activations"] if memory is not None else None)


def _span(timeline, a):
    if timeline is None:
        return contextlib.nullcontext()
    return timeline.span(str(a), category=a.kind, mb=a.mb, chunk=a.chunk)
