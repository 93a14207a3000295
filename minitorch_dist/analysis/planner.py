"""Chapter 12 — choose data x tensor x pipeline parallelism, microbatches, ZeRO stage and
recomputation for a model on a cluster, from the cost model and a machine profile alone.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), §3 ("Performance Analysis of Parallelization Configurations": tensor
parallelism inside a node, pipeline across nodes, then data parallelism; the microbatch size) is
the recipe this search makes mechanical. Every configuration ``(t, p, d, b, zero, recompute)`` with
``t*p*d`` = the GPUs is scored:

**Divisibility** (:func:`check_config`): ``t`` divides the GPUs of a node (a tensor-parallel group
never leaves its NVLink domain), the heads and the vocabulary; ``p`` divides the layers; ``d*b``
divides the global batch ``B``, leaving ``m = B/(d*b)`` microbatches. Every ZeRO stage combines with
pipelining, at the cost ``costmodel.zero_stage_under_pipeline`` gives it: under a pipeline ZeRO-2
reduces the accumulated gradients once after the last microbatch (as ``parallelism.three_d.Model3D``
does), which costs ZeRO-1's memory and bytes, and ZeRO-3 re-gathers the stage's parameters for every
microbatch's forward and backward (``costmodel.zero_dp_collectives``: 3m collectives a step). The search
lists ZeRO-2 with ``p > 1`` only when ZeRO-1 is not searched too (it would be the same row twice).

**Memory per GPU** (the first pipeline stage, which holds the embedding and the most activations)::

    model states = zero_memory_bytes(Psi_stage, d, zero', k=12, param_bytes=2, grad_bytes=g)
                   Psi_stage = pipeline_stage_params(t, p)[0], zero' = zero_stage_under_pipeline(zero, p)
                   g = 4: Megatron-LM's fp32 gradient buffer main_grad (18 B/param unsharded);
                   g = 2 with Assumptions(main_grad=False): the ZeRO paper's 16 B/param
    activations  = pipeline_activation_bytes(s, b, h, a, L, t, p, m, sp, recompute)   (Korthikanti §4.2)

A configuration fits when their sum is at most ``usable_memory`` (0.9) of the GPU's: the rest is
the CUDA context, communication buffers, temporaries and fragmentation, which no formula here counts.

**Step time** comes from the cluster's machine profile (:mod:`.profiles`: a shipped GPU profile with
a citation for every number, or this machine's, measured by ``calibrate``), never from a free
efficiency constant. :mod:`.costmodel.planner_time` has the formulas: each GEMM of a layer
(QKV, the attention scores and context, the attention output, the two MLP GEMMs, the LM head) at
its own size through ``profile.matmul_seconds``; the elementwise bytes of Megatron's fused kernels
(Korthikanti §4.1's tensors) over ``profile.copy_bytes_per_s``; the tensor-parallel all-reduces
(NVLink inside a node), the pipeline messages and ZeRO's collectives with the profile's α, β
(``inter_node`` when a group spans nodes; with ``main_grad`` the gradients are reduced in fp32, as
Megatron-LM does with bf16 and Llama 3 did, §3.3.2, and the parameters all-gathered in bf16); the 1F1B
bubble; the optimizer's pass over its shard. The slowest stage (the last: it also computes the logits)
sets the pace.

**MFU** (Chowdhery et al. 2022, App. B) = model FLOPs per token x tokens/s / (GPUs x the profile's
peak); ``mfu_6nd`` uses ``6 * params`` per token instead. ``tflops_per_gpu`` counts the FLOPs executed,
recomputation included (eq. 3's 96·B·s·l·h²(...) under full recomputation, 72·B·s·l·h²(...) without):
Narayanan's Table 1 counting, so the two compare.

**What runs here** (:func:`local_plans`, :func:`predict_local`): for the course's tiny GPT on this
machine's ranks the planner scores the configurations the course's techniques implement, and the
chosen one is predicted by replaying its recorded step on the calibrated profile
(:func:`.predict.predict`), which also counts the per-op costs a formula cannot see.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .. import costmodel
from .planner_presets import GPUS, GPUSpec, ModelSpec, get_gpu, get_model
from .profiles import MachineProfile, load_profile

__all__ = ["NO_EFFICIENCY", "LOCAL_TECHNIQUES", "Assumptions", "Cluster", "Config", "Plan", "candidates",
           "check_config", "evaluate", "memory_per_gpu", "plan", "rank_of", "format_plans", "local_plans",
           "predict_local"]

NO_EFFICIENCY = "no free efficiency: the profile's measured GEMM rates set compute time; pass --profile"
#: The techniques of :mod:`.techniques` that a planner configuration maps to (``3d``: several axes).
LOCAL_TECHNIQUES = ("ddp", "zero1", "zero2", "zero3", "tp", "pp-1f1b", "3d")


def _profile_for(gpu: GPUSpec, profile) -> MachineProfile:
    if profile is not None:
        return load_profile(profile)
    name = next((k for k, v in GPUS.items() if v == gpu), None)
    if name is None:
        raise ValueError(f"no machine profile for GPU {gpu.name!r}: pass profile= (h100, h200, a100, a file "
                         f"from `python -m minitorch_dist calibrate`, or a MachineProfile)")
    return load_profile(None if name == "cpu" else name)  # cpu: this machine's calibrated profile


@dataclass(frozen=True)
class Cluster:
    """``n_gpus`` GPUs of one kind, ``gpus_per_node`` to a node (NVLink inside, the network between;
    default: the profile's). ``profile``: where every rate comes from (a :class:`MachineProfile`, a
    shipped name, a path); default the GPU's shipped profile, or for the ``cpu`` preset this
    machine's calibrated one."""

    gpu: GPUSpec
    n_gpus: int
    gpus_per_node: int | None = None
    profile: MachineProfile | str | None = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if isinstance(self.gpu, str):
            object.__setattr__(self, "gpu", get_gpu(self.gpu))
        object.__setattr__(self, "profile", _profile_for(self.gpu, self.profile))
        if self.gpus_per_node is None:
            object.__setattr__(self, "gpus_per_node", self.profile.gpus_per_node or 8)
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

    def link(self, stride: int, size: int, op: str = "all_reduce") -> tuple:
        """(alpha, beta) of ``op`` on a group of ``size`` ranks ``stride`` apart: the profile's own
        (NVLink) if the group fits in a node, its ``inter_node`` link otherwise."""
        inside = stride * size <= self.node_size and self.node_size % (stride * size) == 0
        if inside or size <= 1:
            return self.profile.alpha_beta(op)
        if not self.profile.inter_node:
            raise ValueError(f"profile {self.profile.name!r} has no inter_node alpha, beta (it describes one "
                             f"node): use at most {self.node_size} GPUs, or a profile with inter_node")
        return self.profile.inter_node["alpha_s"], self.profile.inter_node["beta_s_per_byte"]

    def peak_flops(self, precision: str = "mixed") -> float:
        """The profile's dense peak for the precision's GEMMs (bf16 or fp32): MFU's denominator."""
        peaks = self.profile.peak_flops
        return peaks.get("bf16" if precision == "mixed" else "fp32") or max(peaks.values())


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
    """What the cost model takes as given; see the module docstring for each. No efficiency: the
    profile's measured GEMM rates set the compute time."""

    precision: str = "mixed"  #: "mixed" (16-bit weights/grads/activations, fp32 master + Adam) or "fp32"
    optimizer: str = "adamw"
    schedule: str = "1f1b"  #: "1f1b" or "interleaved" (v chunks per stage)
    v: int = 1
    overlap_dp: bool = True  #: hide the DP gradient sync behind the backward it follows
    usable_memory: float = 0.9  #: fraction of the GPU's memory tensors may use
    scatter_gather: bool = True  #: Narayanan §4.1: pipeline messages of b*s*h/t per rank
    #: Megatron-LM's recipe under "mixed": the gradients live in an fp32 buffer (main_grad) that the
    #: microbatches accumulate into and that is reduced over the DP group in fp32, 18 B/param of model
    #: states (costmodel.model_state_bytes(..., main_grad=True)); False: 16-bit gradients, 16 B/param
    main_grad: bool = True

    def __post_init__(self):
        if not 0 < self.usable_memory <= 1:
            raise ValueError(f"usable_memory must be in (0, 1], got {self.usable_memory}")
        if self.schedule not in ("1f1b", "interleaved") or (self.v != 1 and self.schedule != "interleaved"):
            raise ValueError(f"schedule must be '1f1b' or 'interleaved' (v > 1 only with interleaved), "
                             f"got {self.schedule!r}, v={self.v}")
        costmodel.optimizer_bytes_per_param(self.precision, self.optimizer)  # names the valid choices


def _assumptions(kw: dict) -> Assumptions:
    if "efficiency" in kw:
        raise ValueError(NO_EFFICIENCY)
    return Assumptions(**kw)


@dataclass
class Plan:
    """A scored configuration. ``memory``: bytes per GPU; ``time``: seconds per step by part
    (:func:`.costmodel.step_seconds`); ``comm_bytes``: bytes one GPU sends per step on each axis
    (ring model); ``profile``: the name of the profile the times come from."""

    config: Config
    memory: dict
    time: dict
    comm_bytes: dict
    mfu: float
    mfu_6nd: float
    tflops_per_gpu: float
    tokens_per_s: float
    fits: bool = field(default=True)
    profile: str = ""

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
    errors = _shape_errors(c, model, cluster, assumptions) + _option_errors(c, model, assumptions)
    if errors:
        raise ValueError(f"invalid configuration {c}: " + "; ".join(errors))


def _shape_errors(c: Config, model: ModelSpec, cluster: Cluster, assumptions: Assumptions) -> list[str]:
    """The rules of :func:`check_config` on the grid's sizes: what each degree must divide."""
    errors = []
    if min(c.tp, c.pp, c.dp, c.micro_batch, c.microbatches) < 1:
        errors.append("tp, pp, dp, micro_batch and microbatches must all be >= 1")
    elif c.tp * c.pp * c.dp != cluster.n_gpus:
        errors.append(f"tp*pp*dp = {c.tp * c.pp * c.dp} but the cluster has {cluster.n_gpus} GPUs")
    if c.tp >= 1 and cluster.node_size % c.tp:
        errors.append(f"tp={c.tp} does not divide the {cluster.node_size} GPUs of a node: a tensor-parallel "
                      f"group must stay on NVLink")
    for what, n in (("heads", model.heads), ("vocab", model.vocab), ("MLP width", model.ffn_width)):
        if c.tp >= 1 and n % c.tp:
            errors.append(f"{what} {n} is not divisible by tp={c.tp}")
    if c.tp >= 1 and model.n_kv % c.tp and c.tp % model.n_kv:  # grouped-query attention (ch04)
        errors.append(f"kv heads {model.n_kv} are neither split by tp={c.tp} nor a divisor of it")
    if c.pp >= 1 and model.layers % (c.pp * assumptions.v):
        errors.append(f"layers {model.layers} are not divisible by pp*v = {c.pp * assumptions.v}")
    if c.dp >= 1 and c.micro_batch >= 1 and c.dp * c.micro_batch * c.microbatches != model.global_batch:
        errors.append(f"dp*micro_batch*microbatches = {c.dp * c.micro_batch * c.microbatches} != global "
                      f"batch {model.global_batch}")
    return errors


def _option_errors(c: Config, model: ModelSpec, assumptions: Assumptions) -> list[str]:
    """The rules of :func:`check_config` on the techniques: ZeRO, recomputation, SP, the schedule."""
    errors = []
    if c.zero not in (0, 1, 2, 3):
        errors.append(f"zero must be 0, 1, 2 or 3, got {c.zero!r}")
    if c.recompute not in costmodel.RECOMPUTE:
        errors.append(f"recompute must be one of {costmodel.RECOMPUTE}, got {c.recompute!r}")
    if c.sequence_parallel and model.seq % max(c.tp, 1):
        errors.append(f"sequence parallelism needs seq {model.seq} divisible by tp={c.tp}")
    if assumptions.schedule == "interleaved" and c.pp > 1 and c.microbatches % c.pp:
        errors.append(f"the interleaved schedule needs microbatches {c.microbatches} divisible by pp={c.pp}")
    return errors


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(model, cluster: Cluster, zero=(0, 1, 2, 3), recompute=costmodel.RECOMPUTE,
               sequence_parallel=(False,), micro_batches=None,
               assumptions: Assumptions = Assumptions()) -> list:
    """Every :class:`Config` for ``model`` on ``cluster`` that passes :func:`check_config`.

    ``micro_batches`` defaults to the powers of two; ZeRO stages > 0 are skipped at dp = 1 (nothing
    to shard over), sequence parallelism at tp = 1 (nothing to split) and ZeRO-2 at pp > 1 when ZeRO-1
    is searched too (under a pipeline it costs ZeRO-1's memory and bytes:
    ``costmodel.zero_stage_under_pipeline``), as duplicates.
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
                            if (z > 0 and dp == 1) or (sp and tp == 1) or (z == 2 and pp > 1 and 1 in zero):
                                continue
                            c = Config(tp, pp, dp, b, model.global_batch // (dp * b), z, r, sp)
                            try:
                                check_config(c, model, cluster, assumptions)
                            except ValueError:
                                continue
                            out.append(c)
    return out


def _zero(c: Config) -> int:
    """The ZeRO stage whose memory and bytes ``c`` costs (its own, but under a pipeline)."""
    return costmodel.zero_stage_under_pipeline(c.zero, c.pp)


class _Shared:
    """What the configurations of one search (one model, cluster and assumptions) have in common,
    computed once: the parameters of each stage by ``(t, p)``, one microbatch's seconds by
    ``(b, layers, t, recompute, sp)`` (the same for every ZeRO stage), the FLOPs of a step."""

    def __init__(self, model: ModelSpec, cluster: Cluster, a: Assumptions):
        self.model, self.cluster, self.a = model, cluster, a
        self._memo: dict = {}

    def _get(self, key, compute):
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def stage_params(self, tp: int, pp: int) -> list:
        return self._get(("stages", tp, pp), lambda: self.model.stage_params(tp, pp))

    def microbatch_seconds(self, b, layers, tp, recompute, sp) -> dict:
        return self._get(("mb", b, layers, tp, recompute, sp), lambda: self.model.microbatch_seconds(
            self.cluster.profile, b, layers, tp, self.a.precision, recompute, sp))

    def flops_per_step(self, recompute: str) -> float:
        return self._get(("flops", recompute), lambda: self.model.flops_per_step(recompute))

    def flops_per_token(self) -> float:
        return self._get(("flops_per_token",), self.model.flops_per_token)

    @property
    def params(self) -> int:
        return self._get(("params",), lambda: self.model.params)

    def kv_replica_elements(self, tp: int) -> int:
        return self._get(("kv", tp), lambda: self.model.kv_replica_elements(tp))


def _memory(c: Config, sh: _Shared) -> dict:
    """Bytes per GPU of the first pipeline stage (embedding + the most stashed microbatches)."""
    model, cluster, a = sh.model, sh.cluster, sh.a
    psi = sh.stage_params(c.tp, c.pp)[0]
    per = costmodel.model_state_bytes(1, a.precision, a.optimizer, a.main_grad)  # bytes per parameter
    w, g, k = per["weights"], per["gradients"], per["optimizer"]
    stage = _zero(c)

    # zero_memory_bytes is linear in its byte sizes: one part at a time is the breakdown
    def zero(pw, pg, pk):
        return costmodel.zero_memory_bytes(psi, c.dp, stage, k=pk, param_bytes=pw, grad_bytes=pg)

    act = model.activation_bytes(c.micro_batch, c.tp, c.pp, c.microbatches, c.sequence_parallel, c.recompute,
                                 a.schedule, a.v)
    mem = {"weights": zero(w, 0, 0), "gradients": zero(0, g, 0), "optimizer": zero(0, 0, k),
           "activations": act * (2 if a.precision == "fp32" else 1),  # Korthikanti counts 16-bit activations
           # ZeRO-3 gathers a layer's weights just in time and prefetches the next: about two whole layers
           "buffers": 2 * w * psi / (model.layers // c.pp) if stage == 3 else 0.0}
    mem["total"] = sum(mem.values())
    mem["capacity"] = a.usable_memory * cluster.gpu.memory_bytes
    return mem


def _time(c: Config, sh: _Shared):
    """Seconds per step by part (the profile's rates: :mod:`.costmodel.planner_time`), bytes per GPU
    per step by axis, and the FLOPs executed."""
    model, cluster, a = sh.model, sh.cluster, sh.a
    s, h = model.seq, model.hidden
    b, m, layers, prof = c.micro_batch, c.microbatches, model.layers // c.pp, cluster.profile
    e = 4 if a.precision == "fp32" else 2  # bytes of an activation or a weight on the wire
    g = costmodel.gradient_bytes_per_param(a.precision, a.main_grad)  # of a gradient in the DP reductions
    zero = _zero(c)
    # one microbatch on the slowest stage, the last: its layers, the logits and the loss
    mb = sh.microbatch_seconds(b, layers, c.tp, c.recompute, c.sequence_parallel)
    # tensor parallelism: 4 all-reduces per layer on the critical path; full recompute redoes the forward's 2
    redo = 1.5 if c.recompute == "full" else 1.0
    tp_link = cluster.link(1, c.tp)
    t_tp = layers * redo * costmodel.tensor_parallel_comm_time_per_layer(b, s, h, c.tp, *tp_link, e)
    kv = sh.kv_replica_elements(c.tp) * e  # replicated kv heads: weight gradients summed every backward
    t_tp += layers * (costmodel.collective_time("all_reduce", kv, c.tp, *tp_link) if kv else 0.0)
    # pipeline: one activation out and one gradient back per microbatch (per chunk, interleaved)
    msg = costmodel.pipeline_p2p_message_bytes(b, s, h, c.tp, e, a.scatter_gather)
    t_p2p = 2 * a.v * costmodel.p2p_time(msg, *cluster.link(c.tp * c.dp, c.pp, "send")) if c.pp > 1 else 0.0
    # data parallelism: ZeRO's collectives on the DP link; then the optimizer's pass over its shard
    stages = sh.stage_params(c.tp, c.pp)
    psi = max(stages)  # the stage with the most parameters syncs and updates the longest
    t_dp = costmodel.zero_dp_seconds(psi, c.dp, zero, lambda op: cluster.link(c.tp, c.dp, op), m, e, g)
    shard = psi / c.dp if zero >= 1 else psi
    t_opt = costmodel.optimizer_step_bytes(shard, a.precision, a.optimizer) / prof.copy_bytes_per_s
    time = costmodel.step_seconds(mb, m, c.pp, t_tp, t_p2p, t_dp, zero, t_opt, prof.overlap, a.schedule,
                                  a.v, a.overlap_dp)
    comm = {"tp": m * layers * (redo * costmodel.tensor_parallel_bytes_per_layer(b, s, h, c.tp, e)
                                + costmodel.bus_bytes("all_reduce", kv, c.tp)),
            "pp": costmodel.pipeline_p2p_bytes(c.pp, m, msg, a.v) / c.pp,  # averaged over the stages
            "dp": costmodel.zero_dp_bytes_per_step(stages[0], c.dp, zero, m, e, g)}  # the first stage's
    return time, comm, sh.flops_per_step(c.recompute)  # FLOPs executed, recomputation included


def memory_per_gpu(configs, model, cluster: Cluster, assumptions: Assumptions = Assumptions()) -> list:
    """The bytes per GPU (by category, as :func:`evaluate` reports them) of each of ``configs``, checked
    configurations of one search, without timing them."""
    sh = _Shared(get_model(model), cluster, assumptions)
    return [_memory(c, sh) for c in configs]


def evaluate(c: Config, model, cluster: Cluster, assumptions: Assumptions = Assumptions()) -> Plan:
    """Memory, step time, bytes and MFU of one configuration (checked by :func:`check_config` first)."""
    model = get_model(model)
    check_config(c, model, cluster, assumptions)
    return _evaluate(c, _Shared(model, cluster, assumptions))


def _evaluate(c: Config, sh: _Shared, mem: dict | None = None) -> Plan:
    """:func:`evaluate` of a checked ``c`` with the search's shared parts (and its memory, if known)."""
    model, cluster, assumptions = sh.model, sh.cluster, sh.a
    mem = _memory(c, sh) if mem is None else mem
    time, comm, flops = _time(c, sh)
    n, t, tokens = cluster.n_gpus, time["total"], model.global_batch * model.seq
    peak = cluster.peak_flops(assumptions.precision)
    per_token = sh.flops_per_token()  # model FLOPs: no recomputation
    mfu = costmodel.model_flops_utilization(per_token * tokens / t, 1.0, peak, n)
    mfu_6nd = costmodel.model_flops_utilization(costmodel.training_flops(sh.params, tokens), t, peak, n)
    return Plan(c, mem, time, comm, mfu, mfu_6nd, tflops_per_gpu=flops / n / t / 1e12,
                tokens_per_s=tokens / t, fits=mem["total"] <= mem["capacity"], profile=cluster.profile.name)


def plan(model, gpus: int | None = None, gpu="h100", *, cluster: Cluster | None = None,
         gpus_per_node: int | None = None, profile=None, top_k: int | None = None, zero=(0, 1, 2, 3),
         recompute=costmodel.RECOMPUTE, sequence_parallel=(False,), micro_batches=None,
         **assumptions) -> list[Plan]:
    """The configurations of ``model`` (a name of ``MODELS`` or a ModelSpec) that fit in memory on
    ``gpus`` x ``gpu`` (or ``cluster``), fastest first (ties: less memory first); ``top_k`` of them.
    ``profile``: the machine profile times come from (default: the GPU's shipped one).
    ``assumptions``: the fields of :class:`Assumptions` (precision="mixed", ...)."""
    model, a = get_model(model), _assumptions(assumptions)
    if cluster is None:
        if gpus is None:
            raise ValueError("give the number of GPUs (gpus=1024) or a Cluster")
        cluster = Cluster(get_gpu(gpu), gpus, gpus_per_node, profile)
    sh = _Shared(model, cluster, a)
    fit = []
    for c in candidates(model, cluster, zero, recompute, sequence_parallel, micro_batches, a):
        mem = _memory(c, sh)  # cheap: a configuration that cannot fit is never timed
        if mem["total"] <= mem["capacity"]:
            fit.append(_evaluate(c, sh, mem))
    fit.sort(key=lambda p: (p.step_time, p.memory["total"]))
    return fit[:top_k] if top_k else fit


def rank_of(plans: list[Plan], **match) -> int | None:
    """1-based rank of the first plan whose config matches every ``field=value`` (None if absent)."""
    return next((i for i, p in enumerate(plans, 1)
                 if all(getattr(p.config, k) == v for k, v in match.items())), None)


def format_plans(plans: list[Plan], top_k: int = 10) -> str:
    """A plain-text table of the first ``top_k`` plans: the step's parts as shares of it."""
    from ..runtime.tables import format_table

    parts = ("gemm", "elementwise", "tp_comm", "pp_comm", "bubble", "dp_comm", "optimizer")
    rows = []
    for i, p in enumerate(plans[:top_k], 1):
        c = p.config
        rows.append([i, c.tp, c.pp, c.dp, c.micro_batch, c.microbatches, c.zero,
                     c.recompute + (" +sp" if c.sequence_parallel else ""), f"{p.memory['total'] / 1e9:.1f}",
                     f"{p.step_time:#.4g}", *(f"{p.time[k] / p.step_time:.0%}" for k in parts),
                     f"{p.mfu:.1%}", f"{p.tflops_per_gpu:.0f}"])
    return format_table(rows, ["#", "tp", "pp", "dp", "b", "m", "zero", "recompute", "GB/GPU", "step s",
                               "gemm", "elem", "tp", "pp", "bubble", "dp", "opt", "MFU", "TFLOP/s"],
                        align="r" * 7 + "l" + "r" * 11)


# --- what runs here ------------------------------------------------------------------------------------

def local_plans(size: str = "tiny", world: int = 2, profile=None) -> list:
    """``[(technique, Plan)]``, fastest first: the planner's score of each configuration that a
    technique of :data:`LOCAL_TECHNIQUES` runs for the course GPT of ``size`` on ``world`` ranks of this
    machine (fp32, AdamW, whole pipeline messages), from ``profile`` (default: the calibrated one).
    Techniques whose configuration another already has (ZeRO over one rank) are left out."""
    from . import techniques as T

    model = ModelSpec.from_gpt_config(T.model_config(size), T.GLOBAL_BATCH[size], name=f"{size} GPT")
    cluster = Cluster(GPUS["cpu"], world, world, load_profile(profile))
    a = Assumptions(precision="fp32", scatter_gather=False)
    out = []
    for tech in LOCAL_TECHNIQUES:
        try:
            k = T.step_config(tech, size, world)
        except ValueError:
            continue
        zero = int(tech[-1]) if tech.startswith("zero") else k.get("zero_stage", 0)
        c = Config(k["tp"], k["pp"], k["dp"], k["rows_per_microbatch"], k["microbatches"],
                   zero if k["dp"] > 1 else 0, "none")
        if all(c != p.config for _, p in out):
            out.append((tech, evaluate(c, model, cluster, a)))
    return sorted(out, key=lambda pair: (pair[1].step_time, pair[1].memory["total"]))


def predict_local(size: str = "tiny", world: int = 2, profile=None, measure: bool = True,
                  reps: int = 7) -> dict:
    """The planner's choice among :func:`local_plans`, predicted by replaying its technique's recorded
    step on ``profile`` (:func:`.predict.predict`) and, with ``measure``, timed here. Returns that
    result plus ``plan`` (the formula's :class:`Plan`), ``formula_s`` (its step time) and ``ranking``
    (:func:`local_plans`' ``[(technique, Plan)]``, fastest first)."""
    from .predict import predict

    prof = load_profile(profile)
    ranked = local_plans(size, world, prof)
    tech, best = ranked[0]
    res = predict(tech, world, size, prof, measure=measure, reps=reps)
    return {**res, "plan": best, "formula_s": best.step_time, "ranking": ranked}
