"""Chapter 00 — measure what a training step costs: bytes by category (``MemoryMeter``), seconds
(``Timer``), and the bytes an eager op sequence moves through memory (``ByteCounter``, chapter 11).

Every memory claim in the course comes from ``MemoryMeter``. It splits a step's memory the way
the ZeRO paper does (Rajbhandari et al. 2020, §3): *model states* -- parameters, gradients,
optimizer state -- and *residual states*, chiefly activations.

Activations are the tensors autograd saves for backward: Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", §4) define them as the tensors created in
the forward pass that back-propagation needs -- not parameters or optimizer state, but e.g. the
dropout mask. Temporaries that die inside the forward pass are not activations: they are freed before the next
layer runs. So activation memory is measured exactly where autograd keeps it, with
``torch.autograd.graph.saved_tensors_hooks``: the pack hook sees every tensor saved for backward,
and the packed object lives exactly as long as autograd keeps the saved tensor. This works on any
device, CPU included, with no allocator statistics.

Bytes are counted by *storage*, not by tensor: two views of one buffer (q, k, v split from one
projection; a ReLU output saved by the ReLU and by the next Linear) are one allocation, and a
tied embedding/unembedding weight is one parameter. A view keeps its whole storage alive, so
the whole storage is counted.

On CUDA the meter also reads the caching allocator's high-water mark
(``torch.cuda.max_memory_allocated``) as ``peak["cuda_peak_allocated"]``: it includes what the
categories miss (temporaries, workspaces, fragmentation inside blocks), so the gap between it and
``peak["total"]`` is itself a lesson.

:class:`.memory_core.MeterCore` is what this meter and chapter 12's ``MetaMemoryMeter`` share: the
model states' tensors, the hooks at the moments memory may peak, the saved-tensor stand-in, the table.
``Timer`` reads the course's one clock (:mod:`..runtime.timing`).
"""
from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..runtime.timing import sync, timed_runs
from .memory_core import MeterCore, SavedAlias, storage_of

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations")


def _storage(t: torch.Tensor) -> tuple[tuple, int] | None:
    """(key, nbytes) of the storage behind ``t``; None for an empty or storage-less tensor."""
    s = storage_of(t)
    if s is None:
        n = t.numel() * t.element_size()
        return ((str(t.device), "id", id(t)), n) if n else None
    if s.nbytes() == 0:
        return None
    # Every meta storage sits at address 0: tell them apart by the storage itself.
    where = s._cdata if t.device.type == "meta" else s.data_ptr()
    return (str(t.device), where), s.nbytes()


def _tensors(obj: Any) -> Iterable[torch.Tensor]:
    """Every tensor inside ``obj`` (a tensor, or lists / tuples / dicts / sets of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            yield from _tensors(v)


def _unique_bytes(tensors: Iterable[torch.Tensor], seen: set) -> int:
    """Bytes of the storages behind ``tensors`` not already in ``seen`` (which is updated)."""
    total = 0
    for t in tensors:
        st = _storage(t)
        if st is not None and st[0] not in seen:
            seen.add(st[0])
            total += st[1]
    return total


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the unique storages behind ``tensors`` (a tensor or a nested list/dict of them).

    Views and tied tensors share a storage and are counted once; a view counts its whole storage,
    because that is what it keeps alive.
    """
    return _unique_bytes(_tensors(tensors), set())


class MemoryMeter(MeterCore):
    """Peak and current bytes of parameters, gradients, optimizer state and activations.

    >>> meter = MemoryMeter(model, opt)
    >>> with meter.track():                      # activations are seen only in here
    ...     model(x).sum().backward(); opt.step()
    >>> meter.peak["activations"], meter.current()["gradients"]
    >>> meter.report()                           # a small table in MiB

    ``peak`` holds per-category maxima over samples taken while tracking: at entry, whenever a
    tensor is saved for backward, a gradient is accumulated or the optimizer steps, and at exit.
    ``peak["total"]`` is the largest *simultaneous* sum, not the sum of the category peaks. Each storage is
    counted in one category only (parameters first, then gradients, then optimizer state).

    Parameters saved for backward (a Linear saves its weight) are not activations and are skipped,
    as are buffers. Without ``model`` and ``optimizer`` the meter still recognises tensors that are
    ``nn.Parameter``s or views of one.

    Under ``torch.utils.checkpoint`` the segment inputs it keeps are counted and the tensors inside
    a segment are not -- they are recomputed, which is the point. With ``use_reentrant=True`` the
    recomputation runs under this meter's hooks, so the peak includes one segment's recomputed
    activations; with ``use_reentrant=False`` checkpoint stores them itself and the meter misses
    that bump (the CUDA allocator peak does not).
    The hooks are thread-local, and autograd carries them into its worker threads (CUDA backward,
    re-entrant recomputation), so CUDA activations are counted by the same code path; on CUDA the
    allocator's peak is reported as well (see the module docstring).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 device: torch.device | str | None = None):
        super().__init__(model, optimizer)
        if device is None:
            first = next(iter(self._params()), None)
            device = first.device if first is not None else "cpu"
        self.device = torch.device(device)
        self.peak: dict[str, int] = dict.fromkeys((*CATEGORIES, "total"), 0)
        self._live: dict[tuple, list] = {}  # storage key -> [nbytes, number of saved tensors using it]
        self._live_bytes = 0
        self._tracking = False
        self._param_keys: set = set()
        self._plist: list[torch.Tensor] = []
        self._cache: dict[str, int] | None = None

    # --- the three model-state categories -------------------------------------------------------
    def _model_states(self) -> dict[str, int]:
        params, seen = self._params(), set()
        out = {"parameters": _unique_bytes(params, seen),
               "gradients": _unique_bytes((p.grad for p in params if p.grad is not None), seen)}
        state = self.optimizer.state.values() if self.optimizer is not None else ()
        out["optimizer_state"] = _unique_bytes(_tensors(list(state)), seen)  # step counters included
        return out

    def current(self) -> dict[str, int]:
        """Bytes held *now*: model states, live saved activations, their total (and CUDA allocated)."""
        out = self._model_states()
        out["activations"] = self._live_bytes
        out["total"] = sum(out[c] for c in CATEGORIES)
        if self.device.type == "cuda":
            out["cuda_allocated"] = torch.cuda.memory_allocated(self.device)
        return out

    @property
    def live_activation_bytes(self) -> int:
        """Bytes of saved-for-backward tensors alive right now (returns to 0 after backward)."""
        return self._live_bytes

    def _sample(self, refresh: bool = False) -> None:
        """Update the peaks. Memory only grows when a tensor is saved, a gradient accumulated or an
        optimizer steps, so those are the moments sampled; parameters and optimizer state are
        re-read only when ``refresh`` (entry, optimizer step, exit), gradients every time."""
        if not self._tracking:
            return
        with self._lock:
            if refresh or self._cache is None:
                self._cache = self._model_states()
            now = dict(self._cache, activations=self._live_bytes)
            grads = (p.grad for p in self._plist if p.grad is not None)
            now["gradients"] = _unique_bytes(grads, set(self._param_keys))
            now["total"] = sum(now[c] for c in CATEGORIES)
            for k in (*CATEGORIES, "total"):
                self.peak[k] = max(self.peak[k], now[k])

    # --- activations: saved-tensor hooks ----------------------------------------------------------
    def _is_param(self, t: torch.Tensor, key: tuple) -> bool:
        base = t._base if t._base is not None else t
        return key in self._param_keys or any(isinstance(u, torch.nn.Parameter) for u in (t, base))

    def _pack(self, t: torch.Tensor):
        st = _storage(t)
        if st is None or self._is_param(t, st[0]):
            return t  # not an activation: autograd keeps it as it would without the meter
        key, nbytes = st
        with self._lock:
            entry = self._live.setdefault(key, [nbytes, 0])
            if entry[1] == 0:
                self._live_bytes += nbytes
            entry[1] += 1
            self._sample()
        return SavedAlias(t.detach(), lambda: self._release(key))

    def _release(self, key: tuple) -> None:
        with self._lock:
            entry = self._live.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:  # a release only lowers memory: no peak to sample
                del self._live[key]
                self._live_bytes -= entry[0]

    @contextlib.contextmanager
    def track(self, reset: bool = True):
        """Record peaks over the block; activations saved inside it are counted until autograd frees them."""
        if self._tracking:
            raise RuntimeError("MemoryMeter.track() is already active; nest two meters, not one meter twice")
        if reset:
            self.peak = dict.fromkeys((*CATEGORIES, "total"), 0)
        self._plist, self._cache = self._params(), None
        self._param_keys = {st[0] for st in map(_storage, self._plist) if st is not None}
        if self.model is not None:
            self._param_keys |= {st[0] for st in map(_storage, self.model.buffers()) if st is not None}
        cuda = self.device.type == "cuda"
        if cuda:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        # A gradient appearing is a moment memory may peak (activations not yet freed, grads growing).
        handles = self._hooks(self._plist, self._sample, lambda: self._sample(refresh=True))
        self._tracking = True
        self._sample(refresh=True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._sample(refresh=True)
            self._tracking = False
            for h in handles:
                h.remove()
            if cuda:
                sync(self.device)
                cuda_peak = torch.cuda.max_memory_allocated(self.device)
                self.peak["cuda_peak_allocated"] = max(self.peak.get("cuda_peak_allocated", 0), cuda_peak)

    def report(self, unit: str = "MiB") -> str:
        """A small table of peak and current bytes per category (``unit``: B, KiB, MiB or GiB).

        Returns a string that a notebook displays as the table itself.
        """
        cur = self.current()
        keys = [k for k in (*CATEGORIES, "total", "cuda_peak_allocated", "cuda_allocated")
                if k in self.peak or k in cur]
        return self._table(keys, {"peak": self.peak, "now": cur}, unit)


def saved_activation_bytes(fn: Callable, *args, **kwargs) -> int:
    """Peak bytes of tensors saved for backward while ``fn(*args, **kwargs)`` runs (no model states).

    Parameters are recognised as ``nn.Parameter`` instances (or views of them) and skipped.
    """
    meter = MemoryMeter()
    with meter.track():
        fn(*args, **kwargs)
    return meter.peak["activations"]


class Timer:
    """Wall-clock seconds of a block, synchronised with CUDA when CUDA is in use (the course's one
    clock, :mod:`..runtime.timing`: a GPU runs asynchronously, and a clock read without waiting for
    it would time the launch, not the work).

    >>> with Timer() as t:
    ...     step()
    >>> t.elapsed
    >>> Timer.measure(step, repeat=5, warmup=1)["median"]

    ``time.perf_counter`` is the highest-resolution monotonic clock; the median of several
    repeats resists the outliers (a context switch, a page fault) that the mean does not.
    """

    def __init__(self):
        self.start: float | None = None
        self.elapsed: float | None = None

    def __enter__(self) -> Timer:
        sync()
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        sync()
        self.elapsed = time.perf_counter() - self.start

    @staticmethod
    def measure(fn: Callable[[], Any], repeat: int = 5, warmup: int = 1) -> dict:
        """Run ``fn`` ``warmup`` times untimed, then ``repeat`` times timed: median, min, mean, times (s)."""
        if repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {repeat}")
        times = timed_runs(fn, repeat, warmup)
        return {"median": statistics.median(times), "min": min(times),
                "mean": statistics.fmean(times), "times": times}


class ByteCounter(TorchDispatchMode):
    """Bytes each ATen op reads (tensor arguments) and writes (new results, mutated arguments),
    as if every op went to memory and back with no cache: what an eager op sequence moves, the
    number ``costmodel``'s ``*_bytes(fused=False)`` formulas predict (chapter 11). ``with
    ByteCounter() as c: fn(...)`` then ``c.read``, ``c.written`` (bytes) and ``c.ops`` (op names).

    Views move nothing and are skipped; 0-dim tensors (scalars, step counters) are not counted.
    Two ops read less of an argument than its size: nll_loss_forward gathers one logit per row
    from ``self`` and nll_loss_backward uses ``self`` only for its shape."""

    def __init__(self):
        super().__init__()
        self.read = self.written = 0
        self.ops: list[str] = []

    @staticmethod
    def _bytes(value) -> int:
        return sum(t.numel() * t.element_size() for t in tree_flatten(value)[0]
                   if isinstance(t, torch.Tensor) and t.dim() > 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no bytes move
        bound = {a.name: (args[i] if i < len(args) else kwargs.get(a.name, a.default_value))
                 for i, a in enumerate(schema.arguments)}
        reads = {name: self._bytes(v) for name, v in bound.items()}
        if func is torch.ops.aten.nll_loss_forward.default:
            reads["self"] = bound["target"].numel() * bound["self"].element_size()
        elif func is torch.ops.aten.nll_loss_backward.default:
            reads["self"] = 0
        self.read += sum(reads.values())
        self.written += sum(self._bytes(bound[a.name]) for a in schema.arguments
                            if a.alias_info is not None and a.alias_info.is_write)
        outs = out if len(schema.returns) > 1 else (out,)  # one return may be a list (foreach ops)
        fresh = [o for o, r in zip(outs, schema.returns) if r.alias_info is None]
        self.written += self._bytes(fresh)
        self.ops.append(str(func.overloadpacket.__name__))
        return out
