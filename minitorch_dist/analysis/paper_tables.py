"""Chapter 12 — papers' tables from the library's own training steps on meta tensors.

``python -m minitorch_dist.analysis.paper_tables zero`` measures Table 1 of Rajbhandari et al. 2020
(ZeRO): model-state memory per device for Psi = 7.5B, 128B and 1T parameters on N_d = 1 ... 1024
data-parallel ranks under P_os, P_os+g and P_os+g+p. It plays rank 0 of N_d ranks under torch's
*fake* process group (every collective returns at once) with the model on ``meta`` tensors, and runs
two training steps of the library's wrappers: :class:`~..memory.zero.ShardedOptimizer` at stage 1
(P_os) and 2 (P_os+g), :func:`~..memory.zero.fully_shard` on every block and the root (P_os+g+p),
AdamW inside. :class:`.meta_memory.MetaMemoryMeter` reads the bytes this rank holds in parameters,
gradients and optimizer state after the second step (the model states that live from step to step;
the paper's Table 1 counts those, not a step's transient buffers).

What is measured and what is converted, explicitly:

* **layer-stacked**: a Psi-parameter model is not built. A GPT of one block of ``REP_HIDDEN`` (a
  representative layer: every block of a GPT has the same shape) and a tiny embedding is measured,
  and its bytes per parameter are scaled to Psi: ``bytes(Psi) = bytes(measured) * Psi /
  params(measured)``. Model states are per element, so this is exact up to ZeRO's padding of each
  shard to ``ceil(numel / N_d)`` elements (at most 0.4% from ``costmodel.zero_memory_bytes``, at
  N_d = 1024 where the measured model is smallest per rank).
* **mixed precision**: the step runs in fp16 end to end, so parameters and gradients are the
  paper's 2 + 2 bytes as measured, and AdamW's two moments are fp16 (4 bytes per element of this
  rank's shard). Mixed-precision Adam keeps an fp32 master copy and fp32 moments, K = 12 bytes,
  for exactly those elements: the optimizer state reported is 3 x the measured one. The sharding
  (which elements, 1/N_d of them or all) is the library's, measured; the factor 3 is converted.

``python -m minitorch_dist.analysis.paper_tables korthikanti`` measures Table 2 of Korthikanti et
al. 2022: activation bytes per transformer layer of GPT-3 175B (s = 2048, b = 1, h = 12288, a = 96)
on rank 0 of t = 8, in five settings: TP alone, TP + SP, TP + selective recomputation, TP + SP +
selective, full recomputation. One real layer of the library (the TP block of
``parallelism.tensor_parallel``, the SP block of ``parallelism.sequence_parallel.megatron_sp``) runs
its forward in bf16 on meta; the meter counts the tensors autograd saves. Measured vs converted:

* **attention**: ``F.scaled_dot_product_attention`` is routed to the library's
  ``memory.checkpointing.attention_core`` (scores and softmax written out, what the paper counts;
  a fused kernel would keep none of them), inside ``memory.checkpointing.checkpoint`` for selective
  recomputation. Full recomputation checkpoints the whole block with the same ``checkpoint``.
* **dropout**: the layers run without dropout (the SP block refuses it), and the bytes the paper
  counts for it -- two 1-byte residual masks and, where the scores are kept, the attention dropout's
  1-byte mask and 2-byte output -- are added as :func:`dropout_bytes`. For the TP layer (which takes
  dropout) a second run with dropout checks that term: it differs from it by one byte per mask
  element only (on meta a mask has the activation dtype, 2 bytes; a GPU keeps 1-byte bools).

``python -m minitorch_dist.analysis.paper_tables narayanan`` runs ``dryrun`` (the library's 3D
step, ``parallelism.three_d.Model3D``) for rank 0 of every row of Table 1 of Narayanan et al. 2021
with full recomputation and reports its peak against an 80 GB A100 (see
:func:`narayanan_row_measured` for the microbatches run).
"""
from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import costmodel
from ..runtime.tables import format_table
from .meta_memory import MetaMemoryMeter

__all__ = ["ZERO_MODELS", "ZERO_DPS", "ZERO_STAGES", "REP_HIDDEN", "KORTHIKANTI_SETTINGS", "GPT3_LAYER",
           "fake_group", "zero_states_measured", "zero_table1_measured", "korthikanti_layer_measured",
           "dropout_bytes", "korthikanti_table2_measured", "narayanan_row_measured",
           "narayanan_table1_measured"]

ZERO_MODELS = costmodel.TABLE1_MODELS  #: Psi of ZeRO's Table 1: 7.5B, 128B, 1T
ZERO_DPS = costmodel.TABLE1_DP  #: N_d: 1, 4, 16, 64, 256, 1024
ZERO_STAGES = (1, 2, 3)  #: P_os, P_os+g, P_os+g+p
REP_HIDDEN = 512  #: width of the representative block (3.1M parameters)
_K_OVER_MEASURED = 12 / 4  # fp32 master + 2 fp32 moments per element / the 2 fp16 moments measured


@contextlib.contextmanager
def fake_group(world: int, rank: int = 0):
    """Torch's fake process group of ``world`` ranks, as ``rank``, for the block; destroyed after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised: measure in a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _block_model(hidden: int, dtype):
    """A GPT of one representative block on meta (tiny vocabulary and sequence), in ``dtype``."""
    from ..models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=8, n_embd=hidden)
    with torch.device("meta"):
        model = GPT(cfg).to(dtype)
    block = sum(p.numel() for p in model.blocks.parameters())
    return model, cfg, block


def zero_states_measured(stage: int, dp: int, hidden: int = REP_HIDDEN) -> dict:
    """Rank 0 of ``dp``: bytes of parameters, gradients and fp16 AdamW state after the second step of
    a one-block fp16 GPT under ZeRO ``stage`` (the library's wrappers), and the model's sizes.
    Call inside no process group: this opens (and closes) the fake one."""
    from ..memory.zero import ShardedOptimizer, fully_shard

    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage!r}: choose 1 (P_os), 2 (P_os+g) or 3 (P_os+g+p)")
    with fake_group(dp):
        model, cfg, block = _block_model(hidden, torch.float16)
        total = sum(p.numel() for p in model.parameters())
        if stage == 3:
            for b in model.blocks:
                fully_shard(b)
            fully_shard(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)
            inner = opt
        else:
            opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-4,
                                   foreach=False)
            inner = opt.optim
        x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), device="meta")
        meter = MetaMemoryMeter(model, inner)
        for _ in range(2):  # the first creates the optimizer state; the second is measured
            with meter.track():
                opt.zero_grad()
                model(x, x)[1].backward()
                opt.step()
        end = meter.final
    return {"parameters": end["parameters"], "gradients": end["gradients"],
            "optimizer_state": end["optimizer_state"], "model_params": total, "block_params": block}


def zero_table1_measured(models=ZERO_MODELS, dps=ZERO_DPS, stages=ZERO_STAGES,
                         hidden: int = REP_HIDDEN) -> dict:
    """ZeRO's Table 1 from the library's steps: ``{dp: {psi: {stage: bytes per device}}}``.

    One measurement per (stage, dp), all in one fresh interpreter (the fake group is opened and
    destroyed around each), scaled to every Psi (see the module docstring: measured per element,
    K = 12 converted). The tiny embedding of the measured model counts at the block's bytes per
    element."""
    out: dict = {dp: {psi: {} for psi in models} for dp in dps}
    jobs = [{"stage": stage, "dp": dp, "hidden": hidden} for stage in stages for dp in dps]
    for job, m in zip(jobs, _in_subprocess("zero", jobs)):
        per_element = (m["parameters"] + m["gradients"] + _K_OVER_MEASURED * m["optimizer_state"]) \
            / m["model_params"]
        for psi in models:
            out[job["dp"]][psi][job["stage"]] = per_element * psi
    return out


def _in_subprocess(kind: str, jobs: list, timeout: float = 120) -> list:
    """Run measurements of ``kind`` (one per dict of arguments in ``jobs``) in a fresh interpreter:
    the fake group lives in that process only, never in the caller's."""
    cmd = [sys.executable, "-m", "minitorch_dist.analysis.paper_tables", "--json", kind, json.dumps(jobs)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"measurement {kind} {jobs} failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


# --- Korthikanti et al. 2022, Table 2: activations per layer -------------------------------------------
#: Table 2's five settings: (sequence parallel, recompute) with Korthikanti's names for recompute.
KORTHIKANTI_SETTINGS = {"tp": (False, "none"), "tp+sp": (True, "none"), "tp+selective": (False, "selective"),
                        "tp+sp+selective": (True, "selective"), "full": (False, "full")}
GPT3_LAYER = {"seq": 2048, "batch": 1, "hidden": 12288, "heads": 96, "tp": 8}  #: Korthikanti §4, GPT-3 175B


class _ExplicitAttention(TorchFunctionMode):
    """Route the layer's ``F.scaled_dot_product_attention`` (causal, no mask) to the library's
    ``memory.checkpointing.attention_core`` (scores, softmax and its dropout written out, as the
    paper counts them); ``selective``: that core inside the library's ``checkpoint`` (Korthikanti §5)."""

    def __init__(self, selective: bool):
        super().__init__()
        self.selective = selective

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from ..memory.checkpointing import attention_core, checkpoint

        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("attn_mask") is None and len(args) == 3:
            p = kwargs.get("dropout_p", 0.0)
            return checkpoint(attention_core, *args, p) if self.selective else attention_core(*args, p)
        return func(*args, **kwargs)


def _tp_layer(cfg, sequence_parallel: bool):
    """One GPT block of ``cfg`` on meta in bf16, made this rank's TP (Megatron §3) or TP + SP block."""
    from ..models.gpt import Block
    from ..parallelism.sequence_parallel import sequence_parallel_block
    from ..parallelism.tensor_parallel import ParallelAttention, ParallelMLP

    with torch.device("meta"):
        block = Block(cfg).to(torch.bfloat16)
    if sequence_parallel:
        return sequence_parallel_block(block, regather=True, broadcast_weights=False)
    block.attn = ParallelAttention(block.attn, broadcast_weights=False)
    block.mlp = ParallelMLP(block.mlp, broadcast_weights=False)
    return block


def _saved_by_layer(cfg, sp: bool, recompute: str, batch: int, tp: int) -> int:
    """Bytes the meter sees saved for backward by one forward of this rank's layer (in the fake group)."""
    from ..memory.checkpointing import checkpoint

    layer = _tp_layer(cfg, sp).train()
    x = torch.empty(batch, cfg.block_size // tp if sp else cfg.block_size, cfg.n_embd, device="meta",
                    dtype=torch.bfloat16, requires_grad=True)
    meter = MetaMemoryMeter(layer)
    with meter.track(), _ExplicitAttention(recompute == "selective"):
        y = checkpoint(layer, x) if recompute == "full" else layer(x)
        saved = meter.current()["activations"]
        del y
    return saved


def korthikanti_layer_measured(setting: str, seq: int = 2048, batch: int = 1, hidden: int = 12288,
                               heads: int = 96, tp: int = 8) -> dict:
    """Bytes one transformer layer saves for backward on rank 0 of ``tp`` in Table 2's ``setting``:
    the library's TP block (``parallelism.tensor_parallel``) or SP block (``megatron_sp``, the
    input re-gathered in backward, ``regather=True``), bf16, on meta under the fake group; the
    attention core written out (``attention_core``) or checkpointed (selective); ``full``: the whole
    block inside ``memory.checkpointing.checkpoint``.

    ``measured``: the meter's activations after the forward of the layer without dropout (the SP
    block refuses dropout); ``dropout``: what the paper's dropout adds, :func:`dropout_bytes`.
    ``measured_dropout`` (TP settings without SP and without full recompute; else None): the
    same layer measured with dropout 0.1, where the masks are in the activation dtype (2 bytes, as
    on CPU; a GPU keeps a 1-byte bool mask) -- a check of :func:`dropout_bytes`."""
    from ..models.gpt import GPTConfig

    if setting not in KORTHIKANTI_SETTINGS:
        raise ValueError(f"setting {setting!r}: choose one of {', '.join(KORTHIKANTI_SETTINGS)}")
    sp, recompute = KORTHIKANTI_SETTINGS[setting]
    cfg = GPTConfig(vocab_size=64, block_size=seq, n_layer=1, n_head=heads, n_embd=hidden, dropout=0.0)
    with fake_group(tp):
        saved = _saved_by_layer(cfg, sp, recompute, batch, tp)
        with_dropout = None
        if not sp and recompute != "full":
            cfg.dropout = 0.1
            with_dropout = _saved_by_layer(cfg, sp, recompute, batch, tp)
    return {"measured": saved, "dropout": dropout_bytes(setting, seq, batch, hidden, heads, tp),
            "measured_dropout": with_dropout}


def dropout_bytes(setting: str, seq: int, batch: int, hidden: int, heads: int, tp: int) -> float:
    """What Korthikanti's accounting adds for dropout to a layer run without it: the two residual
    dropouts' 1-byte masks (sbh, split by t only under SP) and, where the scores are kept, the
    attention dropout's 1-byte mask and 2-byte output (3as^2b/t; without dropout the softmax output
    feeds the product with v directly). Full recomputation keeps the layer input only: nothing."""
    sp, recompute = KORTHIKANTI_SETTINGS[setting]
    if recompute == "full":
        return 0.0
    sbh = seq * batch * hidden
    masks = 2 * sbh / (tp if sp else 1)
    return masks + (3 * heads * seq * seq * batch / tp if recompute == "none" else 0.0)


def korthikanti_table2_measured(settings=tuple(KORTHIKANTI_SETTINGS), **layer) -> dict:
    """Table 2 for GPT-3 175B at t = 8 (or ``layer``'s sizes): ``{setting: {"measured", "dropout",
    "total", "formula"}}`` in bytes per layer, ``total`` = measured + dropout, ``formula`` =
    ``costmodel.activation_memory_bytes``. Measured in one fresh interpreter."""
    layer = {**GPT3_LAYER, **layer}
    jobs = [{"setting": s, **layer} for s in settings]
    out = {}
    for job, m in zip(jobs, _in_subprocess("korthikanti", jobs)):
        sp, recompute = KORTHIKANTI_SETTINGS[job["setting"]]
        formula = costmodel.activation_memory_bytes(layer["seq"], layer["batch"], layer["hidden"],
                                                    layer["heads"], 1, layer["tp"], sp, recompute)
        out[job["setting"]] = {**m, "total": m["measured"] + m["dropout"], "formula": formula}
    return out


# --- Narayanan et al. 2021, Table 1: every configuration fits --------------------------------------------
def narayanan_row_measured(index: int, gpu: str = "a100") -> dict:
    """The ``dryrun`` of rank 0 (first pipeline stage, the most stashed microbatches) of row ``index``
    of ``planner_presets.NARAYANAN_TABLE1``: its t, p and d = GPUs / (t p), micro-batch 1, full
    recomputation (the paper's), ZeRO-0, bf16 with fp32 master weights and moments, 1F1B.

    The step runs min(batch / d, p) microbatches: 1F1B's first stage stashes at most p at once, so
    this is the schedule's steady state, and the dry run stays short. Not the whole batch's step:
    the library's first stage also holds one b x s x h boundary tensor per microbatch of the step
    until it ends (temporaries that grow with all B/d microbatches, not with the p in flight)."""
    from .dryrun import DryRun, dryrun
    from .planner_presets import NARAYANAN_TABLE1

    row = NARAYANAN_TABLE1[index]
    dp = row.gpus // (row.tp * row.pp)
    run = DryRun(n_layer=row.layers, n_embd=row.hidden, n_head=row.heads, vocab_size=51200, seq=2048,
                 dp=dp, tp=row.tp, pp=row.pp, zero=0, recompute="full", gpu=gpu,
                 microbatches=min(row.batch // dp, row.pp))
    res = dryrun(run)
    return {"params_billion": row.params_billion, "dp": dp, "tp": row.tp, "pp": row.pp,
            "peak": res["measured"]["memory_bytes"]["peak"], "capacity": res["gpu_memory_bytes"],
            "fits": res["fits"]}


def narayanan_table1_measured(rows=None, gpu: str = "a100", timeout: float = 300, processes: int = 2) -> list:
    """:func:`narayanan_row_measured` for the given row indices (default: all), returned in that order.
    The rows are dealt out to ``processes`` fresh interpreters that run at once (a dry run keeps one core
    busy): row k goes to interpreter k mod ``processes``, so the large rows at the end are shared."""
    from concurrent.futures import ThreadPoolExecutor

    from .planner_presets import NARAYANAN_TABLE1

    rows = list(range(len(NARAYANAN_TABLE1)) if rows is None else rows)
    if not isinstance(processes, int) or processes < 1:
        raise ValueError(f"processes={processes!r}: at least 1 interpreter")
    groups = [rows[k::processes] for k in range(min(processes, len(rows)))]
    with ThreadPoolExecutor(len(groups) or 1) as pool:
        done = list(pool.map(lambda g: _in_subprocess("narayanan", [{"index": i, "gpu": gpu} for i in g],
                                                      timeout=timeout), groups))
    by_row = {i: r for g, res in zip(groups, done) for i, r in zip(g, res)}
    return [by_row[i] for i in rows]


_MEASURE = {"zero": zero_states_measured, "korthikanti": korthikanti_layer_measured,
            "narayanan": narayanan_row_measured}


def main(argv=None) -> int:
    import warnings

    warnings.filterwarnings("ignore")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--json"]:
        print(json.dumps([_MEASURE[argv[1]](**kw) for kw in json.loads(argv[2])]))
        return 0
    which = argv[0] if argv else "zero"
    if which not in ("zero", "korthikanti", "narayanan"):
        print(f"error: {which!r}: choose zero, korthikanti or narayanan", file=sys.stderr)
        return 2
    if which == "narayanan":
        print(_format_narayanan(narayanan_table1_measured(timeout=3600)))
        return 0
    print(_format_zero(zero_table1_measured()) if which == "zero" else
          _format_korthikanti(korthikanti_table2_measured()))
    return 0


def _format_zero(table: dict) -> str:
    rows = [[dp, f"{psi / 1e9:g}B", *(f"{cells[s] / 1e9:.4g}" for s in ZERO_STAGES)]
            for dp, row in table.items() for psi, cells in row.items()]
    return format_table(rows, ["N_d", "Psi", *(f"stage {s} GB" for s in ZERO_STAGES)],
                        align="r" * (2 + len(ZERO_STAGES)))


def _format_korthikanti(table: dict) -> str:
    keys = ("measured", "dropout", "total", "formula")
    rows = [[setting, *(f"{r[k] / 1e6:.1f}" for k in keys)] for setting, r in table.items()]
    return format_table(rows, ["setting", *(k + " MB" for k in keys)], align="l" + "r" * len(keys))


def _format_narayanan(results: list) -> str:
    rows = [[f"{r['params_billion']:g}B", r["dp"], r["tp"], r["pp"], f"{r['peak'] / 1e9:.1f}",
             f"{r['capacity'] / 1e9:.0f}", "fits" if r["fits"] else "NO"] for r in results]
    return format_table(rows, ["params", "d", "t", "p", "peak GB", "GPU GB", "fits"], align="rrrrrrl")


if __name__ == "__main__":
    sys.exit(main())
