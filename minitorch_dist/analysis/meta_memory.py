"""Chapter 12 — a memory meter that also runs on ``meta`` tensors: one rank's peak bytes per category,
from watching every storage being created, resized and freed.

``MemoryMeter`` (chapter 00) keys storages by address; on ``meta`` every address is 0 and there is
no allocator to ask, yet that is where a paper-scale step runs on one machine. This meter counts
the same categories -- ``parameters``, ``gradients``, ``optimizer_state``, ``activations`` -- plus
``temporaries``: whatever else the step allocated and still holds (an all-gathered FSDP unit, a
gradient bucket being reduced, an intermediate). No formula is involved.

**How it sees memory.** Inside ``with meter.track():`` a ``TorchDispatchMode`` sees every ATen op,
collectives included (``c10d`` ops dispatch too). An output the schema says aliases nothing, and
that no argument holds, is a new storage: its ``nbytes()`` is recorded under the storage's identity
``untyped_storage()._cdata`` (unique among live storages, on meta too). ``weakref.finalize`` on the
storage's Python object -- which torch keeps alive exactly as long as the storage -- says when its
last tensor or view goes. ``UntypedStorage.resize_`` is not an op (FSDP frees a gathered unit by
resizing its storage to 0, then gathers into it again), so while a meter tracks, that method is
wrapped to tell it. ``saved_tensors_hooks`` mark what autograd keeps for backward. What it does as
``MemoryMeter`` does -- find the model states, hook gradients and the optimizer step, stand in for a
saved tensor, print the table -- is their shared core, ``MeterCore``.

**How it classifies.** A storage is in the first category that applies: ``parameters`` (of
``model`` or ``optimizer``'s groups, or an ``nn.Parameter`` seen as an op's argument whose storage
was not allocated in the block), ``gradients`` (their ``.grad``), ``optimizer_state`` (tensors in
``optimizer.state``), ``activations`` (saved for backward; saved parameters and buffers are not),
``temporaries`` (allocated in the block). A storage from before the block that is none of these
(the batch, a buffer) is not counted, as in ``MemoryMeter``. An FSDP unit's gathered weights are
``nn.Parameter`` s over a buffer grown in the block: temporaries.

**When it samples.** After every op and storage resize, and when a tensor is saved, a gradient
accumulated or the optimizer steps. Totals are kept running. Which storages are ``.grad`` s (and,
inside ``step``, optimizer state) is re-read only where it matters: when some value may be a new
peak, at each gradient accumulated, around ``step`` and at the end. ``peak[c]`` is the most c held
at a sample; ``peak["total"]`` the largest simultaneous sum; ``at_peak`` its split.

**What it cannot see.** Memory that is no tensor's storage (allocator caching and fragmentation,
cuBLAS workspaces, NCCL buffers, kernels' scratch); storages made below the dispatcher (such as
``torch.tensor(data, device="meta")``); sparse tensors. A state tensor made by ``optimizer.step`` is
a temporary until the optimizer stores it (one op); a ``.grad`` assigned by hand and dropped before
any of the moments above is never seen as a gradient. On ``meta``, ops are what the meta kernels
choose: ``scaled_dot_product_attention`` takes its math path, materialising the T x T scores a flash
kernel never holds (for a like-for-like CPU run use ``sdpa_kernel(SDPBackend.MATH)``).
"""
from __future__ import annotations

import contextlib
import operator
import threading
import weakref

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .memory_core import MeterCore, SavedAlias, storage_of
from .meters import CATEGORIES

STEP_CATEGORIES = (*CATEGORIES, "temporaries")
_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)  # torch.tensor(...)
_GRAD = operator.attrgetter("grad")


def _arg_tensors(args, kwargs):
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


class _Store:
    """What the meter knows of one live storage."""

    __slots__ = ("key", "nbytes", "cat", "inside", "saved", "finalizer")

    def __init__(self, key: int, nbytes: int, inside: bool):
        self.key, self.nbytes, self.inside = key, nbytes, inside
        self.cat, self.saved, self.finalizer = None, 0, None


class _SeeOps(TorchDispatchMode):
    def __init__(self, meter: MetaMemoryMeter):
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.meter._after_op(func, args, kwargs, out)
        return out


# Meters tracking now; while there is one, UntypedStorage.resize_ tells them (it is not an ATen op).
_active: list = []
_patch_lock = threading.Lock()
_plain_resize = torch.UntypedStorage.resize_
_own_resize = vars(torch.UntypedStorage).get("resize_")  # None: inherited from the C++ base class


def _resize_and_tell(storage, size):
    out = _plain_resize(storage, size)
    for m in list(_active):
        m._on_resize(storage)
    return out


@contextlib.contextmanager
def _told_of_resizes(meter):
    with _patch_lock:
        if not _active:
            torch.UntypedStorage.resize_ = _resize_and_tell
        _active.append(meter)
    try:
        yield
    finally:
        with _patch_lock:
            _active.remove(meter)
            if not _active and _own_resize is None:
                del torch.UntypedStorage.resize_
            elif not _active:
                torch.UntypedStorage.resize_ = _own_resize


class MetaMemoryMeter(MeterCore):
    """Peak bytes of one step per category, on any device, ``meta`` included.

    >>> meter = MetaMemoryMeter(model, opt)
    >>> with meter.track():
    ...     model(x, y)[1].backward(); opt.step()
    >>> meter.peak["temporaries"], meter.peak["total"], meter.at_peak
    >>> meter.report()

    Categories: ``STEP_CATEGORIES`` (see the module docstring). ``current()`` gives the bytes held
    now while tracking, and those at the end of the block after it. On CPU, ``parameters``,
    ``gradients``, ``optimizer_state`` and ``activations`` agree with :class:`MemoryMeter`'s;
    ``peak["total"]`` here also includes temporaries. One meter's ``track()`` at a time records
    activations: saved-tensor hooks do not nest (the innermost wins).
    """

    def __init__(self, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None):
        super().__init__(model, optimizer)
        self._generation, self._tracking = 0, False
        self._reset()

    def _reset(self) -> None:
        for rec in getattr(self, "_recs", {}).values():
            rec.finalizer.detach()
        self._generation += 1
        self._recs: dict[int, _Store] = {}
        self._now = dict.fromkeys(STEP_CATEGORIES, 0)
        self.peak = dict.fromkeys((*STEP_CATEGORIES, "total"), 0)
        self.at_peak, self.final = dict(self.peak), None
        self._plist, self._param_keys, self._buffer_keys = [], set(), set()
        # per parameter: id(p.grad) at the last sample, and its storage; storage -> how many use it
        self._grad_ids, self._grad_key, self._grad_count = [], [], {}
        self._state_lens, self._state_keys, self._in_step = [], set(), False

    # --- bookkeeping: one record per storage, running totals per category -------------------------
    def _see(self, s: torch.UntypedStorage, inside: bool) -> _Store:
        """The record of storage ``s``, made (uncounted until classified) if new."""
        rec = self._recs.get(s._cdata)
        if rec is None:
            rec = self._recs[s._cdata] = _Store(s._cdata, s.nbytes(), inside)
            rec.finalizer = weakref.finalize(s, self._free, s._cdata, self._generation)
        return rec

    def _category(self, rec: _Store) -> str | None:
        for cat, keys in (("parameters", self._param_keys), ("gradients", self._grad_count),
                          ("optimizer_state", self._state_keys)):
            if rec.key in keys:
                return cat
        return "activations" if rec.saved else "temporaries" if rec.inside else None

    def _classify(self, rec: _Store | None) -> None:
        cat = self._category(rec) if rec is not None else None
        if rec is not None and cat != rec.cat:
            if rec.cat is not None:
                self._now[rec.cat] -= rec.nbytes
            if cat is not None:
                self._now[cat] += rec.nbytes
            rec.cat = cat

    def _resize(self, rec: _Store, nbytes: int) -> None:
        if nbytes > rec.nbytes:
            rec.inside = True  # the new bytes were allocated in the block
        if rec.cat is not None:
            self._now[rec.cat] += nbytes - rec.nbytes
        rec.nbytes = nbytes
        self._classify(rec)

    def _free(self, key: int, generation: int) -> None:
        with self._lock:
            if generation != self._generation:
                return
            rec = self._recs.pop(key, None)
            if rec is not None and rec.cat is not None:
                self._now[rec.cat] -= rec.nbytes
            self._grad_count.pop(key, None)  # an address may be reused: forget it
            self._state_keys.discard(key)

    # --- events ---------------------------------------------------------------------------------------
    def _after_op(self, func, args, kwargs, out) -> None:
        """Record the storages an op's results live in: a new one (the schema says it aliases nothing,
        and no argument holds it) is allocated in the block; a known one may have changed size."""
        returns, ins = func._schema.returns, None
        outs = out if len(returns) > 1 else (out,)
        with self._lock:
            for o, r in zip(outs, returns):
                for t in (o if isinstance(o, (list, tuple)) else (o,)):
                    s = storage_of(t) if isinstance(t, torch.Tensor) else None
                    rec = self._recs.get(s._cdata) if s is not None else None
                    if rec is not None and s.nbytes() != rec.nbytes:  # resize_, set_, a grown out= tensor
                        self._resize(rec, s.nbytes())
                    elif rec is None and s is not None and (r.alias_info is None or func in _LIFTS):
                        if ins is None:  # c10d ops return their arguments with no alias annotation
                            ins = {a._cdata for a in map(storage_of, _arg_tensors(args, kwargs))
                                   if a is not None}
                        if s._cdata not in ins or func in _LIFTS:
                            self._classify(self._see(s, inside=True))
            for a in _arg_tensors(args, kwargs):
                if isinstance(a, nn.Parameter):
                    self._add_param(a, seen=True)
            self._sample()

    def _add_param(self, p: torch.Tensor, seen: bool = False) -> None:
        """Count ``p``'s storage as parameters. One ``seen`` as an op's argument is not a parameter if
        its storage was allocated in the block (an FSDP unit's gathered weights, bound while it runs)."""
        s = storage_of(p)
        rec = self._recs.get(s._cdata) if s is not None else None
        if s is None or seen and (s._cdata in self._param_keys or rec is not None and rec.inside):
            return
        self._plist.append(p)
        self._grad_ids.append(id(None))
        self._grad_key.append(None)
        self._param_keys.add(s._cdata)
        self._classify(self._see(s, inside=False))

    def _on_resize(self, s: torch.UntypedStorage) -> None:
        with self._lock:
            rec = self._recs.get(s._cdata)
            if rec is not None:
                self._resize(rec, s.nbytes())
            elif s.nbytes() > 0:
                self._classify(self._see(s, inside=True))
            self._sample()

    def _pack(self, t: torch.Tensor):
        base = t._base if t._base is not None else t
        s = storage_of(t)
        if s is None or isinstance(t, nn.Parameter) or isinstance(base, nn.Parameter):
            return t  # a parameter (or a view of one) saved is not an activation
        with self._lock:
            if s._cdata in self._param_keys or s._cdata in self._buffer_keys:
                return t
            rec = self._see(s, inside=False)
            rec.saved += 1
            self._classify(rec)
            self._sample()
        key, generation = s._cdata, self._generation
        return SavedAlias(t.detach(), lambda: self._unsave(key, generation))

    def _unsave(self, key: int, generation: int) -> None:
        with self._lock:
            rec = self._recs.get(key) if generation == self._generation else None
            if rec is not None:
                rec.saved -= 1
                self._classify(rec)

    # --- model states: read at each sample, changes applied to the records ----------------------------
    def _scan_grads(self) -> None:
        ids = list(map(id, map(_GRAD, self._plist)))
        if ids == self._grad_ids:
            return
        for i, (new, old) in enumerate(zip(ids, self._grad_ids)):
            if new == old:
                continue
            was, g = self._grad_key[i], self._plist[i].grad
            s = storage_of(g) if g is not None else None
            self._grad_key[i] = s._cdata if s is not None else None
            if s is not None:
                self._grad_count[s._cdata] = self._grad_count.get(s._cdata, 0) + 1
                self._classify(self._see(s, inside=False))
            if was is not None and was in self._grad_count:
                self._grad_count[was] -= 1
                if self._grad_count[was] == 0:
                    del self._grad_count[was]
                self._classify(self._recs.get(was))
        self._grad_ids = ids

    def _scan_state(self, full: bool) -> None:
        """Optimizer state tensors: every one when ``full``, else those of the states that grew."""
        maps = {id(o.state): o.state for o in self._optimizers()}.values()  # a sharded one shares its inner's
        states = [st for m in maps for st in m.values()]
        lens = list(map(len, states))
        if not full and lens == self._state_lens:
            return
        old, self._state_lens = self._state_lens, lens
        keys = set()
        for i, st in enumerate(states):
            if full or i >= len(old) or old[i] != lens[i]:
                for t in st.values():
                    s = storage_of(t) if isinstance(t, torch.Tensor) else None
                    if s is not None:
                        keys.add(s._cdata)
                        self._see(s, inside=False)
        changed = keys ^ self._state_keys if full else keys - self._state_keys
        self._state_keys = keys if full else self._state_keys | keys
        for k in changed:
            self._classify(self._recs.get(k))

    def _sample(self, force: bool = False) -> None:
        """Update the peaks. Reading the ``.grad`` s and optimizer states only moves bytes between
        categories, so it is done when some value may be a new peak (or when ``force``)."""
        if not self._tracking:
            return
        with self._lock:
            now, peak = self._now, self.peak
            if not force and all(v <= peak[k] for k, v in now.items()) and sum(now.values()) <= peak["total"]:
                return
            self._scan_grads()
            if self._in_step:
                self._scan_state(full=False)
            for k, v in now.items():
                if v > peak[k]:
                    peak[k] = v
            total = sum(now.values())
            if total > peak["total"]:
                peak["total"] = total
                self.at_peak = dict(now, total=total)

    def _step_event(self, starting: bool) -> None:
        with self._lock:
            self._in_step = starting
            self._scan_state(full=True)
            self._sample(force=True)

    # --- the public face ----------------------------------------------------------------------------
    def _start(self) -> list:
        """Register the model states as they are now; return the hook handles."""
        self._reset()
        for p in self._params():
            self._add_param(p)
        buffers = self.model.buffers() if self.model is not None else ()
        self._buffer_keys = {s._cdata for s in map(storage_of, buffers) if s is not None}
        self._tracking = True
        self._scan_state(full=True)
        handles = self._hooks(self._plist, lambda: self._sample(force=True), lambda: self._step_event(False),
                              before_step=lambda: self._step_event(True))
        self._sample(force=True)
        return handles

    @contextlib.contextmanager
    def track(self):
        """Measure the block (peaks reset at entry); afterwards ``final`` holds the bytes at its end."""
        if self._tracking:
            raise RuntimeError("MetaMemoryMeter.track() is already active; use a second meter to nest")
        handles = self._start()
        try:
            with _told_of_resizes(self), _SeeOps(self), \
                    torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            with self._lock:
                self._in_step = False
                self._scan_state(full=True)
                self._sample(force=True)
                self._tracking = False
                self.final = dict(self._now, total=sum(self._now.values()))
                for h in handles:
                    h.remove()
                for rec in self._recs.values():  # stop following the storages
                    rec.finalizer.detach()
                self._recs, self._plist = {}, []

    def current(self) -> dict[str, int]:
        """Bytes per category held now (while tracking) or at the end of the last block."""
        if not self._tracking:
            return dict(self.final or dict.fromkeys((*STEP_CATEGORIES, "total"), 0))
        with self._lock:
            self._sample(force=True)  # read the .grads and states now
            return dict(self._now, total=sum(self._now.values()))

    def report(self, unit: str = "MiB") -> str:
        """A table: per category the peak, the split at the peak of the total, and the bytes now
        (``unit``: B, KiB, MiB or GiB)."""
        return self._table((*STEP_CATEGORIES, "total"),
                           {"peak": self.peak, "at peak": self.at_peak, "now": self.current()}, unit)
