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
    matmul       bf16 GEMM TF/s, n = 1024 .. 8192, timed with CUDA events (the roof MFU is read against)
    mfu          the tiny GPT's model FLOPs utilisation on one GPU under bf16 autocast (chapter 12)

It writes ``notebooks/results/gpu/<gpu-slug>-x<N>-<YYYY-MM-DD>.json`` and PNGs beside it. Without
CUDA it prints one line saying there is nothing to report and exits 0, writing nothing.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

__all__ = ["SECTIONS", "gpu_slug", "report_stem", "write_report", "collect", "main"]

ROOT = Path(__file__).resolve().parents[2]  # the repository (an editable install)
DEFAULT_OUT = ROOT / "notebooks" / "results" / "gpu"
SECTIONS = ("tests", "calibrate", "collectives", "training", "kernels", "matmul", "mfu")
MiB = 2**20
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
LARGE_GPT = dict(vocab_size=50304, block_size=512, n_layer=12, n_head=12, n_embd=768)  # GPT-2 small
PROFILE_KEYS = {"H100": "h100", "H200": "h200", "A100": "a100"}
IMPLS = ("ours_ddp", "torch_ddp", "ours_fsdp", "torch_fsdp")


# --- naming and small helpers -------------------------------------------------------------------------


def gpu_slug(name: str) -> str:
    """``"NVIDIA H100 80GB HBM3"`` -> ``"nvidia-h100-80gb-hbm3"``: lower case, runs of anything else
    than letters and digits become one dash."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def report_stem(device: str, n_gpus: int, date: str) -> str:
    return f"{gpu_slug(device)}-x{n_gpus}-{date}"


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _guarded(name: str, fn, *args) -> dict:
    """``fn(*args)``, or ``{"error", "traceback"}`` if it raised: one section's failure is recorded."""
    t0 = time.perf_counter()
    print(f"gpu-report: {name} ...", flush=True)
    try:
        out = fn(*args)
    except Exception as e:  # noqa: BLE001 - recorded in the report, the next section still runs
        out = {"error": f"{type(e).__name__}: {e}", "traceback": _tail(traceback.format_exc(), 30)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"gpu-report: {name} {'FAILED: ' + out['error'] if 'error' in out else 'done'} "
          f"({out['seconds']} s)", flush=True)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_s(fn, device: torch.device) -> float:
    """Seconds of one ``fn()``: CUDA events on a GPU, the wall clock (after a sync) elsewhere."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


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
           "summary": summary.strip("= "), "tail": _tail(out)}
    if proc.returncode not in (0, 1):  # 1: some tests failed (counted); anything else: pytest itself
        res["error"] = f"pytest exited {proc.returncode}"
    return res


def run_json_command(args: list, path: Path, timeout_s: float) -> dict:
    """``python <args>``, which writes ``path``: its exit status, output tail and the JSON it wrote."""
    proc = _subprocess(args, timeout_s)
    res = {"command": " ".join(["python", *args]), "returncode": proc.returncode, "path": str(path),
           "tail": _tail(proc.stdout + proc.stderr)}
    if proc.returncode == 0 and path.exists():
        res["results"] = json.loads(path.read_text())
    else:
        res["error"] = f"exited {proc.returncode}" + ("" if path.exists() else f", no {path.name} written")
    return res


# --- 3: collective bus bandwidth --------------------------------------------------------------------------


def _collective_call(op: str, nbytes: int, n: int, device: torch.device):
    """A zero-argument call of ``op`` on an ``nbytes`` fp32 buffer (the full, unsharded one)."""
    import torch.distributed as dist

    numel = max(n, nbytes // 4 // n * n)
    full = torch.ones(numel, device=device)
    part = torch.ones(numel // n, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch 2.13 renames
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    calls = {"all_reduce": lambda: dist.all_reduce(full), "all_gather": lambda: gather(full, part),
             "reduce_scatter": lambda: scatter(part, full)}
    return calls[op], numel * 4


def collectives_rank(sizes: list, ops=COLLECTIVE_OPS, warmup: int = 3, iters: int = 10) -> dict:
    """On every rank: median seconds of each collective and size; algbw = S / t, busbw = algbw *
    factor(n) (nccl-tests), with t the slowest rank's median. Under gloo the buffers sit on GPU 0 if
    there is one (ranks sharing a GPU), else on the CPU."""
    import torch.distributed as dist

    from ..runtime.busbw import BUS_FACTORS
    from ..runtime.launch import device

    dev = device()
    if dev.type == "cpu" and torch.cuda.is_available():
        dev = torch.device("cuda", 0)
    n, out = dist.get_world_size(), {}
    for op in ops:
        rows = []
        for nbytes in sizes:
            try:
                call, nbytes = _collective_call(op, nbytes, n, dev)
                for _ in range(warmup):
                    call()
                _sync(dev), dist.barrier()
                t = torch.tensor([statistics.median(_time_s(call, dev) for _ in range(iters))], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            except Exception as e:  # noqa: BLE001 - e.g. gloo has no reduce_scatter on CUDA tensors
                rows.append({"bytes": nbytes, "error": f"{type(e).__name__}: {e}"})
                break
            algbw = nbytes / t.item() / 1e9
            rows.append({"bytes": nbytes, "seconds": t.item(), "algbw_GBps": algbw,
                         "busbw_GBps": algbw * BUS_FACTORS[op](n)})
        out[op] = rows
    return {"device": str(dev), "world_size": n, "backend": dist.get_backend(), "ops": out}


def bench_collectives(n_gpus: int, smoke: bool) -> dict:
    """The sweep on all visible GPUs under NCCL; with one GPU, two gloo ranks share it."""
    from ..runtime.launch import launch

    sizes = [2**i * MiB for i in range(7 if smoke else 11)]  # 1 MiB .. 64 MiB or 1 GiB
    if n_gpus >= 2:
        res = launch(collectives_rank, n_gpus, sizes, backend="nccl", timeout_s=900)[0]
        res["note"] = "NCCL, one GPU per rank"
        return res
    try:
        res = launch(collectives_rank, 2, sizes[:7], backend="gloo", timeout_s=900, start_method="spawn")[0]
    except Exception as e:  # noqa: BLE001 - recorded with the reason there is no NCCL number
        return {"error": f"needs 2 GPUs (NCCL); gloo with 2 ranks sharing the one GPU failed: "
                         f"{type(e).__name__}: {e}"}
    res["note"] = ("needs 2 GPUs for NCCL: this is gloo with 2 ranks sharing one GPU (host staging and "
                   "loopback, not a GPU interconnect)")
    return res


# --- 4: our DDP and fully_shard against torch's ----------------------------------------------------------


def _wrap(impl: str, model, dev: torch.device):
    """``model`` (already on ``dev``) wrapped by one of the four implementations."""
    import torch.distributed as dist

    if impl == "ours_ddp":
        from ..parallelism.data_parallel import DistributedDataParallel
        return DistributedDataParallel(model)
    if impl == "torch_ddp":
        ids = [dev.index] if dev.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    if impl == "ours_fsdp":
        from ..memory.zero import fully_shard
        shard, kw = fully_shard, {}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as shard
        kw = {"mesh": init_device_mesh(dev.type, (dist.get_world_size(),))}
    for b in model.blocks:
        shard(b, **kw)
    return shard(model, **kw)


def _median_steps(cfg, batch: int, rounds: int, dev: torch.device, per_round: int = 2) -> dict:
    """Median step seconds of the four implementations, one model each (the same initial weights),
    timed in rounds alternating ours and torch's, so a clock or thermal drift hits both alike."""
    import torch.distributed as dist

    from ..models.gpt import GPT

    g = torch.Generator().manual_seed(1234 + dist.get_rank())
    x, y = (torch.randint(cfg.vocab_size, (batch, cfg.block_size), generator=g).to(dev) for _ in range(2))
    runs = {}
    for impl in IMPLS:
        torch.manual_seed(0)
        model = _wrap(impl, GPT(cfg).to(dev), dev)
        runs[impl] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))

    def step(impl):
        model, opt = runs[impl]
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for impl in IMPLS:
        for _ in range(3):
            step(impl)
    times = {impl: [] for impl in IMPLS}
    for _ in range(rounds):
        for impl in IMPLS:
            times[impl] += [_time_s(lambda: step(impl), dev) for _ in range(per_round)]
    return {impl: statistics.median(t) for impl, t in times.items()}


def training_rank(cfg_kw: dict, batch: int, rounds: int) -> dict:
    """On every rank: forward, loss, backward, AdamW step, zero_grad, of each implementation."""
    import torch.distributed as dist

    from ..models.gpt import GPTConfig
    from ..runtime.launch import device

    cfg, dev = GPTConfig(**cfg_kw), device()
    med = _median_steps(cfg, batch, rounds, dev)
    return {"config": cfg_kw, "batch_per_rank": batch, "seq": cfg.block_size, "device": str(dev),
            "world_size": dist.get_world_size(), "median_step_s": med,
            "ours_over_torch": {"ddp": med["ours_ddp"] / med["torch_ddp"],
                                "fsdp": med["ours_fsdp"] / med["torch_fsdp"]}}


def bench_training(n_gpus: int, smoke: bool) -> dict:
    """The four implementations on all visible GPUs under NCCL (one GPU: world 1, still NCCL); one
    launch per model, so a larger model that fails (out of memory, say) keeps the tiny one's numbers."""
    from ..models.gpt import GPTConfig
    from ..runtime.launch import launch

    large = ("small", GPTConfig.small()) if smoke else ("gpt2-small", GPTConfig(**LARGE_GPT))
    models = {}
    for name, cfg in (("tiny", GPTConfig.tiny()), large):
        models[name] = _guarded(f"training {name}", lambda c=cfg: launch(
            training_rank, n_gpus, vars(c), 8, 3 if smoke else 10, backend="nccl", timeout_s=1800)[0])
    return {"precision": "fp32 weights and math (torch defaults), AdamW", "models": models}


# --- 6, 7: matmul TF/s and the tiny GPT's MFU on one GPU -------------------------------------------------


def bench_matmul(sizes: list, device: torch.device, dtype=torch.bfloat16, warmup=3, iters=10) -> dict:
    """Square GEMMs: median seconds after warm-up, TF/s = 2 n^3 / t."""
    rows = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        for _ in range(warmup):
            torch.mm(a, b)
        _sync(device)
        t = statistics.median(_time_s(lambda: torch.mm(a, b), device) for _ in range(iters))
        rows.append({"n": n, "seconds": t, "tflops": 2 * n**3 / t / 1e12})
    return {"dtype": str(dtype).removeprefix("torch."), "device": str(device), "rows": rows,
            "timer": "CUDA events" if device.type == "cuda" else "wall clock"}


def flops_per_token(cfg) -> tuple[float, str]:
    """Model FLOPs per token and where the number comes from."""
    try:
        from .costmodel import model_flops_per_token
    except ImportError:  # N: the weights that multiply an activation (blocks' Linears, the LM head)
        h, f = cfg.n_embd, cfg.mlp_ratio * cfg.n_embd
        n = cfg.n_layer * (4 * h * h + 2 * h * f) + cfg.vocab_size * h
        fpt = 6 * n + 12 * cfg.n_layer * h * cfg.block_size
        return fpt, "inline 6*N + 12*L*h*s (costmodel.model_flops_per_token not importable)"
    return model_flops_per_token(cfg), "costmodel.model_flops_per_token"


def peak_flops(device_name: str, dtype: str = "bf16") -> tuple[float | None, str]:
    """The shipped profile's dense peak for a GPU whose name contains H100 / H200 / A100."""
    key = next((v for k, v in PROFILE_KEYS.items() if k in device_name.upper()), None)
    if key is None:
        return None, f"no shipped profile for {device_name!r} (known: {', '.join(PROFILE_KEYS)})"
    from .profiles import load_profile
    peak = load_profile(key).peak_flops.get(dtype)
    return peak, f"load_profile({key!r}).peak_flops[{dtype!r}]"


def bench_mfu(device: torch.device, device_name: str, batch: int = 64, steps: int = 10) -> dict:
    """Tokens/s of the tiny GPT's training step under bf16 autocast, times model FLOPs per token,
    over the device's peak."""
    from ..models.gpt import GPT, GPTConfig

    cfg = GPTConfig.tiny()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = (torch.randint(cfg.vocab_size, (batch, cfg.block_size), device=device) for _ in range(2))

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()
    t = statistics.median(_time_s(step, device) for _ in range(steps))
    tokens_per_s = batch * cfg.block_size / t
    fpt, fpt_source = flops_per_token(cfg)
    try:
        peak, peak_source = peak_flops(device_name)
    except Exception as e:  # noqa: BLE001 - a missing or broken profile: MFU null, with the reason
        peak, peak_source = None, f"{type(e).__name__}: {e}"
    return {"config": vars(cfg), "batch": batch, "step_s": t, "tokens_per_s": tokens_per_s,
            "flops_per_token": fpt, "flops_per_token_source": fpt_source, "peak_flops": peak,
            "peak_source": peak_source, "mfu": tokens_per_s * fpt / peak if peak else None}


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
        except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
            errors[section] = f"{type(e).__name__}: {e}"
    if errors:
        result["plot_errors"] = errors
    return [write_json(result, out_dir, stem), *written]


# --- the report -----------------------------------------------------------------------------------------


def _sections(n_gpus: int, name: str, out_dir: Path, stem: str, smoke: bool) -> dict:
    """section -> (function, *arguments)."""
    dev = torch.device("cuda", 0)
    profile, kernels = out_dir / f"{stem}-profile.json", out_dir / f"{stem}-kernels.json"
    return {
        "tests": (run_gpu_tests,),
        "calibrate": (run_json_command, ["-m", "minitorch_dist", "calibrate", "--world", str(n_gpus),
                                         "--out", str(profile)], profile, 600),
        "collectives": (bench_collectives, n_gpus, smoke),
        "training": (bench_training, n_gpus, smoke),
        "kernels": (run_json_command, ["-m", "minitorch_dist.kernels.bench", "--out", str(kernels),
                                       *(["--smoke"] if smoke else [])], kernels, 1800),
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
    except Exception as e:  # noqa: BLE001 - a report without the line beats no report
        result["hardware"] = {"error": f"{type(e).__name__}: {e}"}
    for section, (fn, *args) in _sections(n_gpus, name, out_dir, stem, smoke).items():
        result[section] = {"skipped": True} if section in skip else _guarded(section, fn, *args)
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
