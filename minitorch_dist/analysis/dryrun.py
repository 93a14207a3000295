"""Chapter 12 — a dry run at the papers' scale on one machine: one training step of one rank.

``python -m minitorch_dist dryrun --model gpt3-175b --dp 8 --tp 8 --pp 16 --zero 1 --dtype bf16-mixed``
plays one rank of a d x t x p grid (up to 4096 ranks) under torch's *fake* process group (every
collective returns at once, moving nothing) with the model on ``meta`` tensors (shapes without
values). The step is the library's own: :class:`~..parallelism.three_d.Model3D` (Megatron's TP
slices, with ``--sequence-parallel`` ch05's sequence-parallel layers, the pipeline schedule, the
tied-embedding all-reduce, ZeRO-0/1/2 over the DP group), run twice:
a first step creates the optimizer state, the second -- the one measured -- starts as a training step
does, with it. :class:`.meta_memory.MetaMemoryMeter` records this rank's peak bytes per category and
the comm meter's events (``Model3D.step``'s phases) the bytes this rank puts on the wire (ring model).
Next to each measured value is ``costmodel``'s prediction.

A Llama-shaped preset (``--model llama3-8b``: grouped-query attention, SwiGLU) plays the Llama of
``models.llama`` instead, through the same ``Model3D`` step (:mod:`.dryrun_llama`: its checks and formulas).

Two accountings are not the library's kernels:

* attention: on ``meta``, ``F.scaled_dot_product_attention`` takes its math path and materialises the
  T x T scores a GPU's flash kernel never holds. ``attention="flash"`` (the default) routes it to the
  fused op ``_scaled_dot_product_flash_attention_for_cpu`` (same shapes; saves q, k, v, the output
  and a log-sum-exp per row), the memory of flash attention; ``"math"`` keeps the math path.
* ``bf16-mixed``: the step runs in bf16 end to end, so AdamW's moments are bf16 (2 x 2 bytes per
  element of this rank's shard). Mixed-precision AdamW keeps an fp32 master copy and fp32 moments
  (12 bytes) for exactly those elements, so the optimizer state counted is 3 x the measured one, and
  the extra 2 x is added to the peak (the state lives through the whole step).
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import costmodel
from ..costmodel import llama as llama_cost
from ..runtime.tables import format_table
from .dryrun_llama import check_llama_grid, llama_predicted
from .meta_memory import MetaMemoryMeter
from .planner_presets import get_gpu, get_model

__all__ = ["MAX_WORLD", "MAX_LAYERS", "COMM_OPS", "DTYPES", "DryRun", "check_grid", "dryrun",
           "flash_attention_accounting"]

MAX_WORLD = 4096
#: The deepest model a dry run builds: the presets have at most 128 layers. Its time grows faster than the
#: layers (the memory meter re-reads every parameter's ``.grad`` at each op that may set a new peak).
MAX_LAYERS = 256
COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "broadcast")
DTYPES = {"fp32": (torch.float32, "fp32"), "bf16-mixed": (torch.bfloat16, "mixed")}
MEMORY_KEYS = ("parameters", "gradients", "optimizer_states", "activations", "temporaries", "peak")


class _FlashSDPA(TorchFunctionMode):
    """Route ``F.scaled_dot_product_attention`` (no mask, causal or not) to the fused flash op."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) == 3:
            q, k, v = args
            out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(
                q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                scale=kwargs.get("scale"))
            return out[0]
        return func(*args, **kwargs)


def flash_attention_accounting():
    """A context in which attention keeps flash attention's memory (no T x T scores), on any device."""
    return _FlashSDPA()


class DryRun:
    """The configuration of one dry run, checked: a clear ``ValueError`` naming the fix otherwise."""

    def __init__(self, model=None, n_layer=None, n_embd=None, n_head=None,  # noqa: C901 - flat guard clauses
                 vocab_size=None, seq=None, dp=1, tp=1, pp=1, zero=1, sequence_parallel=False,
                 recompute="none", microbatches=None, micro_batch_size=1, schedule="1f1b", dtype="bf16-mixed",
                 gpu="h100", rank=0, attention="flash", world=None):
        from ..models.gpt import GPTConfig

        spec = get_model(model) if model else None
        dims = {"n_layer": n_layer, "n_embd": n_embd, "n_head": n_head, "vocab_size": vocab_size, "seq": seq}
        if spec is not None:
            base = dict(n_layer=spec.layers, n_embd=spec.hidden, n_head=spec.heads, vocab_size=spec.vocab,
                        seq=spec.seq)
            dims = {k: base[k] if v is None else v for k, v in dims.items()}
        missing = [k for k, v in dims.items() if v is None]
        if missing:
            flags = ", ".join("--" + k.replace("_", "-") for k in missing)
            raise ValueError(f"no model size: give --model PRESET or every one of --n-layer --n-embd "
                             f"--n-head --vocab-size --seq (missing: {flags})")
        if dims["n_layer"] > MAX_LAYERS:
            raise ValueError(f"--n-layer {dims['n_layer']} is over the {MAX_LAYERS} layers a dry run builds "
                             f"(its time grows faster than the layers); choose --n-layer <= {MAX_LAYERS}: "
                             f"every layer of a stage holds the same bytes, so a deeper model's per-layer "
                             f"numbers scale from a shallower run")
        self.llama = spec is not None and spec.is_llama
        shape = {} if spec is None or self.llama else dict(bias=spec.bias, tie_embeddings=spec.tie_embeddings,
                                                           mlp_ratio=spec.mlp_ratio)
        sizes = dict(vocab_size=dims["vocab_size"], block_size=dims["seq"], n_layer=dims["n_layer"],
                     n_head=dims["n_head"], n_embd=dims["n_embd"])
        self.cfg = spec.llama_config(**sizes) if self.llama else GPTConfig(**sizes, **shape)
        self.name = spec.name if spec is not None else "explicit"
        if self.llama:
            check_llama_grid(self.cfg, tp, pp, recompute)
        self.dp, self.tp, self.pp, self.world = check_grid(self.cfg, dp, tp, pp, world)
        self.microbatches = pp if microbatches is None else microbatches
        self.micro_batch_size, self.rank = micro_batch_size, rank
        for what, v in (("--microbatches", self.microbatches), ("--micro-batch-size", micro_batch_size)):
            if v < 1:
                raise ValueError(f"{what} must be >= 1, got {v}")
        if not 0 <= rank < self.world:
            raise ValueError(f"--rank {rank} is outside the grid of {self.world} ranks; "
                             f"choose 0..{self.world - 1}")
        if zero not in (0, 1, 2):
            raise ValueError(f"--zero {zero}: the 3D step (parallelism/three_d.Model3D) shards with ZeRO "
                             f"stage 0, 1 or 2 only (ZeRO-3 would all-gather the parameters for every "
                             f"microbatch; Megatron-LM and DeepSpeed refuse it with pipelining too); "
                             f"use --zero 0, 1 or 2")
        if sequence_parallel and tp == 1:
            raise ValueError("--sequence-parallel splits the regions tensor parallelism leaves replicated "
                             "over the TP group; with --tp 1 there is none: give --tp > 1 or drop the flag")
        if sequence_parallel and self.cfg.block_size % tp:
            raise ValueError(f"--sequence-parallel gives each of the tp={tp} ranks seq/tp tokens: seq "
                             f"{self.cfg.block_size} is not divisible by {tp}; "
                             f"choose --seq as a multiple of {tp}")
        if recompute not in ("none", "selective", "full"):
            raise ValueError(f"--recompute {recompute}: the 3D step recomputes whole blocks (full), the "
                             f"attention core (selective) or nothing; "
                             f"use --recompute none, selective or full")
        if dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        if attention not in ("flash", "math"):
            raise ValueError(f"attention {attention!r}: choose flash or math")
        self.zero, self.recompute, self.schedule, self.dtype = zero, recompute, schedule, dtype
        self.sequence_parallel = bool(sequence_parallel)
        self.attention, self.gpu = attention, get_gpu(gpu)
        self.gpu_name = gpu

    @property
    def params(self) -> int:
        return llama_cost.llama_params(self.cfg) if self.llama else costmodel.transformer_params(self.cfg)


def check_grid(cfg, dp, tp, pp, world=None) -> tuple:
    """``(dp, tp, pp, world)``, or a ``ValueError`` naming the fix (``world``: None, or dp·tp·pp)."""
    from ..parallelism.mesh import check_model

    for name, v in (("--dp", dp), ("--tp", tp), ("--pp", pp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    if world is not None and world != dp * tp * pp:
        raise ValueError(f"dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp} is not the world size {world}; choose "
                         f"degrees whose product is {world} (or leave out --world)")
    world = dp * tp * pp
    if world > MAX_WORLD:
        raise ValueError(f"world size dp·tp·pp = {dp}·{tp}·{pp} = {world} is over the {MAX_WORLD} ranks "
                         f"a dry run plays; choose smaller degrees")
    if pp > cfg.n_layer:
        raise ValueError(f"--pp {pp} is more than the {cfg.n_layer} layers: every stage needs a layer; "
                         f"choose --pp among the divisors of {cfg.n_layer}")
    if hasattr(cfg, "mlp_ratio"):  # the GPT's rules; a Llama's are check_llama_grid's
        check_model(cfg, tp, pp)
    return dp, tp, pp, world


def _comm(events) -> tuple[dict, dict]:
    """(wire bytes, calls) per op in ``COMM_OPS`` from comm events (recv puts nothing on the wire)."""
    wire, calls = dict.fromkeys(COMM_OPS, 0.0), dict.fromkeys(COMM_OPS, 0)
    for e in events:
        if e.op in wire:
            wire[e.op] += e.wire_bytes
            calls[e.op] += 1
    return wire, calls


def _step(run: DryRun):
    """Build this rank's Model3D on meta under the fake group; return (meter's peak dict, comm events)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    from ..parallelism.mesh import RankGrid, init_groups
    from ..parallelism.three_d import Model3D

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: run the dry run in a fresh process "
                           "(python -m minitorch_dist dryrun ...)")
    dist.init_process_group("fake", store=FakeStore(), rank=run.rank, world_size=run.world)
    before = torch.get_default_dtype()
    try:
        torch.set_default_dtype(DTYPES[run.dtype][0])
        groups = init_groups(RankGrid(run.world, run.dp, run.tp, run.pp))
        model = Model3D(run.cfg, groups, run.microbatches, run.schedule, zero_stage=run.zero,
                        recompute=run.recompute, device="meta", sequence_parallel=run.sequence_parallel,
                        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=False))
        rows = run.micro_batch_size * run.microbatches  # this DP rank's share of the global batch
        x = torch.randint(0, run.cfg.vocab_size, (rows, run.cfg.block_size), device="meta")
        attention = _FlashSDPA() if run.attention == "flash" else contextlib.nullcontext()
        with attention:
            model.step(x, x)  # creates the optimizer state
            meter = MetaMemoryMeter(model.zero.module, model.zero.sharded.optim)
            with meter.track():
                _, events = model.step(x, x)
        return dict(meter.peak), [e for phase in events.values() for e in phase]
    finally:
        torch.set_default_dtype(before)
        dist.destroy_process_group()


def predicted(run: DryRun, stage: int) -> dict:
    """``costmodel``'s value for each measured key of this rank (pipeline stage ``stage``);
    None where it has no formula. Activations: Korthikanti et al. 2022 in the element size of the
    run, "selective" (no attention scores) under flash accounting or selective recomputation, times the
    microbatches the schedule stashes on this stage; with full recomputation one layer's working set is
    added."""
    cfg, e = run.cfg, torch.finfo(DTYPES[run.dtype][0]).bits // 8
    local = costmodel.pipeline_stage_params(cfg, run.tp, run.pp)[stage]
    states = costmodel.model_state_bytes(local, DTYPES[run.dtype][1], "adamw")
    b, s, h, a, layers = run.micro_batch_size, cfg.block_size, cfg.n_embd, cfg.n_head, cfg.n_layer // run.pp
    selective = run.attention == "flash" or run.recompute == "selective"  # no a·s² scores kept
    kind = "full" if run.recompute == "full" else ("selective" if selective else "none")
    sp = run.sequence_parallel
    act = costmodel.activation_memory_bytes(s, b, h, a, layers, run.tp, sp, kind) * e / 2
    act *= costmodel.pipeline_stashed_microbatches(run.schedule, run.pp, run.microbatches, stage=stage)
    if run.recompute == "full":
        one = "selective" if run.attention == "flash" else "none"
        act += costmodel.activation_memory_bytes(s, b, h, a, 1, run.tp, sp, one) * e / 2
    mem = {"parameters": local * e, "gradients": local * e,
           "optimizer_states": states["optimizer"] / (run.dp if run.zero >= 1 else 1),
           "activations": act, "temporaries": None}
    mem["peak"] = sum(v for v in mem.values() if v is not None)
    m, tp_factor = run.microbatches, 6 / 4 if run.recompute == "full" else 1
    tp_bytes = m * layers * costmodel.tensor_parallel_bytes_per_layer(b, s, h, run.tp, e) * tp_factor
    sp_bytes = dict.fromkeys(("all_gather", "reduce_scatter"), 0.0)
    if sp:  # the layers' all-reduces become all-gathers and reduce-scatters
        sp_bytes, tp_bytes = _sequence_parallel_bytes(run, m * layers), 0.0
    first, last = stage == 0, stage == run.pp - 1
    tied_sync = cfg.tie_embeddings and run.pp > 1 and (first or last)  # Megatron's embedding group
    emb = costmodel.bus_bytes("all_reduce", cfg.vocab_size * h // run.tp * e, 2) if tied_sync else 0.0
    # ZeRO-2 in Model3D reduce-scatters once, after the last microbatch: the collectives of m = 1
    dp_op = costmodel.zero_dp_bytes_per_step(local, run.dp, run.zero, 1 if run.zero == 2 else m, e)
    msg = costmodel.pipeline_p2p_message_bytes(b, s, h, run.tp, e, scatter_gather=sp)  # SP: the s/t slice
    comm = {"all_reduce": tp_bytes + emb + (dp_op if run.zero == 0 else 0.0),
            "all_gather": sp_bytes["all_gather"] + (dp_op / 2 if run.zero >= 1 else 0.0),
            "reduce_scatter": sp_bytes["reduce_scatter"] + (dp_op / 2 if run.zero >= 1 else 0.0),
            "all_to_all": 0.0, "send": m * ((not last) + (not first)) * msg, "broadcast": 0.0}
    return {"memory_bytes": mem, "comm_bytes": comm}


def _sequence_parallel_bytes(run: DryRun, layer_passes: int) -> dict:
    """Wire bytes of the all-gathers and reduce-scatters of ``layer_passes`` layer forward+backwards with
    sequence parallelism (Model3D's SP layers re-gather their input for the weight gradient)."""
    cfg, e = run.cfg, torch.finfo(DTYPES[run.dtype][0]).bits // 8
    full = run.micro_batch_size * cfg.block_size * cfg.n_embd * e  # a (b, s, h) buffer
    counts = costmodel.sequence_parallel_collectives_per_layer(regather=True,
                                                               recompute=run.recompute == "full")
    return {op: layer_passes * sum(phase[op] for phase in counts.values())
            * costmodel.bus_bytes(op, full, run.tp) for op in ("all_gather", "reduce_scatter")}


def _notes(run: DryRun) -> list[str]:
    """What the measured and predicted columns count, for this run."""
    notes = [f"attention: {run.attention} accounting" + (" (no T x T scores held, as a GPU's flash kernel)"
                                                        if run.attention == "flash" else
                                                        " (the meta math path holds T x T scores)"),
             "one rank's second step: the optimizer state exists from its start, as in training"]
    if run.llama:
        notes += [f"Llama-shaped: {run.cfg.n_kv_head} kv heads, SwiGLU width {run.cfg.ffn_hidden}; predicted "
                  f"activations (costmodel.llama) count fused RMSNorm and SwiGLU kernels: eager PyTorch also "
                  f"keeps each RMSNorm's float32 input and output and a copy of the attention output",
                  "predicted all_reduce: TP layers (and replicated kv heads' weight gradients) and DP; "
                  "the embedding/output layer's f/g and the vocabulary-parallel loss's all-reduces are "
                  "measured only"]
    else:
        notes += ["predicted activations: Korthikanti et al. 2022 with dropout masks; the step runs without "
                  "dropout (GPTConfig.dropout = 0)",
                  "predicted all_reduce: TP layers, the tied-embedding sync and DP; the embedding/output "
                  "layer's f/g and the vocabulary-parallel loss's all-reduces are measured only"]
    notes.append("predicted peak: model states + activations; temporaries (buffers, one op's working set) "
                 "have no formula")
    if run.sequence_parallel:
        notes.append("sequence parallel: predicted all_gather / reduce_scatter are the layers' (with the "
                     "re-gather for weight gradients); the embedding's and output layer's g / ḡ and the "
                     "all-reduce of the norm / bias / wpe partial gradients over TP are measured only")
    if run.dtype == "bf16-mixed":
        notes.append("bf16-mixed: optimizer_states = 3 x the measured bf16 AdamW moments (fp32 master "
                     "and moments of the same elements); the extra 2 x is added to peak")
    return notes


def dryrun(run: DryRun) -> dict:
    """One measured step of ``run``'s rank: the result as plain data (see the module docstring)."""
    from ..parallelism.mesh import RankGrid

    t0 = time.perf_counter()
    coords = RankGrid(run.world, run.dp, run.tp, run.pp).coords(run.rank)
    peak, events = _step(run)  # chapter 12's Model3D step: the GPT, or the Llama-shaped model
    opt = peak["optimizer_state"]
    extra = 2 * opt if run.dtype == "bf16-mixed" else 0  # fp32 master + fp32 moments: 12 bytes, not 4
    mem = {"parameters": peak["parameters"], "gradients": peak["gradients"], "optimizer_states": opt + extra,
           "activations": peak["activations"], "temporaries": peak["temporaries"],
           "peak": peak["total"] + extra}
    wire, calls = _comm(events)
    capacity = run.gpu.memory_bytes
    largest = max(("parameters", "gradients", "optimizer_states", "activations", "temporaries"),
                  key=mem.__getitem__)
    notes = _notes(run)
    return {"config": {"model": run.name, "n_layer": run.cfg.n_layer, "n_embd": run.cfg.n_embd,
                       "n_head": run.cfg.n_head, "vocab_size": run.cfg.vocab_size, "seq": run.cfg.block_size,
                       "dp": run.dp, "tp": run.tp, "pp": run.pp, "zero": run.zero, "recompute": run.recompute,
                       "sequence_parallel": run.sequence_parallel, "microbatches": run.microbatches,
                       "micro_batch_size": run.micro_batch_size, "schedule": run.schedule, "dtype": run.dtype,
                       "attention": run.attention, "gpu": run.gpu_name, "params": run.params},
            "world_size": run.world, "rank": run.rank, "coords": coords._asdict(),
            "measured": {"memory_bytes": mem, "comm_bytes": wire, "comm_calls": calls},
            "predicted": (llama_predicted(run, torch.finfo(DTYPES[run.dtype][0]).bits // 8,
                                          DTYPES[run.dtype][1], coords.pp) if run.llama
                          else predicted(run, coords.pp)),
            "fits": mem["peak"] <= capacity, "gpu_memory_bytes": capacity,
            "largest": largest, "notes": notes, "seconds": round(time.perf_counter() - t0, 3)}


def _gb(v) -> str:
    """Bytes in decimal units (kB, MB, GB: powers of 1000), three significant figures."""
    if v is None:
        return "-"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v:.0f} B"


def format_result(res: dict) -> str:
    """The result as a readable table: measured next to predicted."""
    c, meas, pred = res["config"], res["measured"], res["predicted"]
    lines = [f"dry run of {c['model']} ({c['params'] / 1e9:.2f} B parameters: {c['n_layer']} layers, hidden "
             f"{c['n_embd']}, {c['n_head']} heads, vocab {c['vocab_size']}, seq {c['seq']})",
             f"rank {res['rank']} of {res['world_size']} = dp {c['dp']} x tp {c['tp']} x pp {c['pp']} "
             f"(coords {res['coords']}); ZeRO-{c['zero']}, {c['dtype']}, {c['schedule']}, "
             f"m={c['microbatches']} x b={c['micro_batch_size']}, recompute {c['recompute']}"
             + (", sequence parallel" if c["sequence_parallel"] else ""), "",
             format_table([[k, _gb(meas["memory_bytes"][k]), _gb(pred["memory_bytes"][k])]
                           for k in MEMORY_KEYS], ["memory", "measured", "predicted"], align="lrr"), "",
             format_table([[k, meas["comm_calls"][k], _gb(meas["comm_bytes"][k]), _gb(pred["comm_bytes"][k])]
                           for k in COMM_OPS], ["wire bytes", "calls", "measured", "predicted"],
                          align="lrrr")]
    verdict = "fits" if res["fits"] else f"does NOT fit (largest: {res['largest']})"
    peak = _gb(meas["memory_bytes"]["peak"])
    lines += ["", f"{c['gpu']}: {res['gpu_memory_bytes'] / 1e9:.0f} GB; peak {peak}: {verdict}",
              *(f"note: {n}" for n in res["notes"]), f"{res['seconds']:.1f} s"]
    return "\n".join(lines)


def add_arguments(p) -> None:
    from .planner_presets import GPUS, MODELS

    names = sorted({*MODELS, *(a for m in MODELS.values() for a in m.aliases)})
    p.add_argument("--model", help=f"a preset ({', '.join(names)}); explicit dims override it")
    for flag in ("--n-layer", "--n-embd", "--n-head", "--vocab-size", "--seq"):
        p.add_argument(flag, type=int)
    for flag in ("--dp", "--tp", "--pp"):
        p.add_argument(flag, type=int, default=1, help="degree (default 1); dp·tp·pp = world size")
    p.add_argument("--world", type=int, help="world size, checked against dp·tp·pp (default: their product)")
    p.add_argument("--zero", type=int, default=1, help="ZeRO stage, 0, 1 or 2 (default 1)")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--recompute", default="none", help="none (default), selective or full")
    p.add_argument("--microbatches", type=int, help="microbatches per step (default: pp)")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--schedule", default="1f1b", help="1f1b (default), gpipe, zb-h1")
    p.add_argument("--dtype", default="bf16-mixed", help="fp32 or bf16-mixed (default)")
    p.add_argument("--attention", default="flash", help="flash (default) or math accounting")
    p.add_argument("--gpu", default="h100", help=f"capacity check: {', '.join(sorted(GPUS))}")
    p.add_argument("--rank", type=int, default=0, help="which rank to play (default 0)")
    p.add_argument("--json", metavar="PATH", help="also write the result as JSON")


def main(args) -> int:
    """``python -m minitorch_dist dryrun``."""
    import json
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    names = ("model", "n_layer", "n_embd", "n_head", "vocab_size", "seq", "dp", "tp", "pp", "zero",
             "sequence_parallel", "recompute", "microbatches", "micro_batch_size", "schedule", "dtype", "gpu",
             "rank", "attention", "world")
    try:
        res = dryrun(DryRun(**{k: getattr(args, k) for k in names}))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_result(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
