"""Chapter 06 — one FSDP unit: a module's parameters as one sharded flat buffer, gathered just in time.

Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", §3.2 (the
FlatParameter: a unit's tensors end to end in one padded buffer, cut into n equal shards), §3.3
(all-gather before the unit computes, free after, reduce-scatter its gradient) and §3.2.2 (hybrid
sharding); Rajbhandari et al. 2020 (ZeRO), §5.3 P_os+g+p and §7.2.2 (3Ψ of traffic per step).

**What a rank keeps.** The unit's Ψ_u elements, padded to n·S (``S = ceil(Ψ_u / n)``), live in
``flat`` order; rank r keeps elements ``[r·S, (r+1)·S)`` (``shard``). Each original parameter is
replaced on its module by an ``nn.Parameter`` that is *this rank's piece of it*: a 1-D view into
``shard`` (possibly empty), under the parameter's own name, with its own ``requires_grad``. So
``model.named_parameters()``, parameter groups by name, frozen parameters and any elementwise
``torch.optim`` optimizer work as on the dense model (PyTorch's ``use_orig_params``).

**One step of one unit** (n ranks; ``full`` is the gathered buffer, in ``param_dtype``)::

    forward:   all-gather(shard) -> full (n·S)     a leaf per parameter, a view of full, is swapped in
               run the module;  free full          (storage resized to 0: "reshard")
    backward:  all-gather(shard) -> the same full  the tensors autograd saved see the weights again
               backward of the module -> a grad per leaf
               reduce-scatter([grads | has-grad flags]) / n -> each sharded parameter's .grad

so Ψ_u is all-gathered twice and reduce-scattered once per step: ``3·Ψ_u·(n-1)/n`` on the wire.
One call of a unit is one autograd node, :class:`UnitFunction` (the why is in :mod:`.fsdp`);
:class:`UnitCall` carries the call's arguments and outputs through it as flat lists of tensors.

**Who got a gradient.** A parameter that received no gradient on any rank (unused this step, or
frozen) keeps ``grad = None``, so the optimizer leaves it alone, as torch's optimizers do. Each rank
appends one flag per parameter (1 = I have a gradient) to every chunk of the reduce-scatter; the
summed flags say how many ranks had one, with no extra collective.

**Mixed precision** (``MixedPrecisionPolicy``, FSDP2's): the shard stays in the parameters' dtype
(the fp32 master weights); the all-gather and the compute run in ``param_dtype``; gradients are
reduced in ``reduce_dtype`` (default ``param_dtype``) and land on the shard in its own dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...models.init import cut_of
from ...runtime import comm, observe
from ...runtime.devices import has_values, values_or
from .flat import FlatParams, shard_range

__all__ = ["MixedPrecisionPolicy", "FlatUnit", "UnitCall", "UnitFunction", "ShardTag"]


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's policy: ``param_dtype`` for the all-gather and the compute, ``reduce_dtype`` for the
    gradient reduce-scatter (default: ``param_dtype``), ``output_dtype`` to cast the unit's
    floating outputs to, and ``cast_forward_inputs`` (floating inputs cast to ``param_dtype``)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self):
        for k in ("param_dtype", "reduce_dtype", "output_dtype"):
            d = getattr(self, k)
            if d is not None and not (isinstance(d, torch.dtype) and d.is_floating_point):
                raise ValueError(f"MixedPrecisionPolicy({k}={d!r}): a {k} must be a floating-point torch "
                                 f"dtype such as torch.bfloat16, torch.float16 or torch.float32")


class ShardTag:
    """Noted on every sharded parameter as ``p.fsdp_shard``: the group it is sharded over. The tensor
    carries it, as FSDP2's DTensor carries its mesh, so a list of parameters says which of them are
    shards (:func:`.fsdp.shard_groups`). A pickled copy drops it: a process group lives in its processes."""

    __slots__ = ("group",)

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group

    def __reduce__(self):
        return type(None), ()


class FlatPart:
    """Some of a unit's tensors, all of one dtype and one ``requires_grad``, as one sharded padded
    buffer: ``shard`` (this rank's S elements), ``sharded`` (an ``nn.Parameter`` per tensor, a view
    into ``shard``), ``full`` (the gathered buffer in the compute dtype; 0 bytes when resharded).
    """

    def __init__(self, params, unit):
        self.unit, self.flat = unit, FlatParams(params, unit.n)
        self.dtype, self.trains = params[0].dtype, params[0].requires_grad
        self.compute_dtype = unit.mp.param_dtype or self.dtype
        self.reduce_dtype = unit.mp.reduce_dtype or self.compute_dtype
        self.cuts = [cut_of(p) for p in params]  # where each tensor came from (deferred init, ch12)
        self._adopt(self._take_shard(params), [p.requires_grad for p in params])
        self.flat.params = []  # drop the dense tensors: only the shard stays on this rank
        self.pending = None  # (work, version guard, send buffer) of an all-gather in flight
        self.gathered_from = None  # the shard's version counter when ``full`` was gathered from it

    def _pieces(self):
        """Per tensor: its piece's ``[a, b)`` in the shard, and where in the tensor: ``[u, v)``."""
        lo, _ = shard_range(self.flat.numel, self.unit.n, self.unit.rank)
        for i, (a, b) in enumerate(self.flat.spans(lo, 1, self.flat.shard_numel)):
            yield a, b, self.flat.element_of(i, a, lo), self.flat.element_of(i, b, lo)

    def element_ranges(self) -> list[tuple[int, int]]:
        """Per tensor, the ``[u, v)`` of its flattened elements this rank keeps (empty: ``u == v``):
        where a sharded parameter's values sit in its own tensor (saving them, chapter 13)."""
        return [(u, v) for _, _, u, v in self._pieces()]

    def _adopt(self, shard: torch.Tensor, trains: list) -> None:
        """Keep ``shard``; a sharded parameter per tensor, its piece of ``shard`` (1-D, maybe empty:
        [o, o+k) ∩ [r·S, (r+1)·S)); ``full`` allocated then freed (0 bytes until gathered)."""
        self.shard = shard
        self.sharded = [nn.Parameter(shard[a:b], requires_grad=t)
                        for (a, b, _, _), t in zip(self._pieces(), trains)]
        for p in self.sharded:
            p.fsdp_shard = ShardTag(self.unit.group)
        self.full = shard.new_empty(self.flat.padded_numel, dtype=self.compute_dtype)
        self.full_bytes = self.full.untyped_storage().nbytes()
        self.full.untyped_storage().resize_(0)

    @torch.no_grad()
    def materialize(self, device, values_of) -> None:
        """A shard built on ``meta`` made real on ``device``: ``values_of(self, i)`` gives tensor i's values
        (its own shape, e.g. from :func:`..models.init.materialize`); only this rank's elements are kept.
        The sharded parameters are new tensors, views of the new shard."""
        shard = torch.zeros(self.flat.shard_numel, dtype=self.dtype, device=device)  # padding stays 0
        for i, (a, b, u, v) in enumerate(self._pieces()):
            if b > a:
                shard[a:b].copy_(values_of(self, i).reshape(-1)[u:v])
        self._adopt(shard, [p.requires_grad for p in self.sharded])

    def _take_shard(self, params) -> torch.Tensor:
        """Rank 0's weights (of the group, then of the replicate group), flattened; keep our S."""
        u = self.unit
        with torch.no_grad():
            buf = self.flat.flatten([p.detach() for p in params])
            for g in (u.group, *([u.replicate_group] if u.replicate_group is not None else [])):
                comm.broadcast(buf, 0 if g is None else dist.get_global_rank(g, 0), group=g)
            return self.flat.shard(buf, u.rank).clone()

    def all_gather(self, async_op: bool) -> None:
        self.full.untyped_storage().resize_(self.full_bytes)
        guard = torch.autograd._unsafe_preserve_version_counter(self.full)  # see FlatUnit.wait
        send = self.shard.detach().to(self.compute_dtype)  # the cast of mixed precision (a copy if any)
        work = comm.all_gather(self.full, send, group=self.unit.group, async_op=async_op)
        self.pending = (work, guard, send)

    @property
    def stale(self) -> bool:
        """Gathered from a shard that has changed since (an optimizer step ran while it was gathered)."""
        return self.gathered_from is not None and self.gathered_from != self.shard._version

    def finish(self) -> None:
        """Wait for this part's all-gather in flight, if any."""
        if self.pending is None:
            return
        work, guard, _send = self.pending
        self.pending = None
        # The all-gather wrote into tensors autograd saved; their version counter would say
        # "modified in place". The guard (whose docstring names this use) restores it.
        with guard:
            if work is not None:
                work.wait()

    def leaves(self) -> list[nn.Parameter]:
        """A leaf per tensor, a shaped view of ``full`` (one ``split``: its backward is one ``cat``)."""
        return [nn.Parameter(v, requires_grad=p.requires_grad)
                for v, p in zip(self.flat.split_views(self.full), self.sharded)]

    def reduce_grads(self, leaves) -> None:
        """Average the leaves' gradients over every data-parallel rank into the sharded ``.grad``s.

        Rank-major send buffer, row r for rank r: ``[grad elements r·S..(r+1)·S | flags]``, where
        ``flags[i] = 1`` if this rank has a gradient for tensor i. After the reduce-scatter (and the
        all-reduce over ``replicate_group``) a rank holds its S summed elements and the counts.
        """
        u, n = self.unit, self.unit.n
        grads = [leaf.grad for leaf in leaves]
        flags = torch.tensor([g is not None for g in grads], dtype=self.reduce_dtype,
                             device=self.shard.device)
        flat_grad = self.flat.flatten(grads, out=self.flat.empty(self.reduce_dtype, self.shard.device))
        S, F = self.flat.shard_numel, flags.numel()
        send = torch.cat([flat_grad.view(n, S), flags.expand(n, F)], dim=1)  # (n, S + F)
        got = send.new_empty(S + F)
        comm.reduce_scatter(got, send.view(-1), group=u.group)
        world = n
        if u.replicate_group is not None:
            comm.all_reduce(got, group=u.replicate_group)
            world *= dist.get_world_size(u.replicate_group)
        # The summed flags; in a dry run (no values) this rank's own stand in.
        counts = values_or(got[S:], [float(g is not None) for g in grads])
        self._accumulate(got[:S].div(world).to(self.dtype), counts)  # a shard of S, no flags

    def _accumulate(self, shard_grad: torch.Tensor, counts: list) -> None:
        """Each sharded tensor with a gradient on some rank gets its piece of ``shard_grad``."""
        for p, (a, b, _, _), count in zip(self.sharded, self._pieces(), counts):
            if count == 0 or not p.requires_grad:
                continue  # no rank computed a gradient: leave .grad as it is (None after zero_grad)
            g = shard_grad[a:b]
            if p.grad is None:
                p.grad = g
            else:
                p.grad += g  # several backwards before a step accumulate, as in one process


class FlatUnit:
    """One unit: the parameters in ``slots`` (``(module, attribute, parameter)``; a tied parameter
    appears once per module that holds it) sharded over ``group``.

    Its tensors are grouped into :class:`FlatPart` s by dtype and ``requires_grad``: usually one
    part; a frozen tensor goes in a part of its own that is gathered but never reduced (fewer bytes
    on the wire, and no gradient), and a unit may mix dtypes.
    """

    prefetch: bool  # set by fsdp.fully_shard: issue the next unit's all-gather before computing

    def __init__(self, slots, group: dist.ProcessGroup | None, replicate_group: dist.ProcessGroup | None,
                 mp_policy, reshard_after_forward):
        self.name, self.state = "?", None  # set when its root is found (see fsdp.ShardingState)
        self.group, self.replicate_group = group, replicate_group
        self.reshard_after_forward = reshard_after_forward
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.mp = mp_policy or MixedPrecisionPolicy()
        unique = list({id(p): p for _, _, p in slots}.values())
        kinds = list(dict.fromkeys((p.dtype, p.requires_grad) for p in unique))  # in order of appearance
        groups = [[p for p in unique if (p.dtype, p.requires_grad) == kind] for kind in kinds]
        self.parts = [FlatPart(ps, self) for ps in groups]
        where = {id(p): (k, i) for k, ps in enumerate(groups) for i, p in enumerate(ps)}
        self.slots = [(m, a, *where[id(p)]) for m, a, p in slots]  # (module, name, part, index)
        for m, a, k, i in self.slots:
            m._parameters[a] = self.parts[k].sharded[i]
        self.sharded = [p for part in self.parts for p in part.sharded]
        self.shard_numel = sum(part.flat.shard_numel for part in self.parts)
        self.full_bytes = sum(part.full_bytes for part in self.parts)
        self.handle = self.parts[0].shard.new_empty(0).requires_grad_()  # so autograd calls backward

    @property
    def is_meta(self) -> bool:
        return not all(has_values(part.shard) for part in self.parts)  # built on meta: not materialised yet

    def materialize(self, device, values_of) -> None:
        """Deferred initialisation (ch12): each part's meta shard made real on ``device`` (see
        :meth:`FlatPart.materialize`), the new sharded parameters put on the modules. Call it before
        the first forward (the root's replicated parameters are found then)."""
        if self.state is not None:
            raise RuntimeError("materialize an FSDP unit before its first forward")
        for part in self.parts:
            part.materialize(device, values_of)
        self.sharded = [p for part in self.parts for p in part.sharded]
        self.unbind()
        self.handle = self.parts[0].shard.new_empty(0).requires_grad_()

    # --- gather / free ------------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        return any(p.full.untyped_storage().nbytes() > 0 or p.pending is not None for p in self.parts)

    @property
    def stale(self) -> bool:
        return any(part.stale for part in self.parts)

    def issue_all_gather(self, async_op: bool) -> None:
        """Re-allocate the full buffers and all-gather the shards into them (a no-op if they hold the
        shards' current values; gathered from shards an optimizer step has changed since: again)."""
        if self.gathered and not self.stale:
            return
        self.release()
        observe.mark("all_gather", "fsdp", unit=self.name)
        observe.count("gathered_bytes", self.full_bytes, unit=self.name)
        for part in self.parts:
            part.all_gather(async_op)
            part.gathered_from = part.shard._version  # bumped by an optimizer step (the parameters view it)

    def wait(self) -> None:
        """Make sure the full buffers hold the shards' current weights, gathering now if nobody
        prefetched them (or if an optimizer step changed the shards since they were gathered)."""
        if not self.gathered or self.stale:
            self.issue_all_gather(async_op=False)
        for part in self.parts:
            part.finish()

    def free(self) -> None:
        """Reshard: drop the full buffers' storage, keep the shards."""
        for part in self.parts:
            part.full.untyped_storage().resize_(0)
            part.gathered_from = None
        observe.mark("free", "fsdp", unit=self.name)
        observe.count("gathered_bytes", -self.full_bytes, unit=self.name)

    def release(self) -> None:
        """Free a gathered unit that is not to run on these values (a prefetch it did not use, or
        weights an optimizer step has changed): its all-gather in flight finishes first."""
        if not self.gathered:
            return
        for part in self.parts:
            part.finish()
        self.free()

    def bind(self) -> list[list[nn.Parameter]]:
        """Swap in a leaf per parameter, a shaped view of its part's ``full``; return them per part."""
        leaves = [part.leaves() for part in self.parts]
        for m, a, k, i in self.slots:
            m._parameters[a] = leaves[k][i]
        return leaves

    def unbind(self) -> None:
        """Put the sharded parameters back on the modules."""
        for m, a, k, i in self.slots:
            m._parameters[a] = self.parts[k].sharded[i]

    def reduce_grads(self, leaves) -> None:
        """Reduce-scatter every part that trains (a frozen part sends nothing)."""
        for part, part_leaves in zip(self.parts, leaves):
            if any(p.requires_grad for p in part.sharded):  # the same on every rank
                part.reduce_grads(part_leaves)
        observe.mark("reduce_scatter", "fsdp", unit=self.name)


class UnitCall:
    """One call of a unit: the module's forward, where the tensors sit in (args, kwargs), the outputs."""

    def __init__(self, unit, forward, args, kwargs):
        self.unit, self.forward = unit, forward
        self.items, self.spec = tree_flatten((args, kwargs))  # the pytree's items, tensors or not
        self.tensor_at = [i for i, x in enumerate(self.items) if torch.is_tensor(x)]
        self.out_items, self.out_spec, self.out_tensor_at = None, None, None

    def tensors(self):
        return [self.items[i] for i in self.tensor_at]

    def run(self, tensors):
        items = list(self.items)
        for i, t in zip(self.tensor_at, tensors):
            items[i] = t
        args, kwargs = tree_unflatten(items, self.spec)
        out = self.forward(*args, **kwargs)
        self.out_items, self.out_spec = tree_flatten(out)
        self.out_tensor_at = [i for i, x in enumerate(self.out_items) if torch.is_tensor(x)]
        return [self.out_items[i] for i in self.out_tensor_at]

    def output(self, tensors):
        items = list(self.out_items)
        for i, t in zip(self.out_tensor_at, tensors):
            items[i] = t
        return tree_unflatten(items, self.out_spec)


class UnitFunction(torch.autograd.Function):
    """A unit as one autograd node: gather -> run -> free; gather -> backward -> reduce-scatter -> free."""

    @staticmethod
    def forward(ctx, call, handle, *tensors):
        unit, state = call.unit, call.unit.state
        ctx.outermost = state.depth == 0
        state.depth += 1
        try:
            state.enter(unit, "forward")
            inputs = [t.detach().requires_grad_(t.requires_grad) for t in tensors]
            with torch.enable_grad():
                ctx.leaves = unit.bind()  # the unit's own graph: leaves are the gathered weights
                try:
                    outs = call.run(inputs)
                finally:
                    unit.unbind()
        finally:
            state.depth -= 1
        observe.mark("forward_end", "fsdp", unit=unit.name)
        if unit.reshard_after_forward:
            unit.free()
        ctx.call, ctx.inner_outs, ctx.inner_inputs = call, outs, inputs
        ctx.set_materialize_grads(False)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grad_outs):
        unit, state = ctx.call.unit, ctx.call.unit.state
        if ctx.outermost:
            state.queue_end_of_backward()
        state.enter(unit, "backward")  # re-gathers into the storage the saved tensors view
        pairs = [(o, g) for o, g in zip(ctx.inner_outs, grad_outs) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        observe.mark("backward_end", "fsdp", unit=unit.name)
        unit.reduce_grads(ctx.leaves)
        unit.free()
        grads = tuple(x.grad if x.requires_grad else None for x in ctx.inner_inputs)
        ctx.call = ctx.leaves = ctx.inner_outs = ctx.inner_inputs = None
        return (None, None, *grads)
