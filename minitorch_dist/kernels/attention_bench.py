"""Chapter 11 — timing FlashAttention: the tiled PyTorch path on a CPU, the Triton kernel on a GPU.

Two questions, two machines.

- **On this CPU** (no interpreter involved): how does the tiled PyTorch algorithm
  (:func:`.attention_tiled.tiled_attention`) compare in time with standard attention —
  ``F.scaled_dot_product_attention`` restricted to its *math* backend, which forms the S × S scores
  — and with SDPA's own fused CPU kernel? And how many bytes does each keep for the backward
  (``torch.autograd.graph.saved_tensors_hooks``)? :func:`cpu_sweep`.
- **On a GPU**: our Triton kernel (:func:`.flash_attention.flash_attention`, compiled) against SDPA's
  flash backend, forward and forward + backward, in TFLOP/s (matmul FLOPs of
  ``costmodel.attention_flops`` over the median time, :func:`._runtime.time_ms`). :func:`gpu_sweep`,
  run by ``make gpu-report`` (section ``attention``) or ``python -m minitorch_dist.kernels.attention_bench
  --out FILE``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from .. import costmodel
from ..runtime.dtypes import torch_name
from ..runtime.timing import seconds
from ._runtime import time_ms
from .attention_tiled import tiled_attention

__all__ = ["saved_bytes", "best_seconds", "cpu_sweep", "gpu_sweep", "main"]


def saved_bytes(fn, *args) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn(*args)`` runs (each storage once)."""
    seen: dict = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sum(seen.values())


def best_seconds(fn, reps: int = 3) -> float:
    """The best of ``reps`` wall-clock runs after one warm-up (this process, its thread count): the
    course's one clock (:func:`..runtime.timing.seconds`) with ``reduce=min``, since on a shared CPU
    the fastest run is the one least disturbed by other work."""
    return seconds(fn, reps, warmup=1, reduce=min)


def _cpu_impls(block: int):
    def math(q, k, v):
        with sdpa_kernel(SDPBackend.MATH):  # standard attention: the scores are formed
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    return {
        "standard (SDPA math)": math,
        "tiled FlashAttention-2 (PyTorch)": lambda q, k, v: tiled_attention(q, k, v, True, None,
                                                                            block, block),
        "SDPA's fused CPU kernel": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }


def cpu_sweep(seqs, batch: int = 1, heads: int = 4, head_dim: int = 64, block: int = 128,
              reps: int = 3) -> dict:
    """Forward + backward seconds and saved bytes of each implementation, causal, fp32, per length."""
    out = {"seqs": list(seqs), "block": block, "impls": {}}
    for name, fn in _cpu_impls(block).items():
        rows = {"seconds": [], "saved_bytes": []}
        for s in seqs:
            q, k, v = (torch.randn(batch, heads, s, head_dim, requires_grad=True) for _ in range(3))
            do = torch.randn(batch, heads, s, head_dim)

            def step(q=q, k=k, v=v, do=do, fn=fn):
                torch.autograd.backward(fn(q, k, v), do)

            rows["seconds"].append(best_seconds(step, reps))
            rows["saved_bytes"].append(saved_bytes(fn, q, k, v))
        out["impls"][name] = rows
    return out


def gpu_sweep(seqs=(1024, 2048, 4096, 8192), head_dims=(64, 128), batch: int = 4, heads: int = 16,
              dtype=torch.bfloat16) -> dict:
    """TFLOP/s of ours (Triton, compiled) and SDPA's flash backend, causal, forward and fwd + bwd."""
    if not torch.cuda.is_available():
        raise RuntimeError("the attention benchmark times compiled kernels on a CUDA GPU; "
                           "this machine has none")
    from . import backend
    from .flash_attention import flash_attention

    if backend() != "cuda":
        raise RuntimeError("TRITON_INTERPRET is set: unset it before importing minitorch_dist.kernels")
    impls = {"ours (Triton)": lambda q, k, v: flash_attention(q, k, v, causal=True),
             "SDPA flash": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)}
    rows = []
    for d in head_dims:
        for s in seqs:
            q, k, v = (torch.randn(batch, heads, s, d, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            do = torch.randn_like(q)
            fwd_flops = costmodel.attention_flops(batch, heads, s, s, d, causal=True)
            bwd_flops = costmodel.attention_flops(batch, heads, s, s, d, causal=True, backward=True,
                                                  flash=True)
            row = {"seq": s, "head_dim": d}
            for name, fn in impls.items():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    fwd = time_ms(lambda fn=fn, q=q, k=k, v=v: fn(q, k, v))
                    both = time_ms(lambda fn=fn, q=q, k=k, v=v, do=do:
                                   torch.autograd.backward(fn(q, k, v), do))
                row[name] = {"forward_TFLOPs": fwd_flops / fwd / 1e9,
                             "fwd_bwd_TFLOPs": (fwd_flops + bwd_flops) / both / 1e9}
            rows.append(row)
    return {"gpu": torch.cuda.get_device_name(0), "dtype": torch_name(dtype), "batch": batch,
            "heads": heads, "causal": True, "rows": rows,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minitorch_dist.kernels.attention_bench",
                                 description="FlashAttention on a GPU: ours (Triton) vs SDPA's flash backend")
    ap.add_argument("--out", required=True, help="results JSON file to write")
    ap.add_argument("--smoke", action="store_true", help="two lengths, one head size")
    args = ap.parse_args(argv)
    try:
        res = gpu_sweep((1024, 2048), (64,)) if args.smoke else gpu_sweep()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    for r in res["rows"]:
        print(f"S={r['seq']:5d} d={r['head_dim']:3d}: " + ", ".join(
            f"{k} fwd {v['forward_TFLOPs']:.0f} / fwd+bwd {v['fwd_bwd_TFLOPs']:.0f} TFLOP/s"
            for k, v in r.items() if isinstance(v, dict)))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
