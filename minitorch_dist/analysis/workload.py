"""Chapter 14 — what one rank's step asks of the machine: every op with its FLOPs and bytes, every collective.

To predict a step's time before running it, first write down its *work*. :class:`WorkloadRecorder`
is a ``TorchDispatchMode``: while it is active, every ATen op the rank runs -- in the forward, inside
autograd's backward, in the optimizer -- is recorded with

    kind     "matmul" (mm, addmm, bmm, baddbmm), "attention" (a fused attention kernel), "view" (an op
             that only makes a new view: no bytes move), "other" (elementwise, reductions, copies, ...)
    flops    ``torch.utils.flop_counter``'s count for matmuls and attention (2·m·n·k for a GEMM)
    nbytes   bytes the op reads and writes (its tensor inputs and its outputs)
    phase    "forward", "backward" (inside autograd's engine) or "other"

and every collective the library's metered wrappers (:mod:`..runtime.comm`) launch is recorded in its
place among them, with its bytes and whether it was asynchronous -- and, for an asynchronous one, the
place where the step waits for it (:class:`Wait`). ``footprint`` is the bytes of memory the step
touched (each storage once, by address: the allocator's reused blocks count once, as they do in a
cache), what decides whether an op finds its inputs in cache. :mod:`.costmodel.step_time` turns
such a list into seconds with a machine profile. Recording is the only thing this module does: it
never times anything, so a prediction made from it is a prediction.

The recorder works on real tensors and on ``meta`` ones, under gloo or the fake process group.
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

from ..runtime import comm
from ..runtime.dtypes import short_name

__all__ = ["Op", "Comm", "Mark", "Wait", "WorkloadRecorder", "record_workload", "summarize", "rebuild_args",
           "fresh_tensor", "DeviceGenerators", "portable"]

_MATMUL = {"mm", "addmm", "bmm", "baddbmm"}
#: Code that runs only because a dispatch mode is recording: its lines are not the step's.
_RECORDING_ONLY = ("torch/_dynamo/", "torch/_library/", "torch/_compile.py", "torch/compiler/",
                   "torch/utils/_python_dispatch.py", "torch/_ops.py", "analysis/workload.py",
                   "runtime/observe.py")  # observe: only the recording listens (unwatched: one test)
_COUNTED: dict = {}  # code object -> whether its lines count
_ATTENTION = ("_scaled_dot_product", "_flash_attention", "_efficient_attention")


@dataclasses.dataclass
class Op:
    """One ATen op of the step. ``key`` names the op and its arguments' shapes (ops with one key take
    the same time); ``func`` and ``spec`` let :func:`replay` run it again on fresh tensors."""

    name: str
    kind: str  # matmul | attention | view | other
    flops: float
    nbytes: float
    phase: str  # forward | backward | other
    key: str = ""
    dtype: str = "fp32"  # of its first floating-point input: fp32, bf16, fp16
    lines: int = 0  # Python lines the step executed since the previous op (the framework around it)
    func: object = None
    spec: tuple = ()


@dataclasses.dataclass
class Wait:
    """The step waits here for an asynchronous collective or message: ``ref`` is its :class:`Comm`'s index."""

    ref: int


@dataclasses.dataclass
class Mark:
    """A named point in the step (a pipeline action starting or ending): :meth:`WorkloadRecorder.on_begin`."""

    name: str
    edge: str  # "start" | "end"


@dataclasses.dataclass
class Comm:
    """One metered collective of the step, in its place among the ops."""

    op: str
    nbytes: int  # the full buffer S (comm's convention)
    group_size: int
    async_op: bool
    phase: str
    ranks: tuple = ()  # global ranks of its group
    peer: int | None = None  # send / recv: the other end


def _flops(func, args, kwargs, out) -> float:
    """FLOPs of one op: ``torch.utils.flop_counter``'s formula, and for the CPU's fused flash attention
    (which it does not count) the same count as for the GPU's: 4·b·heads·s_q·s_k·d forward, 2.5x that in
    backward (the scores are recomputed)."""
    packet = func._overloadpacket
    if packet in flop_registry:
        return float(flop_registry[packet](*args, **kwargs, out_val=out))
    name = packet.__name__
    if name == "_scaled_dot_product_flash_attention_for_cpu":
        q, k, v = args[:3]
        return float(sdpa_flop_count(q.shape, k.shape, v.shape))
    if name == "_scaled_dot_product_flash_attention_for_cpu_backward":
        grad_out, q, k, v = args[:4]
        return float(sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape))
    return 0.0


def _phase() -> str:
    if torch._C._current_graph_task_id() != -1:
        return "backward"
    return "forward" if torch.is_grad_enabled() else "other"


def _tensors(tree) -> list:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _kind(func, outs, ins) -> str:
    name = func._overloadpacket.__name__
    if name in _MATMUL:
        return "matmul"
    if name.startswith(_ATTENTION):
        return "attention"
    if func.is_view:
        return "view"  # a new view of the same storage: no bytes move
    return "other"  # elementwise, reductions, copies -- in place or not


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _spec(tree):
    """An op's arguments, each tensor as ("T", shape, stride, dtype, device): enough to rebuild it."""
    flat, spec = tree_flatten(tree)
    return tuple(("T", tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))
                 if isinstance(t, torch.Tensor) else t for t in flat), spec


def _key(func, leaves) -> str:
    """``aten.mm.default(float32[1024, 64], float32[64, 256])``: the op and its arguments' shapes."""
    def show(x):
        if isinstance(x, tuple) and x and x[0] == "T":
            _, shape, stride, dtype, _ = x
            dense = torch.empty(shape, device="meta").stride() == tuple(stride)
            return f"{str(dtype).replace('torch.', '')}{list(shape)}" + ("" if dense else f"/{list(stride)}")
        return repr(x)
    return f"{func}({', '.join(show(x) for x in leaves)})"


class WorkloadRecorder(TorchDispatchMode):
    """Records ops and collectives in order (``items``: :class:`Op` and :class:`Comm`)."""

    _warm = False  # whether this process has run a recorder once (torch imports sympy on first use)

    def __init__(self, count_lines: bool = True):
        super().__init__()
        self.count_lines = count_lines
        self.items: list = []
        self._meter = None
        self._seen = 0
        self.lines = self._lines_at_last_op = 0
        self._inside = False  # in the recorder's own code: its lines are not the step's
        self._storages: dict = {}  # storage address -> its bytes (the largest seen there)

    @property
    def footprint(self) -> int:
        """Bytes of memory the recorded ops touched, each address once."""
        return sum(self._storages.values())

    def __enter__(self):
        self._index: dict = {}  # id(CommEvent) -> index of its Comm item
        self._stack = contextlib.ExitStack()
        self._meter = self._stack.enter_context(comm.meter())
        self._stack.enter_context(comm.on_wait(self._on_wait))
        if self.count_lines and not WorkloadRecorder._warm:  # the first use's imports are not the step's
            WorkloadRecorder._warm = True
            with WorkloadRecorder(count_lines=False):
                (torch.ones(2, requires_grad=True) * 2).sum().backward()
        self._tracing = self.count_lines and sys.gettrace() is None  # a debugger keeps its own tracer
        if self._tracing:
            sys.settrace(self._trace)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if self._tracing:
            sys.settrace(None)
        self._flush_comm()
        self._stack.__exit__(*exc)
        return out

    def _trace(self, frame, event, arg):
        """Count the Python lines the step executes (the framework's work between ops), not those that
        only run because a dispatch mode is recording (torch's mode machinery, this module)."""
        if event == "line" and not self._inside:
            code = frame.f_code
            counted = _COUNTED.get(code)
            if counted is None:
                counted = _COUNTED[code] = not any(part in code.co_filename for part in _RECORDING_ONLY)
            self.lines += counted
        return self._trace

    def _flush_comm(self) -> None:
        events = self._meter.events
        for ev in events[self._seen:]:
            self._index[id(ev)] = len(self.items)
            self.items.append(Comm(ev.op, ev.nbytes, ev.group_size, ev.async_op, _phase(), ev.ranks, ev.peer))
        self._seen = len(events)

    def _on_wait(self, event) -> None:
        self._flush_comm()
        if id(event) in self._index:  # launched while recording
            self.items.append(Wait(self._index[id(event)]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._inside = True
        try:
            return self._record(func, args, kwargs or {})
        finally:
            self._inside = False

    def _record(self, func, args, kwargs):
        out = func(*args, **kwargs)
        self._flush_comm()  # collectives launched before this op
        if func.namespace in ("c10d", "_c10d_functional", "profiler"):
            return out
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        kind = _kind(func, outs, ins)
        packet = func._overloadpacket
        flops = _flops(func, args, kwargs, out)
        if kind == "view":
            nbytes = 0.0
        else:  # read every input; write every output (an in-place op writes back where it read)
            nbytes = float(sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))
        self._touch(ins + outs)
        leaves, spec = _spec((args, kwargs))
        floats = [t.dtype for t in ins if t.dtype.is_floating_point]
        lines, self._lines_at_last_op = self.lines - self._lines_at_last_op, self.lines
        self.items.append(Op(packet.__name__, kind, flops, nbytes, _phase(), _key(func, leaves),
                             short_name(floats[0], "fp32") if floats else "fp32", lines, func,
                             (leaves, spec)))
        return out

    def _touch(self, tensors) -> None:
        for t in tensors:
            if t.device.type == "meta":
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
                continue
            self._storages[st.data_ptr()] = max(self._storages.get(st.data_ptr(), 0), st.nbytes())

    # --- as an observer (runtime.observe): ``with observe.watching(rec):`` marks where each piece of
    # work a technique announces (a pipeline action) starts and ends, among the ops and collectives.

    def on_begin(self, name: str, category: str | None, meta: dict) -> str | None:
        """A part of the step starts (a span of :mod:`runtime.observe`). Work announced as detached
        (a collective in flight, ending in the backend's thread) is not a part: its messages are
        recorded as they are issued and waited for."""
        if meta.get("detached"):
            return None
        self._flush_comm()
        self.items.append(Mark(name, "start"))
        return name

    def on_end(self, name: str | None) -> None:
        if name is None:
            return
        self._flush_comm()
        self.items.append(Mark(name, "end"))


def record_workload(fn, *args, **kwargs) -> tuple:
    """``(fn(*args, **kwargs), items)``: run ``fn`` once under a :class:`WorkloadRecorder`."""
    with WorkloadRecorder() as rec:
        result = fn(*args, **kwargs)
    return result, rec.items


def summarize(items) -> dict:
    """Totals of a workload: ops and FLOPs per kind, bytes, and collectives by op."""
    ops = [i for i in items if isinstance(i, Op)]
    comms = [i for i in items if isinstance(i, Comm)]
    return {"ops": Counter(o.kind for o in ops), "flops": sum(o.flops for o in ops),
            "nbytes": sum(o.nbytes for o in ops if o.kind != "view"),
            "collectives": Counter(c.op for c in comms), "comm_bytes": sum(c.nbytes for c in comms)}


class DeviceGenerators(dict):
    """Random generators by device, each made (seeded with ``seed``) when a tensor on its device is
    first filled: a tensor is filled by a generator of its own device -- a CPU generator cannot fill a
    CUDA tensor ("Expected a 'cuda' device type for generator"). ``meta`` holds no values and has no
    generator: None there."""

    def __init__(self, seed: int = 0):
        super().__init__()
        self.seed = seed

    def __missing__(self, device) -> torch.Generator | None:
        dev = torch.device(device)
        made = None if dev.type == "meta" else torch.Generator(device=dev).manual_seed(self.seed)
        self[device] = made
        return made


def fresh_tensor(leaf, generators: DeviceGenerators | None = None):
    """A tensor like the one recorded (``leaf``: ``("T", shape, stride, dtype, device)``, as an op's
    spec holds it; anything else is returned as it is): floats in [0.5, 1.5) (a NaN or a denormal is
    slow on a CPU and would misprice the op), zeros for integers (valid indices), True for bools.
    The floats come from ``generators``' generator of the tensor's device (None: a fresh set)."""
    if not (isinstance(leaf, tuple) and leaf and leaf[0] == "T"):
        return leaf
    _, shape, stride, dtype, where = leaf
    size = 1 + sum((n - 1) * st for n, st in zip(shape, stride) if n > 0) if all(shape) else 0
    base = torch.empty(max(size, 1), dtype=dtype, device=where)  # where the recorded tensor lived
    if dtype.is_floating_point:  # positive and well scaled: a square root or a log of it is no NaN
        generators = DeviceGenerators() if generators is None else generators
        base.uniform_(0.5, 1.5, generator=generators[str(base.device)])
    elif dtype == torch.bool:
        base.fill_(True)
    else:
        base.zero_()
    return base.as_strided(shape, stride)


def rebuild_args(op: Op, seed: int = 0) -> tuple:
    """``(args, kwargs)``: fresh tensors shaped as ``op``'s were, for ``op.func(*args, **kwargs)``, each
    on its recorded device and filled by a generator of that device (:class:`DeviceGenerators`)."""
    leaves, spec = op.spec
    generators = DeviceGenerators(seed)
    return tree_unflatten([fresh_tensor(x, generators) for x in leaves], spec)


def portable(items) -> list:
    """The items without the op objects and argument specs (plain data: picklable, returnable from a rank)."""
    return [dataclasses.replace(i, func=None, spec=()) if isinstance(i, Op) else i for i in items]
