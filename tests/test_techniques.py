"""Chapter 12: the registry of one training step per technique builds and runs every technique at world 2,
times it (``measure``), trains (every parameter of the rank moves), and its steps are the one-process step
on the same global batch: the first loss of every dense technique (all but ep) is the dense GPT's on
global batch 0 (same weights, same batch), and so is the second, after one AdamW update.

Tolerances (derived in tests/_support.py). The ranks and the reference run in float64. The first loss
is the GPT's forward with its reductions in another order (microbatch means, shards, partial sums):
``model_bound(n=N, depth=14)``, N = B·T = 1024 (the longest reduction: a weight gradient's rows;
the logits sum 64), 6 per block + 2 chained. The second adds what one AdamW step makes of gradients
that far apart (the same bound, scaled by the largest gradient): the first bias-corrected update is
g / (|g| + eps), whose slope is eps / (|g| + eps)^2, so a weight moves by at most
lr·δg·eps / (max(|g| - δg, 0) + eps)^2 (and never by more than 2·lr), element by element from the
reference's gradients; through the second step's gradient g' that moves the loss by at most
Σ |g'|·δw to first order (``_second_loss_bound``, ~1e-7; Adam's worst-case slope 1/eps everywhere
would give 5e-2). The first update lowers the loss by 0.14, so a stage not stepped, a shard updated
twice or a gradient missing a rank's share shows far above that (AdamW's step does not see a
gradient's scale: a sum in place of a mean would pass; ch01 checks that).

One launch per world size builds and steps every technique and returns plain data; the tests inspect it.
The reference is computed here, in one process on one thread (like a rank), from GPT, AdamW and the corpus.
"""
import dataclasses
import functools
import os

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it

from minitorch_dist.analysis import techniques as TQ
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT
from minitorch_dist.runtime import observe
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch
from minitorch_dist.runtime.timeline import Timeline

from _support import float64, gamma, model_bound

pytestmark = [pytest.mark.ch12, pytest.mark.timeout(120)]

PIPELINES = ("pp-gpipe", "pp-1f1b", "pp-zbh1")
ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the registry and the reference use


# --- what the ranks run ---------------------------------------------------------------------------


def _one_technique(t):
    """Two steps; which parameters of this rank moved in the first (those with elements here: a zero3
    shard of a small tensor can be empty on a rank); the losses."""
    spec = TQ.make_step(t, "tiny")
    held = [p for p in spec.model.parameters() if p.numel()]
    before = [p.detach().clone() for p in held]
    first = spec.step()
    moved = [not torch.equal(b, p.detach()) for b, p in zip(before, held)]
    return {"moved": moved, "losses": [first, spec.step()], "config": spec.config}


def _timeline_case(t):
    """One step while a Timeline listens, then one while none does: the spans of each."""
    tl = Timeline()
    spec = TQ.make_step(t, "tiny")
    with observe.watching(tl):
        spec.step()
    marked = [(e.name, e.category) for e in tl.events]
    spec.step()
    return {"marked": marked, "after_off": len(tl.events) - len(marked)}


def _error(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return str(e)
    return None


def _world2():
    with float64():
        return _world2_run()


def _world2_run():
    out = {t: _one_technique(t) for t in TQ.TECHNIQUES}
    out["timeline"] = {t: _timeline_case(t) for t in PIPELINES}
    out["errors"] = {"world": _error(lambda: TQ.make_step("ddp", "tiny", world=4))}
    return out


def _world4():
    with float64():
        return _world4_run()


def _world4_run():
    out = {}
    for t in ("ddp", "tp"):
        spec = TQ.make_step(t, "tiny")
        losses = [spec.step(), spec.step()]  # the first two steps, compared with one process
        out[t] = {"losses": losses, "times": TQ.time_steps(spec, 2, 1), "config": spec.config}
    return out


@functools.cache
def _ranks(world):
    return launch({2: _world2, 4: _world4}[world], world, timeout_s=180)


@functools.cache
def _reference():
    """Two AdamW steps of the dense GPT on global batch 0 (the registry's batch), one thread, float64: the
    losses, and how far a technique's losses may be from them (module docstring)."""
    cfg = TQ.model_config("tiny")
    with float64(), single_thread():
        x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, TQ.GLOBAL_BATCH["tiny"], cfg.block_size)
        torch.manual_seed(0)
        model = GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=TQ.LR, eps=ADAM_EPS)
        losses, grads, weights = [], [], [p.detach().clone() for p in model.parameters()]
        for _ in range(2):
            opt.zero_grad()
            _, loss = model(x, y)
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
            opt.step()
            losses.append(loss.item())
    n = max(TQ.GLOBAL_BATCH["tiny"] * cfg.block_size, cfg.vocab_size, 4 * cfg.n_embd)
    depth = 6 * cfg.n_layer + 2
    bounds = [model_bound(n=n, depth=depth, scale=max(1.0, abs(loss))) for loss in losses]
    bounds[1] += _second_loss_bound(weights, *grads, n=n, depth=depth)
    return losses, bounds


def _second_loss_bound(weights, g0, g1, *, n, depth):
    """How far the loss after one AdamW step can move when that step's gradients g0 are off by the GPT's
    ``model_bound``: each weight by lr·δg·eps / (max(|g| - δg, 0) + eps)^2 (at most 2 lr; and float64's
    rounding of the update), carried into the loss by the next gradient g1, to first order."""
    dg = model_bound(n=n, depth=depth, scale=max(1.0, max(g.abs().max().item() for g in g0)))
    total = 0.0
    for w, a, b in zip(weights, g0, g1, strict=True):
        slope = (dg * ADAM_EPS / ((a.abs() - dg).clamp(min=0) + ADAM_EPS) ** 2).clamp(max=2.0)
        moved = TQ.LR * slope + gamma(8, torch.float64) * (w.abs() + TQ.LR)
        total += (b.abs() * moved).sum().item()
    return total


def _global_losses(t, results):
    """The loss over the global batch at each step, from the ranks' losses."""
    if t in ("ddp", "zero1", "zero2", "zero3"):  # each rank the mean over its equal share of rows
        return [sum(r[t]["losses"][i] for r in results) / len(results) for i in range(2)]
    return next(r[t]["losses"] for r in results if r[t]["losses"][0] is not None)  # tp: any; pp, 3d: last


# --- the tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("technique", TQ.TECHNIQUES)
def test_measure_times_every_technique_at_world_2(technique):
    res = TQ.measure(technique, "tiny", 2, reps=2, warmup=1)
    assert res["median_s"] > 0 and len(res["times_s"]) == 2 and all(t > 0 for t in res["times_s"])
    assert min(res["times_s"]) <= res["median_s"] <= max(res["times_s"])
    conf = res["config"]
    assert (conf["technique"], conf["size"], conf["world"]) == (technique, "tiny", 2)
    assert conf["dp"] * conf["tp"] * conf["pp"] == 2 and conf["local_params"] > 0


@pytest.mark.parametrize("technique", TQ.TECHNIQUES)
def test_one_step_moves_every_parameter_of_every_rank(technique):
    for r, res in enumerate(_ranks(2)):
        moved = res[technique]["moved"]
        stayed = [i for i, m in enumerate(moved) if not m]
        assert moved and not stayed, f"rank {r}: parameters {stayed} stayed"


DENSE_AT = [(t, 2) for t in TQ.TECHNIQUES if t != "ep"] + [("ddp", 4), ("tp", 4)]


@pytest.mark.parametrize("technique,world", DENSE_AT)
def test_two_steps_are_the_one_process_steps(technique, world):
    """Same weights on every rank, same global batch: the first loss is the dense GPT's; after one AdamW
    update (gradients averaged, summed over shards, accumulated over microbatches) so is the second."""
    want, bounds = _reference()
    got = _global_losses(technique, _ranks(world))
    assert all(abs(g - w) <= b for g, w, b in zip(got, want, bounds, strict=True)), (got, want, bounds)


def test_expert_parallel_ranks_report_finite_losses():
    for res in _ranks(2):
        assert all(torch.isfinite(torch.tensor(v)) for v in res["ep"]["losses"])
        assert res["ep"]["config"]["n_experts"] == 4


def test_world_4_times_ddp_and_tp():
    for res in _ranks(4):
        for t in ("ddp", "tp"):
            assert len(res[t]["times"]) == 2 and all(s > 0 for s in res[t]["times"])
            assert res[t]["config"]["world"] == 4
    assert _ranks(4)[0]["tp"]["config"]["tp"] == 4 and _ranks(4)[0]["ddp"]["config"]["rows_per_rank"] == 4


@pytest.mark.parametrize("technique", PIPELINES)
def test_pipeline_steps_mark_each_action_on_the_timeline(technique):
    m = TQ.step_config(technique, "tiny", 2)["microbatches"]
    for res in _ranks(2):
        case = res["timeline"][technique]
        kinds = [c for _, c in case["marked"]]
        want = {"F", "B", "W"} if technique == "pp-zbh1" else {"F", "B"}
        assert set(kinds) == want and all(kinds.count(k) == m for k in want)
        assert case["after_off"] == 0  # nobody listening: the next step marks nothing


def test_configs_and_grids():
    assert [TQ.grid_3d(n) for n in (2, 4, 8)] == [(1, 1, 2), (1, 2, 2), (2, 2, 2)]
    assert TQ.step_config("pp-1f1b", "tiny", 2)["microbatches"] == 4
    assert TQ.step_config("pp-1f1b", "10x", 4)["microbatches"] == 8
    assert TQ.step_config("3d", "10x", 4)["microbatches"] == 4
    for t in TQ.TECHNIQUES:  # every technique at world 2 on both sizes, 4 where the layers allow
        TQ.check(t, 2)
        TQ.check(t, 4, "10x")


def test_the_10x_model_has_8_to_12_times_the_parameters():
    with torch.device("meta"):
        n = {s: GPT(TQ.model_config(s)).num_params() for s in TQ.SIZES}
    assert 8 <= n["10x"] / n["tiny"] <= 12
    for s in TQ.SIZES:
        assert TQ.model_config(s).dropout == 0


@pytest.mark.parametrize("args,match", [
    (("fsdp", 2), "unknown technique 'fsdp'; choose one of ddp, zero1"),
    (("ddp", 2, "huge"), "unknown size 'huge'; choose one of tiny, 10x"),
    (("ddp", 0), "world must be an int from 1 to"),
    (("ddp", 4 * (os.cpu_count() or 1) + 1), "4 ranks per core"),
    (("tp", 1), "needs world >= 2: use world=2"),
    (("tp", 3), "n_head 4 is not divisible by tp=3"),
    (("pp-1f1b", 4, "tiny"), "n_layer 2 is not divisible by pp"),
    (("ddp", 3), "global batch of 16 sequences must split into dp=3"),
    (("3d", 3), "n_layer 2 is not divisible by pp"),
])
def test_check_names_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        TQ.check(*args)


def test_bad_calls_name_the_fix():
    with pytest.raises(ValueError, match="reps must be an int >= 1"):
        TQ.measure("ddp", "tiny", 2, reps=0)
    with pytest.raises(RuntimeError, match="make_step needs an initialised process group"):
        TQ.make_step("ddp", "tiny")
    errors = _ranks(2)[0]["errors"]
    assert "pass world=2, or launch 4 ranks" in errors["world"]


# --- the records: a technique's name is looked up once ---------------------------------------------


@pytest.mark.parametrize("technique", TQ.TECHNIQUES)
def test_every_name_resolves_to_its_record(technique):
    tech = TQ.resolve(technique)
    assert tech is TQ.TECHNIQUE[technique] and tech.name == technique
    assert TQ.resolve(tech) is tech and TQ.resolve(tech, 2, "tiny") is tech  # a record is not looked up again
    conf = TQ.step_config(tech, "tiny", 2)
    assert conf == TQ.step_config(technique, "tiny", 2) and conf["technique"] == technique
    assert (conf["dp"], conf["tp"], conf["pp"]) == tech.degrees(2)
    assert conf.get("schedule") == tech.schedule
    assert tech.multi_rank == (technique not in ("ddp", "zero1", "zero2", "zero3"))
    assert tech.marks_actions == (technique in PIPELINES)  # the pipelines' actions, in their records
    assert tech.splits_sequence == (technique == "sp")
    assert repr(tech).startswith(f"Technique(name={technique!r}")  # its functions stay out of its repr


def test_the_table_is_the_one_list_of_techniques():
    assert TQ.TECHNIQUES == tuple(TQ.TECHNIQUE) == ("ddp", "zero1", "zero2", "zero3", "tp", "sp", "pp-gpipe",
                                                    "pp-1f1b", "pp-zbh1", "ep", "3d")
    assert {TQ.TECHNIQUE[t].schedule for t in PIPELINES} == {"gpipe", "1f1b", "zb-h1"}
    assert TQ.TECHNIQUE["3d"].schedule == "1f1b" and TQ.TECHNIQUE["ep"].degrees(4) == (4, 1, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TQ.TECHNIQUE["ddp"].name = "fsdp"


@pytest.mark.parametrize("args,match", [
    (("fsdp",), "unknown technique 'fsdp'; choose one of ddp, zero1, zero2, zero3, tp, sp, pp-gpipe"),
    ((None,), "unknown technique None; choose one of ddp"),
    (("ddp", None, "huge"), "unknown size 'huge'; choose one of tiny, 10x"),
    (("sp", 1), "'sp' splits the model over ranks and needs world >= 2: use world=2, or 'ddp'"),
    ((TQ.TECHNIQUE["pp-1f1b"], 1), "'pp-1f1b' splits the model over ranks and needs world >= 2"),
    (("tp", 3), "'tp' on 3 ranks, size 'tiny': n_head 4 is not divisible by tp=3"),
    (("pp-1f1b", 4, "tiny"), "'pp-1f1b' on 4 ranks, size 'tiny': n_layer 2 is not divisible by pp"),
    (("ddp", 3, "10x"), "global batch of 8 sequences must split into dp=3 shards"),
    (("ddp", 2.0), "world must be an int from 1 to"),
])
def test_resolve_names_the_fix(args, match):
    with pytest.raises(ValueError, match=match):
        TQ.resolve(*args)


def test_resolve_checks_the_world_at_the_size_asked_for():
    assert TQ.resolve("pp-1f1b", 4, "10x") is TQ.TECHNIQUE["pp-1f1b"]  # 4 layers over 4 stages
    with pytest.raises(ValueError, match="size 'tiny'"):
        TQ.resolve("pp-1f1b", 4)  # no size: every size, and the tiny GPT's 2 layers do not split 4 ways
    assert TQ.check("3d", 4, "10x") is TQ.TECHNIQUE["3d"]
