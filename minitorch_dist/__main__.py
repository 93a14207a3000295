"""Chapter 00 — the command line: ``python -m minitorch_dist {tour,grade,...,calibrate,predict,figures}``
(or ``minitorch-dist``).

    tour      run each written chapter's headline experiment; print theory vs measured
    grade     run the exercise tests; print a per-exercise report (passed / failed / todo / blocked)
    estimate  model-state memory per device under ZeRO stages 0-3, from costmodel
    plan      search DP x TP x PP x ZeRO for a model on a cluster (chapter 12)
    schedule  print a pipeline schedule (chapter 03)
    dryrun    one rank's training step at the papers' scale, on meta tensors (chapter 12)
    calibrate measure this machine into a profile (collectives' α-β, GEMMs, ops); --show h100 (chapter 00)
    predict   a technique's step time from a profile, and with --measure the clock's (chapter 12)
    figures   draw the chapters' figures into chapters/figures/*.svg (--check: list stale ones)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

#: Published parameter counts for ``estimate --model``.
MODELS = {
    "gpt2": (117e6, "GPT-2 small, Radford et al. 2019, Table 2"),
    "gpt2-medium": (345e6, "Radford et al. 2019, Table 2"),
    "gpt2-large": (762e6, "Radford et al. 2019, Table 2"),
    "gpt2-xl": (1542e6, "Radford et al. 2019, Table 2"),
    "zero-7.5b": (7.5e9, "the worked example of ZeRO, Rajbhandari et al. 2020, Table 1"),
    "megatron-8.3b": (8.3e9, "Shoeybi et al. 2019 (Megatron-LM), Table 1"),
    "gpt3-13b": (13.0e9, "Brown et al. 2020, Table 2.1"),
    "gpt3-175b": (175.0e9, "Brown et al. 2020, Table 2.1"),
    "llama2-70b": (70e9, "Touvron et al. 2023 (Llama 2), Table 1"),
}

STAGES = {0: "none (plain data parallel)", 1: "optimizer states (P_os)",
          2: "+ gradients (P_os+g)", 3: "+ parameters (P_os+g+p)"}

#: ``schedule`` simulates at most this many (stage, microbatch, chunk) triples, p*m*v: a few seconds.
MAX_SCHEDULE_WORK = 100_000
#: ``schedule`` draws its chart only up to this many columns; wider, it prints the summary alone.
MAX_CHART_COLUMNS = 1000
#: The option through which a command writes a file: command -> (argument, flag, makes missing folders).
OUTPUTS = {"dryrun": ("json", "--json", False), "predict": ("json", "--json", False),
           "calibrate": ("out", "--out", True)}
#: The exit status of a command whose reader closed the pipe (``... | head``): 128 + SIGPIPE, as a shell says.
EXIT_BROKEN_PIPE = 141


def positive(kind: type, what: str, example: str):
    """An argparse ``type``: a finite ``kind`` (int or float) > 0, else an error that shows ``example``."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"must be {what} (e.g. {example}), got {text!r}")
        return value
    return parse


def _gb(nbytes: float) -> str:
    """Decimal GB to three significant figures, the way the ZeRO paper prints them."""
    v = nbytes / 1e9
    return f"{v:,.0f} GB" if v >= 1000 else f"{v:.3g} GB"


def per_device_bytes(num_params: float, dp: int, stage: int, precision: str, optimizer: str) -> float:
    """Model-state bytes one device holds under ZeRO `stage` (activations and buffers excluded)."""
    from . import costmodel

    parts = costmodel.model_state_bytes(num_params, precision, optimizer)
    w, g, o = (parts[k] / num_params for k in ("weights", "gradients", "optimizer"))  # bytes per parameter
    return costmodel.zero_memory_bytes(num_params, dp, stage, k=o, param_bytes=w, grad_bytes=g)


def estimate(args) -> int:
    if args.model:
        num_params, source = MODELS[args.model]
        what = f"{args.model} ({num_params:.4g} parameters; {source})"
    else:
        num_params, what = args.params, f"{args.params:.4g} parameters"
    if not (math.isfinite(num_params) and num_params > 0 and args.dp >= 1 and args.gpu_mem_gb > 0):
        print("error: --params and --gpu-mem-gb must be finite numbers > 0, and --dp >= 1", file=sys.stderr)
        return 2
    try:
        from . import costmodel

        parts = costmodel.model_state_bytes(num_params, args.precision, args.optimizer)
        stages = [args.zero] if args.zero is not None else [0, 1, 2, 3]
        rows = [(s, per_device_bytes(num_params, args.dp, s, args.precision, args.optimizer)) for s in stages]
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from .runtime.tables import format_table

    per = {k: parts[k] / num_params for k in ("weights", "gradients", "optimizer")}
    print(f"Model-state memory per device for {what}, {args.dp} data-parallel ranks")
    print(f"{args.precision} precision, {args.optimizer}: weights {per['weights']:g} + gradients "
          f"{per['gradients']:g} + optimizer K={per['optimizer']:g} bytes/parameter "
          f"(ZeRO, Rajbhandari et al. 2020, §5.1 and Table 1)")
    print("GB = 1e9 bytes, as in the paper; activations, buffers and fragmentation not included\n")
    body = [[str(s), STAGES[s], f"{b / num_params:.3g}", _gb(b),
             "yes" if b <= args.gpu_mem_gb * 1e9 else "no"]
            for s, b in rows]
    print(format_table(body,
                       ["stage", "partitions", "bytes/param", "per device", f"fits {args.gpu_mem_gb:g} GB"],
                       align="llrrl"))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .course import grade, tour

    p = argparse.ArgumentParser(prog="python -m minitorch_dist",
                                description="minitorch_dist: large-scale training as code you can read "
                                            "and numbers you can reproduce.",
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="examples:\n  python -m minitorch_dist tour --smoke\n"
                                       "  python -m minitorch_dist grade --chapter ch00\n"
                                       "  python -m minitorch_dist estimate --params 7.5e9 --dp 64\n")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("tour", help="run each written chapter's headline experiment: theory vs measured",
                       description=tour.__doc__.split("\n\n")[0])
    tour.add_arguments(t)
    t.set_defaults(func=tour.main)
    g = sub.add_parser("grade",
                       help="run the exercise tests; report passed / failed / todo / blocked per exercise",
                       description=grade.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    grade.add_arguments(g)
    g.set_defaults(func=grade.main)
    e = sub.add_parser("estimate", help="model-state memory per device under ZeRO stages 0-3",
                       description="Per-device memory of weights, gradients and optimizer states under "
                                   "ZeRO stage 0-3 (costmodel). Example, ZeRO's Table 1: "
                                   "--params 7.5e9 --dp 64 gives 120 / 31.4 / 16.6 / 1.88 GB.")
    size = e.add_mutually_exclusive_group(required=True)
    size.add_argument("--params", help="number of parameters, e.g. 7.5e9",
                      type=positive(float, "a positive, finite number of parameters", "--params 7.5e9"))
    size.add_argument("--model", choices=sorted(MODELS), help="a published model size")
    e.add_argument("--dp", type=positive(int, "a whole number >= 1", "--dp 64"), default=1,
                   help="data-parallel degree N_d (default 1)")
    e.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="one ZeRO stage (default: all four)")
    e.add_argument("--precision", choices=("mixed", "fp32"), default="mixed",
                   help="default mixed (fp16/bf16)")
    e.add_argument("--optimizer", default="adamw", help="adamw (default), sgd, ... (see costmodel)")
    e.add_argument("--gpu-mem-gb", type=positive(float, "a positive, finite number of GB", "--gpu-mem-gb 80"),
                   default=80,
                   help="device memory for the 'fits' column (default 80)")
    e.set_defaults(func=estimate)
    from .analysis import planner, planner_cli

    pl = sub.add_parser("plan",
                        help="search DP x TP x PP x ZeRO x recompute for a model on a cluster (chapter 12)",
                        description=(planner.__doc__.split("\n\n")[0] + " Example: --model gpt3-175b "
                                     "--gpus 1024 --gpu a100 (Narayanan et al. 2021's cluster)."))
    planner_cli.add_arguments(pl)
    pl.set_defaults(func=planner_cli.main)
    sc = sub.add_parser("schedule", help="print a pipeline schedule as a text Gantt chart (chapter 03)",
                        description="Each stage's actions (F forward, B backward, W weight gradient; "
                                    "microbatch.chunk) on a time axis, replayed by the chapter 03 simulator "
                                    "with unit times, then its bubble and peak stashed activations. "
                                    f"At most p*m*v = {MAX_SCHEDULE_WORK:,}; a chart wider than "
                                    f"{MAX_CHART_COLUMNS:,} columns is left out. "
                                    "Example: --name 1f1b -p 4 -m 8")
    sc.add_argument("--name", default="1f1b", help="naive, gpipe, 1f1b (default), interleaved, zb-h1, "
                                                   "zbv, dualpipev (the last two: 2 chunks per stage in a V)")
    whole = positive(int, "a whole number >= 1", "-p 4 -m 8")
    sc.add_argument("-p", type=whole, default=4, help="pipeline stages (default 4)")
    sc.add_argument("-m", type=whole, default=8, help="microbatches per step (default 8)")
    sc.add_argument("-v", type=whole, default=1, help="model chunks per stage, interleaved only (default 1; "
                                                       "zbv and dualpipev always hold 2)")
    sc.set_defaults(func=schedule)
    from .analysis import dryrun

    dr = sub.add_parser("dryrun", help="one rank's training step at the papers' scale, on meta tensors "
                                       "(chapter 12)",
                        description=dryrun.__doc__.split("\n\n")[0] + " Example: --model gpt3-175b "
                                    "--dp 8 --tp 8 --pp 16 --zero 1 --dtype bf16-mixed")
    dryrun.add_arguments(dr)
    dr.set_defaults(func=dryrun.main)
    from .analysis import calibrate, predict

    ca = sub.add_parser("calibrate", help="measure this machine: α-β per collective, GEMMs, ops (chapter 00)",
                        description=calibrate.__doc__.split("\n\n")[0] + " Example: --world 2; "
                                    "--show h100 prints a shipped GPU profile.")
    calibrate.add_arguments(ca)
    ca.set_defaults(func=calibrate.main)
    pr = sub.add_parser("predict", help="a technique's step time from the machine profile, then measured "
                                        "(chapter 12)",
                        description=predict.__doc__.split("\n\n")[0] + " Example: --technique ddp --world 2 "
                                    "--measure")
    predict.add_arguments(pr)
    pr.set_defaults(func=predict.main)
    fi = sub.add_parser("figures", help="draw the chapters' figures into chapters/figures/*.svg",
                        description="Draw every chapter's figures (course/figures/chNN_*.py) as SVG into "
                                    "chapters/figures/. Example: --chapter ch03; --check lists the "
                                    "committed figures that differ from what the code draws.")
    fi.add_argument("--chapter", help="one chapter's figures (ch03, 3 or 03_pipeline); default all")
    fi.add_argument("--check", action="store_true", help="write nothing; exit 1 if a figure is stale")
    fi.set_defaults(func=figures)
    sub.metavar = "{" + ",".join(sub.choices) + "}"  # the usage line names every command above
    return p


def figures(args) -> int:
    """Write (or ``--check``) the chapters' figures."""
    from .course import figures as figs
    from .course.registry import UnknownChapter, chapter

    try:
        tag = chapter(args.chapter).tag if args.chapter else None
    except UnknownChapter as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        old = figs.stale(tag)
        for name in old:
            print(f"stale: chapters/figures/{name}.svg (run: python -m minitorch_dist figures)")
        print(f"{len(figs.names_of(tag)) - len(old)} figure(s) up to date, {len(old)} stale")
        return 1 if old else 0
    changed = figs.generate(chapter=tag)
    for path in changed:
        print(f"wrote {path.relative_to(figs.FIGURE_DIR.parents[1])}")
    print(f"{len(changed)} figure(s) written, {len(figs.names_of(tag)) - len(changed)} already up to date")
    return 0


def _formula(args) -> str:
    """``costmodel.pipeline_bubble_fraction`` for the schedule, or "" where it has no formula."""
    from . import costmodel

    if args.name not in costmodel.SCHEDULES:
        return ""
    v = args.v if args.name == "interleaved" else 1
    bubble = costmodel.pipeline_bubble_fraction(args.name, args.p, args.m, v)
    return f"costmodel.pipeline_bubble_fraction: {bubble:.3f}"


def schedule(args) -> int:
    """Print ``make_schedule(name, p, m, v)`` as one row of time slots per stage (t_F = t_B = t_W = 1,
    so a slot is 1/v and an unsplit backward B takes two); over `MAX_CHART_COLUMNS`, the summary only."""
    from .parallelism.pipeline.schedules import SCHEDULES, V_SHAPED, make_schedule
    from .parallelism.pipeline.simulator import simulate

    work = args.p * args.m * (2 if args.name in V_SHAPED else args.v)
    if work > MAX_SCHEDULE_WORK and args.name in SCHEDULES:  # an unknown name: make_schedule says so
        print(f"error: p*m*v = {work:,} (stages x microbatches x chunks) is over the {MAX_SCHEDULE_WORK:,} "
              f"the simulator replays in a few seconds; use smaller -p or -m. {_formula(args)}",
              file=sys.stderr)
        return 2
    try:
        sched = make_schedule(args.name, args.p, args.m, args.v)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sim = simulate(sched)
    slots = round(sim.makespan * sched.v)
    width = max(len(e.name) for e in sim.events) + 1
    print(f"{sched.name}: p={sched.p} stages, m={sched.m} microbatches, v={sched.v}; one slot = 1/{sched.v} "
          f"of t_F (t_F = t_B = t_W)")
    columns = len(f"stage {sched.p - 1}: ") + slots * width - 1
    if columns > MAX_CHART_COLUMNS:
        print(f"(chart left out: {columns:,} columns wide, over {MAX_CHART_COLUMNS:,}; use smaller -p or -m "
              f"to see it)")
    for r in range(sched.p if columns <= MAX_CHART_COLUMNS else 0):
        row = ["." * (width - 1)] * slots
        for e in sim.stage_events(r):
            a, b = round(e.t_start * sched.v), round(e.t_end * sched.v)
            row[a:b] = [e.name] + ["-" * (width - 1)] * (b - a - 1)
        print(f"stage {r}: " + " ".join(c.ljust(width - 1) for c in row))
    peak = sim.peak_stashed if sched.p <= 32 else \
        f"{max(sim.peak_stashed):g} at most, {min(sim.peak_stashed):g} at least"
    print(f"bubble fraction {sim.bubble_fraction:.3f}; peak stashed microbatches per stage {peak}")
    if sched.overlapped:
        print(f"overlapped F&B pairs per stage {[len(x) for x in sched.overlapped]}: each an F and the other "
              f"chunk's whole B, started once both inputs are there, run back to back")
    if _formula(args):
        print(_formula(args))
    return 0


def output_problem(path, flag: str, make_folders: bool = False) -> str | None:
    """Why the file ``path`` (given with option ``flag``) cannot be written, or None if it can. Checked
    before a command runs, so that a run of minutes never ends in an error about where to put its
    result. ``make_folders``: the command creates missing folders (then the nearest existing one counts)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return f"{flag} {path} is a folder: name a file in it, e.g. {flag} {p / 'result.json'}"
    folder = p.parent
    while make_folders and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.exists():
        return (f"{flag} {path}: the folder {folder} does not exist; create it first (mkdir -p {folder}) "
                f"or choose a path in an existing folder")
    if not folder.is_dir():
        return f"{flag} {path}: {folder} is a file, not a folder; choose another path"
    writable = os.access(p, os.W_OK) if p.exists() else os.access(folder, os.W_OK | os.X_OK)
    if not writable:
        return (f"{flag} {path}: {p if p.exists() else folder} is not writable by this user; choose a path "
                f"you can write, e.g. {flag} {Path.home() / p.name}")
    return None


def _output_problem(args) -> str | None:
    """``output_problem`` for the file this command will write (``OUTPUTS``), if any."""
    if args.command not in OUTPUTS:
        return None
    attr, flag, make_folders = OUTPUTS[args.command]
    path = getattr(args, attr)
    if args.command == "calibrate" and not getattr(args, "show", None) and path is None:
        from .analysis.profiles import default_profile_path

        path = default_profile_path()  # where calibrate writes without --out
    return None if path is None else output_problem(path, flag, make_folders)


def _run(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    problem = _output_problem(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return args.func(args)


def main(argv: list[str] | None = None) -> int:
    """The entry point. A reader that closes the pipe early (``python -m minitorch_dist schedule | head``)
    ends the command quietly with status ``EXIT_BROKEN_PIPE``: the rest of the output goes nowhere, as
    the Python documentation recommends (the "Note on SIGPIPE" of the ``signal`` module)."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # a closed pipe shows here, where it can be caught, not at interpreter exit
        return code
    except BrokenPipeError:
        try:  # the interpreter flushes stdout at exit once more: send that to devnull
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # a stdout with no file descriptor (captured output)
            pass
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
