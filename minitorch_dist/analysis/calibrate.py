"""Chapter 14 — calibrate: measure this machine once, so that every time is predicted before it is measured.

``python -m minitorch_dist calibrate [--world N] [--out PATH]`` runs N ranks (one thread each, all of
them busy at once, as in a real step) and measures what :mod:`.costmodel.step_time` needs:

* **collectives**: each of all-reduce, all-gather, reduce-scatter, all-to-all, broadcast and a
  point-to-point message, timed over a size sweep (4 kB - 16 MB); α and β fitted to the ring model
  (``costmodel.fit_alpha_beta``; Hockney 1994, Thakur et al. 2005);
* **GEMMs**: seconds against FLOPs over a sweep of shapes: the roofline's compute side, and the peak
  this machine reaches (a CPU has no datasheet number the course could trust);
* **copy bandwidth** and the **fixed cost of one op** (a one-element add in a loop) and **of one
  metered collective call** (the wrapper over the raw call);
* **overlap**: an asynchronous all-reduce beside GEMMs, against the two alone -- how much of the
  communication the computation hides (on a CPU, gloo's thread needs a core too); and how long a
  message posted with ``isend`` waits to start while its sender keeps computing;
* **the kernel table**: one step of every technique of :mod:`.techniques` at both sizes is recorded
  (:mod:`.workload`), and every distinct op (name and shapes) is run again alone and timed -- on as
  many argument sets, taken in turn, as the step's footprint holds (:func:`time_kernels`): in a step
  an op finds its inputs where the rest of the step left them, in cache for a step that fits in it,
  in memory for one that does not. Timed on one set over and over, every call would find its
  inputs in cache, and a step too large for the cache would be under-predicted by a fifth or more;
* **a whole step** of the course GPT (forward, backward, AdamW) per rank: the part of it that its
  ops, each timed as above, do not explain is the framework's, charged per Python line the step
  executes (module calls, hooks, a wrapper's bookkeeping: the recorder counts them). On a CPU it is
  small beside the ops' own variation and may come out 0.

It writes a profile (:mod:`.profiles`; default in the user's cache directory, path printed) and prints
a table. ``--show h100`` prints a shipped profile instead.

``--quick`` (``calibrate(quick=True)``) measures the same things on fewer points: every other size of the
collectives' sweep up to 4 MB, 20 timed calls per size instead of 60, and each op and the reference step
timed fewer times -- for a smoke run, where seconds matter more than the last digit.
:func:`time_techniques` adds the ops of more techniques to a calibrated profile's kernel table. Both
resolve the techniques once (:func:`.techniques.resolve`), before any rank starts, and the ranks receive
the records.
"""
from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from datetime import date
from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from .. import costmodel
from ..runtime import comm
from ..runtime.launch import device as rank_device
from ..runtime.tables import format_table
from ..runtime.timing import seconds, sync
from .op_timing import last_level_cache_bytes, median_seconds, repeat, time_kernels
from .profiles import COLLECTIVES, MachineProfile, default_profile_path, load_profile
from .workload import Op, WorkloadRecorder

if TYPE_CHECKING:
    from .techniques import Technique

__all__ = ["calibrate", "time_techniques", "gemm_peak_flops", "median_seconds", "time_kernels",
           "reference_step_seconds", "cache_effect", "last_level_cache_bytes", "main"]

SWEEP_BYTES = tuple(4096 * 2 ** i for i in range(13))  # 4 kB ... 16 MB
QUICK_SWEEP_BYTES = SWEEP_BYTES[:11:2]  # 4 kB, 16 kB, ... 4 MB: 6 sizes
GEMM_SHAPES = ((16, 16, 16), (64, 64, 64), (256, 64, 64), (1024, 64, 64), (1024, 64, 256), (1024, 256, 64),
               (256, 256, 256), (1024, 128, 512), (512, 512, 512), (2048, 512, 512))


# --- collectives ---------------------------------------------------------------------------------


def _collective_call(op: str, nbytes: int):
    n, r = dist.get_world_size(), dist.get_rank()
    numel = max(n, nbytes // 4 // n * n)
    full, part = torch.ones(numel, device=rank_device()), torch.ones(numel // n, device=rank_device())
    calls = {"all_reduce": lambda: comm.all_reduce(full), "broadcast": lambda: comm.broadcast(full, 0),
             "all_gather": lambda: comm.all_gather(full, part),
             "reduce_scatter": lambda: comm.reduce_scatter(part, full),
             "all_to_all": lambda: comm.all_to_all(full.clone(), full)}
    if op != "send":
        return calls[op]

    def one_way():  # rank 0 sends, rank 1 receives (both just computed, as pipeline stages have)
        if r == 0:
            dist.send(full, 1)
        elif r == 1:
            dist.recv(full, 0)
    return one_way


def _mean_after_compute(fn, reps: int = 60) -> float:
    """Mean seconds of ``fn()``, each call right after a short burst of GEMMs on every rank, as a
    collective follows compute in a step (a barrier first would time the barrier's wake-up too). The
    mean, not the best or the median: a step pays every slow call, and on a loaded CPU some are slow."""
    a = torch.randn(128, 128, device=rank_device())

    def burst():
        for _ in range(8):
            a @ a
    return seconds(fn, reps, warmup=1, device=rank_device(), before=burst, reduce=statistics.fmean)


def _alpha_beta(quick: bool = False, attempts: int = 3) -> dict:
    """Per collective: the measured sweep (full-buffer bytes, mean seconds) and its α-β fit; ``quick``:
    every other size up to 4 MB, 20 calls each instead of 60.

    A sweep whose times do not grow with the size fits β = 0 (no cost per byte): other work on the
    cores disturbed it more than the bytes cost. Such a sweep is measured again, up to ``attempts``
    times in all; the ranks agree on retrying (one MAX all-reduce), so they run the same calls."""
    n, out = dist.get_world_size(), {}
    sweep, reps = (QUICK_SWEEP_BYTES, 20) if quick else (SWEEP_BYTES, 60)
    sizes = [max(n, s // 4 // n * n) * 4 for s in sweep]
    for op in COLLECTIVES:
        for _ in range(attempts):
            times = _sweep_times(op, sweep, reps)
            alpha, beta = costmodel.fit_alpha_beta(sizes, times, n if op != "send" else 2, op)
            unresolved = torch.tensor([float(beta <= 0)], device=rank_device())
            dist.all_reduce(unresolved, op=dist.ReduceOp.MAX)
            if not unresolved.item():
                break
        out[op] = {"alpha_s": alpha, "beta_s_per_byte": beta, "sweep": [[b, t] for b, t in zip(sizes, times)]}
    return out


def _sweep_times(op: str, sweep, reps: int) -> list[float]:
    """Mean seconds of ``op`` at each size of ``sweep`` (for ``send``: the receiver's, on every rank)."""
    times = [_mean_after_compute(_collective_call(op, s), reps) for s in sweep]
    if op == "send":  # the receiver's clock: from the end of its compute to the message's arrival
        agreed = torch.tensor(times, dtype=torch.float64, device=rank_device()) * (dist.get_rank() == 1)
        dist.all_reduce(agreed)
        times = agreed.tolist()
    return times


def _collective_overhead(calls: int = 200) -> float:
    """What the metered wrapper adds to a collective call: its bookkeeping (the event, the status line),
    timed alone -- beside the call itself it is too small to see in the noise of the network."""
    x = torch.ones(1, device=rank_device())

    def book():
        for _ in range(calls):
            ev = comm.record("all_reduce", 4, 2, x.dtype, x.shape, (0, 1))
            comm.set_status(f"in all_reduce {ev.op}")
            comm.set_status("after")
    return median_seconds(book, barrier=False) / calls


def _overlap(nbytes: int = 4 * 2 ** 20, trials: int = 5) -> float:
    """Fraction of an asynchronous all-reduce hidden by GEMMs that run meanwhile (clamped to [0, 1]):
    the median of ``trials`` experiments, each comparing the two together with each alone."""
    buf, a = torch.ones(nbytes // 4, device=rank_device()), torch.randn(256, 256, device=rank_device())
    t_comm = median_seconds(lambda: comm.all_reduce(buf, async_op=True).wait(), reps=7)
    loop, _ = repeat(lambda: a @ a, t_comm)

    def both():
        work = comm.all_reduce(buf, async_op=True)
        loop()
        work.wait()
    shares = []
    for _ in range(trials):
        t_math = median_seconds(loop, reps=5)
        t_both = median_seconds(both, reps=5)
        shares.append((t_comm + t_math - t_both) / min(t_comm, t_math))
    return min(1.0, max(0.0, statistics.median(shares)))


def _async_start(nbytes: int = 128 * 1024, compute_s: float = 0.01, trials: int = 25) -> float:
    """How late a message posted with ``isend`` arrives when both ends keep computing, as a pipeline's
    stages do: rank 0 posts it and computes for ``compute_s``; rank 1 computes for half that, then
    receives and times the receive; the mean over ``trials``, less the same receive's mean time when
    rank 0 posted the message and waited (the message's own time)."""
    r, a = dist.get_rank(), torch.randn(128, 128, device=rank_device())
    buf = torch.ones(nbytes // 4, device=rank_device())

    def busy(duration: float):
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duration:
            a @ a
        sync(rank_device())  # on a GPU the compute is the GEMMs queued, done

    def recv():
        if r == 1:
            dist.recv(buf, 0)

    def receive(sender_busy: bool) -> float:
        dist.barrier()
        if r == 0:
            work = dist.isend(buf, 1)
            busy(compute_s if sender_busy else 0.0)
            work.wait()
            return 0.0
        busy(compute_s / 2)
        return seconds(recv, reps=1, warmup=0, device=rank_device())
    late = statistics.mean(receive(True) for _ in range(trials))  # the mean: a step pays the slow ones too
    alone = statistics.mean(receive(False) for _ in range(trials))
    agreed = torch.tensor([max(0.0, late - alone) if r == 1 else 0.0], dtype=torch.float64,
                          device=rank_device())
    dist.all_reduce(agreed)  # the receiver's clock
    return agreed.item()


# --- compute ---------------------------------------------------------------------------------------


def _gemm_table() -> list:
    table = []
    for m, k, n in GEMM_SHAPES:
        a, b = torch.randn(m, k, device=rank_device()), torch.randn(k, n, device=rank_device())
        loop, inner = repeat(partial(torch.mm, a, b))
        table.append([2.0 * m * k * n, median_seconds(loop, reps=5) / inner])
    table.sort()
    for i in range(1, len(table)):  # more FLOPs never take less time
        table[i][1] = max(table[i][1], table[i - 1][1])
    return table


def gemm_peak_flops() -> float:
    """FLOP/s of the fastest GEMM in the calibration's sweep, timed in this process with the threads it
    has: a calibration's ``peak_flops["fp32"]`` without starting ranks or timing the links (a second,
    not half a minute), for a smoke run or a quick look."""
    return max(flops / seconds for flops, seconds in _gemm_table())


def _copy_bandwidth(nbytes: int = 32 * 2 ** 20) -> float:
    """Bytes moved per second by ``y.copy_(x)`` (read x, write y) on a buffer larger than the caches."""
    x = torch.randn(nbytes // 4, device=rank_device())
    y = torch.empty_like(x)
    return 2 * nbytes / median_seconds(lambda: y.copy_(x), reps=5)


def _op_overhead() -> float:
    x = torch.zeros(1, device=rank_device())
    loop, inner = repeat(lambda: x.add_(1.0), 1e-3)
    return median_seconds(loop) / inner


def _reference_step(size: str = "tiny"):
    """The reference step: the tiny GPT on this rank (8 sequences, AdamW), as a function to time
    (``size``: another of :data:`.techniques.SIZES`)."""
    from ..models.data import MarkovCorpus
    from ..models.gpt import GPT
    from .techniques import model_config

    cfg = model_config(size)
    torch.manual_seed(0)
    model = GPT(cfg).to(rank_device())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, 8, cfg.block_size, device=rank_device())

    def step():
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    return step


def _reference_seconds(quick: bool = False) -> float:
    return median_seconds(_reference_step(), reps=7 if quick else 15)


def reference_step_seconds(world: int, quick: bool = False, timeout_s: float = 120) -> float:
    """The reference step timed now on ``world`` ranks at once (the median over ranks), as
    :func:`calibrate` timed it into ``profile.reference_step_s``: their ratio is how much slower the
    machine is than when it was calibrated."""
    from ..runtime.launch import launch

    return statistics.median(launch(_reference_seconds, world, quick, timeout_s=timeout_s))


def _table_seconds(table: dict, ops) -> float:
    """The seconds of ``ops`` in a kernel table, added up (0 for an op it could not time)."""
    return sum(table.get(o.key) or 0.0 for o in ops)


def _framework_overhead(table: dict, quick: bool = False) -> dict:
    """A whole step of the tiny GPT on this rank (8 sequences, AdamW): measured, and its ops' table sum.
    The difference, per Python line the step executed, is the framework's cost, which no op timed alone
    contains. Both sides are medians, the statistic a measured step reports; the step is timed 15 times
    (``quick``: 7, and each op 3 times) before its ops and again after them, and the faster of the two
    counts: a difference of two timings, the per-line cost is what a moment of other work on the
    machine would move most."""
    step = _reference_step()
    reps = 7 if quick else 15
    before = median_seconds(step, reps=reps)
    with WorkloadRecorder() as rec:
        step()
    ops = [o for o in rec.items if isinstance(o, Op)]
    time_kernels(ops, table, reps=3 if quick else 5, footprint=rec.footprint)
    measured = min(before, median_seconds(step, reps=reps))  # a burst of other work hits one, not both
    alone = _table_seconds(table, ops)
    flops = sum(o.flops for o in ops)
    return {"step_s": measured, "ops_alone_s": alone, "n_ops": len(ops), "flops": flops,
            "python_lines": rec.lines, "per_line_s": max(0.0, (measured - alone) / max(rec.lines, 1))}


def _cache_effect_rank(sizes, quick: bool) -> list:
    out = []
    for size in sizes:
        step = _reference_step(size)
        step()
        with WorkloadRecorder() as rec:
            step()
        ops = [o for o in rec.items if isinstance(o, Op)]
        runs = {"step_s": [], "hot_s": [], "footprint_s": []}
        for _ in range(1 if quick else 3):  # interleaved: a slow moment of the machine hits all three
            runs["step_s"].append(median_seconds(step, reps=5 if quick else 11))
            hot, spread = time_kernels(ops, reps=3), time_kernels(ops, reps=3, footprint=rec.footprint)
            runs["hot_s"].append(_table_seconds(hot, ops))
            runs["footprint_s"].append(_table_seconds(spread, ops))
        out.append({"size": size, "footprint_bytes": rec.footprint, "n_ops": len(ops),
                    **{k: statistics.median(v) for k, v in runs.items()}})
    return out


def cache_effect(sizes=("tiny", "10x"), world: int = 2, quick: bool = False, timeout_s: float = 300) -> list:
    """The reference step at each of ``sizes`` on ``world`` ranks (all busy), against the sum of its ops
    timed alone two ways: hot (one argument set, always in cache) and over the step's footprint (as the
    kernel table times them); the three timed in turn three times (``quick``: once), their medians.
    Rank 0's rows: ``size, step_s, hot_s, footprint_s, footprint_bytes, n_ops``."""
    from ..runtime.launch import launch

    return launch(_cache_effect_rank, world, tuple(sizes), quick, timeout_s=timeout_s)[0]


def _kernel_runs(techniques, sizes, world: int) -> list[tuple[Technique, str]]:
    """``(record, size)`` of each step whose ops go into the kernel table, resolved once before the ranks
    start: each of ``techniques`` (names or records) at each of ``sizes``, raising ``ValueError`` naming
    the fix for one that cannot run on ``world`` ranks; None: every technique, those that cannot left
    out."""
    from . import techniques as T

    chosen = [T.resolve(t) for t in (T.TECHNIQUES if techniques is None else techniques)]  # names first
    for size in sizes:
        T.model_config(size)
    runs = []
    for size in sizes:
        for tech in chosen:
            try:
                runs.append((T.resolve(tech, world, size), size))
            except ValueError:
                if techniques is not None:
                    raise
    return runs


def _technique_kernels(table: dict, runs, quick: bool = False) -> list:
    """Record one step of each ``(technique, size)`` of ``runs`` on this rank and time its ops alone
    (``quick``: each 3 times instead of 5)."""
    from . import techniques as T

    done = []
    for tech, size in runs:
        spec = T.make_step(tech, size, dist.get_world_size())
        spec.step()  # warm-up: optimizer state, buffers
        with WorkloadRecorder() as rec:
            spec.step()
        time_kernels(rec.items, table, reps=3 if quick else 5, footprint=rec.footprint)
        done.append(f"{tech.name}/{size}")
    return done


def _rank(runs, quick: bool = False) -> dict:
    """Everything one rank measures (all ranks at once)."""
    out = {"collectives": _alpha_beta(quick), "collective_overhead_s": _collective_overhead(),
           "overlap": _overlap(), "async_start_s": _async_start(), "matmul": _gemm_table(),
           "copy_bytes_per_s": _copy_bandwidth(),
           "op_overhead_s": _op_overhead()}
    table: dict = {}
    out["reference"] = _framework_overhead(table, quick)
    out["recorded"] = _technique_kernels(table, runs, quick)
    out["kernels"] = table
    return out


def _kernels_rank(runs, quick: bool) -> dict:
    """The kernel table of ``runs`` alone, on one rank (all ranks at once)."""
    table: dict = {}
    return {"recorded": _technique_kernels(table, runs, quick), "kernels": table}


def _merge_kernels(per_rank) -> dict:
    """One table for all ranks: the mean of the ranks that timed a key (None where none could)."""
    keys = {k for r in per_rank for k in r["kernels"]}
    merged = {}
    for k in keys:
        ts = [r["kernels"][k] for r in per_rank if r["kernels"].get(k) is not None]
        merged[k] = sum(ts) / len(ts) if ts else None
    return {k: v for k, v in merged.items() if v is not None}


def calibrate(world: int = 2, out=None, sizes=("tiny", "10x"), techniques=None,
              timeout_s: float = 600, quick: bool = False) -> tuple[MachineProfile, dict]:
    """Measure this machine on ``world`` ranks; write the profile to ``out`` (None: the user's cache;
    False: nowhere, a notebook's own); return ``(profile, details)`` (details: the sweeps, the reference
    step). ``sizes`` and ``techniques`` (names or records) choose whose ops go into the kernel table
    (default: every technique that runs on ``world`` ranks; (): none); ``quick``: the same measurements
    on fewer points and repetitions (a smoke run's)."""
    from ..runtime.env import hardware_summary
    from ..runtime.launch import launch

    if isinstance(world, bool) or not isinstance(world, int) or world < 2:
        raise ValueError(f"--world {world!r}: collectives need at least 2 ranks; "
                         f"use --world 2 (one rank per core)")
    runs = _kernel_runs(techniques, sizes, world)
    res = launch(_rank, world, runs, quick, timeout_s=timeout_s)
    r0 = res[0]
    ref = [r["reference"] for r in res]
    gemm_peak = max(f / t for f, t in r0["matmul"])
    med = lambda key: statistics.median(r[key] for r in res)
    profile = MachineProfile(
        name="calibrated", device=hardware_summary().split(" | ")[0], kind="calibrated", world_size=world,
        threads_per_rank=1, memory_bytes=_memory_bytes(), peak_flops={"fp32": gemm_peak},
        matmul={"fp32": r0["matmul"]}, op_overhead_s=med("op_overhead_s"),
        copy_bytes_per_s=med("copy_bytes_per_s"), collective_overhead_s=med("collective_overhead_s"),
        collectives={op: {k: v[k] for k in ("alpha_s", "beta_s_per_byte")}
                     for op, v in r0["collectives"].items()},
        collective_sweeps={op: v["sweep"] for op, v in r0["collectives"].items()},
        overlap=med("overlap"), async_start_s=med("async_start_s"),
        python_line_s=statistics.median(x["per_line_s"] for x in ref),
        reference_step_s=statistics.median(x["step_s"] for x in ref),
        kernels=_merge_kernels(res), hardware=hardware_summary(), created=date.today().isoformat(),
        sources={"peak_flops.fp32": "the fastest GEMM of the sweep on this machine (measured)"},
        notes=[f"{world} ranks, one thread each, all busy while measuring" + (", quick" if quick else ""),
               f"recorded: {', '.join(r0['recorded'])}"])
    path = None if out is False else profile.save(out or default_profile_path())
    return profile, {"path": str(path), "collectives": r0["collectives"], "reference": ref}


def time_techniques(profile: MachineProfile, techniques, sizes=("tiny",), quick: bool = False,
                    timeout_s: float = 600) -> MachineProfile:
    """A copy of ``profile`` (calibrated on this machine) whose kernel table also holds the ops of one step
    of each of ``techniques`` at ``sizes``, timed alone as :func:`calibrate` times them; the ops it
    already holds keep their times, and nothing else is measured again."""
    from ..runtime.launch import launch

    if profile.kind != "calibrated":
        raise ValueError(f"profile {profile.name!r} is {profile.kind}: only a profile calibrated here can "
                         f"time more ops; run calibrate")
    runs = _kernel_runs(techniques, sizes, profile.world_size)
    res = launch(_kernels_rank, profile.world_size, runs, quick, timeout_s=timeout_s)
    return dataclasses.replace(profile, kernels={**_merge_kernels(res), **profile.kernels},
                               notes=[*profile.notes, f"recorded: {', '.join(res[0]['recorded'])}"])


def _memory_bytes() -> float:
    try:
        import os
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0.0


# --- the table and the command line ----------------------------------------------------------------


def format_profile(p: MachineProfile, details: dict | None = None) -> str:
    """A profile as a readable table (and, after a calibration, what the reference step showed)."""
    rows = []
    for op in COLLECTIVES:
        a, b = p.alpha_beta(op)
        rows.append([op, f"{a * 1e6:.1f}", f"{1 / b / 1e9 if b > 0 else float('inf'):.2f}"])
    lines = [f"profile {p.name!r} ({p.kind}): {p.device}", f"  {p.hardware}" if p.hardware else "",
             f"  collectives on {p.world_size} ranks (ring model: steps·α + bus bytes·β)",
             *("  " + line for line in  # numbers to the right: their decimal points line up
               format_table(rows, ["op", "α (µs)", "1/β (GB/s)"], align="lrr").splitlines())]
    peak = ", ".join(f"{k} {v / 1e12:.3g} TF/s" for k, v in p.peak_flops.items() if v)
    big_flops, big_s = p.matmul["fp32"][-1]
    lines += [f"  peak: {peak}", f"  largest GEMM of the table: {big_flops / big_s / 1e9:.1f} GF/s fp32",
              f"  copy bandwidth {p.copy_bytes_per_s / 1e9:.1f} GB/s; one op {p.op_overhead_s * 1e6:.1f} µs; "
              f"one metered collective call +{p.collective_overhead_s * 1e6:.1f} µs",
              f"  overlap of an asynchronous all-reduce with compute: {p.overlap:.2f}; an asynchronous "
              f"message waits {p.async_start_s * 1e3:.2f} ms to start while its sender computes",
              f"  the framework around the ops: {p.python_line_s * 1e9:.0f} ns per Python line "
              f"(+{p.framework_overhead_s * 1e6:.1f} µs per op); kernel table: {len(p.kernels)} ops",
              f"  memory: {p.memory_bytes / 1e9:.0f} GB"]
    for ref in (details or {}).get("reference", [])[:1]:
        lines.append(f"  reference step (tiny GPT, 8 sequences, AdamW): {ref['step_s'] * 1e3:.2f} ms, "
                     f"its {ref['n_ops']} ops alone {ref['ops_alone_s'] * 1e3:.2f} ms, "
                     f"{ref['python_lines']} Python lines "
                     f"({ref['flops'] / ref['step_s'] / 1e9:.2f} GF/s achieved)")
    for k, v in sorted(p.sources.items()):
        lines.append(f"  source {k}: {v}")
    return "\n".join(x for x in lines if x)


def add_arguments(parser) -> None:
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2: one per core)")
    parser.add_argument("--out", help="where to write the profile (default: the user's cache directory)")
    parser.add_argument("--show", metavar="NAME|PATH", help="print a profile (h100, h200, a100, file)")
    parser.add_argument("--techniques", help="comma-separated techniques whose ops to time (default: all)")
    parser.add_argument("--sizes", default="tiny,10x", help="model sizes whose ops to time (default: both)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer sweep points and repetitions: seconds instead of a minute (a smoke run)")


def main(args) -> int:
    """``python -m minitorch_dist calibrate``."""
    try:
        if args.show:
            print(format_profile(load_profile(args.show)))
            return 0
        t0 = time.perf_counter()
        techniques = args.techniques.split(",") if args.techniques else None
        sizes = args.sizes.split(",")
        profile, details = calibrate(args.world, args.out, sizes, techniques, quick=args.quick)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_profile(profile, details))
    print(f"wrote {details['path']} in {time.perf_counter() - t0:.0f} s")
    return 0
