"""Chapter 00 — metered collectives: torch.distributed's calls, counted.

Every collective the library runs goes through these wrappers, which have the signatures of
``torch.distributed`` (tensor forms). Inside ``with comm.meter() as m:`` each call is recorded:

- ``m.calls[op]``: how many times ``op`` ran;
- ``m.bytes[op]``: the size S of the *full* buffer, summed over calls (the tensor of an
  all-reduce or broadcast, the unsharded tensor of a reduce-scatter / all-gather, a rank's whole
  input of an all-to-all, the message of a send);
- ``m.wire_bytes[op]``: what this rank puts on the wire under the ring model,
  ``busbw.bus_bytes(op, S, n)``: all-reduce 2(n-1)/n S, reduce-scatter and all-gather
  (n-1)/n S, all-to-all (n-1)/n S, broadcast S (the factors of nccl-tests' "bus bandwidth").

The meter counts what was *asked of* the backend under a model of the algorithm; chapter 00's
``collectives.py`` sends real bytes with send/recv and shows the two counts agree.

Each call also updates a one-line status ("in all_reduce float32[1024] ...", "after ...") that
``launch`` reads when a rank hangs, so a deadlock is reported as *which op each rank was in*.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .busbw import bus_bytes
from .tables import format_table

ReduceOp = dist.ReduceOp

# torch 2.13 renamed the tensor forms (reduce_scatter_tensor -> reduce_scatter_single, all_gather_into_tensor
# -> all_gather_single) and warns on the old names; older releases only have the old ones.
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class CommEvent:
    """One metered call: what ran, on how many ranks, and how many bytes it moved."""

    op: str
    nbytes: int  # S, the full buffer (see module docstring)
    wire_bytes: float  # bus_bytes(op, S, n): bytes this rank sends under the ring model
    group_size: int
    dtype: str
    shape: tuple
    t: float  # time.perf_counter() at launch
    ranks: tuple = ()  # global ranks of the group it ran on: tells a 3D run's TP, DP and PP calls apart
    async_op: bool = False  # launched without waiting (a DDP bucket): it may overlap the compute after it
    peer: int | None = None  # send / recv: the global rank at the other end


@dataclass
class CommMeter:
    """Counts of the collectives run while the meter is active (one rank's view)."""

    calls: Counter = field(default_factory=Counter)
    bytes: Counter = field(default_factory=Counter)
    wire_bytes: Counter = field(default_factory=Counter)
    events: list = field(default_factory=list)

    def add(self, ev: CommEvent) -> None:
        self.calls[ev.op] += 1
        self.bytes[ev.op] += ev.nbytes
        self.wire_bytes[ev.op] += ev.wire_bytes  # type: ignore[assignment]  # float counts: ring-model bytes
        self.events.append(ev)

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())

    @property
    def total_wire_bytes(self) -> float:
        return sum(self.wire_bytes.values())

    def ops(self) -> list:
        """The ops in the order they ran: handy for asserting *which* collectives a step uses."""
        return [e.op for e in self.events]

    def summary(self) -> dict:
        """``{op: {"calls", "bytes", "wire_bytes"}}``, plain data (picklable, returnable from a rank)."""
        return {
            op: {"calls": self.calls[op], "bytes": self.bytes[op], "wire_bytes": self.wire_bytes[op]}
            for op in sorted(self.calls)
        }

    def table(self) -> str:
        rows = [[op, s["calls"], f"{s['bytes']:,}", f"{s['wire_bytes']:,.0f}"]
                for op, s in self.summary().items()]
        return format_table(rows, ["op", "calls", "bytes", "wire bytes"], align="lrrr")


# Meters active in this process (nested `with meter()` blocks all see each call), and the
# status line launch() reads on a hang. A lock because async hooks may call from other threads.
_active: list = []
_lock = threading.Lock()
_status: dict = {"text": "no collective yet", "sink": None}


@contextlib.contextmanager
def meter() -> Iterator[CommMeter]:
    """Count every metered call made inside the block (on this rank)."""
    m = CommMeter()
    with _lock:
        _active.append(m)
    try:
        yield m
    finally:
        with _lock:  # by identity: two meters that counted the same calls compare equal
            del _active[next(i for i, a in enumerate(_active) if a is m)]


def set_status_sink(sink: Any) -> None:
    """Mirror the status line into ``sink`` (a shared ``multiprocessing.Array('c')``), for launch()."""
    _status["sink"] = sink


def last_op() -> str:
    """What this rank last did: ``"in <op> ..."`` while a call blocks, ``"after <op> ..."`` once done."""
    return _status["text"]


def set_status(text: str) -> None:
    _status["text"] = text
    sink = _status["sink"]
    if sink is not None:
        raw = text.encode("utf-8", "replace")[: len(sink) - 1]
        sink.value = raw  # no lock: a torn line on a hang report is harmless


def _group_size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _group_ranks(group: dist.ProcessGroup | None) -> tuple:
    return tuple(dist.get_process_group_ranks(group or dist.group.WORLD)) if dist.is_initialized() else ()


def record(op: str, nbytes: int, n: int, dtype: object = "", shape: Iterable[int] = (),
           ranks: Iterable[int] = ()) -> CommEvent:
    """Register one call of ``op`` on a buffer of ``nbytes`` among ``n`` ranks in every active meter.

    ``ranks``: the global ranks of the group it ran on (the wrappers fill it in). The wrappers
    below call this; code that moves bytes itself (e.g. a ring all-reduce made of
    send/recv) may call it too, to be counted as one logical collective.
    """
    ev = CommEvent(op, int(nbytes), bus_bytes(op, nbytes, n), n, str(dtype), tuple(shape),
                   time.perf_counter(), tuple(ranks))
    with _lock:
        for m in _active:
            m.add(ev)
    return ev


_calls_so_far: Counter[str] = Counter()
_wait_listeners: list = []  # called with a CommEvent when the work of an asynchronous call is waited on


class MeteredWork:
    """The ``Work`` of an asynchronous call, unchanged except that ``wait()`` is reported first to the
    listeners of :func:`on_wait` (analysis.workload records where a step waits for its communication)."""

    def __init__(self, work: Any, event: CommEvent) -> None:
        self._work, self.event = work, event

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        for listener in list(_wait_listeners):
            listener(self.event)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


@contextlib.contextmanager
def on_wait(listener: Callable[[CommEvent], object]) -> Iterator[None]:
    """Within the block, ``listener(event)`` runs whenever an asynchronous call's work is waited on."""
    _wait_listeners.append(listener)
    try:
        yield
    finally:
        _wait_listeners.remove(listener)


def _run(op: str, tensor: torch.Tensor, nbytes: int, group: dist.ProcessGroup | None, async_op: bool,
         fn: Callable[[], Any], peer: int | None = None) -> Any:
    """Record the call, run it, keep the status line current."""
    n = _group_size(group)
    ev = record(op, nbytes, n, tensor.dtype, tensor.shape, _group_ranks(group))
    ev.async_op, ev.peer = bool(async_op), peer
    _calls_so_far[op] += 1
    desc = (f"{op} {str(tensor.dtype).replace('torch.', '')}{list(tensor.shape)} on {n} ranks "
            f"(call #{_calls_so_far[op]})")
    set_status(f"in {desc}")
    work = fn()
    set_status(f"launched {desc}" if async_op else f"after {desc}")
    return MeteredWork(work, ev) if async_op and work is not None else work


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# --- the wrappers: torch.distributed signatures ---------------------------------------------


def all_reduce(tensor: torch.Tensor, op: dist.ReduceOp | dist.ReduceOp.RedOpType = ReduceOp.SUM,
               group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    return _run("all_reduce", tensor, _nbytes(tensor), group, async_op,
                lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op))


def reduce_scatter(output: torch.Tensor, input: torch.Tensor,
                   op: dist.ReduceOp | dist.ReduceOp.RedOpType = ReduceOp.SUM,
                   group: dist.ProcessGroup | None = None, async_op: bool = False) -> Any:
    """``reduce_scatter_tensor`` (``reduce_scatter_single``): ``input`` is the full buffer (n x output)."""
    return _run("reduce_scatter", input, _nbytes(input), group, async_op,
                lambda: _reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op))


def all_gather(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """``all_gather_into_tensor`` (``all_gather_single``): ``output`` is the full buffer (n x input)."""
    return _run("all_gather", output, _nbytes(output), group, async_op,
                lambda: _all_gather_tensor(output, input, group=group, async_op=async_op))


def all_to_all(output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int] | None = None,
               input_split_sizes: list[int] | None = None, group: dist.ProcessGroup | None = None,
               async_op: bool = False) -> Any:
    """``all_to_all_single`` (uneven splits allowed). S is this rank's whole input."""
    return _run("all_to_all", input, _nbytes(input), group, async_op,
                lambda: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                               group=group, async_op=async_op))


def broadcast(tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None,
              async_op: bool = False) -> Any:
    return _run("broadcast", tensor, _nbytes(tensor), group, async_op,
                lambda: dist.broadcast(tensor, src, group=group, async_op=async_op))


def send(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Any:
    return _run("send", tensor, _nbytes(tensor), group, False, lambda: dist.send(tensor, dst, group=group),
                peer=dst)


def recv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None) -> Any:
    return _run("recv", tensor, _nbytes(tensor), group, False, lambda: dist.recv(tensor, src, group=group),
                peer=src)


def isend(tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None) -> Any:
    return _run("send", tensor, _nbytes(tensor), group, True, lambda: dist.isend(tensor, dst, group=group),
                peer=dst)


def irecv(tensor: torch.Tensor, src: int | None = None, group: dist.ProcessGroup | None = None) -> Any:
    return _run("recv", tensor, _nbytes(tensor), group, True, lambda: dist.irecv(tensor, src, group=group),
                peer=src)


def batch_isend_irecv(p2p_ops: list[dist.P2POp]) -> list[Any]:
    """Launch a list of ``dist.P2POp`` together; each send / recv is counted on its own."""
    events = []
    for p in p2p_ops:
        name = "send" if p.op in (dist.isend, dist.send) else "recv"
        ev = record(name, _nbytes(p.tensor), _group_size(p.group), p.tensor.dtype, p.tensor.shape,
                    _group_ranks(p.group))
        ev.async_op, ev.peer = True, p.peer  # both are posted without waiting; the work is waited on
        events.append(ev)
    set_status(f"in batch_isend_irecv of {len(p2p_ops)} ops")
    if any(p.tensor.is_meta for p in p2p_ops):
        # torch batches by the tensors' device, and no backend is registered for meta (the tensors of
        # a dry run under torch's fake process group): there each op is issued alone
        works = [p.op(p.tensor, p.peer, p.group, p.tag) for p in p2p_ops]
    else:
        works = dist.batch_isend_irecv(p2p_ops)
    set_status(f"launched batch_isend_irecv of {len(p2p_ops)} ops")
    if works and len(works) == len(events):
        return [MeteredWork(w, ev) for w, ev in zip(works, events)]
    return works


def barrier(group: dist.ProcessGroup | None = None) -> None:
    set_status("in barrier")
    dist.barrier(group=group)
    set_status("after barrier")
