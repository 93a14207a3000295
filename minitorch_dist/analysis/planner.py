"""Chapter 12 — choose data x tensor x pipeline parallelism, microbatches, ZeRO stage and
recomputation for a model on a cluster, from the cost model alone.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), §3 ("Performance Analysis of Parallelization Configurations": tensor
parallelism inside a node, pipeline across nodes, then data parallelism; the microbatch size) is
the recipe this search makes mechanical. Every configuration ``(t, p, d, b, zero, recompute)`` with
``t*p*d`` = the GPUs is scored:

**Divisibility** (:func:`check_config`): ``t`` divides the GPUs of a node (a tensor-parallel group
never leaves its NVLink domain), the heads and the vocabulary; ``p`` divides the layers; ``d*b``
divides the global batch ``B``, leaving ``m = B/(d*b)`` microbatches; ZeRO-2/3 only without
pipelining (they communicate per microbatch: ``costmodel.zero_dp_collectives``).

**Memory per GPU** (the first pipeline stage, which holds the embedding and the most activations)::

    model states = zero_memory_bytes(Psi_stage, d, zero)      Psi_stage = pipeline_stage_params(t, p)[0]
    activations  = pipeline_activation_bytes(s, b, h, a, L, t, p, m, sp, recompute)   (Korthikanti §4.2)

A configuration fits when their sum is at most ``usable_memory`` (0.9) of the GPU's: the rest is
the CUDA context, communication buffers, temporaries and fragmentation, which no formula here counts.

**Step time** (seconds, on the critical path of the first stage)::

    t_mb   = F_hw / (N * peak * efficiency) / m            compute of one microbatch on one stage
           + (L/p) * tensor_parallel_comm_time_per_layer    4 all-reduces a layer on NVLink (x1.5 if
                                                            full recompute re-runs the forward's 2)
           + 2 * p2p_time(b*s*h*e/t)                        activation out, gradient back (§4.1)
    t_step = m * t_mb * (1 + pipeline_bubble_ratio(p, m))   the (p-1)/m bubble of 1F1B (§2.2)
           + max(0, t_dp - overlap window)                  ZeRO's collectives on the DP link

``F_hw`` = ``megatron_flops_per_step`` (eq. 3) times ``1 + recompute_overhead``. The data-parallel
gradient sync can hide behind the backward it follows: the last microbatch's (stages 0/1: the sync
waits for the accumulated gradient), every microbatch's (stage 2), everything (stage 3). The
optimizer step and the embedding/output layers' imbalance between stages are left out.

**MFU** (Chowdhery et al. 2022, App. B) = model FLOPs (no recomputation) / (t_step * N * peak);
``mfu_6nd`` uses ``6 * params * tokens`` instead. ``tflops_per_gpu`` counts the FLOPs executed,
recomputation included: Narayanan's Table 1 counting, so the two compare.

**The efficiency.** Matmuls never run at the datasheet's peak. The default 0.5 of peak is an
assumption, set near Narayanan et al.'s end-to-end 44-52% of peak on A100s (Table 1, with the
bubble and communication inside it), so that predicted throughput lands in the published range;
change it with ``efficiency=``. It does not depend on the microbatch size here, so a larger ``b``
only lengthens the bubble and ``b = 1`` usually wins; real GEMMs get faster with ``b`` up to a point
(Narayanan §3.3.2). The planner predicts *ranks* better than it predicts seconds; checked against
all of Table 1 in ``tests/test_planner.py`` (within 25%).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from . import costmodel
from .planner_presets import GPUSpec, ModelSpec, get_gpu, get_model

__all__ = ["Assumptions", "Cluster", "Config", "Plan", "candidates", "check_config", "evaluate", "plan",
           "rank_of", "format_plans", "why_nothing_fits"]


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` GPUs of one kind, ``gpus_per_node`` to a node (NVLink inside, the network between)."""

    gpu: GPUSpec
    n_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self):
        if isinstance(self.gpu, str):
            object.__setattr__(self, "gpu", get_gpu(self.gpu))
        if self.n_gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"need gpus >= 1 and gpus_per_node >= 1, got {self.n_gpus}, "
                             f"{self.gpus_per_node}")
        if self.n_gpus > self.gpus_per_node and self.n_gpus % self.gpus_per_node:
            lo = self.n_gpus // self.gpus_per_node * self.gpus_per_node
            raise ValueError(f"gpus {self.n_gpus} is not divisible by gpus_per_node {self.gpus_per_node}: "
                             f"use whole nodes, e.g. {lo} or {lo + self.gpus_per_node} GPUs")

    @property
    def node_size(self) -> int:
        """GPUs that share one NVLink domain (fewer than a node when the cluster is one partial node)."""
        return min(self.gpus_per_node, self.n_gpus)

    def link(self, stride: int, size: int) -> tuple:
        """(alpha, beta) of a group of ``size`` ranks ``stride`` apart: NVLink if it fits in a node."""
        inside = stride * size <= self.node_size and self.node_size % (stride * size) == 0
        return self.gpu.intra_node if inside else self.gpu.inter_node


@dataclass(frozen=True)
class Config:
    """One point of the search: degrees, microbatch size ``b`` and count ``m``, ZeRO stage, recompute."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    microbatches: int
    zero: int = 0
    recompute: str = "none"
    sequence_parallel: bool = False

    def __str__(self) -> str:
        return (f"tp={self.tp} pp={self.pp} dp={self.dp} b={self.micro_batch} m={self.microbatches} "
                f"zero={self.zero} recompute={self.recompute}" + (" sp" if self.sequence_parallel else ""))


@dataclass(frozen=True)
class Assumptions:
    """What the cost model takes as given; see the module docstring for each."""

    efficiency: float = 0.5  #: fraction of peak FLOP/s the math runs at
    precision: str = "mixed"  #: "mixed" (16-bit weights/grads/activations, fp32 master + Adam) or "fp32"
    optimizer: str = "adamw"
    schedule: str = "1f1b"  #: "1f1b" or "interleaved" (v chunks per stage)
    v: int = 1
    overlap_dp: bool = True  #: hide the DP gradient sync behind the backward it follows
    usable_memory: float = 0.9  #: fraction of the GPU's memory tensors may use
    scatter_gather: bool = True  #: Narayanan §4.1: pipeline messages of b*s*h/t per rank

    def __post_init__(self):
        if not 0 < self.efficiency <= 1 or not 0 < self.usable_memory <= 1:
            raise ValueError(f"efficiency and usable_memory must be in (0, 1], got {self.efficiency}, "
                             f"{self.usable_memory}")
        if self.schedule not in ("1f1b", "interleaved") or (self.v != 1 and self.schedule != "interleaved"):
            raise ValueError(f"schedule must be '1f1b' or 'interleaved' (v > 1 only with interleaved), "
                             f"got {self.schedule!r}, v={self.v}")
        costmodel.optimizer_bytes_per_param(self.precision, self.optimizer)  # names the valid choices


@dataclass
class Plan:
    """A scored configuration. ``memory``: bytes per GPU; ``time``: seconds per step;
    ``comm_bytes``: bytes one GPU sends per step on each axis (ring model)."""

    config: Config
    memory: dict
    time: dict
    comm_bytes: dict
    mfu: float
    mfu_6nd: float
    tflops_per_gpu: float
    tokens_per_s: float
    fits: bool = field(default=True)

    @property
    def step_time(self) -> float:
        return self.time["total"]

    def row(self) -> dict:
        """A flat dict (config, memory, time, MFU): one row of a table or a DataFrame."""
        return {**asdict(self.config), **{f"mem_{k}": v for k, v in self.memory.items()},
                **{f"t_{k}": v for k, v in self.time.items()},
                **{f"bytes_{k}": v for k, v in self.comm_bytes.items()},
                "mfu": self.mfu, "mfu_6nd": self.mfu_6nd, "tflops_per_gpu": self.tflops_per_gpu,
                "tokens_per_s": self.tokens_per_s, "fits": self.fits}


def check_config(c: Config, model: ModelSpec, cluster: Cluster,
                 assumptions: Assumptions = Assumptions()) -> None:
    """Raise ValueError naming every rule ``c`` breaks for ``model`` on ``cluster`` (and the fix)."""
    errors = []
    if min(c.tp, c.pp, c.dp, c.micro_batch, c.microbatches) < 1:
        errors.append("tp, pp, dp, micro_batch and microbatches must all be >= 1")
    elif c.tp * c.pp * c.dp != cluster.n_gpus:
        errors.append(f"tp*pp*dp = {c.tp * c.pp * c.dp} but the cluster has {cluster.n_gpus} GPUs")
    if c.tp >= 1 and cluster.node_size % c.tp:
        errors.append(f"tp={c.tp} does not divide the {cluster.node_size} GPUs of a node: a tensor-parallel "
                      f"group must stay on NVLink")
    for what, n in (("heads", model.heads), ("vocab", model.vocab),
                    ("MLP width", model.mlp_ratio * model.hidden)):
        if c.tp >= 1 and n % c.tp:
            errors.append(f"{what} {n} is not divisible by tp={c.tp}")
    if c.pp >= 1 and model.layers % (c.pp * assumptions.v):
        errors.append(f"layers {model.layers} are not divisible by pp*v = {c.pp * assumptions.v}")
    if c.dp >= 1 and c.micro_batch >= 1 and c.dp * c.micro_batch * c.microbatches != model.global_batch:
        errors.append(f"dp*micro_batch*microbatches = {c.dp * c.micro_batch * c.microbatches} != global "
                      f"batch {model.global_batch}")
    if c.zero not in (0, 1, 2, 3):
        errors.append(f"zero must be 0, 1, 2 or 3, got {c.zero!r}")
    elif c.zero >= 2 and c.pp > 1:
        errors.append(f"ZeRO-{c.zero} with pp={c.pp}: stages 2/3 communicate every microbatch; use zero <= 1 "
                      f"with pipelining (as DeepSpeed requires)")
    if c.recompute not in costmodel.RECOMPUTE:
        errors.append(f"recompute must be one of {costmodel.RECOMPUTE}, got {c.recompute!r}")
    if c.sequence_parallel and model.seq % max(c.tp, 1):
        errors.append(f"sequence parallelism needs seq {model.seq} divisible by tp={c.tp}")
    if assumptions.schedule == "interleaved" and c.pp > 1 and c.microbatches % c.pp:
        errors.append(f"the interleaved schedule needs microbatches {c.microbatches} divisible by pp={c.pp}")
    if errors:
        raise ValueError(f"invalid configuration {c}: " + "; ".join(errors))


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(model, cluster: Cluster, zero=(0, 1, 2, 3), recompute=costmodel.RECOMPUTE,
               sequence_parallel=(False,), micro_batches=None,
               assumptions: Assumptions = Assumptions()) -> list:
    """Every :class:`Config` for ``model`` on ``cluster`` that passes :func:`check_config`.

    ``micro_batches`` defaults to the powers of two; ZeRO stages > 0 are skipped at dp = 1 (nothing
    to shard over) and sequence parallelism at tp = 1 (nothing to split), as duplicates.
    """
    model, out = get_model(model), []
    bs = micro_batches or [2 ** i for i in range(model.global_batch.bit_length())]
    for tp in _divisors(cluster.node_size):
        for pp in _divisors(model.layers):
            if cluster.n_gpus % (tp * pp):
                continue
            dp = cluster.n_gpus // (tp * pp)
            for b in bs:
                if model.global_batch % (dp * b):
                    continue
                for z in zero:
                    for r in recompute:
                        for sp in sequence_parallel:
                            if (z > 0 and dp == 1) or (sp and tp == 1):
                                continue
                            c = Config(tp, pp, dp, b, model.global_batch // (dp * b), z, r, sp)
                            try:
                                check_config(c, model, cluster, assumptions)
                            except ValueError:
                                continue
                            out.append(c)
    return out


def _memory(c: Config, model: ModelSpec, cluster: Cluster, a: Assumptions) -> dict:
    """Bytes per GPU of the first pipeline stage (embedding + the most stashed microbatches)."""
    psi = costmodel.pipeline_stage_params(model.as_cfg(), c.tp, c.pp)[0]
    per = costmodel.model_state_bytes(1, a.precision, a.optimizer)  # bytes per parameter of each part
    w, g, k = per["weights"], per["gradients"], per["optimizer"]

    # zero_memory_bytes is linear in its byte sizes: one part at a time is the breakdown
    def zero(pw, pg, pk):
        return costmodel.zero_memory_bytes(psi, c.dp, c.zero, k=pk, param_bytes=pw, grad_bytes=pg)

    act = costmodel.pipeline_activation_bytes(model.seq, c.micro_batch, model.hidden, model.heads,
                                              model.layers, c.tp, c.pp, c.microbatches, c.sequence_parallel,
                                              c.recompute, a.schedule, a.v)
    mem = {"weights": zero(w, 0, 0), "gradients": zero(0, g, 0), "optimizer": zero(0, 0, k),
           "activations": act * (2 if a.precision == "fp32" else 1),  # Korthikanti counts 16-bit activations
           # ZeRO-3 gathers a layer's weights just in time and prefetches the next: about two whole layers
           "buffers": 2 * w * psi / (model.layers // c.pp) if c.zero == 3 else 0.0}
    mem["total"] = sum(mem.values())
    mem["capacity"] = a.usable_memory * cluster.gpu.memory_bytes
    return mem


def _time(c: Config, model: ModelSpec, cluster: Cluster, a: Assumptions):
    """Seconds per step by part, bytes per GPU per step by axis, and the FLOPs executed."""
    B, s, L, h, V = model.global_batch, model.seq, model.layers, model.hidden, model.vocab
    b, m, layers = c.micro_batch, c.microbatches, model.layers // c.pp
    e = 4 if a.precision == "fp32" else 2  # bytes of an activation or a gradient on the wire
    extra = costmodel.recompute_overhead(c.recompute, s, h, L, V)  # FLOPs executed beyond the model's
    flops = costmodel.megatron_flops_per_step(B, s, L, h, V) * (1 + extra)
    t_math = flops / (cluster.n_gpus * cluster.gpu.peak_flops * a.efficiency) / m  # one microbatch, one stage
    # tensor parallelism: 4 all-reduces per layer on the critical path; full recompute redoes the forward's 2
    redo = 1.5 if c.recompute == "full" else 1.0
    t_tp = layers * redo * costmodel.tensor_parallel_comm_time_per_layer(b, s, h, c.tp,
                                                                         *cluster.link(1, c.tp), e)
    # pipeline: one activation out and one gradient back per microbatch (per chunk, interleaved)
    msg = costmodel.pipeline_p2p_message_bytes(b, s, h, c.tp, e, a.scatter_gather)
    pp_link = cluster.link(c.tp * c.dp, c.pp)
    t_p2p = 2 * a.v * costmodel.p2p_time(msg, *pp_link) if c.pp > 1 else 0.0
    t_mb = t_math + t_tp + t_p2p
    bubble = costmodel.pipeline_bubble_ratio(a.schedule, c.pp, m, a.v) * m * t_mb
    # data parallelism: ZeRO's collectives, partly hidden behind the backward they follow
    psi = costmodel.pipeline_stage_params(model.as_cfg(), c.tp, c.pp)[0]
    t_dp = costmodel.zero_dp_time_per_step(psi, c.dp, c.zero, *cluster.link(c.tp, c.dp), m, e)
    window = {0: 2 / 3 * t_math, 1: 2 / 3 * t_math, 2: 2 / 3 * m * t_math, 3: m * t_math}[c.zero]
    exposed = max(0.0, t_dp - window) if a.overlap_dp else t_dp
    time = {"compute": m * t_math, "tp_comm": m * t_tp, "pp_comm": m * t_p2p, "bubble": bubble,
            "dp_comm": exposed, "dp_comm_total": t_dp, "total": m * t_mb + bubble + exposed}
    comm = {"tp": m * layers * redo * costmodel.tensor_parallel_bytes_per_layer(b, s, h, c.tp, e),
            "pp": costmodel.pipeline_p2p_bytes(c.pp, m, msg, a.v) / c.pp,  # averaged over the stages
            "dp": costmodel.zero_dp_bytes_per_step(psi, c.dp, c.zero, m, e)}
    return time, comm, flops


def evaluate(c: Config, model, cluster: Cluster, assumptions: Assumptions = Assumptions()) -> Plan:
    """Memory, step time, bytes and MFU of one configuration (checked by :func:`check_config` first)."""
    model = get_model(model)
    check_config(c, model, cluster, assumptions)
    mem = _memory(c, model, cluster, assumptions)
    time, comm, flops = _time(c, model, cluster, assumptions)
    n, peak, t, tokens = cluster.n_gpus, cluster.gpu.peak_flops, time["total"], model.global_batch * model.seq
    model_flops = costmodel.megatron_flops_per_step(model.global_batch, model.seq, model.layers, model.hidden,
                                                    model.vocab)  # recompute=False: model FLOPs
    mfu = costmodel.model_flops_utilization(model_flops, t, peak, n)
    mfu_6nd = costmodel.model_flops_utilization(costmodel.training_flops(model.params, tokens), t, peak, n)
    return Plan(c, mem, time, comm, mfu, mfu_6nd, tflops_per_gpu=flops / n / t / 1e12,
                tokens_per_s=tokens / t, fits=mem["total"] <= mem["capacity"])


def plan(model, gpus: int | None = None, gpu="h100", *, cluster: Cluster | None = None,
         gpus_per_node: int = 8, top_k: int | None = None, zero=(0, 1, 2, 3), recompute=costmodel.RECOMPUTE,
         sequence_parallel=(False,), micro_batches=None, **assumptions) -> list[Plan]:
    """The configurations of ``model`` (a name of ``MODELS`` or a ModelSpec) that fit in memory on
    ``gpus`` x ``gpu`` (or ``cluster``), fastest first (ties: less memory first); ``top_k`` of them.
    ``assumptions``: the fields of :class:`Assumptions` (efficiency=0.5, precision="mixed", ...)."""
    model, a = get_model(model), Assumptions(**assumptions)
    if cluster is None:
        if gpus is None:
            raise ValueError("give the number of GPUs (gpus=1024) or a Cluster")
        cluster = Cluster(get_gpu(gpu), gpus, gpus_per_node)
    found = [evaluate(c, model, cluster, a)
             for c in candidates(model, cluster, zero, recompute, sequence_parallel, micro_batches, a)]
    fit = sorted((p for p in found if p.fits), key=lambda p: (p.step_time, p.memory["total"]))
    return fit[:top_k] if top_k else fit


def rank_of(plans: list[Plan], **match) -> int | None:
    """1-based rank of the first plan whose config matches every ``field=value`` (None if absent)."""
    return next((i for i, p in enumerate(plans, 1)
                 if all(getattr(p.config, k) == v for k, v in match.items())), None)


def format_plans(plans: list[Plan], top_k: int = 10) -> str:
    """A plain-text table of the first ``top_k`` plans."""
    from ..course.registry import format_table

    parts = ("compute", "tp_comm", "pp_comm", "bubble", "dp_comm")
    rows = []
    for i, p in enumerate(plans[:top_k], 1):
        c = p.config
        rows.append([i, c.tp, c.pp, c.dp, c.micro_batch, c.microbatches, c.zero,
                     c.recompute + (" +sp" if c.sequence_parallel else ""), f"{p.memory['total'] / 1e9:.1f}",
                     f"{p.step_time:.2f}", *(f"{p.time[k] / p.step_time:.0%}" for k in parts), f"{p.mfu:.1%}",
                     f"{p.tflops_per_gpu:.0f}"])
    return format_table(rows, ["#", "tp", "pp", "dp", "b", "m", "zero", "recompute", "GB/GPU", "step s",
                               "compute", "tp", "pp", "bubble", "dp", "MFU", "TFLOP/s"])


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
    if not [z for z in zero for (_, q, d) in shapes if (z == 0 or d > 1) and (z < 2 or q == 1)]:
        return (f"ZeRO {sorted(zero)} fits none of the shapes (tp, pp, dp) {shapes}: ZeRO-1/2/3 need "
                f"dp > 1 and ZeRO-2/3 need pp = 1; add stage 0 (--zero 0)")
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
    best = min((evaluate(c, model, cluster, a) for c in found), key=lambda p: p.memory["total"])
    if best.fits:
        return f"nothing is wrong: {best.config} and others fit"
    cap, gpu = best.memory["capacity"], cluster.gpu
    states = costmodel.model_state_bytes(model.params, a.precision, a.optimizer)["total"]
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
