"""ZeRO-3 / fully sharded data parallelism: parameters, gradients and optimizer state all sharded.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models":
§5.3 (P_os+g+p: each rank keeps 1/n of the parameters and gathers the rest only while a layer
needs them) and §7.2.2 (its communication: 3Ψ per step instead of data parallelism's 2Ψ).
Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", §3: units,
the FlatParameter, resharding after use, forward and backward prefetching, and §3.2.2's hybrid
sharding (HYBRID_SHARD: shard within a group of ranks, replicate across groups).

**Units.** Every transformer ``Block`` is a unit, and a *root* unit holds the rest (``wte``,
``wpe``, ``ln_f``, ``lm_head``; the tied ``lm_head.weight`` *is* ``wte.weight``, one parameter).
Each unit flattens its parameters into one padded buffer (:class:`.flat.FlatParams`) and keeps
only its own ``S = ceil(Ψ_u / n)`` elements as an ``nn.Parameter``: the model's ``.parameters()``
are these shards, so any ``torch.optim`` optimizer updates the shard and nothing else.

**One step of one unit** (n ranks, Ψ_u elements padded to n·S)::

    forward:   all-gather shard -> full (n·S)       views of full become the unit's weights
               run the unit;  free full             (storage resized to 0: "reshard")
    backward:  all-gather shard -> the same full    the tensors autograd saved point into it
               run the unit's backward -> grad full (n·S)
               reduce-scatter(grad full) / n -> shard.grad;  free full and grad full

so per step Ψ is all-gathered twice and reduce-scattered once: ``3·Ψ·(n-1)/n`` elements on each
rank's wire under the ring model, 1.5x the ``2·Ψ·(n-1)/n`` of ZeRO-1/2 (reduce-scatter + all-gather).

**How backward re-gathers.** Each unit runs inside a custom ``autograd.Function``
(:class:`_UnitFunction`). Its ``forward`` gathers, runs the unit *with grad enabled* (building the
unit's own small graph, whose leaves are the gathered flat buffer and the detached input), frees
the buffer by resizing its storage to 0 (as FSDP does) and returns detached outputs. Autograd
calls its ``backward`` exactly when the gradient of the unit's output is ready -- that is the
backward pre-hook: it resizes the storage back, all-gathers into it (the saved tensors are views of
that storage, so they see the weights again), runs the unit's graph backward, reduce-scatters the
flat gradient and returns it as the gradient of the shard, which autograd accumulates into
``shard.grad``. Nothing is recomputed. The all-gather writes into a tensor autograd saved, which
would bump its version counter and trip autograd's in-place check; the write is hidden with
``torch.autograd._unsafe_preserve_version_counter``, whose docstring names exactly this use.

**Prefetch** (FSDP §3.3.2 backward, §3.3.3 forward). With ``prefetch=True`` a unit, before it
computes, issues the all-gather of the next unit (``async_op=True``): in forward order (root,
blocks 0..L-1) during forward, in reverse order (root, blocks L-1..0) during backward. The root's
forward encloses the blocks' (it embeds, runs them, then the head), so the root stays gathered for
the whole forward and the whole backward, and at most root + 2 blocks are full at once (root + 1
without prefetch). (FSDP2 keeps the root gathered from forward into backward; we reshard it and
gather it again, so every unit moves exactly the paper's 3Ψ_u.)

**Hybrid sharding.** ``group`` is the sharding group (n_s ranks); with ``replicate_group`` (n_r
ranks holding the same shard) the reduce-scattered shard gradient is also all-reduced across it.
Gradients are summed over all n_s·n_r ranks and divided by n_s·n_r: n ranks on B/n rows each
compute the gradient of one process on the global batch (chapter 01's argument).

Memory per rank (fp32, AdamW, Ψ_pad = Σ_u n_s·S_u): parameters 4Ψ_pad/n_s, gradients 4Ψ_pad/n_s,
optimizer state 8Ψ_pad/n_s (+ a step counter per shard): ZeRO's (4+4+8)Ψ/n, plus, during a
step, the gathered units above.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from ...runtime import comm
from .flat import FlatParams


class FlatUnit:
    """One FSDP unit: ``module``'s parameters as one sharded flat buffer (FSDP's FlatParameter).

    ``shard`` (an ``nn.Parameter``, registered on ``module`` as ``flat_shard``) is all this rank
    keeps. ``full`` is the gathered padded buffer, also an ``nn.Parameter`` (so a memory meter
    sees the weights saved for backward as parameters, not activations); its storage has 0 bytes
    whenever the unit is resharded.
    """

    def __init__(self, name, module, slots, owner, group=None, replicate_group=None):
        self.name, self.module, self.owner = name, module, owner
        self.group, self.replicate_group = group, replicate_group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        # slots: (submodule, attribute) of every parameter reference; a tied parameter appears
        # twice but is flattened once.
        self.slots = [(m, a, getattr(m, a)) for m, a in slots]
        unique = list({id(p): p for _, _, p in self.slots}.values())
        self.flat = FlatParams(unique, self.n)
        self.slot_index = [next(i for i, u in enumerate(unique) if u is p) for _, _, p in self.slots]
        with torch.no_grad():
            buf = self.flat.flatten([p.detach() for p in unique])
            self.shard = nn.Parameter(self.flat.shard(buf, self.rank).clone())
        self.full = nn.Parameter(torch.zeros_like(buf))
        self.full_bytes = self.full.untyped_storage().nbytes()
        self._free_storage()
        for m, a, _ in self.slots:  # the weights become plain attributes, set to views while gathered
            del m._parameters[a]
            setattr(m, a, None)
        module.register_parameter("flat_shard", self.shard)
        self._pending = None  # (work, version guard) of an all-gather in flight

    # --- gather / free ----------------------------------------------------------------------
    def _free_storage(self):
        self.full.untyped_storage().resize_(0)

    @property
    def gathered(self) -> bool:
        return self.full.untyped_storage().nbytes() > 0 or self._pending is not None

    def issue_all_gather(self, async_op: bool):
        """Re-allocate the full buffer and all-gather the shards into it (no-op if already there)."""
        if self.gathered:
            return
        self.full.untyped_storage().resize_(self.full_bytes)
        self.owner._note_gathered(self, +1)
        guard = torch.autograd._unsafe_preserve_version_counter(self.full)  # remembers the version now
        work = comm.all_gather(self.full.detach(), self.shard.detach(), group=self.group, async_op=async_op)
        self.owner._trace("all_gather", self.name)
        self._pending = (work, guard)

    def wait(self):
        """Make sure the full buffer holds this step's weights (gathering now if nobody prefetched)."""
        if not self.gathered:
            self.issue_all_gather(async_op=False)
        if self._pending is None:  # gathered and already waited for
            return
        work, guard = self._pending
        self._pending = None
        with guard:  # the all-gather wrote into saved tensors: restore their version counter
            if work is not None:
                work.wait()

    def free(self):
        """Reshard: drop the full buffer (its storage), keep the shard."""
        self._free_storage()
        self.owner._note_gathered(self, -1)
        self.owner._trace("free", self.name)

    def bind(self):
        """Point the module's weights at shaped views of the full buffer (made in the current grad mode)."""
        # One split (its backward is one concatenation into the flat gradient), not a slice per
        # tensor (each slice's backward would build a zero-padded buffer of the whole unit).
        flat = self.flat
        pieces = self.full.split([*flat.numels, flat.padding] if flat.padding else flat.numels)
        views = [t.view(shape) for t, shape in zip(pieces, flat.shapes)]
        for (m, a, _), i in zip(self.slots, self.slot_index):
            setattr(m, a, views[i])

    # --- gradients ----------------------------------------------------------------------------
    def reduce_scatter_grad(self, full_grad: torch.Tensor) -> torch.Tensor:
        """Average ``full_grad`` over every data-parallel rank; return this rank's shard of it."""
        shard_grad = torch.empty_like(self.shard)
        comm.reduce_scatter(shard_grad, full_grad.contiguous(), group=self.group)
        world = self.n
        if self.replicate_group is not None:
            comm.all_reduce(shard_grad, group=self.replicate_group)
            world *= dist.get_world_size(self.replicate_group)
        self.owner._trace("reduce_scatter", self.name)
        return shard_grad.div_(world)


class _UnitFunction(torch.autograd.Function):
    """A unit as one autograd node: gather -> run -> free forward; gather -> backward -> reduce-scatter -> free."""

    @staticmethod
    def forward(ctx, unit, run, shard, *inputs):
        owner = unit.owner
        unit.wait()
        owner._prefetch_after(unit, backward=False)
        owner._trace("forward", unit.name)
        # The unit's own graph: leaves are the flat buffer and detached copies of the inputs.
        detached = [x.detach().requires_grad_(x.requires_grad) if torch.is_tensor(x) else x for x in inputs]
        with torch.enable_grad():
            unit.bind()
            outs = run(*detached)
        owner._trace("forward_end", unit.name)
        unit.free()
        outs = outs if isinstance(outs, tuple) else (outs,)
        ctx.unit, ctx.inner_outs, ctx.inner_inputs = unit, outs, detached
        ctx.set_materialize_grads(False)
        return tuple(o.detach() if torch.is_tensor(o) else o for o in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        unit, owner = ctx.unit, ctx.unit.owner
        unit.wait()  # the backward pre-hook: re-gather into the storage the saved tensors view
        owner._prefetch_after(unit, backward=True)
        owner._trace("backward", unit.name)
        pairs = [(o, g) for o, g in zip(ctx.inner_outs, grad_outs)
                 if g is not None and torch.is_tensor(o) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        owner._trace("backward_end", unit.name)
        full_grad = unit.full.grad if unit.full.grad is not None else torch.zeros_like(unit.full)
        shard_grad = unit.reduce_scatter_grad(full_grad)
        unit.full.grad = None  # free the full gradient ...
        unit.free()  # ... and the full parameters
        input_grads = tuple(x.grad if torch.is_tensor(x) and x.requires_grad else None for x in ctx.inner_inputs)
        ctx.inner_outs = ctx.inner_inputs = None
        return (None, None, shard_grad, *input_grads)


class FullyShardedGPT(nn.Module):
    """The GPT of ``models/gpt.py`` with ZeRO-3 sharding; built by :func:`fully_shard`.

    ``forward(idx, targets=None) -> (logits, loss)`` as the dense model. ``.parameters()`` are the
    units' shards. ``full_state_dict()`` gathers the dense weights (a collective: every rank calls
    it). ``trace`` (when ``record_trace`` is True) lists ``(event, unit, perf_counter)``;
    ``peak_gathered`` is the most units, and ``peak_gathered_bytes`` the most bytes, full at once.
    """

    def __init__(self, model, group=None, prefetch=True, replicate_group=None):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("fully_shard needs a process group: call it inside launch(fn, n)")
        if not hasattr(model, "blocks"):
            raise ValueError(f"fully_shard expects the GPT of models/gpt.py (with .blocks), got {type(model).__name__}")
        if replicate_group is not None and group is None:
            raise ValueError("replicate_group needs group: pass the sharding group too (see hybrid_groups)")
        self.module, self.cfg, self.prefetch = model, model.cfg, prefetch
        self.record_trace, self.trace = False, []
        self.gathered_now, self.peak_gathered, self.gathered_bytes_now, self.peak_gathered_bytes = set(), 0, 0, 0
        dense = dict(model.named_parameters())  # dense names (tied lm_head.weight appears as wte.weight)
        blocks = list(model.blocks)

        def slots(mod, skip=()):
            return [(m, a) for mn, m in mod.named_modules() if not any(mn.startswith(s) for s in skip)
                    for a, _ in m.named_parameters(recurse=False)]

        self.units = [FlatUnit(f"blocks.{i}", b, slots(b), self, group, replicate_group)
                      for i, b in enumerate(blocks)]
        root = FlatUnit("root", model, slots(model, skip=("blocks.",)), self, group, replicate_group)
        self.units.insert(0, root)
        self.forward_order = self.units  # root, blocks 0..L-1
        self.backward_order = [root] + self.units[:0:-1]  # root, blocks L-1..0
        # dense name -> (unit, index of the tensor in its FlatParams), for full_state_dict
        ids = {id(p): (u, i) for u in self.units for i, p in enumerate(u.flat.params)}
        self.dense_names = {k: ids[id(p)] for k, p in dense.items()}
        for u in self.units[1:]:  # a block runs through its unit's autograd node
            u.module.forward = self._wrap(u, type(u.module).forward.__get__(u.module))

    def _wrap(self, unit, run):
        def forward(*inputs):
            if not torch.is_grad_enabled():  # inference: gather, run, free; no graph to keep
                unit.wait()
                self._prefetch_after(unit, backward=False)
                with torch.no_grad():
                    unit.bind()
                    out = run(*inputs)
                unit.free()
                return out
            outs = _UnitFunction.apply(unit, run, unit.shard, *inputs)
            return outs[0] if len(outs) == 1 else outs
        return forward

    def forward(self, idx, targets=None):
        root = self.units[0]

        def run(idx, *t):
            logits, loss = type(self.module).forward(self.module, idx, *t)
            return (logits,) if loss is None else (logits, loss)

        outs = self._wrap(root, run)(idx, *(() if targets is None else (targets,)))
        outs = outs if isinstance(outs, tuple) else (outs,)
        return outs[0], (outs[1] if len(outs) > 1 else None)

    # --- bookkeeping ------------------------------------------------------------------------
    def _prefetch_after(self, unit, backward: bool):
        if not self.prefetch:
            return
        order = self.backward_order if backward else self.forward_order
        k = order.index(unit)
        if k + 1 < len(order):
            order[k + 1].issue_all_gather(async_op=True)

    def _note_gathered(self, unit, delta):
        (self.gathered_now.add if delta > 0 else self.gathered_now.discard)(unit.name)
        self.gathered_bytes_now += delta * unit.full_bytes
        self.peak_gathered = max(self.peak_gathered, len(self.gathered_now))
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes_now)

    def _trace(self, event, name):
        if self.record_trace:
            self.trace.append((event, name, time.perf_counter()))

    def reset_stats(self):
        self.trace, self.peak_gathered, self.peak_gathered_bytes = [], len(self.gathered_now), self.gathered_bytes_now

    @torch.no_grad()
    def full_state_dict(self) -> dict:
        """``{dense name: full tensor}`` of the unsharded weights (a collective: all ranks call it)."""
        fulls = {}
        for u in self.units:
            buf = u.flat.empty()
            comm.all_gather(buf, u.shard.detach(), group=u.group)
            fulls[u.name] = [v.clone() for v in u.flat.views(buf)]
        return {k: fulls[u.name][i] for k, (u, i) in self.dense_names.items()}


def fully_shard(model, group=None, prefetch=True, replicate_group=None) -> FullyShardedGPT:
    """ZeRO-3 / FSDP for the GPT of ``models/gpt.py``: one unit per ``Block`` plus a root unit.

    Every rank must build the same model (same seed) and call this. ``group``: the ranks that
    shard the parameters (default: all). ``replicate_group``: the ranks holding the same shard as
    this one (hybrid sharding; see :func:`hybrid_groups`). ``prefetch``: issue the next unit's
    all-gather before computing the current one. The model is modified in place (its weights
    become views of gathered buffers) and wrapped; use the returned module from then on.
    """
    return FullyShardedGPT(model, group=group, prefetch=prefetch, replicate_group=replicate_group)


def hybrid_groups(shard_size: int):
    """This rank's ``(group, replicate_group)`` on a 2-D grid: rows of ``shard_size`` consecutive
    ranks shard, columns replicate. n = 4, shard_size = 2: shard {0,1} {2,3}; replicate {0,2} {1,3}.

    ``dist.new_group`` is collective over the world, so every rank creates every group, in the same order.
    """
    n, r = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or n % shard_size:
        raise ValueError(f"world size {n} is not divisible by shard_size {shard_size}; "
                         f"pick a shard_size that divides it")
    rows = [dist.new_group(list(range(i, i + shard_size))) for i in range(0, n, shard_size)]
    cols = [dist.new_group(list(range(j, n, shard_size))) for j in range(shard_size)]
    return rows[r // shard_size], cols[r % shard_size]
