"""Chapter 06 — ZeRO stages 1 and 2 as an optimizer: ``ShardedOptimizer`` wraps any elementwise
``torch.optim`` optimizer so that each of the n data-parallel ranks keeps and updates only 1/n of
the optimizer state (Rajbhandari et al. 2020, §5.1 P_os) and, at stage 2, of the gradients (§5.2
P_g, reduce-scattered bucket by bucket during backward); the shape of torch's
``ZeroRedundancyOptimizer``::

    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=2, lr=1e-3)
    opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step()    # x, y: this rank's rows

Each rank feeds its rows of the global batch; gradients are *averaged* over the group, so n ranks
take the step of one process on the whole batch. Stage 0 (every rank keeps everything, one
all-reduce) is the baseline the other stages are measured against.

**Layout** (:mod:`.partition`). The parameters (every group) move into one flat buffer of one
dtype, rank 0's values broadcast to all; rank r owns the interleaved elements ``r, r+n, ...``.
Per step: stage 1 reduce-scatters the flat gradient in ``step()``; stage 2 has reduce-scattered
it during backward (no rank ever holds the full gradient); each rank updates its elements; one
all-gather (per bucket) brings every rank's update back into every replica. Wire bytes, ring
model (§7.2): reduce-scatter + all-gather ``(n-1)/n * 4Psi'`` each, the 2Psi of plain data
parallelism; plus a tiny all-reduce of one byte per parameter tensor (below).

**A parameter with no gradient is not touched.** A torch optimizer skips a parameter whose
``grad`` is None: no weight decay, no momentum, no step count (a frozen parameter, a branch the
batch did not use). A flat buffer cannot say "no gradient" -- it holds zeros -- and AdamW moves a
parameter on zero gradients (decay, old momentum). So the inner optimizer is given *pieces*:
one parameter per tensor, aliasing that tensor's elements in this rank's shard. Its state is then
per tensor, exactly as in one process (AdamW's per-tensor ``step`` and bias correction included),
and before each update every rank agrees which tensors had a gradient: a one-byte-per-tensor
"has grad" mask, all-reduced with MAX (a tensor with a gradient on *any* rank takes the averaged
step, as torch DDP's ``find_unused_parameters`` decides with its per-parameter "locally used"
map). Pieces of tensors without one get ``grad = None`` and the inner optimizer skips them; their
elements are all-gathered back unchanged, bit for bit. The price: one tiny collective per step,
and state per tensor (the inner optimizer must be elementwise: SGD, Adam, AdamW, RMSprop, ...;
not one that uses a whole tensor's norm, such as LAMB or Adafactor).

**State dict.** ``state_dict()`` is *consolidated* (a collective): the dict ``optimizer_cls``
would hold in one process -- per-tensor state at full size, torch's format -- so it loads into a
plain optimizer, and ``load_state_dict`` takes one from any world size or a plain optimizer.

**With a loss scaler** (chapter 08, :class:`..mixed_precision.DynamicLossScaler`). At stage 2 no
``p.grad`` exists at step time, and at every stage a rank sees only its own gradients: an inf in one
rank's shard is invisible to the others. ``grads_to_step()`` names the tensors to unscale and check,
and the group over which the skip-or-step verdict is agreed (one MAX all-reduce of one flag).

One dtype: mixed dtypes raise (the fix: cast the model to one dtype, or one ShardedOptimizer per
dtype). ``offload="cpu"|"disk"`` steps the shard with :class:`.offload.OffloadedOptimizer`.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from ...runtime import comm, require_process_group
from ...runtime.devices import same_memory, values_or
from .offload import OffloadedOptimizer
from .partition import FlatPartition, bucket_ranges

__all__ = ["ShardedOptimizer", "STAGES"]

STAGES = (0, 1, 2)


def _check_arguments(stage, optimizer_cls, offload, bucket_cap_mb) -> None:
    if isinstance(stage, bool) or stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES} here, got {stage!r} (1: shard the optimizer "
                         f"state, 2: and the gradients; stage 3 shards the parameters too: use "
                         f"fsdp.fully_shard)")
    if not callable(optimizer_cls):
        raise TypeError(f"optimizer_cls must be a torch.optim.Optimizer class (or a function of the "
                        f"parameter groups returning one), got {optimizer_cls!r}")
    if offload not in (None, "cpu", "disk"):
        raise ValueError(f"offload must be None, 'cpu' or 'disk', got {offload!r}")
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0 (or None for one bucket), got {bucket_cap_mb!r}")


def _check_flat(params) -> None:
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        got = sorted(f"{d} on {dev}" for d, dev in kinds)
        raise ValueError(f"ShardedOptimizer keeps its parameters in one flat buffer of one dtype on one "
                         f"device, got {got}: cast the model to one dtype (e.g. model.float()), or build "
                         f"one ShardedOptimizer per dtype")
    if len({id(p) for p in params}) != len(params):
        raise ValueError("a parameter is listed twice: pass each tensor (a tied weight too) once")


def _options(group: dict) -> dict:
    """A parameter group's options: everything but its ``params``."""
    return {k: v for k, v in group.items() if k != "params"}


def _elementwise(key, value, param) -> bool:
    """A per-element state tensor (shaped like its parameter), as opposed to a scalar such as ``step``."""
    return torch.is_tensor(value) and value.shape == param.shape and (param.dim() > 0 or key != "step")


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-DP over ``group``: ``optimizer_cls(param_groups, **defaults)`` run on this rank's 1/n.

    ``params``: tensors or parameter groups (dicts with per-group options, e.g. ``lr``); they become
    views of one flat buffer. ``stage``: 1 (optimizer state sharded), 2 (and gradients, reduced
    during backward in buckets of ``bucket_cap_mb`` MiB; None: one bucket), 0 (neither: the
    baseline). ``param_groups`` are the caller's groups (an LR scheduler may edit them); ``optim``
    is the local optimizer over this rank's pieces and ``state`` its state (this rank's shard).
    ``offload="cpu"|"disk"`` keeps the master shard and state off the device (``offloaded``).
    Attributes: ``partition`` (:class:`.partition.FlatPartition`), ``buckets``, ``stage``, ``group``.
    Every rank of ``group`` builds it, steps it and saves it together: those are collectives.
    """

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                 optimizer_cls: Callable[..., torch.optim.Optimizer], *, stage: int = 1,
                 group: dist.ProcessGroup | None = None, bucket_cap_mb: float | None = 1.0,
                 offload: str | None = None, offload_dir: str | os.PathLike | None = None,
                 **defaults: Any) -> None:
        _check_arguments(stage, optimizer_cls, offload, bucket_cap_mb)
        require_process_group("ShardedOptimizer")
        self._built = False
        super().__init__(params, defaults)
        flat = [p for g in self.param_groups for p in g["params"]]
        _check_flat(flat)
        self.stage, self.group = stage, group
        self.partition = part = FlatPartition(flat, group, replicate=stage == 0)
        self._group_of = [i for i, g in enumerate(self.param_groups) for _ in g["params"]]
        cap = None if stage < 2 or bucket_cap_mb is None else bucket_cap_mb * 2 ** 20 / flat[0].element_size()
        self.buckets = bucket_ranges(part.flat.padded_numel, part.n, cap)
        self._mask, self._got = [True] * len(flat), [False] * len(flat)
        self.offloaded = None
        if offload is None:
            self.optim = self._local_optimizer(part.shard, optimizer_cls, defaults)
        else:
            build = lambda ps: self._local_optimizer(ps[0], optimizer_cls, defaults)
            self.offloaded = OffloadedOptimizer(part.shard, build, where=offload, directory=offload_dir)
            self.optim = self.offloaded.optimizer
        self.state = self.optim.state  # this rank's shard of the state, keyed by its pieces
        for mine, local in zip(self.param_groups, self.optim.param_groups):
            for k, v in local.items():  # show the inner optimizer's defaults (betas, eps, ...) too
                if k != "params":
                    mine.setdefault(k, v)
        self._index = {id(p): i for i, p in enumerate(flat)}
        trained = [p for p in flat if p.requires_grad]
        self.flat_grad: torch.Tensor | None
        if stage < 2:  # gradients are gathered into one flat buffer (DDP's gradient_as_bucket_view)
            self.flat_grad = part.flat.empty()
            self._grad_views = part.flat.views(self.flat_grad)
            self._hooks = [p.register_post_accumulate_grad_hook(self._into_flat_grad) for p in trained]
        else:
            self.flat_grad = None  # never exists: each bucket is reduced and dropped during backward
            self._plan_buckets(trained)
            self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in trained]
        self._built = True

    def _local_optimizer(self, shard: torch.Tensor, optimizer_cls, defaults) -> torch.optim.Optimizer:
        """``optimizer_cls`` over this rank's pieces of ``shard``, grouped as the caller's groups."""
        self._pieces = self.partition.pieces(shard)
        self._master = shard  # whose ``.grad`` the pieces' gradients are cut from
        groups = [_options(g) | {"params": []} for g in self.param_groups]
        for i, piece in zip(self._group_of, self._pieces):
            groups[i]["params"].append(piece)
        opt = optimizer_cls(groups, **defaults)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer_cls must build a torch.optim.Optimizer, got {type(opt).__name__}")
        opt.register_step_pre_hook(lambda *_: self._give_piece_grads())
        return opt

    def _give_piece_grads(self) -> None:
        """Each piece's gradient: its slice of the shard's gradient, or None if no rank had one."""
        g = self._master.grad
        for piece, (a, z), has in zip(self._pieces, self.partition.spans, self._mask):
            piece.grad = g[a:z] if has and g is not None else None

    @property
    def pieces(self) -> list:
        """The inner optimizer's parameters: per tensor, this rank's elements of it (its *piece*; where
        it sits in the tensor: ``partition.piece_slice(i)``)."""
        return self._pieces

    def add_param_group(self, param_group: dict) -> None:
        if self._built:
            raise NotImplementedError("ShardedOptimizer partitions its parameters once, when it is built: "
                                      "pass every parameter group to the constructor")
        super().add_param_group(param_group)

    # --- gradients: stages 0 and 1, one flat buffer reduced in step() ------------------------------
    def _into_flat_grad(self, p: torch.Tensor) -> None:
        """A gradient arrived: keep it in the flat gradient buffer, as a view (nothing if it is one)."""
        v = self._grad_views[self._index[id(p)]]
        if p.grad is not None and not same_memory(p.grad, v):  # set: a post-accumulate hook
            v.copy_(p.grad)  # autograd made a fresh gradient (p.grad was None): it starts the sum
            p.grad = v

    def _reduce_flat(self) -> None:
        for p, v in zip(self.partition.flat.params, self._grad_views):
            if p.grad is None:
                v.zero_()  # no gradient on this rank: it adds nothing to the average
            elif not same_memory(p.grad, v):
                v.copy_(p.grad)  # set by hand, not by backward
                p.grad = v
        assert self.flat_grad is not None  # stages 0 and 1 always have one
        self.partition.shard.grad = self.partition.reduce(self.flat_grad)

    # --- gradients: stage 2, bucket by bucket during backward (§5.2) -------------------------------
    def _plan_buckets(self, trained) -> None:
        spans = self.partition.flat.spans()  # each tensor's [start, end) in the flat buffer
        waits = {self._index[id(p)] for p in trained}  # a frozen tensor never produces a gradient
        # which tensors each bucket waits for, and the buckets of each tensor (ascending)
        self._members = [[i for i, (a, z) in enumerate(spans) if a < hi and lo < z]
                         for lo, hi in self.buckets]
        self._wait_for = [sum(i in waits for i in ms) for ms in self._members]
        self._buckets_of = [[b for b, ms in enumerate(self._members) if i in ms] for i in range(len(spans))]
        self._in_flight: tuple[int, torch.Tensor, torch.Tensor, Any] | None  # bucket, chunk, sent, work
        self._in_backward, self._in_flight, self._paused = False, None, False

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Stage 2: inside the block backward reduces nothing; gradients accumulate in each ``.grad``
        (DDP's ``no_sync``: several microbatches, one reduction). :meth:`reduce_accumulated` then
        reduce-scatters them once. Stages 0 and 1 reduce in :meth:`step` anyway: nothing to pause."""
        if self.stage < 2:
            yield
            return
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def reduce_accumulated(self) -> None:
        """Stage 2: reduce-scatter the gradients accumulated under :meth:`no_sync`, bucket by bucket,
        freeing each full gradient as its last bucket goes (the memory of one backward's reduction).
        The gradients are passed through autograd once (``torch.autograd.backward`` on the parameters
        themselves), so the bucket hooks fire in the order and with the overlap of a real backward."""
        if self.stage < 2:
            return
        params = [p for p in self.partition.flat.params if p.grad is not None]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if params:
            torch.autograd.backward(params, grads)

    def _on_grad(self, p: torch.Tensor) -> None:
        """A gradient is ready: count it towards its buckets, launch every bucket now complete."""
        if self._paused:  # under no_sync: it stays in p.grad, accumulating
            return
        if not self._in_backward:  # the first gradient of this backward
            self._in_backward = True
            self._waiting = list(self._wait_for)
            self._next = len(self.buckets) - 1  # launch order: last bucket first, the same on every rank
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        i = self._index[id(p)]
        self._got[i] = True
        for b in self._buckets_of[i]:
            self._waiting[b] -= 1
        self._launch_ready()

    def _launch_ready(self, flush: bool = False) -> None:
        while self._next >= 0 and (flush or self._waiting[self._next] == 0):
            self._launch(self._next)
            self._next -= 1

    def _launch(self, b: int) -> None:
        """Copy bucket b's gradients out of the parameters, free them, start its reduce-scatter."""
        lo, hi = self.buckets[b]
        flat = self.partition.flat
        g = self.partition.flat_param.new_zeros(hi - lo)  # zeros: padding, tensors without a gradient
        spans = flat.spans(lo, 1, hi - lo)  # each tensor's [a, z) in the bucket
        for i in self._members[b]:
            p, (a, z) = flat.params[i], spans[i]
            if p.grad is None:
                continue
            g[a:z].copy_(p.grad.reshape(-1)[flat.element_of(i, a, lo):flat.element_of(i, z, lo)])
            if b == self._buckets_of[i][0]:  # its lowest bucket goes last: the gradient is no longer needed
                p.grad = None
        send = self.partition.rank_major(g)
        del g  # only the rank-major copy goes on the wire
        mine = send.new_empty((hi - lo) // self.partition.n)
        self._finish()  # at most one reduce-scatter in flight: the memory stays one bucket or two
        work = comm.reduce_scatter(mine, send, group=self.group, async_op=True)
        self._in_flight = (b, mine, send, work)

    def _finish(self) -> None:
        """Wait for the bucket in flight; add its averaged chunk into this rank's gradient shard."""
        if self._in_flight is None:
            return
        b, mine, _send, work = self._in_flight  # ``_send`` kept alive until the collective is done
        self._in_flight = None
        work.wait()
        shard, n = self.partition.shard, self.partition.n
        if shard.grad is None:
            shard.grad = mine.new_zeros(self.partition.flat.shard_numel)
            if self.offloaded is None:
                self._give_piece_grads()  # the pieces' gradients are views of it from now on
        lo, hi = self.buckets[b]
        shard.grad[lo // n:hi // n].add_(mine.div_(n))  # several backwards before a step accumulate

    def _end_of_backward(self) -> None:
        """Launch what is left (buckets with a tensor that got no gradient) and wait for it."""
        self._launch_ready(flush=True)
        self._finish()
        self._in_backward = False

    # --- the step ------------------------------------------------------------------------------------
    def grads_to_step(self) -> tuple[list[torch.Tensor], object]:
        """``(gradients, group)``: the gradient tensors :meth:`step` will apply, where they are now,
        and the group whose ranks step together (a loss scaler unscales and checks these, see above).

        Stage 2: this rank's reduced gradient shard, ``partition.shard.grad`` ([] before a backward).
        Stages 0 and 1: each tensor's local gradient (a view of ``flat_grad``; not ``flat_grad`` itself,
        where a tensor without a gradient this step holds old values until ``step`` zeroes them),
        reduced inside ``step``: mean_r(g_r/S) = mean_r(g_r)/S, exactly for a power-of-two S.
        """
        if self.stage == 2:
            g = self.partition.shard.grad
            return ([] if g is None else [g]), self.group
        return [p.grad for p in self.partition.flat.params if p.grad is not None], self.group

    def _agreed_mask(self) -> list[bool]:
        """Which tensors have a gradient on at least one rank: a MAX all-reduce of one byte each."""
        flat = self.partition.flat
        local = self._got if self.stage == 2 else [p.grad is not None for p in flat.params]
        mask = torch.tensor(local, dtype=torch.uint8, device=self.partition.flat_param.device)
        comm.all_reduce(mask, op=dist.ReduceOp.MAX, group=self.group)
        return values_or(mask.bool(), list(local))  # a dry run agrees on nothing: this rank's flags stand in

    @torch.no_grad()
    def step(self,  # type: ignore[override]  # torch.optim.Optimizer's two overloads, as one signature
             closure: Callable[[], float] | None = None) -> float | None:
        """Agree on the tensors with a gradient, reduce (stages 0/1), update this rank's pieces of
        those, all-gather (stages 1/2). Without a gradient on any rank nothing happens at all."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        mask = self._agreed_mask()
        if not any(mask):
            return loss
        if self.stage < 2:
            self._reduce_flat()
        elif self.partition.shard.grad is None:
            raise RuntimeError("stage 2 reduces gradients during backward, and this rank saw none: call "
                               "loss.backward() on every rank before step()")
        self._mask = mask
        for mine, local in zip(self.param_groups, self.optim.param_groups):  # an LR scheduler edits ours
            local.update(_options(mine))
        if self.offloaded is not None:
            assert self.partition.shard.grad is not None  # reduced above (stages 0, 1) or checked (2)
            self.offloaded.step(self.partition.shard.grad)
        else:
            self.optim.step()
        if self.stage > 0:
            self.partition.all_gather(self.buckets)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's: gradients to None (the flat buffers stay allocated), or existing ones zeroed."""
        shard = self.partition.shard
        if set_to_none:
            shard.grad = None
            for t in (*self.partition.flat.params, *self._pieces):
                t.grad = None
            self._got = [False] * len(self._got)
        else:
            for t in (shard, *self.partition.flat.params):
                if t.grad is not None:
                    t.grad.zero_()
        self._mask = [True] * len(self._mask)

    # --- saving ------------------------------------------------------------------------------------
    @torch.no_grad()
    def state_dict(self) -> dict:
        """The consolidated state dict (a collective: every rank calls it and gets the whole): what
        ``optimizer_cls`` holds in one process -- ``{"state": {index: {key: full tensor or scalar}},
        "param_groups": [{options, "params": [indices]}]}``, tensors numbered across the groups."""
        part = self.partition
        local = [self.optim.state.get(piece, {}) for piece in self._pieces]
        keys = sorted({k for s in local for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0})
        full: dict = {i: {} for i, s in enumerate(local) if s}
        for key in keys:  # one all-gather per per-element state (exp_avg, exp_avg_sq, momentum_buffer, ...)
            have = [(i, s[key]) for i, s in enumerate(local) if key in s]
            values = have[0][1].new_zeros(part.shard.numel())
            for i, v in have:
                if v.shape != self._pieces[i].shape:
                    raise ValueError(f"state {key!r} of shape {tuple(v.shape)} is not per element (its piece "
                                     f"has {tuple(self._pieces[i].shape)}): ShardedOptimizer needs an "
                                     f"elementwise optimizer (SGD, Adam, AdamW, ...)")
                a, z = part.spans[i]
                values[a:z] = v
            whole = part.gather(values)
            for i, _ in have:
                full[i][key] = whole[i].to(have[0][1].device)
        for i, s in enumerate(local):
            for key, v in s.items():
                if key not in keys:  # scalars (Adam's step), the same on every rank
                    full[i][key] = v.clone() if torch.is_tensor(v) else v
        groups, start = [], 0
        for g in self.param_groups:
            indices = list(range(start, start + len(g["params"])))
            groups.append(_options(g) | {"params": indices})
            start += len(g["params"])
        return {"state": full, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated state dict (from :meth:`state_dict` at any world size, or from a plain
        ``optimizer_cls`` over the same parameter groups): every rank keeps its pieces of it."""
        groups = state_dict["param_groups"]
        saved_sizes, sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in self.param_groups]
        if saved_sizes != sizes:
            raise ValueError(f"the state dict has groups of {saved_sizes} tensors, this optimizer {sizes}: "
                             f"build it with the same parameter groups as the optimizer that was saved")
        saved = [i for g in groups for i in g["params"]]
        params, part = self.partition.flat.params, self.partition
        state = {}
        for pos, i in enumerate(saved):
            s = state_dict["state"].get(i, state_dict["state"].get(str(i)))
            if s is None:
                continue
            state[pos] = {k: part.own_elements(pos, v).clone() if _elementwise(k, v, params[pos])
                          else (v.clone() if torch.is_tensor(v) else v) for k, v in s.items()}
        for mine, g in zip(self.param_groups, groups):
            mine.update(_options(g))
        local_groups = [_options(g) | {"params": []} for g in self.param_groups]
        for j, gi in enumerate(self._group_of):
            local_groups[gi]["params"].append(j)
        self.optim.load_state_dict({"state": state, "param_groups": local_groups})
        self.state = self.optim.state

    @torch.no_grad()
    def init_state(self) -> None:
        """Create the inner optimizer's state (zeros) without moving a parameter, as a step with zero
        gradients and learning rate 0 does; nothing happens if there is state already. A checkpoint
        loads into the state in place (chapter 13), so it must exist before the first step."""
        if self.optim.state or self.offloaded is not None:
            return
        shard = self.partition.shard
        shard.grad = torch.zeros_like(shard)
        self._mask = [True] * len(self._mask)  # every piece gets its slice of the zero gradient
        lrs = [g.get("lr") for g in self.optim.param_groups]
        for g in self.optim.param_groups:
            if "lr" in g:
                g["lr"] = 0.0
        try:
            self.optim.step()
        finally:
            for g, lr in zip(self.optim.param_groups, lrs):
                if lr is not None:
                    g["lr"] = lr
            self.zero_grad()

    def close(self) -> None:
        """Done training: remove the gradient hooks from the parameters (a new optimizer may then be
        built on them) and release the offloaded master and state (files, with ``offload="disk"``)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self.offloaded is not None:
            self.offloaded.close()

    def __repr__(self) -> str:
        inner = type(self.optim).__name__
        return (f"ShardedOptimizer({inner}, stage={self.stage}, {len(self.param_groups)} groups, "
                f"{self.partition!r})")
