"""Chapter 00 — the GPU report's measurements: collective bus bandwidth, ours against torch's, GEMMs, MFU.

Each function measures one section of :mod:`.gpu_report` on the devices at hand: NCCL bus bandwidth
(nccl-tests' busbw = algbw x factor, :mod:`..runtime.busbw`), the median step of the course's DDP and
``fully_shard`` against torch's, bf16 GEMM TF/s, and the tiny GPT's model FLOPs utilisation
(``costmodel.model_flops_per_token`` over the shipped profile's dense peak). Every time is the course's
one clock (:mod:`..runtime.timing`), with CUDA events on a GPU and the wall clock elsewhere. They also
run on CPU ranks (gloo), which is how they are tested without a GPU.
"""
from __future__ import annotations

import statistics
import time
import traceback

import torch

from ..costmodel import model_flops_per_token
from ..runtime.dtypes import torch_name
from ..runtime.timing import seconds, sync, timed_runs

__all__ = ["MiB", "COLLECTIVE_OPS", "LARGE_GPT", "PROFILE_KEYS", "IMPLS", "guarded", "tail",
           "collectives_rank", "bench_collectives", "training_rank", "bench_training", "bench_matmul",
           "peak_flops", "bench_mfu"]

MiB = 2**20
COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter")
LARGE_GPT = dict(vocab_size=50304, block_size=512, n_layer=12, n_head=12, n_embd=768)  # GPT-2 small
PROFILE_KEYS = {"H100": "h100", "H200": "h200", "A100": "a100"}
IMPLS = ("ours_ddp", "torch_ddp", "ours_fsdp", "torch_fsdp")


def tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.splitlines()[-lines:])


def guarded(name: str, fn, *args) -> dict:
    """``fn(*args)``, or ``{"error", "traceback"}`` if it raised: one section's failure is recorded."""
    t0 = time.perf_counter()
    print(f"gpu-report: {name} ...", flush=True)
    try:
        out = fn(*args)
    except Exception as e:  # recorded in the report, the next section still runs
        out = {"error": f"{type(e).__name__}: {e}", "traceback": tail(traceback.format_exc(), 30)}
    out["seconds"] = round(time.perf_counter() - t0, 1)
    print(f"gpu-report: {name} {'FAILED: ' + out['error'] if 'error' in out else 'done'} "
          f"({out['seconds']} s)", flush=True)
    return out


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
                sync(dev), dist.barrier()  # every rank starts the timed calls together
                t = torch.tensor([seconds(call, iters, warmup=0, device=dev, cuda_events=True)], device=dev)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
            except Exception as e:  # e.g. gloo has no reduce_scatter on CUDA tensors
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
    except Exception as e:  # recorded with the reason there is no NCCL number
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
            times[impl] += timed_runs(lambda impl=impl: step(impl), per_round, warmup=0, device=dev,
                                      cuda_events=True)
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
        models[name] = guarded(f"training {name}", lambda c=cfg: launch(
            training_rank, n_gpus, vars(c), 8, 3 if smoke else 10, backend="nccl", timeout_s=1800)[0])
    return {"precision": "fp32 weights and math (torch defaults), AdamW", "models": models}


# --- 6, 7: matmul TF/s and the tiny GPT's MFU on one GPU -------------------------------------------------


def bench_matmul(sizes: list, device: torch.device, dtype=torch.bfloat16, warmup=3, iters=10) -> dict:
    """Square GEMMs: median seconds after warm-up, TF/s = 2 n^3 / t."""
    rows = []
    for n in sizes:
        a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
        t = seconds(lambda a=a, b=b: torch.mm(a, b), iters, warmup, device=device, cuda_events=True)
        rows.append({"n": n, "seconds": t, "tflops": 2 * n**3 / t / 1e12})
    return {"dtype": torch_name(dtype), "device": str(device), "rows": rows,
            "timer": "CUDA events" if device.type == "cuda" else "wall clock"}


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

    t = seconds(step, steps, warmup=3, device=device, cuda_events=True)
    tokens_per_s = batch * cfg.block_size / t
    fpt = model_flops_per_token(cfg)
    try:
        peak, peak_source = peak_flops(device_name)
    except Exception as e:  # a missing or broken profile: MFU null, with the reason
        peak, peak_source = None, f"{type(e).__name__}: {e}"
    return {"config": vars(cfg), "batch": batch, "step_s": t, "tokens_per_s": tokens_per_s,
            "flops_per_token": fpt, "flops_per_token_source": "costmodel.model_flops_per_token",
            "peak_flops": peak,
            "peak_source": peak_source, "mfu": tokens_per_s * fpt / peak if peak else None}


