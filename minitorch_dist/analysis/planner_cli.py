"""Chapter 12 — the planner's command line: ``python -m minitorch_dist plan``.

Prints the search of :func:`.planner.plan` as a table, the configuration it chooses, and the
published configuration of the model (``planner_presets.PUBLISHED``) ranked in the same search.
When nothing fits, :func:`.planner.why_nothing_fits` says which rule failed and what to change.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from . import costmodel
from .planner import (
    Assumptions,
    Cluster,
    Config,
    candidates,
    evaluate,
    format_plans,
    plan,
    rank_of,
    why_nothing_fits,
)
from .planner_presets import GPUS, MODELS, PUBLISHED, ModelSpec, get_gpu, get_model


def _count(text: str) -> int:
    """``--top``: a positive whole number."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (e.g. --top 5), got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = sorted({*MODELS, *(a for m in MODELS.values() for a in m.aliases)})
    p.add_argument("--model", required=True, choices=names,
                   help="a named model (planner_presets.MODELS, or one of its aliases)")
    p.add_argument("--gpus", type=int, required=True, help="number of GPUs, e.g. 1024")
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="accelerator (default h100)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs sharing one NVLink domain (default 8)")
    p.add_argument("--top", type=_count, default=10, help="how many configurations to print (default 10)")
    p.add_argument("--efficiency", type=float, default=0.5,
                   help="fraction of peak FLOP/s the math reaches (0.5)")
    p.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    p.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1, 2, 3],
                   help="stages to try")
    p.add_argument("--recompute", nargs="+", choices=costmodel.RECOMPUTE, default=list(costmodel.RECOMPUTE))
    p.add_argument("--sequence-parallel", action="store_true", help="also try Megatron sequence parallelism")
    p.add_argument("--no-overlap", action="store_true",
                   help="do not hide the DP gradient sync behind backward")


def _published(model: ModelSpec, cluster: Cluster, plans: list, a: dict) -> None:
    """Print the published configuration of ``model`` next to the search (PUBLISHED presets)."""
    pub = PUBLISHED.get(model.name)
    if pub is None or cluster.n_gpus % (pub.tp * pub.pp):
        return
    dp = cluster.n_gpus // (pub.tp * pub.pp)
    c = Config(pub.tp, pub.pp, dp, pub.micro_batch, model.global_batch // (dp * pub.micro_batch), pub.zero,
               pub.recompute)
    print(f"\npublished for {pub.gpus} x {pub.gpu.upper()} ({pub.source}):")
    try:
        p = evaluate(c, model, cluster, Assumptions(**a))
    except ValueError as e:
        print(f"  not possible on this cluster: {e}")
        return
    rank = rank_of(plans, **asdict(c))
    # the space Megatron-LM had in 2021: no distributed optimizer, full activation recomputation
    old = plan(model, cluster=cluster, zero=(pub.zero,), recompute=(pub.recompute,), **a)
    old_rank = rank_of(old, **asdict(c))
    print(f"  {c}: predicted here {p.step_time:.2f} s/step, MFU {p.mfu:.1%}, {p.tflops_per_gpu:.0f} TFLOP/s "
          f"per GPU, {p.memory['total'] / 1e9:.1f} GB per GPU" + ("" if p.fits else " (does not fit)"))
    print(f"  rank {rank or '-'} of {len(plans)} in the full search; rank {old_rank or '-'} of {len(old)} "
          f"among zero={pub.zero}, recompute={pub.recompute} (the space the publication searched)")
    if pub.tflops_per_gpu and get_gpu(pub.gpu) == cluster.gpu and pub.gpus == cluster.n_gpus:
        peak = cluster.gpu.peak_flops
        extra = costmodel.recompute_overhead(pub.recompute, model.seq, model.hidden, model.layers,
                                             model.vocab)
        print(f"  reported: {pub.tflops_per_gpu:.0f} TFLOP/s per GPU = "
              f"{pub.tflops_per_gpu * 1e12 / peak:.1%} of peak, i.e. MFU "
              f"{pub.tflops_per_gpu * 1e12 / peak / (1 + extra):.1%} without the recomputation")


def main(args) -> int:
    """``python -m minitorch_dist plan``: the search as a table, the choice, and the published
    configuration."""
    try:
        model, cluster = get_model(args.model), Cluster(args.gpu, args.gpus, args.gpus_per_node)
        a = dict(efficiency=args.efficiency, precision=args.precision, overlap_dp=not args.no_overlap)
        sp = (False, True) if args.sequence_parallel else (False,)
        n_valid = len(candidates(model, cluster, args.zero, args.recompute, sp, assumptions=Assumptions(**a)))
        plans = plan(model, cluster=cluster, zero=args.zero, recompute=args.recompute, sequence_parallel=sp,
                     **a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    g = cluster.gpu
    print(f"Plan for {model.name}: {model.params / 1e9:.1f} B parameters, {model.layers} layers, hidden "
          f"{model.hidden}, {model.heads} heads, seq {model.seq}, vocab {model.vocab}, global batch "
          f"{model.global_batch} ({model.source})")
    print(f"on {cluster.n_gpus} x {g.name}, {cluster.node_size} per node: {g.memory_bytes / 1e9:.0f} GB, "
          f"{g.peak_flops / 1e12:.0f} TFLOP/s bf16 dense, NVLink {1 / g.intra_node[1] / 1e9:.0f} GB/s, "
          f"network {1 / g.inter_node[1] / 1e9:.0f} GB/s per GPU and direction")
    print(f"assumptions: compute at {args.efficiency:.0%} of peak; {args.precision} precision AdamW; 1F1B; "
          f"DP sync {'not ' if args.no_overlap else ''}overlapped with backward; 90% of memory usable "
          f"(analysis/planner.py)")
    print(f"{n_valid} configurations satisfy divisibility; {len(plans)} fit in memory. "
          f"Columns compute..dp: share of the step time.\n")
    if not plans:
        print("Nothing fits: " + why_nothing_fits(model, cluster, args.zero, args.recompute, sp,
                                                  assumptions=Assumptions(**a)) + ".")
        return 1
    print(format_plans(plans, args.top))
    best = plans[0]
    print(f"\nchosen: {best.config}: {best.step_time:.2f} s/step, MFU {best.mfu:.1%} (6ND: "
          f"{best.mfu_6nd:.1%}), {best.tflops_per_gpu:.0f} TFLOP/s per GPU executed, "
          f"{best.memory['total'] / 1e9:.1f} GB per GPU")
    _published(model, cluster, plans, a)
    return 0
