"""Chapter 12 (2026 edition): the Llama 3 presets are Dubey et al. 2024's models, and the formulas the
planner and the dry run use for a Llama-shaped model (``costmodel.llama``: grouped-query attention's
smaller k, v projections, SwiGLU's three matrices) are the Llama's own.

Expected values come from elsewhere: the published parameter counts (8.0B, 70.6B, 405.9B: the formula
must be within 1%), the ``models.llama.Llama`` module itself built on ``meta`` (its parameters counted),
torch's
``FlopCounterMode`` (its matmul FLOPs), the ``MemoryMeter`` (the bytes autograd saves), and the dry
run's measured step: the command line's ``main`` for each run, played one after another by one worker
process (``python tests/test_llama_presets.py``), so pytest never holds the fake process group.

Tolerances. The published parameter counts are printed to one decimal of a billion (8.0B, 70.6B,
405.9B) and count what the formula counts only up to the papers' rounding: within 1%. Formulas against
formulas are a few float64 operations: rel 1e-12 and pytest.approx's default 1e-6 >> k·u; counts of
parameters, FLOPs and bytes are integers, compared exactly.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from minitorch_dist import costmodel
from minitorch_dist.analysis import planner as P
from minitorch_dist.analysis.dryrun import DryRun
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.analysis.planner_presets import GPUS, MODELS, ModelSpec, get_model
from minitorch_dist.costmodel import llama as LC
from minitorch_dist.course.registry import REPO_ROOT
from minitorch_dist.models.llama import Llama, LlamaBlock, LlamaConfig

pytestmark = [pytest.mark.ch12, pytest.mark.timeout(180)]

PUBLISHED = {"llama3-8b": 8.0e9, "llama3-70b": 70.6e9, "llama3-405b": 405.9e9}
TABLE3 = {  # Dubey et al. 2024, Table 3: layers, model dimension, FFN dimension, heads, kv heads
    "llama3-8b": (32, 4096, 14336, 32, 8), "llama3-70b": (80, 8192, 28672, 64, 8),
    "llama3-405b": (126, 16384, 53248, 128, 8)}


# --- the presets ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_are_table3_and_count_the_published_parameters(name):
    spec = get_model(name)
    assert (spec.layers, spec.hidden, spec.ffn_hidden, spec.heads, spec.kv_heads) == TABLE3[name]
    assert (spec.vocab, spec.seq, spec.tie_embeddings, spec.bias) == (128256, 8192, False, False)
    assert spec.params == pytest.approx(PUBLISHED[name], rel=0.01)
    with torch.device("meta"):
        model = Llama(spec.llama_config())
    assert model.num_params() == spec.params  # the formula is the module's count, exactly
    if name == "llama3-8b":  # GPT's formula (a 4h GELU MLP, k and v of every head) is 6% off here
        assert abs(costmodel.transformer_params(spec.as_cfg()) - spec.params) / spec.params > 0.05


def test_gpt_presets_keep_the_gpt_formulas():
    for name in ("gpt3-175b", "llama-7b", "tiny"):
        spec = get_model(name)
        assert not spec.is_llama
        assert spec.params == costmodel.transformer_params(spec.as_cfg())
        assert spec.stage_params(8 if name != "tiny" else 2, 2) == costmodel.pipeline_stage_params(
            spec.as_cfg(), 8 if name != "tiny" else 2, 2)
        assert spec.flops_per_token() == costmodel.model_flops_per_token(spec.as_cfg(), spec.seq)


def test_a_bad_llama_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_heads 8 needs a Llama-shaped model"):
        ModelSpec("x", 2, 64, 8, 16, 64, 8, kv_heads=8)
    with pytest.raises(ValueError, match="must divide heads 8"):
        ModelSpec("x", 2, 64, 8, 16, 64, 8, kv_heads=3, ffn_hidden=128)


# --- the formulas against the module ------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
def test_flops_per_token_equal_torchs_flop_counter(n_kv_head):
    cfg = LlamaConfig.tiny(n_head=4, n_kv_head=n_kv_head, n_embd=64, vocab_size=96, block_size=32)
    model, (b, s) = Llama(cfg), (2, 32)
    x = torch.randint(0, 96, (b, s))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x, x)[1].backward()
    assert counter.get_total_flops() == LC.llama_flops_per_token(cfg, s) * b * s
    assert LC.llama_flops_per_step(cfg, b, s) == LC.llama_flops_per_token(cfg, s) * b * s


@pytest.mark.parametrize("h, a, g, f, s, b", [(64, 4, 2, 192, 64, 4), (128, 8, 2, 352, 128, 2),
                                               (96, 6, 6, 256, 32, 3)])
def test_activation_formula_accounts_for_every_saved_byte(h, a, g, f, s, b):
    """fp32, one block, SDPA's flash path (no s² scores: "selective"). The formula counts what fused
    kernels keep; eager PyTorch keeps three b·s·h tensors more (each RMSNorm's normalised output, and
    SDPA's output besides o_proj's contiguous copy of it), one log-sum-exp per query row (b·a·s), one
    rstd per row per RMSNorm (2·b·s) and RoPE's cos and sin for q and for k (2·s·d): nothing else."""
    torch.manual_seed(0)
    block = LlamaBlock(LlamaConfig.tiny(n_embd=h, n_head=a, n_kv_head=g, ffn_hidden=f, block_size=s))
    meter = MemoryMeter(block)
    with meter.track():
        block(torch.randn(b, s, h, requires_grad=True))
    formula = LC.llama_activation_bytes(s, b, h, a, g, f, 1, 1, False, "selective", bytes_per_element=4)
    eager = 3 * s * b * h + b * a * s + 2 * b * s + 2 * s * (h // a)
    assert meter.peak["activations"] == formula + 4 * eager


def test_llama_gemms_are_the_counted_flops_and_shrink_with_gqa():
    b, s, h, a, f = 1, 8192, 4096, 32, 14336
    gemm = LC.llama_layer_gemm_flops(b, s, h, a, 8, f)
    cfg = get_model("llama3-8b").as_cfg()
    per_layer = (LC.llama_flops_per_token(cfg, s) - 6 * cfg.vocab_size * h) / 3 / cfg.n_layer * b * s
    assert sum(gemm.values()) == pytest.approx(per_layer, rel=1e-12)
    assert gemm["qkv"] == 2 * b * s * h * (h + 2 * 8 * 128)  # k, v: 8 heads of 128, a quarter of q
    assert LC.llama_layer_gemm_flops(b, s, h, a, 32, f)["qkv"] == 6 * b * s * h * h  # MHA: GPT's 6bsh²
    assert gemm["gate_up"] + gemm["down"] == 6 * b * s * h * f  # three h x f matrices
    assert LC.llama_layer_gemm_flops(b, s, h, a, 8, f, t=16)["qkv"] == 2 * b * s * h * (h / 16 + 2 * 128)


def test_kv_heads_per_rank_split_replicated_or_refused():
    assert LC.llama_kv_heads_per_rank(32, 8, 4) == 2 and LC.llama_kv_heads_per_rank(32, 8, 16) == 1
    assert LC.llama_kv_heads_per_rank(12, 6, 3) == 2
    with pytest.raises(ValueError, match="tp=4 must divide n_head 12, and divide n_kv_head 6 or be a"):
        LC.llama_kv_heads_per_rank(12, 6, 4)
    cfg = get_model("llama3-70b").as_cfg()
    assert LC.llama_kv_replica_allreduce_elements(cfg, 8) == 0
    assert LC.llama_kv_replica_allreduce_elements(cfg, 16) == 2 * 8 * 128 * 8192
    assert LC.ulysses_max_degree_gqa(64, 8) == 8


# --- the planner -------------------------------------------------------------------------------------------


def test_planner_counts_the_llamas_memory_and_flops():
    model, cluster = get_model("llama3-70b"), P.Cluster(GPUS["h100"], 64)
    c = P.Config(8, 1, 8, 1, 256, 1, "selective", True)
    plan = P.evaluate(c, model, cluster)
    psi = LC.llama_params_per_rank(model.as_cfg(), 8)
    assert plan.memory["weights"] == pytest.approx(2 * psi)  # bf16 weights of this rank's slice
    act = LC.llama_activation_bytes(8192, 1, 8192, 64, 8, 28672, 80, 8, True, "selective")
    assert plan.memory["activations"] == pytest.approx(act)
    tokens = model.global_batch * model.seq
    assert plan.tokens_per_s * plan.step_time == pytest.approx(tokens)
    want_mfu = LC.llama_flops_per_token(model.as_cfg(), 8192) * tokens / plan.step_time / 64 / \
        cluster.peak_flops()
    assert plan.mfu == pytest.approx(want_mfu)


def test_planner_refuses_a_tp_that_splits_no_whole_kv_heads():
    model = ModelSpec("gqa-6", 4, 768, 12, 1024, 32000, 64, bias=False, tie_embeddings=False, kv_heads=6,
                      ffn_hidden=2048)
    with pytest.raises(ValueError, match="kv heads 6 are neither split by tp=4 nor a divisor of it"):
        P.check_config(P.Config(4, 1, 2, 1, 32), model, P.Cluster(GPUS["h100"], 8))
    assert all(c.tp in (1, 2, 3, 6) or c.tp % 6 == 0 for c in P.candidates(model, P.Cluster(GPUS["h100"], 8)))


def test_llama_presets_are_in_the_table():
    assert {"llama3-8b", "llama3-70b", "llama3-405b"} <= set(MODELS)


# --- the dry run -------------------------------------------------------------------------------------------


LLAMA = ("--model", "llama3-8b", "--zero", "1")
LLAMA_TP = {(8, True): (*LLAMA, "--tp", "8", "--dp", "2", "--sequence-parallel"),
            (16, False): (*LLAMA, "--tp", "16", "--dp", "2")}
PP_LAYERS = 16  # llama3-8b's widths, 4 layers per stage (the formulas checked are per stage)
LLAMA_PP = {rank: (*LLAMA, "--n-layer", str(PP_LAYERS), "--dp", "1", "--tp", "8", "--pp", "4",
                   "--rank", str(rank)) for rank in (0, 8, 31)}


def play(runs: list) -> list:
    """The worker: ``[exit code, JSON result]`` of each run, through the command line's main."""
    import warnings

    from minitorch_dist.__main__ import main

    warnings.filterwarnings("ignore", category=FutureWarning)
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, args in enumerate(runs):
            path = os.path.join(tmp, f"{i}.json")
            with contextlib.redirect_stdout(io.StringIO()):
                code = main(["dryrun", *args, "--json", path])
            out.append([code, json.loads(Path(path).read_text()) if code == 0 else None])
    return out


@pytest.fixture(scope="module")
def dryruns():
    runs = [*LLAMA_TP.values(), *LLAMA_PP.values()]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(runs),
                          capture_output=True, text=True, timeout=170, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for args, (code, _) in zip(runs, out):
        assert code == 0, f"dryrun {' '.join(args)} exited {code}"
    return {args: res for args, (_, res) in zip(map(tuple, runs), out)}


@pytest.mark.parametrize("tp, sp", [(8, True), (16, False)])  # kv heads split; replicated (2 copies each)
def test_dryrun_plays_llama3_8b_and_measures_its_formulas(dryruns, tp, sp):
    res = dryruns[LLAMA_TP[tp, sp]]
    mem, wire, pred = res["measured"]["memory_bytes"], res["measured"]["comm_bytes"], res["predicted"]
    local = LC.llama_params_per_rank(get_model("llama3-8b").as_cfg(), tp)
    assert res["config"]["params"] == get_model("llama3-8b").params
    assert mem["parameters"] == mem["gradients"] == 2 * local == pred["memory_bytes"]["parameters"]
    # the layers' collectives are the formula's; the embedding's and output layer's come on top (< 3%)
    for op in ("all_gather", "reduce_scatter") if sp else ("all_reduce",):
        assert pred["comm_bytes"][op] <= wire[op] <= 1.03 * pred["comm_bytes"][op], op
    assert mem["activations"] > pred["memory_bytes"]["activations"]  # eager keeps more than fused kernels
    assert any("Llama-shaped: 8 kv heads" in n for n in res["notes"])


@pytest.mark.parametrize("rank", [0, 8, 31])  # the first, a middle and the last stage (tp 0, 0, 7)
def test_dryrun_plays_a_llama_in_pipeline_stages(dryruns, rank):
    """pp > 1: the rank's step is chapter 12's Model3D with the Llama cut into stages; its parameters,
    its sends and its data-parallel collectives are the stage's formulas exactly."""
    res = dryruns[LLAMA_PP[rank]]
    mem, wire, pred = res["measured"]["memory_bytes"], res["measured"]["comm_bytes"], res["predicted"]
    stage = res["coords"]["pp"]
    cfg = SimpleNamespace(**vars(get_model("llama3-8b").as_cfg()) | {"n_layer": PP_LAYERS})
    assert res["config"]["n_layer"] == PP_LAYERS and res["config"]["n_embd"] == cfg.n_embd
    local = LC.llama_stage_params(cfg, 8, 4)[stage]
    assert mem["parameters"] == 2 * local == pred["memory_bytes"]["parameters"]
    assert wire["send"] == pred["comm_bytes"]["send"] > 0
    assert pred["comm_bytes"]["all_reduce"] <= wire["all_reduce"] <= 1.1 * pred["comm_bytes"]["all_reduce"]
    assert mem["activations"] > pred["memory_bytes"]["activations"]  # eager keeps more than fused kernels


def test_dryrun_refuses_what_it_cannot_play_for_a_llama():
    with pytest.raises(ValueError, match="--pp 3 does not divide the 32 layers"):
        DryRun(model="llama3-8b", pp=3)
    with pytest.raises(ValueError, match=r"n_kv_head=8, t=3; use t in \(1, 2, 4, 8, 16, 32\)"):
        DryRun(model="llama3-8b", tp=3)
    with pytest.raises(ValueError, match="recomputes whole blocks"):
        DryRun(model="llama3-8b", recompute="selective")


if __name__ == "__main__":
    print(json.dumps(play(json.load(sys.stdin))))
