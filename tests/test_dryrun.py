"""Chapter 12: ``python -m minitorch_dist dryrun`` -- one rank's step of the 3D model on meta tensors under
the fake process group -- measures what the formulas say.

Every run goes through the command line (``python -m minitorch_dist dryrun``'s ``main``) in a
subprocess, so the fake process group is held by that process, never by pytest: the runs the tests
share are played once, one after another, by one worker (``python tests/test_dryrun.py``, each run
initialising and destroying its own group); the exit on bad input and the 175B run are the command
itself, in its own process. The 2 x 2 x 2 grid is chapter 12's test model (tests/test_three_d.py): on
rank 0 (first pipeline stage) and rank 7 (last stage) the parameter, gradient and ZeRO-1 bytes equal
``costmodel.pipeline_stage_params`` (and ``three_d.local_param_count``, padded as ZeRO pads), the
sends and the DP reduce-scatter / all-gather equal their formulas exactly, and the all-reduces equal
the TP layers' formula plus what the costmodel leaves out: the embedding's or output layer's f/g,
the vocabulary-parallel loss's three all-reduces of b·s on the last stage, and ZeRO's one byte per
tensor. Bad input is refused by the checks alone (no process group), with the fix named.

Tolerances. Bytes and call counts are integers, compared exactly; pytest.approx's default rel 1e-6
compares sums of a few float64 byte formulas (k·u ~ 1e-14). The 175B run's parameter and optimizer
bytes differ from the formula by the flat buffers' padding to a multiple of the data-parallel degree,
at most d elements per buffer: below 1e-6 of ~1e9 bytes per rank.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from minitorch_dist import costmodel
from minitorch_dist.analysis.dryrun import COMM_OPS, MAX_LAYERS, MAX_WORLD, DryRun
from minitorch_dist.course.registry import REPO_ROOT
from minitorch_dist.memory.zero import shard_size
from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.parallelism.three_d import local_param_count

pytestmark = [pytest.mark.ch12, pytest.mark.timeout(180)]

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)
D, T, P, M, B = 2, 2, 2, 2, 8  # grid, microbatches, rows per microbatch
SMALL = ("--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--vocab-size", "64", "--seq", "16",
         "--dp", "2", "--tp", "2", "--pp", "2", "--microbatches", "2", "--micro-batch-size", "8",
         "--dtype", "fp32")


WIDE = tuple(a if a != "16" else "128" for a in SMALL)  # seq 128: the attention scores dominate
PIPE = ("--n-layer", "4", "--n-embd", "32", "--n-head", "4", "--vocab-size", "64", "--seq", "16",
        "--pp", "2", "--micro-batch-size", "8", "--dtype", "fp32")
RUNS = {  # every dry run the tests below read, played once by the worker
    "rank0": (*SMALL, "--rank", "0"), "rank7": (*SMALL, "--rank", "7"),
    "zero2": (*SMALL, "--zero", "2"),
    "sp0": (*SMALL, "--rank", "0", "--sequence-parallel"),
    "sp7": (*SMALL, "--rank", "7", "--sequence-parallel"),
    "flash": WIDE, "math": (*WIDE, "--attention", "math"),
    "selective": (*WIDE, "--attention", "math", "--recompute", "selective"),
    "pipe-m2": (*PIPE, "--microbatches", "2"), "pipe-m4": (*PIPE, "--microbatches", "4"),
    "a100": (*SMALL, "--gpu", "a100"),
    "too-big": ("--n-layer", "8", "--n-embd", "4096", "--n-head", "32", "--vocab-size", "51200",
                "--seq", "512", "--dp", "2", "--tp", "2", "--pp", "2", "--gpu", "cpu"),
}


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "minitorch_dist", "dryrun", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT)


def run_json(tmp_path, *args, timeout=120) -> tuple[dict, str]:
    path = tmp_path / "out.json"
    out = cli(*args, "--json", str(path), timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(path.read_text()), out.stdout


def play(runs: dict) -> dict:
    """The worker: ``{name: [exit code, JSON result, stdout]}``, each run through the command line's main."""
    import warnings

    from minitorch_dist.__main__ import main

    warnings.filterwarnings("ignore", category=FutureWarning)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, args in runs.items():
            path, stdout = os.path.join(tmp, f"{name}.json"), io.StringIO()
            with contextlib.redirect_stdout(stdout):
                code = main(["dryrun", *args, "--json", path])
            res = json.loads(Path(path).read_text()) if code == 0 else None
            out[name] = [code, res, stdout.getvalue()]
    return out


@pytest.fixture(scope="module")
def runs():
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], input=json.dumps(RUNS),
                          capture_output=True, text=True, timeout=170, cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, (code, _, _) in out.items():
        assert code == 0, f"dryrun {' '.join(RUNS[name])} exited {code}"
    return {name: (res, stdout) for name, (_, res, stdout) in out.items()}


@pytest.mark.parametrize("rank", [0, 7])
def test_small_grid_measures_the_formulas(runs, rank):
    res, stdout = runs[f"rank{rank}"]
    stage = res["coords"]["pp"]
    first, last = stage == 0, stage == P - 1
    mem, wire, pred = res["measured"]["memory_bytes"], res["measured"]["comm_bytes"], res["predicted"]
    local = costmodel.pipeline_stage_params(CFG, T, P)[stage]
    assert local == local_param_count(CFG, T, P, stage)
    padded = D * shard_size(local, D)
    assert mem["parameters"] == mem["gradients"] == 4 * padded == pred["memory_bytes"]["parameters"]
    # ZeRO-1: AdamW's two fp32 moments of this rank's 1/d shard (torch adds a few bytes of step counters)
    assert 0 <= mem["optimizer_states"] - 8 * shard_size(local, D) < 256
    assert 0 < mem["activations"] <= mem["peak"]
    assert mem["peak"] >= mem["parameters"] + mem["gradients"] + mem["optimizer_states"]
    # pipeline sends: m activations forward (not the last stage) and m gradients back (not the first)
    act = B * CFG.block_size * CFG.n_embd * 4
    assert wire["send"] == pred["comm_bytes"]["send"] == M * ((not last) + (not first)) * act
    assert res["measured"]["comm_calls"]["send"] == M * ((not last) + (not first))
    # ZeRO-1 over the DP group: one reduce-scatter and one all-gather of the (padded) flat buffer
    for op in ("reduce_scatter", "all_gather"):
        assert wire[op] == pred["comm_bytes"][op] == costmodel.bus_bytes(op, 4 * padded, D)
    # all-reduces: TP layers + tied embedding (predicted), plus the edges and the loss (measured only)
    layers = M * (CFG.n_layer // P) * costmodel.tensor_parallel_bytes_per_layer(B, CFG.block_size, CFG.n_embd,
                                                                                 T, bytes_per_element=4)
    emb = costmodel.bus_bytes("all_reduce", 4 * CFG.vocab_size * CFG.n_embd // T, 2)
    assert pred["comm_bytes"]["all_reduce"] == layers + emb
    edges = M * costmodel.bus_bytes("all_reduce", act, T)
    loss = 3 * M * costmodel.bus_bytes("all_reduce", act // CFG.n_embd, T) if last else 0
    one_byte_per_tensor = wire["all_reduce"] - (layers + emb + edges + loss)
    assert 0 < one_byte_per_tensor < 64
    assert wire["all_to_all"] == wire["broadcast"] == 0
    assert "measured" in stdout and "predicted" in stdout and res["fits"] is True


def test_zero2_reduces_once_after_the_last_microbatch(runs):
    """--zero 2: the same reduce-scatter and all-gather bytes as ZeRO-1 (Model3D reduces the bucketed
    gradients once, after the pipeline), the same sharded optimizer state, and gradients freed bucket by
    bucket before the update, so the peak is no higher than ZeRO-1's."""
    one, _ = runs["rank0"]  # --zero 1, the default
    two, stdout = runs["zero2"]
    assert two["config"]["zero"] == 2 and "ZeRO-2" in stdout
    padded = D * shard_size(costmodel.pipeline_stage_params(CFG, T, P)[0], D)
    wire, pred = two["measured"]["comm_bytes"], two["predicted"]["comm_bytes"]
    for op in ("reduce_scatter", "all_gather"):
        assert wire[op] == pred[op] == costmodel.bus_bytes(op, 4 * padded, D)
        assert wire[op] == one["measured"]["comm_bytes"][op]
    assert wire["all_reduce"] == one["measured"]["comm_bytes"]["all_reduce"]
    mem1, mem2 = one["measured"]["memory_bytes"], two["measured"]["memory_bytes"]
    assert mem2["optimizer_states"] == mem1["optimizer_states"]
    assert mem2["parameters"] == mem1["parameters"] and mem2["peak"] <= mem1["peak"]


def test_selective_recomputation_drops_the_attention_scores(runs):
    """--recompute selective (Korthikanti §5) under math accounting: backward keeps q, k, v, not the
    b·a/t·s·s scores, so the activations fall to near flash accounting's and to the costmodel's "selective"
    prediction; no communication changes (the core has no collective)."""
    (none, _), (sel, _), (flash, _) = runs["math"], runs["selective"], runs["flash"]
    scores = B * (CFG.n_head // T) * 128 * 128 * 4
    act = {k: r["measured"]["memory_bytes"]["activations"] for k, r in (("none", none), ("sel", sel),
                                                                         ("flash", flash))}
    assert act["none"] - act["sel"] >= 2 * scores
    assert abs(act["sel"] - act["flash"]) < scores  # flash keeps its output and log-sum-exp too
    pred = {k: r["predicted"]["memory_bytes"]["activations"] for k, r in (("none", none), ("sel", sel))}
    assert pred["sel"] == flash["predicted"]["memory_bytes"]["activations"] < pred["none"]
    assert abs(act["sel"] - pred["sel"]) <= 0.25 * pred["sel"]
    assert sel["measured"]["comm_bytes"] == none["measured"]["comm_bytes"]


def test_sequence_parallel_measures_the_formulas(runs):
    """--sequence-parallel: the layers' all-reduces become the costmodel's all-gathers and reduce-scatters
    (with the re-gather), plus the embedding's ḡ (first stage) or the output layer's g (last); the stage
    sends its s/t slice; the TP group sums the partial LayerNorm / bias / wpe gradients in one all-reduce;
    activations fall below TP's (Korthikanti Table 2: 34/t against 10 + 24/t per s·b·h)."""
    for rank in (0, 7):
        (tp, _), (sp, stdout) = runs[f"rank{rank}"], runs[f"sp{rank}"]
        first = rank == 0
        wire, calls = sp["measured"]["comm_bytes"], sp["measured"]["comm_calls"]
        pred = sp["predicted"]["comm_bytes"]
        act = B * CFG.block_size * CFG.n_embd * 4
        edge = costmodel.bus_bytes("all_gather", act, T)
        zero1 = {op: costmodel.bus_bytes(op, 4 * D * shard_size(costmodel.pipeline_stage_params(CFG, T, P)[
            sp["coords"]["pp"]], D), D) for op in ("all_gather", "reduce_scatter")}
        edges = {"all_gather": M * edge * (1 if first else 2), "reduce_scatter": M * edge}  # ḡ / g; re-gather
        for op in ("all_gather", "reduce_scatter"):
            assert wire[op] == pytest.approx(pred[op] + edges[op])
            assert pred[op] - zero1[op] == pytest.approx(M * (CFG.n_layer // P) * sum(
                n[op] * costmodel.bus_bytes(op, act, T)
                for n in costmodel.sequence_parallel_collectives_per_layer(regather=True).values()))
        assert wire["send"] == pred["send"] == tp["measured"]["comm_bytes"]["send"] / T
        assert calls["send"] == tp["measured"]["comm_calls"]["send"]
        held = {k: r["measured"]["memory_bytes"]["activations"] for k, r in (("tp", tp), ("sp", sp))}
        assert held["sp"] < held["tp"]
        assert sp["config"]["sequence_parallel"] is True and "sequence parallel" in stdout


def test_temporaries_do_not_grow_with_the_microbatches(runs):
    """The fake group's sends never report completion, so a pipeline that kept each sent tensor until its
    send completed would hold every microbatch's boundary activation to the end of the step, and the
    temporaries would grow with m; the executor keeps none under it."""
    tmp = {m: runs[f"pipe-m{m}"][0]["measured"]["memory_bytes"]["temporaries"] for m in (2, 4)}
    assert tmp[4] == tmp[2] > 0


def test_json_schema(runs):
    res, _ = runs["a100"]
    assert {"config", "world_size", "rank", "measured", "predicted", "fits", "seconds"} <= set(res)
    assert res["world_size"] == 8 and res["rank"] == 0
    assert res["config"]["params"] == costmodel.transformer_params(CFG)
    mem_keys = {"parameters", "gradients", "optimizer_states", "activations", "peak"}
    for side in ("measured", "predicted"):
        assert mem_keys <= set(res[side]["memory_bytes"])
    for part in ("comm_bytes", "comm_calls"):
        assert set(res["measured"][part]) == set(COMM_OPS)
    assert set(res["predicted"]["comm_bytes"]) == set(COMM_OPS)
    assert isinstance(res["fits"], bool) and res["seconds"] > 0


def test_a_model_that_does_not_fit_is_a_result(runs):
    """A 1.7B-parameter model on 8 ranks of 4 GB ('--gpu cpu') does not fit: reported, with its largest
    category, not raised."""
    res, stdout = runs["too-big"]
    assert res["fits"] is False and res["largest"] in res["measured"]["memory_bytes"]
    assert "does NOT fit" in stdout


BAD = [
    (dict(model="no-such-model"), "unknown model"),
    (dict(model="gpt3-175b", dp=8, tp=8, pp=16, world=512), "is not the world size 512"),
    (dict(model="gpt3-175b", tp=7), "not divisible by tp=7"),
    (dict(model="gpt3-175b", pp=97), "more than the 96 layers"),
    (dict(model="gpt3-175b", dp=64, tp=8, pp=16), f"over the {MAX_WORLD} ranks"),
    (dict(model="gpt3-175b", zero=3), "use --zero 0, 1 or 2"),
    (dict(model="gpt3-175b", recompute="some"), "use --recompute none, selective or full"),
    (dict(model="gpt3-175b", sequence_parallel=True), "with --tp 1 there is none"),
    (dict(model="gpt3-175b", seq=2050, tp=8, sequence_parallel=True), "choose --seq as a multiple of 8"),
    (dict(model="gpt3-175b", rank=1), "outside the grid of 1 ranks"),
    (dict(n_layer=4, n_embd=32), "missing: --n-head, --vocab-size, --seq"),
    (dict(model="gpt3-175b", n_layer=MAX_LAYERS + 4), f"over the {MAX_LAYERS} layers a dry run builds"),
]


@pytest.mark.parametrize("kw, message", BAD, ids=[m for _, m in BAD])
def test_bad_input_names_the_fix(kw, message):
    with pytest.raises(ValueError, match=message):
        DryRun(**kw)


def test_bad_input_on_the_command_line():
    out = cli("--model", "gpt3-175b", "--dp", "8", "--tp", "8", "--pp", "16", "--world", "1000")
    assert out.returncode == 2 and "error:" in out.stderr and "not the world size 1000" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.serial  # held to wall-clock time
def test_a_model_deeper_than_the_limit_is_refused_at_once():
    """100000 layers would take hours (the run grows faster than the layers): refused before any work."""
    t0 = time.perf_counter()
    out = cli("--n-layer", "100000", "--n-embd", "32", "--n-head", "4", "--vocab-size", "64", "--seq", "16",
              timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert f"--n-layer 100000 is over the {MAX_LAYERS} layers a dry run builds" in out.stderr
    assert f"choose --n-layer <= {MAX_LAYERS}" in out.stderr
    assert time.perf_counter() - t0 < 30  # the interpreter and torch's import, no step


@pytest.mark.serial  # held to wall-clock time
@pytest.mark.slow
def test_gpt3_175b_on_1024_ranks_under_a_minute(tmp_path):
    t0 = time.perf_counter()
    res, _ = run_json(tmp_path, "--model", "gpt3-175b", "--dp", "8", "--tp", "8", "--pp", "16", "--zero", "1",
                      "--dtype", "bf16-mixed", timeout=90)
    wall = time.perf_counter() - t0
    assert wall < 60, f"took {wall:.0f} s"
    assert res["world_size"] == 1024 and res["config"]["params"] > 174e9
    mem, pred = res["measured"]["memory_bytes"], res["predicted"]["memory_bytes"]
    assert mem["parameters"] == pytest.approx(pred["parameters"], rel=1e-6)  # padding to a multiple of d
    assert mem["optimizer_states"] == pytest.approx(pred["optimizer_states"], rel=1e-6)


def test_flash_accounting_drops_the_attention_scores(runs):
    """On meta, attention's math path holds the b·a/t·s·s scores (and their softmax) per layer; flash
    accounting holds none of them, and nothing else changes."""
    (flash, _), (math, _) = runs["flash"], runs["math"]
    scores = B * (CFG.n_head // T) * 128 * 128 * 4  # one layer's scores of one microbatch, fp32
    held = {k: r["measured"]["memory_bytes"] for k, r in (("flash", flash), ("math", math))}
    assert held["math"]["activations"] - held["flash"]["activations"] >= 2 * scores
    assert held["math"]["parameters"] == held["flash"]["parameters"]
    assert math["measured"]["comm_bytes"] == flash["measured"]["comm_bytes"]


if __name__ == "__main__":
    print(json.dumps(play(json.load(sys.stdin))))
