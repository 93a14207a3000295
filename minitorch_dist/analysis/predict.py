"""Chapter 14 — predict, then measure: a technique's step time from the machine profile, beside the clock.

``python -m minitorch_dist predict --technique zero2 --world 2 [--size tiny|10x] [--profile P] [--measure]``

1. **Record** what one step of the technique does on every rank: ranks are launched, each builds the
   course's implementation (:mod:`.techniques`), takes one warm-up step, and records the next one with
   :class:`.workload.WorkloadRecorder` -- every op with its shapes, every collective with its group and
   bytes, and for a pipeline where each F, B and W action begins and ends. Nothing is timed.
2. **Predict** by replaying those records on the profile (:func:`.costmodel.replay_step`): each op's
   seconds from the kernel table or the roofline, each collective's from its α-β fit, the ranks'
   clocks kept in step by their collectives and messages.
3. **Measure** (``--measure``): the median of timed steps, each the slowest rank's
   (:func:`.techniques.measure`).

The prediction never sees the measurement; ``ratio`` = predicted / measured says how good it was, and
``breakdown`` says where the predicted time goes (compute, communication, the part of it left exposed,
the framework's fixed costs).

The technique's name is resolved once, at the entry (:func:`predict`, :func:`tour_row`, the command
line), into its :class:`.techniques.Technique` record, checked against the world and the size before any
rank starts; the record, not the name, is what the ranks and the measurement receive.
"""
from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
from typing import TYPE_CHECKING

from .. import costmodel
from ..runtime import observe
from ..runtime.tables import format_table
from .profiles import load_profile
from .workload import WorkloadRecorder, portable

if TYPE_CHECKING:
    from .techniques import Technique

__all__ = ["record_traces", "predict_step", "predict", "notebook_profile", "plot_predicted_vs_measured",
           "tour_row", "format_prediction", "summary_table", "add_arguments", "main"]


def _record_rank(tech: Technique, size: str, seed: int):
    import torch.distributed as dist

    from . import techniques as T

    spec = T.make_step(tech, size, dist.get_world_size(), seed=seed)
    spec.step()  # warm-up: the optimizer's state, the buffers, the first-call work
    # a pipeline's F, B, W actions are marked in the record
    with WorkloadRecorder() as rec, observe.watching(rec) if tech.marks_actions else contextlib.nullcontext():
        spec.step()
    return portable(rec.items), spec.config


def record_traces(technique: Technique | str, size: str, world: int, seed: int = 0,
                  timeout_s: float = 300) -> tuple:
    """``({rank: recorded items}, config)`` of one step of ``technique`` (a name or its record) on
    ``world`` ranks."""
    from . import techniques as T

    return _record_traces(T.resolve(technique, world, size), size, world, seed, timeout_s)


def _record_traces(tech: Technique, size: str, world: int, seed: int = 0, timeout_s: float = 300) -> tuple:
    from ..runtime.launch import launch

    out = launch(_record_rank, world, tech, size, seed, timeout_s=timeout_s)
    return {r: items for r, (items, _) in enumerate(out)}, out[0][1]


def predict_step(traces: dict, profile) -> dict:
    """The replayed step (:func:`.costmodel.replay_step`) of recorded ``traces`` on ``profile``."""
    return costmodel.replay_step(traces, load_profile(profile))


def predict(technique: Technique | str, world: int, size: str = "tiny", profile=None, measure: bool = False,
            reps: int = 7, seed: int = 0) -> dict:
    """Predict (and with ``measure`` time) one step of ``technique`` (a name or its record); the result of
    ``predict --json``."""
    from . import techniques as T

    tech = T.resolve(technique, world, size)  # the technique and the world first: they need no profile
    return _predict(tech, world, size, profile, measure, reps, seed)


def _predict(tech: Technique, world: int, size: str, profile, measure: bool, reps: int,
             seed: int = 0) -> dict:
    """:func:`predict` of a resolved technique."""
    from . import techniques as T

    prof = load_profile(profile)
    traces, config = _record_traces(tech, size, world, seed)
    res = predict_step(traces, prof)
    slowdown = _slowdown(prof, world) if measure else None
    measured = T.measure(tech, size, world, reps=reps)["median_s"] if measure else None
    return {"technique": tech.name, "world_size": world, "size": size, "config": config,
            "profile": prof.name, "device": prof.device, "predicted_s": res["step_s"], "measured_s": measured,
            "ratio": res["step_s"] / measured if measured else None, "machine_vs_calibration": slowdown,
            "breakdown": {k: res[k] for k in ("compute_s", "comm_s", "exposed_comm_s", "overhead_s")},
            "table_coverage": res["table_coverage"],
            "per_rank_s": {r: v["step_s"] for r, v in res["per_rank"].items()}}


def _slowdown(profile, world: int):
    """How much slower this machine is now than when ``profile`` was calibrated (its reference step timed
    again, right before the measurement); None for a profile not calibrated here."""
    from .calibrate import reference_step_seconds

    if profile.kind != "calibrated" or not profile.reference_step_s or profile.world_size != world:
        return None
    return reference_step_seconds(world) / profile.reference_step_s


def notebook_profile(techniques, sizes=("tiny",), world: int = 2, quick: bool = False):
    """A profile calibrated now for a notebook or the tour (kernel table of ``techniques``, names or
    records, only: a few seconds; ``quick``: fewer points, for a smoke run), kept in memory: the user's
    own profile is not overwritten."""
    from .calibrate import calibrate

    profile, _ = calibrate(world, out=False, sizes=tuple(sizes), techniques=tuple(techniques), quick=quick)
    return profile


def plot_predicted_vs_measured(rows, ax=None, title: str = "predicted vs measured step"):
    """Bars of predicted (split into compute, exposed communication, overhead) next to measured step
    times, one group per row of :func:`predict` results; the ratio over each group."""
    import matplotlib.pyplot as plt

    ax = ax or plt.subplots(figsize=(7, 3.5))[1]
    xs = range(len(rows))
    parts = (("compute_s", "compute"), ("exposed_comm_s", "exposed communication + waiting"),
             ("overhead_s", "framework overhead"))
    bottom = [0.0] * len(rows)
    for key, label in parts:
        vals = [r["breakdown"][key] * 1e3 for r in rows]
        ax.bar([x - 0.2 for x in xs], vals, 0.4, bottom=bottom, label=f"predicted: {label}")
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.bar([x + 0.2 for x in xs], [(r["measured_s"] or 0) * 1e3 for r in rows], 0.4, color="k", alpha=0.6,
           label="measured (median)")
    for x, r in zip(xs, rows):
        if r["ratio"]:
            top = max(bottom[x], (r["measured_s"] or 0) * 1e3)
            ax.text(x, top * 1.02, f"{r['ratio']:.2f}", ha="center", fontsize=8)
    ax.set_xticks(list(xs), [f"{r['technique']}\n{r['size']}, n={r['world_size']}" for r in rows], fontsize=8)
    ax.set_ylabel("step time (ms)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return ax


def tour_row(chapter: str, technique: Technique | str, smoke: bool = False, world: int = 2,
             size: str = "tiny") -> dict:
    """The tour's "predicted vs measured step" row of a chapter: ``technique`` on ``world`` ranks (the tiny
    GPT in a smoke run, else ``size``). Calibration and measurement run back to back: the machine is
    calibrated for this row (a quick calibration, with its technique's ops: seconds, so every row can
    have its own), the step is recorded and predicted, the calibration's reference step is timed again,
    and the step is measured.

    A *timing* row (``timing: True``): its ``ok`` says whether predicted / measured is within its band
    (25%; a smoke run's few steps: 2x), and ``note`` shows how much slower the machine was when it
    measured than when it calibrated -- on a machine busy with other work a ratio outside its band is
    that, not a failed experiment, and the tour's exit status depends on its exactness rows alone."""
    from . import techniques as T
    from .calibrate import reference_step_seconds

    size = "tiny" if smoke else size
    tech = T.resolve(technique, world, size)  # once: the calibration, the record and the clock take it
    profile = notebook_profile((tech,), (size,), world, quick=True)  # seconds: one per row
    traces, _ = _record_traces(tech, size, world)
    predicted = predict_step(traces, profile)["step_s"]
    slowdown = reference_step_seconds(world, quick=smoke) / profile.reference_step_s
    measured = T.measure(tech, size, world, reps=5 if smoke else 15)["median_s"]
    ratio = predicted / measured
    band = 1.0 if smoke else 0.25
    ok = 1 / (1 + band) <= ratio <= 1 + band if smoke else abs(ratio - 1) <= band
    within = "smoke: within 2x" if smoke else "within 25%"
    what = f"predicted vs measured {tech.name} step, {size}, {world} ranks (s), {within}"
    return {"chapter": chapter, "experiment": what, "theory": predicted, "measured": measured, "ok": ok,
            "timing": True, "note": _slowdown_note(ratio, slowdown, ok)}


def _slowdown_note(ratio: float, slowdown: float, ok: bool) -> str:
    """What a timing row says beside its ratio: the machine's slowdown since its calibration (and, when
    the ratio is outside its band, the load: other work on the cores the ranks run on)."""
    machine = (f"machine {slowdown:.1f}x slower than at calibration" if slowdown >= 1.2
               else f"machine {slowdown:.2f}x its calibrated time")
    if ok:
        return f"ratio {ratio:.2f}; {machine}"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"ratio {ratio:.2f}, outside its band; {machine}; load {load:.1f} on {os.cpu_count()} cores"


def format_prediction(res: dict) -> str:
    b = res["breakdown"]
    lines = [f"{res['technique']} on {res['world_size']} ranks, {res['size']} GPT, profile {res['profile']} "
             f"({res['device']})",
             f"  predicted step {res['predicted_s'] * 1e3:9.2f} ms = compute {b['compute_s'] * 1e3:.2f} "
             f"+ exposed communication and waiting {b['exposed_comm_s'] * 1e3:.2f} + framework overhead "
             f"{b['overhead_s'] * 1e3:.2f} ms (collectives {b['comm_s'] * 1e3:.2f} ms in all)",
             f"  ops timed in the profile's kernel table: {res['table_coverage']:.0%} (the rest: roofline)"]
    if res["measured_s"] is not None:
        lines.append(f"  measured step  {res['measured_s'] * 1e3:9.2f} ms (median; each step the slowest "
                     f"rank's)  predicted / measured = {res['ratio']:.3f}")
    if res.get("machine_vs_calibration"):
        lines.append(f"  the reference step now takes {res['machine_vs_calibration']:.2f}x its time at "
                     f"calibration (above 1: the machine is busier or slower than when it was calibrated)")
    return "\n".join(lines)


def add_arguments(p) -> None:
    from .techniques import SIZES, TECHNIQUES

    p.add_argument("--technique", required=True, help=f"one of {', '.join(TECHNIQUES)}, or all")
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--size", default="tiny", help=f"model size: {', '.join(SIZES)} or all (default tiny)")
    p.add_argument("--profile", help="h100, h200, a100 or a profile file (default: this machine's, "
                                     "from calibrate)")
    p.add_argument("--measure", action="store_true", help="also time the step here and print the ratio")
    p.add_argument("--reps", type=int, default=15, help="timed steps with --measure (default 15)")
    p.add_argument("--json", metavar="PATH", help="also write the result (a list with 'all') as JSON")


def _runs(args) -> list[tuple[Technique, str]]:
    """``(record, size)`` of each step the command line asks for, resolved and checked once."""
    from .techniques import SIZES, TECHNIQUES, resolve

    techniques = TECHNIQUES if args.technique == "all" else (args.technique,)
    sizes = SIZES if args.size == "all" else (args.size,)
    runs = []
    for size in sizes:
        for t in techniques:
            try:
                runs.append((resolve(t, args.world, size), size))
            except ValueError:
                if len(techniques) == 1:
                    raise
                # with "all": the techniques this world cannot run are left out
    return runs


def summary_table(results: list) -> str:
    """One line per result: predicted, measured, their ratio."""
    rows = []
    for r in results:
        slow = r.get("machine_vs_calibration")
        rows.append([r["technique"], r["size"], f"{r['predicted_s'] * 1e3:.2f}",
                     f"{r['measured_s'] * 1e3:.2f}" if r["measured_s"] else "-",
                     f"{r['ratio']:.3f}" if r["ratio"] else "-", f"{slow:.2f}x" if slow else "-"])
    lines = [format_table(rows, ["technique", "size", "predicted ms", "measured ms", "ratio",
                                 "machine vs calibration"], align="llrrrr")]
    ratios = [r["ratio"] for r in results if r["ratio"]]
    if len(ratios) > 1:
        lines.append(ratio_summary(ratios))
    return "\n".join(lines)


def ratio_summary(ratios) -> str:
    """The spread of predicted/measured ratios over runs, and its sign: a miss that is noise falls on
    both sides of 1; one that keeps one sign is a term the model lacks."""
    xs = sorted(float(x) for x in ratios)
    if not xs:
        raise ValueError("ratio_summary needs at least one ratio")
    return (f"{len(xs)} runs: ratios {xs[0]:.2f} to {xs[-1]:.2f}, median {statistics.median(xs):.2f}; "
            f"below 1: {sum(x < 1 for x in xs)} of {len(xs)}; within 25%: "
            f"{sum(abs(x - 1) <= 0.25 for x in xs)} of {len(xs)}")


def main(args) -> int:
    """``python -m minitorch_dist predict``."""
    try:
        runs = _runs(args)
        results = [_predict(t, args.world, size, args.profile, args.measure, args.reps) for t, size in runs]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for res in results:
        print(format_prediction(res))
    if len(results) > 1:
        print(summary_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=1, default=str)
    return 0
