"""Chapter 06 — ZeRO-3 / FSDP on any ``nn.Module``: ``fully_shard``, the way PyTorch's FSDP2 is called.

Rajbhandari et al. 2020, "ZeRO", §5.3 (P_os+g+p: each rank keeps 1/n of the parameters and gathers
the rest only while a layer needs them) and §7.2.2 (3Ψ of traffic per step, 1.5x data parallelism);
Zhao et al. 2023, "PyTorch FSDP", §3 (units, resharding, prefetching, hybrid sharding).

**How it is called** (bottom-up, as FSDP2)::

    for block in model.blocks:
        fully_shard(block)            # one unit per block: gathered before its forward, freed after
    fully_shard(model)                # the root: one more unit of the leftover parameters
    opt = torch.optim.AdamW(model.parameters())     # the shards, under their own names
    loss = model(x, y)[1]; loss.backward(); opt.step()

Each call makes one unit of the parameters under ``module`` that no earlier call took
(:class:`.fsdp_unit.FlatUnit`) and returns the same module, its class now also an
:class:`FSDPModule` (FSDP2 swaps the class the same way): its ``forward`` gathers, runs, frees.
Parameters no call covers are yours, as in FSDP2: ``replicate(model)`` in place of the root's
``fully_shard`` keeps them *replicated* (broadcast from rank 0, gradients all-reduced and averaged
at the end of backward, chapter 01), as torch's composable ``replicate`` composes with FSDP2. So
"shard the Linear and Embedding layers, keep the norms replicated" is ``fully_shard`` on those
layers, then ``replicate(model)``. A submodule two parents share is sharded first: its own unit,
which both parents skip. Frozen tensors are gathered but never reduced.

**The root** is found as FSDP2 finds it (``_lazy_init``): each sharded module has a forward
pre-hook, and the first to run, once every ``fully_shard`` call has been made, becomes the root of
every sharded module under it not claimed yet. Its :class:`ShardingState` is shared by its units:
the order they ran in (each pass prefetches by the last pass's order: before a unit computes, the
all-gather of the next one is issued, in forward and in backward) and the replicated parameters.
The state lives on the modules (``module.fsdp_state``), a shard's group on the shard
(``p.fsdp_shard``): nothing is kept per process. FSDP2's four hooks map onto one autograd node per
unit call: its pre-forward and post-forward hooks are the start and the end of
:class:`.fsdp_unit.UnitFunction`'s ``forward`` (gather and prefetch; reshard), its pre-backward hook is
autograd calling that node's ``backward`` (gather again and prefetch) and its post-backward hook is
the end of that ``backward`` (reduce-scatter; reshard).

**Measured beside it.** A unit announces what it does through :mod:`...runtime.observe`, category
``"fsdp"`` (an instant per ``all_gather``, ``forward``, ``forward_end``, ``backward``,
``backward_end``, ``reduce_scatter``, ``free``; the count ``gathered_bytes``);
:class:`...analysis.fsdp_observers.GatheredUnits` listens and keeps the peaks and the schedule.

**Prefetch never serves old weights.** When the units a step runs change (a layer used on some steps,
several forwards before one backward), a prefetched unit may not run before ``opt.step()``. So a
gather remembers the version of the shard it came from and a unit gathered from an older shard is
gathered again; a unit the root's forward prefetched but did not run is released when that forward
ends; and at the end of backward every unit still gathered is released, as FSDP2 reshards all there.
Nothing gathered lives from one step into the next.

**Each unit runs as one autograd node** (:class:`.fsdp_unit.UnitFunction`). Its ``forward`` gathers, runs the
module *with grad enabled* on detached inputs (building the unit's own small graph, whose leaves
are the gathered weights), frees the weights by resizing their storage to 0 and returns detached
outputs. Autograd calls its ``backward`` exactly when the gradient of the unit's output is ready,
which is FSDP's backward pre-hook: it re-gathers into the same storage (the saved tensors view it),
runs the unit's graph backward, reduce-scatters the gradients and frees again. Nothing is recomputed.

**Hybrid sharding.** ``group`` shards (n_s ranks); ``replicate_group`` (n_r ranks holding the same
shard) all-reduces the reduce-scattered gradient: ``hybrid_groups(n_s)`` builds both (rows of
n_s consecutive ranks, and the columns). Gradients are averaged over all n_s·n_r ranks.

**fp8 all-gather** (chapter 08, :mod:`.fsdp_fp8`): ``fully_shard(module, fp8_all_gather=True)`` sends
each shard as E4M3 bytes plus one fp32 scale and dequantises after the gather: half of bf16's bytes.

Memory per rank (fp32, AdamW): parameters 4Ψ_pad/n_s, gradients 4Ψ_pad/n_s, optimizer state
8Ψ_pad/n_s: ZeRO's (4+4+8)Ψ/n, plus, during a step, the gathered units (root + 2 with prefetch).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

from ...runtime import comm, observe, require_process_group
from ...runtime.devices import values_or
from ...runtime.replica_shapes import check_same_shapes
from .fsdp_fp8 import enable_fp8_all_gather, fp8_all_gather_format
from .fsdp_unit import FlatUnit, MixedPrecisionPolicy, UnitCall, UnitFunction

__all__ = ["fully_shard", "replicate", "FSDPModule", "MixedPrecisionPolicy", "ShardingState",
           "sharding_state", "sharded_units", "shard_groups", "full_state_dict", "hybrid_groups"]


class ShardingState:
    """What the units under one root share: the order they ran in and the replicated parameters.

    Made by the root's first forward (:func:`_pre_forward`): it claims every module under ``root``
    that ``fully_shard`` or ``replicate`` marked and no earlier root claimed (``fsdp_state`` None).
    """

    def __init__(self, root: nn.Module):
        self.root = root
        claimed = [(name, m) for name, m in root.named_modules()
                   if getattr(m, "fsdp_state", "unmarked") is None]
        for name, m in claimed:
            m.fsdp_state = self
            if getattr(m, "fsdp_unit", None) is not None:
                m.fsdp_unit.name, m.fsdp_unit.state = name or "root", self
        self.units = [m.fsdp_unit for _, m in claimed if getattr(m, "fsdp_unit", None) is not None]
        first = self.units[0] if self.units else None
        self.group: dist.ProcessGroup | None
        self.replicate_group: dist.ProcessGroup | None
        self.group, self.replicate_group = (first.group, first.replicate_group) if first else (None, None)
        self.replicated = [p for p in root.parameters() if getattr(p, "fsdp_shard", None) is None]
        self._sync_replicated()
        self.order: dict[str, list[FlatUnit]] = {"forward": [], "backward": []}  # this pass
        # the pass before: what prefetch follows
        self.last: dict[str, list[FlatUnit]] = {"forward": [], "backward": []}
        self.depth, self.callback_queued = 0, False

    # --- order and prefetch ---------------------------------------------------------------------
    def begin_pass(self) -> None:
        """A new forward of the root: the order recorded so far becomes the one to prefetch by."""
        for k in ("forward", "backward"):
            if self.order[k]:
                self.last[k], self.order[k] = self.order[k], []

    def end_pass(self) -> None:
        """The root's forward ended: a unit gathered by prefetch that did not run in it is released
        (it ran in the last pass, not in this one: nothing of this step will read it)."""
        ran = self.order["forward"]
        for unit in self.units:
            if unit.gathered and not any(unit is u for u in ran):
                unit.release()

    def enter(self, unit: FlatUnit, kind: str) -> int:
        """Record that ``unit`` starts its forward or backward; issue the next unit's all-gather."""
        pos = len(self.order[kind])
        self.order[kind].append(unit)
        unit.wait()
        last = self.last[kind]
        if unit.prefetch and pos + 1 < len(last):
            last[pos + 1].issue_all_gather(async_op=True)
        observe.mark(kind, "fsdp", unit=unit.name)
        return pos

    # --- replicated parameters (those in no unit) ----------------------------------------------------
    def _groups(self):
        return [self.group, *([self.replicate_group] if self.replicate_group is not None else [])]

    @torch.no_grad()
    def _sync_replicated(self) -> None:
        for p in self.replicated:  # every replica starts from rank 0's weights, as in data parallelism
            for g in self._groups():
                comm.broadcast(p.data, 0 if g is None else dist.get_global_rank(g, 0), group=g)

    def queue_end_of_backward(self) -> None:
        """Called from the outermost unit's backward: at the end of backward, average the replicated
        gradients and release every unit still gathered (FSDP2 reshards everything there too), so no
        gathered weights outlive the step into the optimizer's update."""
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self.callback_queued = False
        self._reduce_replicated()
        for unit in self.units:
            unit.release()

    @torch.no_grad()
    def _reduce_replicated(self) -> None:
        """One all-reduce of ``[every replicated gradient | has-grad flags]``; a parameter no rank
        computed a gradient for keeps ``grad = None``."""
        ps = [p for p in self.replicated if p.requires_grad]
        if not ps:
            return
        flat = torch.cat([p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in ps]
                         + [ps[0].new_tensor([float(p.grad is not None) for p in ps])])
        world = 1
        for g in self._groups():
            comm.all_reduce(flat, group=g)
            world *= dist.get_world_size(g)
        mine = [float(p.grad is not None) for p in ps]  # a dry run has no counts: this rank's stand in
        counts, off = values_or(flat[-len(ps):], mine), 0
        for p, c in zip(ps, counts):
            if c > 0:
                p.grad = flat[off:off + p.numel()].view_as(p).div(world)
            off += p.numel()


def _cast(tree, dtype):
    return tree_map(lambda x: x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x, tree)


class FSDPModule:
    """Put in front of a sharded module's class by :func:`fully_shard`: its forward runs the unit."""

    fsdp_unit: FlatUnit | None  # None: a root whose submodules took every parameter

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        unit = self.fsdp_unit
        if unit is None:
            return super().forward(*args, **kwargs)  # type: ignore[misc]  # the module's own class comes next
        if unit.state is None:
            raise RuntimeError(f"{type(self).__name__} was sharded but its root was not found: call the "
                               f"model (module(...)), not module.forward(...), so the root can be found")
        mp = unit.mp
        if mp.param_dtype is not None and mp.cast_forward_inputs:
            args, kwargs = _cast((args, kwargs), mp.param_dtype)
        call = UnitCall(unit, super().forward, args, kwargs)
        if torch.is_grad_enabled():
            out = call.output(UnitFunction.apply(call, unit.handle, *call.tensors()))
        else:  # inference: gather, run, free; no graph to keep
            unit.state.enter(unit, "forward")
            leaves = unit.bind()
            try:
                out = call.output(call.run([t for t in call.tensors()]))
            finally:
                unit.unbind()
                unit.free()
            del leaves
        return _cast(out, mp.output_dtype) if mp.output_dtype is not None else out

    def full_state_dict(self) -> dict:
        """``{name: full tensor}`` of the unsharded weights (a collective: every rank calls it)."""
        return full_state_dict(self)  # type: ignore[arg-type]  # mixed into an nn.Module subclass


def _pre_forward(module: Any, _args: Any) -> None:  # Any: a marked module carries ``fsdp_state``
    """Forward pre-hook of each module ``fully_shard`` or ``replicate`` marked (FSDP2's root
    pre-forward): the first to run becomes the root (lazy initialisation); the root opens a pass."""
    if module.fsdp_state is None:
        ShardingState(module)
    if module.fsdp_state.root is module:
        module.fsdp_state.begin_pass()


def _post_forward(module: Any, _args: Any, _output: Any) -> None:
    if module.fsdp_state.root is module:
        module.fsdp_state.end_pass()


def _mark(module: Any) -> None:  # Any: an nn.Module, given the attribute ``fsdp_state``
    """Hooks that find the root at the first forward; ``fsdp_state`` None until a root claims it."""
    module.fsdp_state = None
    module.register_forward_pre_hook(_pre_forward, prepend=True)
    module.register_forward_hook(_post_forward)


def _slots(module: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(submodule, name, parameter) under ``module`` not taken by a unit already (a tied one repeats)."""
    sharded = {id(p) for u in sharded_units(module) for p in u.sharded}
    out = []
    for mname, m in module.named_modules(remove_duplicate=False):
        for a, p in m._parameters.items():
            if p is None or id(p) in sharded:
                continue
            if getattr(p, "fsdp_shard", None) is not None:
                where = f"{mname} ({type(m).__name__})" if mname else type(m).__name__
                raise ValueError(f"fully_shard: {where} is already in another module's unit. Either it is "
                                 f"shared by two modules: shard it first, fully_shard(<the shared module>), "
                                 f"and both will skip its unit; or fully_shard was called top-down: call it "
                                 f"on submodules first, then the root")
            if getattr(p, "fsdp_taken", False):
                raise ValueError(f"fully_shard: parameter {mname or type(module).__name__}.{a} is already in "
                                 f"another unit (tied weights?); put every module that uses it in one unit: "
                                 f"call fully_shard on a common parent (e.g. the root) instead")
            out.append((m, a, p))
    return out


def _check(module: nn.Module, group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None,
           mp_policy: MixedPrecisionPolicy | None, reshard_after_forward: bool) -> None:
    require_process_group("fully_shard")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: this {type(module).__name__} is already sharded; call fully_shard "
                         f"once per module, submodules first, then the root")
    if replicate_group is not None and group is None:
        raise ValueError("replicate_group needs group: pass the sharding group too (see hybrid_groups)")
    if dist.get_rank(group) < 0:
        raise ValueError(f"fully_shard: rank {dist.get_rank()} is not in group "
                         f"{dist.get_process_group_ranks(group)}; call it only on the group's ranks")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")


def fully_shard(module: nn.Module, *, group: dist.ProcessGroup | None = None,
                reshard_after_forward: bool = True, mp_policy: MixedPrecisionPolicy | None = None,
                replicate_group: dist.ProcessGroup | None = None,
                prefetch: bool = True, fp8_all_gather: bool | str = False) -> nn.Module:
    """Make ``module`` one FSDP unit (ZeRO-3) over ``group``; return it, now an :class:`FSDPModule`.

    Call it on submodules first, then on the root. The unit takes every parameter under ``module``
    that no earlier call took. Every rank of ``group`` must call it, in the same order (it
    broadcasts rank 0's weights). ``reshard_after_forward``: free the gathered weights after
    forward and gather again in backward (3Ψ of traffic), or keep them to backward (2Ψ, more
    memory). ``mp_policy``: :class:`MixedPrecisionPolicy`. ``replicate_group``: the ranks holding
    the same shard (hybrid sharding, see :func:`hybrid_groups`). ``prefetch``: before this unit
    computes, issue the all-gather of the unit that ran next in the previous pass.
    ``fp8_all_gather`` (chapter 08, :mod:`.fsdp_fp8`): True (E4M3) or ``'e4m3'`` / ``'e5m2'``: each rank
    sends its shard as fp8 plus one fp32 scale, dequantised after the gather (half of bf16's bytes).
    """
    _check(module, group, replicate_group, mp_policy, reshard_after_forward)
    fp8 = fp8_all_gather_format(fp8_all_gather)
    slots = _slots(module)
    names = {id(m): n for n, m in module.named_modules()}  # every rank holding these weights: same shapes
    for g in (group, replicate_group) if replicate_group is not None else (group,):
        check_same_shapes([(f"{names.get(id(m), '?')}.{a}".lstrip("."), p) for m, a, p in slots], g,
                          who="fully_shard")
    unit = None  # a root whose submodules took every parameter is a unit with nothing to gather
    if slots:
        unit = FlatUnit(slots, group, replicate_group, mp_policy, reshard_after_forward)
        unit.prefetch = prefetch
        if fp8 is not None:
            enable_fp8_all_gather(unit, fp8)
        for _, _, p in slots:
            p.fsdp_taken = True  # type: ignore[attr-defined]  # a tied copy of it elsewhere may not join another unit
    cls = type(module)
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    module.fsdp_unit = unit  # type: ignore[assignment]  # a plain attribute, not a submodule
    _mark(module)
    return module


def replicate(module: nn.Module) -> nn.Module:
    """Keep the parameters under ``module`` that no ``fully_shard`` call took replicated (chapter 01):
    broadcast from rank 0 at the first forward, gradients averaged over the units' ranks at the end of
    backward. Call it last, on the root, in place of ``fully_shard(module)``; returns ``module``."""
    require_process_group("replicate")
    if hasattr(module, "fsdp_state") or not any(isinstance(m, FSDPModule) for m in module.modules()):
        raise ValueError("replicate(module) keeps what fully_shard left out: call fully_shard on its "
                         "submodules first, then replicate once, on the root (not on a sharded module)")
    _mark(module)
    return module


def sharded_units(module: nn.Module) -> list[FlatUnit]:
    """The units under ``module`` (itself included), in module order."""
    return [m.fsdp_unit for m in module.modules() if isinstance(m, FSDPModule) and m.fsdp_unit is not None]


def shard_groups(params: Iterable[torch.Tensor]) -> list[dist.ProcessGroup | None]:
    """The groups (None: the default one) any of ``params`` is sharded over, each once; [] for none.
    Their ranks hold different pieces of one gradient, so "an inf or NaN: skip the step" must be agreed
    over them (:class:`..mixed_precision.DynamicLossScaler`); under hybrid sharding the shard group
    suffices, the replicas of a shard holding the same all-reduced gradient."""
    tags = [t for t in (getattr(p, "fsdp_shard", None) for p in params) if t is not None]
    return list({id(t.group): t.group for t in tags}.values())


def sharding_state(module: nn.Module) -> ShardingState:
    """The :class:`ShardingState` of ``module``'s units (it exists from the first forward on)."""
    units = sharded_units(module)
    if not units or units[0].state is None:
        raise RuntimeError("no sharding state yet: fully_shard the model and run one forward first")
    return units[0].state


@torch.no_grad()
def full_state_dict(module: nn.Module) -> dict:
    """``{name: full tensor}`` of the unsharded weights, named as in the dense model (a collective)."""
    full = {}
    for u in sharded_units(module):
        for part in u.parts:
            buf = part.shard.new_empty(part.flat.padded_numel)
            comm.all_gather(buf, part.shard.detach(), group=u.group)
            for p, v in zip(part.sharded, part.flat.views(buf)):
                full[id(p)] = v.clone()
    return {k: full[id(p)] if id(p) in full else p.detach().clone() for k, p in module.named_parameters()}


def hybrid_groups(shard_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """This rank's ``(group, replicate_group)`` on a 2-D grid of ranks: rows of ``shard_size``
    consecutive ranks shard, columns replicate. n = 4, shard_size = 2: shard {0,1} {2,3}; replicate
    {0,2} {1,3}. ``dist.new_group`` is collective, so every rank creates every group, in one order.
    """
    require_process_group("hybrid_groups")
    n, r = dist.get_world_size(), dist.get_rank()
    if shard_size < 1 or n % shard_size:
        raise ValueError(f"world size {n} is not divisible by shard_size {shard_size}; "
                         f"pick a shard_size that divides it")
    rows = [list(range(i, i + shard_size)) for i in range(0, n, shard_size)]  # (n/s rows of s ranks)
    columns = [list(range(j, n, shard_size)) for j in range(shard_size)]  # (s columns of n/s ranks)
    mine = {}
    for axis, groups in (("shard", rows), ("replicate", columns)):
        for ranks in groups:
            g = dist.new_group(ranks)
            if r in ranks:
                mine[axis] = g
    return mine["shard"], mine["replicate"]
