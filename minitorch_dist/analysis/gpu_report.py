"""Chapter 00 — the GPU report: the only place the course gets GPU numbers (chapters 11 and 12 read it).

Every other experiment in the course runs on a laptop CPU; the notebooks quote GPU figures from the
files this module writes. On a CUDA machine ``make gpu-report`` (``python -m
minitorch_dist.analysis.gpu_report``) measures, each section on its own so that one failure is
recorded as ``{"error": ...}`` and the rest of the report survives:

    tests        the ``gpu``-marked tests (pass / fail counts and the tail of their output)
    calibrate    ``python -m minitorch_dist calibrate --world N``: the machine profile (chapter 00)
    collectives  bus bandwidth of all_reduce / all_gather / reduce_scatter over NCCL, 1 MB .. 1 GB,
                 nccl-tests' convention busbw = algbw * factor (:mod:`..runtime.busbw`)
    training     median step seconds of the course's DDP and ``fully_shard`` against torch's, on the
                 tiny GPT and a larger one, alternating ours / torch (chapters 01, 06, 12)
    kernels      the Triton kernels' GB/s against a copy (:mod:`..kernels.bench`, chapter 11)
    attention    our FlashAttention-2 (Triton) against SDPA's flash backend, TFLOP/s forward and
                 forward + backward (:mod:`..kernels.attention_bench`, chapter 11)
    matmul       bf16 GEMM TF/s, n = 1024 .. 8192, timed with CUDA events (the roof MFU is read against)
    mfu          the tiny GPT's model FLOPs utilisation on one GPU under bf16 autocast (chapter 12)

It writes ``notebooks/results/gpu/<gpu-slug>-x<N>-<YYYY-MM-DD>.json`` and PNGs beside it. Without
CUDA it prints one line saying there is nothing to report and exits 0, writing nothing.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from .gpu_bench import IMPLS, MiB, bench_collectives, bench_matmul, bench_mfu, bench_training, guarded, tail

__all__ = ["SECTIONS", "gpu_slug", "report_stem", "write_report", "collect", "main"]

ROOT = Path(__file__).resolve().parents[2]  # the repository (an editable install)
DEFAULT_OUT = ROOT / "notebooks" / "results" / "gpu"
SECTIONS = ("tests", "calibrate", "collectives", "training", "kernels", "attention", "matmul", "mfu")


# --- naming and small helpers -------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: lower case, runs of anything else
    than letters and digits become one dash."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def report_stem(device: str, n_gpus: int, date: str) -> str:
    return f"{gpu_slug(device)}-x{n_gpus}-{date}"


def _subprocess(args: list, timeout_s: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout_s,
                          cwd=ROOT)


# --- 1, 2, 5: the sections that run a command ----------------------------------------------------------


_COUNTS = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def run_gpu_tests(timeout_s: float = 1800) -> dict:
    """The ``gpu``-marked tests (this module's own test left out: it runs this report)."""
    own = ROOT / "tests" / "test_gpu_report.py"
    proc = _subprocess(["-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", f"--ignore={own}",
                        str(ROOT / "tests")], timeout_s)
    out = proc.stdout + proc.stderr
    summary = next((ln for ln in reversed(out.splitlines()) if _COUNTS.search(ln)), "")
    res = {"returncode": proc.returncode, "counts": {k: int(v) for v, k in _COUNTS.findall(summary)},
           "summary": summary.strip("= "), "tail": tail(out)}
    if proc.returncode not in (0, 1):  # 1: some tests failed (counted); anything else: pytest itself
        res["error"] = f"pytest exited {proc.returncode}"
    return res


def run_json_command(args: list, path: Path, timeout_s: float) -> dict:
    """``python <args>``, which writes ``path``: its exit status, output tail and the JSON it wrote."""
    proc = _subprocess(args, timeout_s)
    res = {"command": " ".join(["python", *args]), "returncode": proc.returncode, "path": str(path),
           "tail": tail(proc.stdout + proc.stderr)}
    if proc.returncode == 0 and path.exists():
        res["results"] = json.loads(path.read_text())
    else:
        res["error"] = f"exited {proc.returncode}" + ("" if path.exists() else f", no {path.name} written")
    return res


# --- writing: the JSON and the PNGs ---------------------------------------------------------------------


def _figure(title: str, xlabel: str, ylabel: str):
    """A matplotlib Figure drawn by Agg, without pyplot's global state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(True, alpha=0.3)
    return fig, ax


def _plot_busbw(sec: dict, title: str):
    fig, ax = _figure(f"bus bandwidth, {title}", "buffer size (MiB)", "busbw (GB/s)")
    for op, rows in sec["ops"].items():
        rows = [r for r in rows if "busbw_GBps" in r]
        ax.plot([r["bytes"] / MiB for r in rows], [r["busbw_GBps"] for r in rows], "o-", label=op)
    ax.set_xscale("log", base=2), ax.legend()
    return fig


def _plot_training(sec: dict, title: str):
    fig, ax = _figure(f"step time, ours vs torch, {title}", "", "median step (ms)")
    models = [m for m, r in sec["models"].items() if "median_step_s" in r]
    if not models:
        raise ValueError("no model was timed")
    w = 0.8 / len(IMPLS)
    for i, impl in enumerate(IMPLS):
        ms = [sec["models"][m]["median_step_s"][impl] * 1e3 for m in models]
        ax.bar([j + (i - 1.5) * w for j in range(len(models))], ms, w, label=impl)
    ax.set_xticks(range(len(models)), models), ax.set_yscale("log"), ax.legend()
    return fig


def _plot_matmul(sec: dict, title: str):
    fig, ax = _figure(f"{sec['dtype']} matmul, {title}", "n (square n x n GEMM)", "TF/s")
    ax.plot([r["n"] for r in sec["rows"]], [r["tflops"] for r in sec["rows"]], "o-")
    ax.set_xscale("log", base=2)
    return fig


PLOTS = {"collectives": ("busbw", _plot_busbw), "training": ("steps", _plot_training),
         "matmul": ("matmul", _plot_matmul)}


def write_json(result: dict, out_dir: Path, stem: str) -> Path:
    path = Path(out_dir) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    return path


def write_report(result: dict, out_dir: Path, stem: str) -> list[Path]:
    """``<stem>.json`` and a ``<stem>-<plot>.png`` for each plotted section that has numbers; a plot
    that fails is recorded under ``result["plot_errors"]`` (and in the JSON), never raised."""
    title = f"{result.get('device', '?')} x{result.get('n_gpus', '?')}"
    written, errors = [], {}
    for section, (suffix, plot) in PLOTS.items():
        sec = result.get(section)
        if not isinstance(sec, dict) or "error" in sec or sec.get("skipped"):
            continue
        try:
            path = Path(out_dir) / f"{stem}-{suffix}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            plot(sec, title).savefig(path, dpi=120, bbox_inches="tight")
            written.append(path)
        except Exception as e:  # the numbers matter more than the picture
            errors[section] = f"{type(e).__name__}: {e}"
    if errors:
        result["plot_errors"] = errors
    return [write_json(result, out_dir, stem), *written]


# --- the report -----------------------------------------------------------------------------------------


def _sections(n_gpus: int, name: str, out_dir: Path, stem: str, smoke: bool) -> dict:
    """section -> (function, *arguments)."""
    dev = torch.device("cuda", 0)
    profile, kernels = out_dir / f"{stem}-profile.json", out_dir / f"{stem}-kernels.json"
    attention = out_dir / f"{stem}-attention.json"
    return {
        "tests": (run_gpu_tests,),
        "calibrate": (run_json_command, ["-m", "minitorch_dist", "calibrate", "--world", str(n_gpus),
                                         "--out", str(profile)], profile, 600),
        "collectives": (bench_collectives, n_gpus, smoke),
        "training": (bench_training, n_gpus, smoke),
        "kernels": (run_json_command, ["-m", "minitorch_dist.kernels.bench", "--out", str(kernels),
                                       *(["--smoke"] if smoke else [])], kernels, 1800),
        "attention": (run_json_command, ["-m", "minitorch_dist.kernels.attention_bench", "--out",
                                         str(attention), *(["--smoke"] if smoke else [])], attention, 1800),
        "matmul": (bench_matmul, [1024, 2048] if smoke else [1024, 2048, 4096, 8192], dev),
        "mfu": (bench_mfu, dev, name),
    }


def collect(out_dir: Path, smoke: bool = False, skip=()) -> tuple[dict, str]:
    """Run every section not in ``skip`` on this CUDA machine; the JSON is rewritten after each one, so
    a report cut short keeps what it measured. Returns (result, file stem)."""
    from ..runtime.env import hardware_summary

    out_dir = Path(out_dir).resolve()  # the commands run in the repository root
    n_gpus, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    date = time.strftime("%Y-%m-%d", time.gmtime())
    stem = report_stem(name, n_gpus, date)
    result = {"device": name, "n_gpus": n_gpus, "date": date, "torch": torch.__version__,
              "cuda": torch.version.cuda, "smoke": smoke, "skipped": sorted(skip)}
    try:
        result["hardware"] = hardware_summary()
    except Exception as e:  # a report without the line beats no report
        result["hardware"] = {"error": f"{type(e).__name__}: {e}"}
    for section, (fn, *args) in _sections(n_gpus, name, out_dir, stem, smoke).items():
        result[section] = {"skipped": True} if section in skip else guarded(section, fn, *args)
        write_json(result, out_dir, stem)
    return result, stem


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m minitorch_dist.analysis.gpu_report",
                                 description="Measure the course's GPU numbers (needs CUDA; on a CPU "
                                             "machine it says so and exits 0).")
    ap.add_argument("--out-dir", type=Path, default=DEFAULT_OUT,
                    help=f"where the JSON and PNGs go (default {DEFAULT_OUT.relative_to(ROOT)})")
    ap.add_argument("--smoke", action="store_true", help="small sizes: minutes, not tens of minutes")
    ap.add_argument("--skip", nargs="+", action="extend", default=[], choices=SECTIONS, metavar="SECTION",
                    help=f"sections to leave out, any of: {', '.join(SECTIONS)}")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if not torch.cuda.is_available():
        from ..runtime.env import hardware_summary
        cpu = hardware_summary().split(" | ")[0]
        print(f"gpu-report: no CUDA device on this machine ({cpu}); nothing to report")
        return 0
    result, stem = collect(args.out_dir, smoke=args.smoke, skip=set(args.skip))
    paths = write_report(result, args.out_dir, stem)
    failed = [s for s in SECTIONS if isinstance(result.get(s), dict) and "error" in result[s]]
    print(f"gpu-report: wrote {', '.join(str(p) for p in paths)}")
    print(f"gpu-report: failed sections: {', '.join(failed)}" if failed else "gpu-report: every section ran")
    return 0


if __name__ == "__main__":  # run the importable module's main, so spawned ranks unpickle its functions
    from minitorch_dist.analysis import gpu_report  # by reference, not by value from __main__

    sys.exit(gpu_report.main())
