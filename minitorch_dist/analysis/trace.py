"""Chapter 00 — profiler traces: record one training step per rank with ``torch.profiler`` and write
a Chrome-trace JSON that opens in Perfetto (ui.perfetto.dev) or chrome://tracing, beside the
course's own Gantt (:mod:`.timeline`). Chapter 01 uses it first, on a DDP step.

The course's ``Timeline`` shows the spans we chose to mark; the profiler shows everything torch
dispatched: every ``aten::`` op with its input shapes, autograd's backward nodes, and each
collective twice -- the ``c10d::allreduce_`` op where Python issued it (it only enqueues the
work) and the backend's own span (``gloo:all_reduce``), on the thread that did the communication
(torch 2.13, gloo; under NCCL look for ``nccl:`` spans and ``ncclDevKernel`` GPU kernels, which
the summary also matches, though the course's CPU tests cannot check them). A DDP step shows its
bucket all-reduces running on gloo's thread while backward goes on in the main one::

    paths = trace_steps(ddp_gpt_step, 2, "traces")   # one JSON per rank
    trace_summary(paths[0])   # {'compute_ms': ..., 'collectives': ['c10d::allreduce_', ...], ...}

Durations are host-side (CPU) times, in the trace's microseconds; ``trace_summary`` gives ms. A
backend's span lasts until every rank has joined, so it includes waiting for the slowest one.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, record_function

from ..runtime.launch import launch

__all__ = ["record_step", "trace_summary", "trace_steps", "ddp_gpt_step", "COLLECTIVE_KEYS", "MATMUL_KEYS"]

#: substrings (lower case) that make an event a collective or point-to-point transfer
COLLECTIVE_KEYS = ("allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                   "reducescatter", "broadcast", "alltoall", "all_to_all", "send", "recv", "barrier")
#: substrings of the ``aten::`` ops counted as compute (matmuls and attention)
MATMUL_KEYS = ("mm", "linear", "matmul", "convolution", "scaled_dot_product", "attention")


def record_step(step_fn: Callable[[], object], out_dir: str, *, warmup: int = 1, name: str = "step") -> str:
    """Run ``step_fn()`` ``warmup`` times, then once under the profiler inside
    ``record_function(name)``; write ``out_dir/<name>-rank<r>.json`` and return its path.

    Warm-up keeps one-off costs (allocations, lazy imports, first-call dispatch) out of the
    recorded step. Call it on every rank (inside :func:`~minitorch_dist.runtime.launch.launch`):
    the step's collectives must be issued by all ranks alike.
    """
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative int, got {warmup!r}")
    if not name or os.sep in name:
        raise ValueError(f"name must be a non-empty file-name part without {os.sep!r}, got {name!r}")
    for _ in range(warmup):
        step_fn()
    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, record_shapes=True) as prof:
        with record_function(name):
            step_fn()
    rank = dist.get_rank() if dist.is_initialized() else 0
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}-rank{rank}.json")
    prof.export_chrome_trace(path)
    return path


def _outermost_ms(events: list[dict]) -> float:
    """Total duration (ms) of ``events``, an event nested inside another of them (same thread,
    e.g. ``aten::addmm`` inside ``aten::linear``) counted once, with its parent."""
    total, end = 0.0, {}
    for e in sorted(events, key=lambda e: (e.get("pid"), e.get("tid"), e["ts"], -e["dur"])):
        key = (e.get("pid"), e.get("tid"))
        if e["ts"] >= end.get(key, float("-inf")):
            total += e["dur"]
            end[key] = e["ts"] + e["dur"]
    return total / 1e3


def trace_summary(path: str) -> dict:
    """What a Chrome trace holds, in a few numbers.

    ``compute_ms``: time in matmul-like ``aten::`` ops (``aten::mm``, ``addmm``, ``bmm``,
    ``linear``, attention..., nested ones once); ``compute_ops``: their distinct names;
    ``collectives``: sorted distinct names of communication events (e.g. ``c10d::allreduce_``,
    ``gloo:all_reduce``); ``comm_ms``: time in them, counting the backend's spans (``gloo:``,
    ``nccl:``, GPU kernels), which do the work, and the ``c10d::`` ops only when no backend span
    is there (they merely enqueue it); ``n_events``: number of complete (``ph == "X"``) events.
    """
    with open(path) as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or "traceEvents" not in trace:
        raise ValueError(f"{path} is not a Chrome trace: no 'traceEvents' (export it with "
                         f"prof.export_chrome_trace)")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e and "ts" in e]
    compute = [e for e in events if e["name"].startswith("aten::")
               and any(k in e["name"][6:].lower() for k in MATMUL_KEYS)]
    # not aten ops (aten::broadcast_tensors) nor user labels (record_function("send_step")), but
    # the backends' labels (gloo:send), the c10d:: ops and GPU kernels (ncclDevKernel_AllReduce...)
    comm = [e for e in events if not e["name"].startswith("aten::")
            and (e.get("cat") != "user_annotation" or e["name"].startswith(("gloo:", "nccl:")))
            and any(k in e["name"].lower() for k in COLLECTIVE_KEYS)]
    backend = [e for e in comm if not e["name"].startswith("c10d::")]
    return {
        "compute_ms": _outermost_ms(compute),
        "compute_ops": sorted({e["name"] for e in compute}),
        "collectives": sorted({e["name"] for e in comm}),
        "comm_ms": _outermost_ms(backend or comm),
        "n_events": len(events),
    }


def _trace_rank(make_step, out_dir: str, warmup: int, name: str) -> str:
    return record_step(make_step(), out_dir, warmup=warmup, name=name)


def trace_steps(make_step: Callable[[], Callable[[], object]], n: int, out_dir: str, *, warmup: int = 1,
                name: str = "step", timeout_s: float = 120) -> list[str]:
    """Launch ``n`` ranks; each builds its step with ``make_step()`` (a function of no arguments
    returning the zero-argument step) and records it with :func:`record_step`. Returns the trace
    paths, rank 0 first. ``make_step`` travels to the ranks by value (cloudpickle), so a
    ``functools.partial`` or a notebook function works too."""
    out_dir = os.path.abspath(out_dir)
    return launch(_trace_rank, n, make_step, out_dir, warmup, name, timeout_s=timeout_s)


def ddp_gpt_step(batch: int = 8, seq: int = 32, bucket_cap_mb: float = 0.1, seed: int = 0):
    """A step maker for :func:`trace_steps`: the course DDP (ch01) on the tiny GPT, AdamW, data from
    the Markov corpus, each rank its share of a global ``batch``. Small buckets (0.1 MiB) make
    several all-reduces, so the trace shows them overlapping backward."""
    from ..models.data import MarkovCorpus
    from ..models.gpt import GPT, GPTConfig
    from ..parallelism.data_parallel import DistributedDataParallel

    cfg = GPTConfig.tiny()
    torch.manual_seed(seed)
    model = GPT(cfg)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = MarkovCorpus(cfg.vocab_size, seed=seed)
    rank, world, state = dist.get_rank(), dist.get_world_size(), {"step": 0}

    def step() -> float:
        x, y = corpus.batch(state["step"], batch, seq, rank=rank, world_size=world)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        return loss.item()

    return step
