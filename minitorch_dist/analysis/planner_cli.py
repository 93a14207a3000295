"""Chapter 12 — the planner's command line: ``python -m minitorch_dist plan``.

Prints the search of :func:`.planner.plan` as a table, the configuration it chooses, and the
published configuration of the model (``planner_presets.PUBLISHED``) ranked in the same search,
its predicted throughput next to the reported one. Every time comes from a machine profile
(``--profile h100|h200|a100|PATH``; default the ``--gpu``'s shipped profile): there is no
efficiency to set. When nothing fits, :func:`why_nothing_fits` says which rule failed and what to
change.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from .. import costmodel
from .planner import (
    NO_EFFICIENCY,
    Assumptions,
    Cluster,
    Config,
    candidates,
    check_config,
    evaluate,
    format_plans,
    memory_per_gpu,
    plan,
    rank_of,
)
from .planner_presets import GPUS, MODELS, PUBLISHED, GPUSpec, ModelSpec, get_gpu, get_model
from .profiles import load_profile


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
    p.add_argument("--gpu", choices=sorted(GPUS),
                   help="accelerator: its memory, and its shipped profile unless --profile (default h100; "
                        "cpu: this machine's calibrated profile)")
    p.add_argument("--profile", help="the machine profile every time comes from: h100, h200, a100, or a file "
                                     "written by `python -m minitorch_dist calibrate` (default: the --gpu's)")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs sharing one NVLink domain (default: the profile's, else 8)")
    p.add_argument("--top", type=_count, default=10, help="how many configurations to print (default 10)")
    p.add_argument("--efficiency", help=argparse.SUPPRESS)  # removed: refused with the reason
    p.add_argument("--precision", choices=("mixed", "fp32"), default="mixed")
    p.add_argument("--no-main-grad", action="store_true",
                   help="16-bit gradients (the ZeRO paper's 16 B/param of model states) instead of "
                        "Megatron-LM's fp32 main_grad buffer (18 B/param, reduced in fp32)")
    p.add_argument("--zero", type=int, nargs="+", choices=(0, 1, 2, 3), default=[0, 1, 2, 3],
                   help="stages to try")
    p.add_argument("--recompute", nargs="+", choices=costmodel.RECOMPUTE, default=list(costmodel.RECOMPUTE))
    p.add_argument("--sequence-parallel", action="store_true", help="also try Megatron sequence parallelism")
    p.add_argument("--no-overlap", action="store_true",
                   help="do not hide the DP gradient sync behind backward")


# --- why nothing fits -------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _sizes(n: int, model: ModelSpec, cluster: Cluster, micro_batches, a: Assumptions):
    """The tp and pp that divide what they must; the (tp, pp, dp) of ``n`` GPUs whose dp divides B/b."""
    widths = (model.heads, model.vocab, model.mlp_ratio * model.hidden)
    tps = [t for t in _divisors(min(cluster.gpus_per_node, n)) if all(w % t == 0 for w in widths)]
    pps = [q for q in _divisors(model.layers) if model.layers % (q * a.v) == 0]
    bs = micro_batches or [2 ** i for i in range(model.global_batch.bit_length())]
    shapes = [(t, q, n // (t * q)) for t in tps for q in pps if n % (t * q) == 0
              and any(model.global_batch % (n // (t * q) * b) == 0 for b in bs)]
    return tps, pps, shapes


def _gpu_counts(model: ModelSpec, cluster: Cluster, micro_batches, a: Assumptions) -> list[int]:
    """The GPU counts (whole nodes past one) that some (tp, pp, dp) shape of `_sizes` fits, ascending."""
    per_node = cluster.gpus_per_node
    counts = {t * q * d for t in _divisors(per_node) for q in _divisors(model.layers)
              for d in _divisors(model.global_batch)}
    return sorted(k for k in counts if (k <= per_node or k % per_node == 0)
                  and _sizes(k, model, cluster, micro_batches, a)[2])


def _why_no_candidates(model: ModelSpec, cluster: Cluster, zero, recompute, sequence_parallel, micro_batches,
                       a: Assumptions) -> str:
    """The divisibility rule that leaves :func:`candidates` empty, and the fix."""
    n = cluster.n_gpus
    tps, pps, shapes = _sizes(n, model, cluster, micro_batches, a)
    if not shapes:
        ok = _gpu_counts(model, cluster, micro_batches, a)
        below, above = max((k for k in ok if k < n), default=0), min((k for k in ok if k > n), default=0)
        use = (f"use {below} or {above} GPUs" if below and above else f"use {above} GPUs" if above else
               f"use {below} GPUs (no larger count works with {cluster.gpus_per_node} per node)" if below else
               f"no GPU count works with microbatch sizes {micro_batches}: use sizes that divide it")
        return (f"{n} GPUs = tp*pp*dp has no factorization with tp | {cluster.node_size} GPUs per node, "
                f"the heads, vocab and MLP width (tp in {tps}), pp | {model.layers} layers (pp in {pps}) "
                f"and dp*b | global batch {model.global_batch}; {use}")
    if not [z for z in zero for (_, q, d) in shapes if z == 0 or d > 1]:
        return (f"ZeRO {sorted(zero)} fits none of the shapes (tp, pp, dp) {shapes}: ZeRO-1/2/3 need "
                f"dp > 1; add stage 0 (--zero 0)")
    t, q, d = shapes[0]
    try:
        check_config(Config(t, q, d, 1, max(1, model.global_batch // d), min(zero), recompute[0],
                            any(sequence_parallel)), model, cluster, a)
    except ValueError as e:
        return f"no configuration passes check_config, e.g. {e}"
    return "no configuration passes check_config"


def why_nothing_fits(model, cluster: Cluster, zero=(0, 1, 2, 3), recompute=costmodel.RECOMPUTE,
                     sequence_parallel=(False,), micro_batches=None,
                     assumptions: Assumptions = Assumptions()) -> str:
    """Why :func:`plan` finds nothing with these arguments, and what to change: the divisibility
    rule no configuration passes, or the smallest memory per GPU found against the usable memory.
    It suggests only what was not already searched."""
    model, a, n = get_model(model), assumptions, cluster.n_gpus
    found = candidates(model, cluster, zero, recompute, sequence_parallel, micro_batches, a)
    if not found:
        return _why_no_candidates(model, cluster, zero, recompute, sequence_parallel, micro_batches, a)
    totals = [mem["total"] for mem in memory_per_gpu(found, model, cluster, a)]
    best = evaluate(found[totals.index(min(totals))], model, cluster, a)  # time only the smallest
    if best.fits:
        return f"nothing is wrong: {best.config} and others fit"
    cap, gpu = best.memory["capacity"], cluster.gpu
    states = costmodel.model_state_bytes(model.params, a.precision, a.optimizer, a.main_grad)["total"]
    found_text = (f"the smallest memory per GPU among the {len(found)} valid configurations is "
                  f"{best.memory['total'] / 1e9:,.1f} GB ({best.config}) > {cap / 1e9:.1f} GB usable "
                  f"({a.usable_memory:.0%} of {gpu.memory_bytes / 1e9:.0f} GB, {gpu.name})")
    if states > n * cap:  # no partitioning helps: even perfectly sharded, the states overflow
        enough = [k for k in _gpu_counts(model, cluster, micro_batches, a) if k * cap >= states]
        return (f"{found_text}; the model states alone are {states / 1e9:,.0f} GB, more than {n} GPUs "
                f"hold: use at least {enough[0] if enough else -(-states // cap):.0f} GPUs")
    tries = [f"{what} ({flag})" for what, flag, searched in (
        ("full recomputation", "--recompute full", "full" in recompute), ("ZeRO-3", "--zero 3", 3 in zero),
        ("sequence parallelism", "--sequence-parallel", any(sequence_parallel))) if not searched]
    return f"{found_text}; try " + ", ".join(tries + ["more GPUs"])


# --- the command ----------------------------------------------------------------------------------

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
        peak = cluster.peak_flops(a.get("precision", "mixed"))
        extra = costmodel.recompute_overhead(pub.recompute, model.seq, model.hidden, model.layers,
                                             model.vocab)
        print(f"  reported: {pub.tflops_per_gpu:.0f} TFLOP/s per GPU = "
              f"{pub.tflops_per_gpu * 1e12 / peak:.1%} of peak, i.e. MFU "
              f"{pub.tflops_per_gpu * 1e12 / peak / (1 + extra):.1%} without the recomputation; "
              f"predicted / reported = {p.tflops_per_gpu / pub.tflops_per_gpu:.2f}")


def gpu_of(profile) -> GPUSpec:
    """The planner's GPU (memory, peak) for a profile: the preset of the same name, else one built
    from the profile's own numbers (its memory, its bf16 peak, its links)."""
    prof = load_profile(profile)
    if prof.name in GPUS:
        return GPUS[prof.name]
    inter = prof.inter_node or prof.collectives["all_reduce"]
    peak = prof.peak_flops.get("bf16") or max(prof.peak_flops.values())
    return GPUSpec(prof.device, prof.memory_bytes, peak, prof.alpha_beta("all_reduce"),
                   (inter["alpha_s"], inter["beta_s_per_byte"]), f"profile {prof.name}")


def _cluster(args) -> Cluster:
    profile = load_profile(args.profile) if args.profile else None
    gpu = get_gpu(args.gpu) if args.gpu else gpu_of(profile) if profile else get_gpu("h100")
    return Cluster(gpu, args.gpus, args.gpus_per_node, profile)


def _describe(cluster: Cluster, precision: str) -> str:
    """The GPU and the profile's rates the times come from, one line each."""
    g, prof = cluster.gpu, cluster.profile
    dtype = "bf16" if precision == "mixed" else "fp32"
    rates = ", ".join(f"{f / prof.matmul_seconds(f, dtype) / 1e12:.0f} at {f:.0e}" for f in (1e9, 1e11, 1e13))
    inter = (f", network {1 / prof.inter_node['beta_s_per_byte'] / 1e9:.0f} GB/s per GPU"
             if prof.inter_node else "")
    bus = 1 / prof.alpha_beta("all_reduce")[1]
    return (f"on {cluster.n_gpus} x {g.name}, {cluster.node_size} per node, {g.memory_bytes / 1e9:.0f} GB "
            f"each\nprofile {prof.name} ({prof.kind}, {prof.device}): {dtype} GEMM TFLOP/s {rates} FLOPs; "
            f"memory {prof.copy_bytes_per_s / 1e9:.0f} GB/s; all-reduce bus {bus / 1e9:.0f} GB/s{inter}; "
            f"peak {cluster.peak_flops(precision) / 1e12:.0f} TFLOP/s for MFU")


def main(args) -> int:
    """``python -m minitorch_dist plan``: the search as a table, the choice, and the published
    configuration."""
    if args.efficiency is not None:
        print(f"error: {NO_EFFICIENCY}", file=sys.stderr)
        return 2
    try:
        model, cluster = get_model(args.model), _cluster(args)
        a = dict(precision=args.precision, overlap_dp=not args.no_overlap, main_grad=not args.no_main_grad)
        sp = (False, True) if args.sequence_parallel else (False,)
        n_valid = len(candidates(model, cluster, args.zero, args.recompute, sp, assumptions=Assumptions(**a)))
        plans = plan(model, cluster=cluster, zero=args.zero, recompute=args.recompute, sequence_parallel=sp,
                     **a)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"Plan for {model.name}: {model.params / 1e9:.1f} B parameters, {model.layers} layers, hidden "
          f"{model.hidden}, {model.heads} heads, seq {model.seq}, vocab {model.vocab}, global batch "
          f"{model.global_batch} ({model.source})")
    print(_describe(cluster, args.precision))
    states = costmodel.model_state_bytes(1, args.precision, "adamw", a["main_grad"])["total"]
    grads = ("fp32 main_grad" if a["main_grad"] and args.precision == "mixed"
             else "gradients in the weights' dtype")
    print(f"assumptions: {args.precision} precision AdamW, {grads}: {states:g} B/param of model states; "
          f"Megatron's fused kernels; 1F1B; DP sync {'not ' if args.no_overlap else ''}overlapped with "
          f"backward; 90% of memory usable (analysis/planner.py, costmodel/planner_time.py)")
    print(f"{n_valid} configurations satisfy divisibility; {len(plans)} fit in memory. "
          f"Columns gemm..opt: share of the step time.\n")
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
