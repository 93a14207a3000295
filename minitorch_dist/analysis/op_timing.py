"""Chapter 14 — timing one op, or one short function, on this rank: the clock ``calibrate`` reads.

* :func:`median_seconds`: a function's median time over repetitions on the rank's device
  (:func:`..runtime.timing.seconds`, the course's one clock), each after a barrier when ranks run
  together (every rank starts its repetition at once, as in a step);
* :func:`repeat`: a short function looped until it takes long enough for the clock to time it;
* :func:`time_kernels`: every distinct op of a recorded workload run again alone on fresh tensors
  of its shapes -- the kernel table of a machine profile. An op in a step finds its inputs where the
  rest of the step left them: in cache for a step whose footprint fits in the cache, in memory for
  one that does not. So each op is timed on as many argument sets as the step's footprint holds,
  taken in turn (:func:`argument_sets`); timed on one set over and over, a step larger than the cache
  is under-predicted, by every technique alike (chapter 12 measures by how much).
"""
from __future__ import annotations

import statistics
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_unflatten

from ..runtime.launch import device as rank_device
from ..runtime.timing import seconds
from .workload import DeviceGenerators, Op, fresh_tensor, rebuild_args

__all__ = ["median_seconds", "repeat", "argument_sets", "time_kernels", "last_level_cache_bytes", "COPIES"]


def median_seconds(fn, reps: int = 7, warmup: int = 2, barrier: bool = True, stat=statistics.median) -> float:
    """Median (or ``stat``) seconds of ``fn()`` on the rank's device over ``reps`` runs after ``warmup``
    (:func:`..runtime.timing.seconds`); each run starts after a barrier (every rank begins together)
    when ``barrier`` and a process group exists."""
    before = dist.barrier if barrier and dist.is_initialized() else None
    return seconds(fn, reps, warmup, device=rank_device(), before=before, reduce=stat)


def repeat(fn, floor_s: float = 2e-4):
    """``fn`` looped enough times to take ~``floor_s``, and the loop count: short ops timed reliably."""
    once = seconds(fn, reps=1, warmup=0, device=rank_device())
    inner = max(1, int(floor_s / max(once, 1e-7)))

    def loop():
        for _ in range(inner):
            fn()
    return loop, inner


COPIES = 256  # at most this many argument sets per op (a 4 kB op's 256 sets fill 1 MB)


def argument_sets(op: Op, footprint: int, pools: dict | None = None) -> list:
    """Fresh argument sets for ``op``, together about ``footprint`` bytes (at least one set, at most
    :data:`COPIES`): called on each in turn, the op finds its inputs where its step leaves them. The
    sets after the first are views into ``pools`` (one buffer per dtype and device, as large as the
    largest op needs, filled once and shared by every op of the step: touched once, not once per op)."""
    args, kwargs = rebuild_args(op)
    k = int(min(COPIES, max(1, footprint // max(int(op.nbytes), 1))))
    leaves, spec = op.spec
    pools = {} if pools is None else pools
    budget = k * int(op.nbytes)  # at most the footprint
    generators = DeviceGenerators()  # one per device, made when a pool on that device is first filled
    return [(args, kwargs)] + [tree_unflatten([_place(x, pools, budget, generators) for x in leaves], spec)
                               for _ in range(k - 1)]


def _place(leaf, pools: dict, budget: int, generators: dict):
    """A recorded tensor argument as a view into its dtype's pool (at least ``budget`` bytes), at the
    pool's cursor (which moves past it, and back to the start at the end); anything else as it is.
    A new pool is filled by ``generators``' generator of its own device."""
    if not (isinstance(leaf, tuple) and leaf and leaf[0] == "T"):
        return leaf
    _, shape, stride, dtype, where = leaf
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride)) if all(shape) else 1
    entry = pools.get((dtype, where))
    n = budget // torch.empty((), dtype=dtype).element_size() + span
    if entry is None or entry[0].numel() < n:
        entry = pools[(dtype, where)] = [fresh_tensor(("T", (n,), (1,), dtype, where), generators), 0]
    pool, at = entry
    at = 0 if at + span > pool.numel() else at
    entry[1] = at + span
    return pool.as_strided(shape, stride, at)


def time_kernels(items, table: dict | None = None, reps: int = 5, stat=statistics.median,
                 footprint: int = 0) -> dict:
    """``{op key: seconds}`` for every distinct op of a recorded workload, each run again alone on
    fresh tensors of its shapes (no barrier: every rank replays its own ops, all of them busy).

    ``footprint``: the bytes the recorded step touched (``WorkloadRecorder.footprint``). In a step an op
    reads what the rest of the step wrote since it last ran: its inputs come from the cache level that
    holds the step's footprint (from memory for a step larger than the last-level cache). So the op is
    timed on ``footprint / op bytes`` argument sets taken in turn, which puts the same bytes between two
    uses of one set. (``footprint=0``: one set, every call finds it in cache -- the op at its best.)
    :func:`.calibrate.cache_effect` sets the two against whole steps."""
    table, pools = ({} if table is None else table), {}
    for op in items:
        if not isinstance(op, Op) or op.key in table:
            continue
        try:
            sets = argument_sets(op, footprint, pools)
            turn = iter(range(1 << 62))

            def call(op=op, sets=sets, turn=turn):
                args, kwargs = sets[next(turn) % len(sets)]
                op.func(*args, **kwargs)
            loop, inner = repeat(call)
            table[op.key] = median_seconds(loop, reps=reps, warmup=1, barrier=False, stat=stat) / inner
        except (RuntimeError, ValueError, IndexError, TypeError):
            table[op.key] = None  # not replayable alone (the roofline stands in for it)
        sets = None
    return table


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache Linux reports for core 0 (its last level), or None where it reports none."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        if text[:-1].isdigit() and text[-1] in "KMG":
            sizes.append(int(text[:-1]) * 1024 ** " KMG".index(text[-1]))
    return max(sizes, default=None)
