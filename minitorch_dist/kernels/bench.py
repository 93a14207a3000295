"""Chapter 11 — GPU benchmark: effective bandwidth of softmax and LayerNorm forward vs size, next to a
copy.

A memory-bound kernel is as fast as the bytes it moves allow, and no kernel that reads a tensor
and writes one of the same size can beat ``y.copy_(x)``: the copy's bandwidth is the roof this
device reaches in practice (below the datasheet's HBM figure). For each row width N (M rows)
this times, with :func:`._runtime.time_ms` (the course's one clock as ``triton.testing.do_bench``
uses it: CUDA events, the median, L2 flushed between runs):

- ``eager``: the op-by-op PyTorch sequence (`softmax_reference`, `layernorm_eager`),
- ``torch``: PyTorch's own fused CUDA kernel (``torch.softmax``, ``F.layer_norm``),
- ``compile``: ``torch.compile`` of the eager sequence (Inductor generates a Triton kernel),
- ``triton``: this package's kernel,
- ``copy``: ``y.copy_(x)`` of an M x N tensor,

and reports each as effective bandwidth, the fused kernel's bytes over the time (2 M N bytes per
element size: read x once, write y once; Triton tutorials 02 and 05 use the same measure), so
``triton / copy`` is the fraction of achievable bandwidth. Chapter 11 asks for >= 0.8 at large N.

    python -m minitorch_dist.kernels.bench --out results.json [--smoke] [--dtype float16]

Needs a CUDA GPU with compiled Triton; on a CPU machine it refuses (the notebook then reads a
committed results file, labelled with the GPU it came from).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch
import torch.nn.functional as F

from ..runtime.dtypes import to_dtype, torch_name
from ..runtime.tables import format_table
from ._runtime import INTERPRET, time_ms, triton
from .layernorm import layernorm_forward
from .softmax import softmax_forward, softmax_reference

__all__ = ["KERNELS", "copy_bandwidth", "gbps", "main", "measure", "run", "require_gpu"]

SIZES = [256, 512, 1024, 2048, 4096, 8192, 16384]
SMOKE_SIZES = [256, 1024, 4096]


def require_gpu() -> None:
    """Raise with the reason when this machine cannot run the benchmark."""
    if not torch.cuda.is_available():
        raise RuntimeError("the kernel benchmark times compiled Triton kernels on a CUDA GPU, and this "
                           "machine has none (torch.cuda.is_available() is False); the chapter 11 notebook "
                           "reads the committed results file instead")
    if INTERPRET:
        raise RuntimeError("TRITON_INTERPRET is set, so the kernels would run in the interpreter: unset it "
                           "before importing minitorch_dist.kernels to benchmark compiled kernels")


def layernorm_eager(x, weight, bias, eps=1e-5):
    """LayerNorm as separate eager ops (mean, centre, variance, rsqrt, scale, shift): the sequence
    ``costmodel.layernorm_bytes(fused=False)`` counts (``xc.square()`` reads xc once; ``xc * xc``
    would count it twice)."""
    mean = x.mean(dim=-1, keepdim=True)
    xc = x - mean
    var = xc.square().mean(dim=-1, keepdim=True)
    return xc * torch.rsqrt(var + eps) * weight + bias


#: name -> (make inputs from (x), {implementation: fn(*inputs)}).
KERNELS = {
    "softmax": (lambda x: (x,), {
        "eager": softmax_reference,
        "torch": lambda x: torch.softmax(x, dim=-1),
        "compile": softmax_reference,  # compiled in measure()
        "triton": softmax_forward,
    }),
    "layernorm": (lambda x: (x, torch.randn(x.shape[-1], device=x.device, dtype=x.dtype),
                             torch.randn(x.shape[-1], device=x.device, dtype=x.dtype)), {
        "eager": layernorm_eager,
        "torch": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
        "compile": layernorm_eager,
        "triton": lambda x, w, b: layernorm_forward(x, w, b)[0],
    }),
}


def gbps(nbytes: float, ms: float) -> float:
    """Bytes moved in ``ms`` milliseconds, in GB/s (1 GB = 1e9 bytes)."""
    return nbytes / (ms * 1e-3) / 1e9


def copy_bandwidth(M: int, N: int, dtype=torch.float32) -> float:
    """GB/s of ``y.copy_(x)`` for M x N tensors: read x once, write y once."""
    require_gpu()
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    return gbps(2 * x.numel() * x.element_size(), time_ms(lambda: y.copy_(x)))


def measure(kernel: str, M: int, N: int, dtype=torch.float32,
            impls=("eager", "torch", "compile", "triton")) -> dict:
    """Effective GB/s of each implementation of ``kernel`` on an M x N input, and of a copy."""
    require_gpu()
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose from {sorted(KERNELS)}")
    make_inputs, fns = KERNELS[kernel]
    x = torch.randn(M, N, device="cuda", dtype=dtype)
    inputs = make_inputs(x)
    nbytes = 2 * x.numel() * x.element_size()
    row = {"M": M, "N": N, "bytes": nbytes}
    for name in impls:
        fn = fns[name]
        if name == "compile":
            # a fresh graph per shape: recompile limits would silently fall back to eager
            torch._dynamo.reset()
            fn = torch.compile(fn, dynamic=False)
        fn(*inputs)  # compile / autotune outside the timed runs
        row[name] = gbps(nbytes, time_ms(lambda fn=fn: fn(*inputs)))
    row["copy"] = copy_bandwidth(M, N, dtype)
    return row


def run(kernels=("softmax", "layernorm"), M: int = 4096, sizes=SIZES, dtype=torch.float32) -> dict:
    """The whole sweep, with the machine it ran on and ours / copy at the largest N."""
    require_gpu()
    props = torch.cuda.get_device_properties(0)
    results = {
        "gpu": torch.cuda.get_device_name(0), "compute_capability": f"{props.major}.{props.minor}",
        "gpu_memory_GiB": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
        "triton": triton.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "dtype": torch_name(dtype), "M": M,
        "unit": "GB/s effective (2 M N element bytes / median time)", "kernels": {}, "at_largest_n": {},
    }
    for k in kernels:
        rows = [measure(k, M, n, dtype) for n in sizes]
        results["kernels"][k] = rows
        last = rows[-1]
        fraction = last["triton"] / last["copy"]
        results["at_largest_n"][k] = {"N": last["N"], "fraction_of_copy": round(fraction, 3),
                                    "ok": fraction >= 0.8}
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minitorch_dist.kernels.bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results JSON file to write")
    ap.add_argument("--smoke", action="store_true",
                    help=f"M=1024 and N in {SMOKE_SIZES} (seconds, not minutes)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--kernels", default="softmax,layernorm",
                    help="comma-separated subset of softmax,layernorm")
    args = ap.parse_args(argv)
    try:
        require_gpu()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    results = run(tuple(args.kernels.split(",")), M=1024 if args.smoke else 4096,
                  sizes=SMOKE_SIZES if args.smoke else SIZES, dtype=to_dtype(args.dtype))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    columns = ("eager", "torch", "compile", "triton", "copy")
    for k, rows in results["kernels"].items():
        print(f"{k} on {results['gpu']} ({results['dtype']}, M={results['M']}), GB/s:")
        print(format_table([[r["N"], *(f"{r[c]:.0f}" for c in columns)] for r in rows],
                           ["N", *columns], align="r" * (1 + len(columns))))
        print(f"  triton / copy at N={results['at_largest_n'][k]['N']}: "
              f"{results['at_largest_n'][k]['fraction_of_copy']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
