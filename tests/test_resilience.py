"""Chapter 13: a training state saved from any layout loads into any other and training goes on as if
it had never stopped; the files say what they hold and refuse to be misread; a failed rank is survived.

**Resharding.** The course GPT (tied embeddings) is trained with AdamW for K0 steps in one layout, saved,
loaded into another layout on another number of ranks, and trained K1 more steps. Expected values come
from one process trained K0 + K1 steps, read straight from its parameters and ``optimizer.state`` (not
through this chapter's code). Each checkpoint is checked twice: what was saved (every tensor, the
Adam moments and step counts included, equal to the single process after K0 steps) and what the
loading layout computes after it (its losses, and its own checkpoint after K1 more steps). Layouts:
one process; DDP, ZeRO-1, ZeRO-2, ZeRO-3 (``fully_shard``), TP and PP on 2 ranks; ZeRO-3, DDP,
TP 2 x DP 2 and TP 2 x PP 2 on 4 ranks; an MLP with a frozen layer under ``fully_shard``; PyTorch's
FSDP2 saving through DCP and through this chapter (identical tensors), each read by our loader.

**Mechanism.** Replicas are written once, by the least-loaded holder (file sizes); every rank writes
one file; loading in the same layout copies without rebuilding; an asynchronous save holds the
values of the moment it was called; a fresh optimizer stays fresh through a save and a load.

**Bad input.** Another model's checkpoint (the tensor named), a truncated and an altered shard, a
missing rank file, a save killed half-way (the previous checkpoint intact; the next save of the path
removes what it left), values a checkpoint cannot hold. **Failure drill.** A rank SIGKILLed mid-step
on 4 ranks, the job resumed on 3 from the last checkpoint, its loss curve the uninterrupted one.

Tolerances (derived in tests/_support.py). Every training run is in float64 (``float64()`` around
the ranks' work and the one-process runs; the checkpoints then hold float64, checked): the parallel
layouts sum the same products in another order (chapter 06). The GPT: reductions of at most
N = B·T = 128 terms (a weight gradient sums B·T rows; c_proj sums 4·16), GPT_DEPTH = 6·2 + 2 = 14
chained: gradients within ``model_bound(n=128, depth=14, scale=max(1, |g|))`` ≈ 4.1e-10 (|g| the
largest gradient the one-process run saw); after k AdamW steps (lr 3e-3, eps 1e-6) the weights within
``adam_bound`` = k·lr·grad_err/eps ≈ 6.1e-6 at k = 5; the moments within grad_err (exp_avg, an average of
gradients) and 2·|g|·grad_err (exp_avg_sq, of their squares), the step counts exactly; step s's loss
within its own reductions' ``model_bound`` plus ``‖g‖₁ ·`` the weights' bound after s steps (first order).
The MLP (6-12-12-3 on 8 rows: a 24-term mean, 4 reductions chained each way + 2): the same with
``model_bound(n=24, depth=10)``. A checkpoint missing one step of Adam's moments (exp_avg off by
(1-β1)·|g|, ~1e-3 of it), read from the wrong elements (weights off by |w| ~ 0.02), or a loader that
lost a step (weights off by ~lr = 3e-3) is far outside.
"""
import functools
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch._dynamo  # optimizers import it lazily; forked ranks inherit it
import torch.distributed as dist
from torch import nn

from minitorch_dist.memory.zero import fully_shard
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.resilience import (
    CheckpointError,
    Placement,
    RNGState,
    async_save,
    load,
    read_dense,
    save,
    state_dict,
)
from minitorch_dist.resilience.elastic import Failure, latest_checkpoint, run_elastic
from minitorch_dist.resilience.placement import runs
from minitorch_dist.resilience.stall import measure_stalls, save_phases
from minitorch_dist.resilience.trainers import Trainer, adamw, parse_layout
from minitorch_dist.runtime import observe
from minitorch_dist.runtime.launch import RankError, launch
from minitorch_dist.runtime.timeline import Event, Timeline

from _support import adam_bound, case, close, float64, model_bound, run_cases

pytestmark = [pytest.mark.ch13, pytest.mark.timeout(240)]

CFG = GPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
B, T, K0, K1 = 8, 16, 3, 2
N, GPT_DEPTH = B * T, 6 * CFG.n_layer + 2  # the longest reduction (B·T rows), the chained reductions
MLP_N, MLP_DEPTH = 8 * 3, 2 * 4 + 2  # the MLP's mse mean over 8 rows x 3, its chained reductions
LR, EPS = 3e-3, 1e-6  # trainers.adamw
SAVED_AT_2 = ("single", "ddp", "zero1", "zero2", "zero3", "tp", "pp")
SAVED_AT_4 = ("zero3", "ddp", "dp2-tp2", "dp1-tp2-pp2")
# (loading layout, world size, the checkpoint it reads): every loader reads another layout's checkpoint
LOADS_AT_2 = (("zero1", "dp2-tp2@4"), ("zero2", "zero3@4"), ("tp", "dp1-tp2-pp2@4"), ("pp", "zero1@2"),
              ("ddp", "tp@2"), ("zero3", "pp@2"))
LOADS_AT_4 = (("dp2-tp2", "zero3@4"), ("zero3", "pp@2"), ("dp1-tp2-pp2", "zero2@2"), ("ddp", "single@1"))


# --- the reference: one process, read from torch's own objects ---------------------------------------


def _grad_sizes(model):
    """After a backward: the largest gradient and the gradients' 1-norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return max(g.abs().max().item() for g in grads), sum(g.abs().sum().item() for g in grads)


class _Bounds:
    """The bounds on AdamW runs against one process whose gradients had these sizes (``grads``: per
    step, the largest and the 1-norm): see the module docstring."""

    def __init__(self, grads, n=N, depth=GPT_DEPTH):
        self.n, self.depth = n, depth
        self.gmax, self.g1 = max(g for g, _ in grads), [g1 for _, g1 in grads]
        self.grad_err = model_bound(n=n, depth=depth, scale=max(1.0, self.gmax))

    def weights(self, steps):
        return adam_bound(steps=steps, lr=LR, grad_err=self.grad_err, eps=EPS)

    def loss(self, s, loss):
        """Step s's loss: its reductions reordered, and the weights' error after s steps via the gradient."""
        own = model_bound(n=self.n, depth=self.depth, scale=max(1.0, abs(loss)))
        return own + self.g1[s] * self.weights(s)

    def of(self, key, steps):
        """The bound on a checkpoint's tensor ``key`` after ``steps`` steps (None: exactly)."""
        if key.endswith(".step"):
            return None
        if key.endswith(".exp_avg"):
            return self.grad_err
        if key.endswith(".exp_avg_sq"):
            return 2 * max(1.0, self.gmax) * self.grad_err
        return self.weights(steps)


def _reference(steps):
    with float64():
        trainer, grads = Trainer("single", CFG, B, T), []
        record = lambda: grads.append(_grad_sizes(trainer.model))  # after backward, before the step
        losses = [trainer.step(s, between=record) for s in range(steps)]
        dense = {f"model.{k}": p.detach().clone() for k, p in trainer.model.named_parameters()}
        for k, p in trainer.model.named_parameters():
            for key, v in trainer.opt.state[p].items():
                dense[f"optim.state.{k}.{key}"] = v.detach().clone()
        return losses, dense, _Bounds(grads)


@pytest.fixture(scope="module")
def reference():
    (losses, after_all, bounds), after_k0 = _reference(K0 + K1), _reference(K0)[1]
    return {"losses": losses, "after_k0": after_k0, "after_all": after_all, "bounds": bounds}


# --- what the ranks run --------------------------------------------------------------------------------


def _save_one(root, layout):
    """Train ``layout`` K0 steps from scratch and save it under ``root/<layout>@<n>``."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(layout, CFG, B, T)
    losses = [trainer.step(s) for s in range(K0)]
    handle = save(trainer.state(step=K0), Path(root) / f"{layout}@{n}")
    return {"losses": losses, "bytes": handle.bytes_written}


def _save_layouts(root, layouts):
    """Each layout saved (``_save_one``), a case of its own: one that fails fails only its tests."""
    return run_cases({layout: functools.partial(_save_one, root, layout) for layout in layouts})


def _resume_one(root, layout, src):
    """Load the source checkpoint into ``layout``, train K1 steps, save as ``<layout>-from-<src>``."""
    n = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(layout, CFG, B, T)
    state = trainer.state(step=0)
    report = load(state, Path(root) / src)
    losses = [trainer.step(s) for s in range(state["step"], K0 + K1)]
    save(trainer.state(step=K0 + K1), Path(root) / f"{layout}@{n}-from-{src}")
    return {"losses": losses, "copied": report.copied, "resharded": report.resharded, "start": state["step"]}


def _resume(root, loads):
    """Each (layout, source) resumed (``_resume_one``), a case of its own."""
    return run_cases({layout: functools.partial(_resume_one, root, layout, src) for layout, src in loads})


def _torch_fsdp2(root):
    """PyTorch's FSDP2 trained K0 steps, saved by DCP and by this chapter; our ZeRO-3 resumes from DCP."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from minitorch_dist.models.gpt import GPT

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh)
    torch_fully_shard(model, mesh=mesh)
    data = MarkovCorpus(CFG.vocab_size, seed=0)  # the batches of every layout
    opt, r, n = adamw(model.parameters()), dist.get_rank(), dist.get_world_size()
    for s in range(K0):
        x, y = data.batch(s, B, T, r, n)
        opt.zero_grad()
        model(x, y)[1].backward()
        opt.step()
    torch_state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.save(torch_state | {"step": K0}, checkpoint_id=f"{root}/torch-dcp")
    save(state_dict(model, opt, step=K0), f"{root}/torch-ours")
    return _resume(root, [("zero3", "torch-dcp")])


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 12), nn.GELU(), nn.Linear(12, 12), nn.GELU(), nn.Linear(12, 3))
        self.net[0].weight.requires_grad_(False)  # frozen: no gradient, no optimizer state

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


def _mlp_batch(step, rank=0, n=1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
    return x[rank * 8 // n:(rank + 1) * 8 // n], y[rank * 8 // n:(rank + 1) * 8 // n]


def _mlp_run(path, start, stop, sharded, load_from=None):
    r, n = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    torch.manual_seed(7)
    model = _MLP()
    if sharded:
        for i in (0, 2, 4):
            fully_shard(model.net[i])
        fully_shard(model)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    if load_from:
        load(state_dict(model, opt), load_from)
    for s in range(start, stop):
        opt.zero_grad()
        model(*_mlp_batch(s, r, n)).backward()
        opt.step()
    if path:
        save(state_dict(model, opt), path)


def _two_ranks(root):
    with float64():
        out = {"saved": _save_layouts(root, SAVED_AT_2[1:])}
        out.update(run_cases({"mlp": functools.partial(_mlp_run, f"{root}/mlp@2", 0, K0, sharded=True),
                              "fsdp2": functools.partial(_torch_fsdp2, root)}))
        return out


def _two_ranks_again(root):
    with float64():
        return _resume(root, LOADS_AT_2)


def _four_ranks(root):
    with float64():
        return _save_layouts(root, SAVED_AT_4)


def _four_ranks_again(root):
    with float64():
        return _resume(root, LOADS_AT_4)


@pytest.fixture(scope="module")
def runs_(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    with float64():  # the one-process runs (the ranks set it themselves)
        out = {"single": _save_layouts(root, ["single"])}
        out["two"] = launch(_two_ranks, 2, str(root))
        out["four"] = launch(_four_ranks, 4, str(root))
        out["two_again"] = launch(_two_ranks_again, 2, str(root))
        out["four_again"] = launch(_four_ranks_again, 4, str(root))
        out["single_again"] = _resume(root, [("single", "zero3@4")])
        _mlp_run(f"{root}/mlp-from-2", K0, K0 + K1, sharded=False, load_from=f"{root}/mlp@2")
    out["root"] = root
    yield out
    shutil.rmtree(root, ignore_errors=True)


def _assert_dense(got: dict, want: dict, bounds: _Bounds, steps: int):
    """A checkpoint's tensors (float64, as trained) against one process's after ``steps`` steps."""
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype == torch.float64, (k, got[k].dtype, want[k].dtype)
        bound = bounds.of(k, steps)
        if bound is None:
            assert torch.equal(got[k], want[k]), k
        else:
            close(got[k], want[k], bound, k)


def _assert_losses(got, want, bounds, first=0):
    """Step first + i's loss, for each i."""
    assert len(got) == len(want)
    for s, (a, b) in enumerate(zip(got, want, strict=True), start=first):
        assert abs(a - b) <= bounds.loss(s, b), f"step {s}: loss {a} vs {b} (bound {bounds.loss(s, b):.3g})"


# --- resharding: what was saved, and what a loader computes after it ------------------------------------


@pytest.mark.parametrize("name", [f"{x}@2" for x in SAVED_AT_2[1:]] + [f"{x}@4" for x in SAVED_AT_4]
                         + ["single@1"])
def test_saved_state_equals_one_process(runs_, reference, name):
    _assert_dense(read_dense(runs_["root"] / name), reference["after_k0"], reference["bounds"], K0)


@pytest.mark.parametrize("load_case", [("two_again", x, "2") for x in LOADS_AT_2]
                         + [("four_again", x, "4") for x in LOADS_AT_4]
                         + [("single_again", ("single", "zero3@4"), "1")],
                         ids=lambda c: f"{c[1][0]}@{c[2]}<-{c[1][1]}")
def test_resumed_run_continues_the_uninterrupted_one(runs_, reference, load_case):
    which, (layout, src), n = load_case
    got = case(runs_[which][0] if which != "single_again" else runs_[which], layout)
    assert got["start"] == K0
    _assert_losses(got["losses"], reference["losses"][K0:], reference["bounds"], first=K0)
    _assert_dense(read_dense(runs_["root"] / f"{layout}@{n}-from-{src}"), reference["after_all"],
                  reference["bounds"], K0 + K1)


def test_training_before_the_save_equals_one_process(runs_, reference):
    saved = runs_["two"][0]["saved"]
    assert sorted(saved) == sorted(SAVED_AT_2[1:])
    for layout in saved:
        _assert_losses(case(saved, layout)["losses"], reference["losses"][:K0], reference["bounds"])


def test_pytorch_dcp_and_ours_hold_identical_tensors(runs_, reference):
    ours, theirs = read_dense(runs_["root"] / "torch-ours"), read_dense(runs_["root"] / "torch-dcp")
    assert ours.keys() == theirs.keys() == reference["after_k0"].keys()
    for k in ours:
        assert torch.equal(ours[k], theirs[k]), k
    _assert_dense(ours, reference["after_k0"], reference["bounds"], K0)
    got = case(case(runs_["two"][0], "fsdp2"), "zero3")  # our ZeRO-3 resumed from torch's DCP checkpoint
    _assert_losses(got["losses"], reference["losses"][K0:], reference["bounds"], first=K0)


def test_mlp_with_a_frozen_layer_reshards(runs_):
    case(runs_["two"][0], "mlp")  # the save on 2 ranks ran
    saved, loaded = read_dense(runs_["root"] / "mlp@2"), read_dense(runs_["root"] / "mlp-from-2")
    assert "optim.state.net.0.weight.exp_avg" not in saved  # frozen: no optimizer state
    with float64():
        torch.manual_seed(7)
        model, grads = _MLP(), []
        opt = adamw([p for p in model.parameters() if p.requires_grad])
        for s in range(K0 + K1):
            opt.zero_grad()
            model(*_mlp_batch(s)).backward()
            grads.append(_grad_sizes(model))
            opt.step()
    bound = _Bounds(grads, MLP_N, MLP_DEPTH).weights(K0 + K1)
    for k, p in model.named_parameters():
        assert loaded[f"model.{k}"].dtype == torch.float64, k
        close(loaded[f"model.{k}"], p.detach(), bound, k)


# --- mechanism ------------------------------------------------------------------------------------------


def test_replicas_are_written_once_by_balanced_writers(runs_):
    import json

    root = runs_["root"]
    single = sum(f.stat().st_size for f in (root / "single@1").glob("rank*.pt"))
    for name in ("ddp@2", "ddp@4", "zero1@2", "zero3@4", "tp@2", "dp2-tp2@4"):
        meta = json.loads((root / name / "metadata.json").read_text())
        n = int(name.split("@")[1])
        assert sorted(meta["files"]) == [f"rank{r:05d}.pt" for r in range(n)]
        stored = sum(t.numel() for t in read_dense(root / name).values())
        pieces = sum(Placement.from_json(p["placement"]).numel for e in meta["tensors"].values()
                     for p in e["pieces"])
        assert pieces == stored, name  # every element once: replicas deduplicated
        sizes = [f["bytes"] for f in meta["files"].values()]
        assert sum(sizes) < 1.2 * single + n * 4096, name  # one replica's bytes (plus per-file headers)
    ddp = json.loads((root / "ddp@4" / "metadata.json").read_text())
    counts = [sum(1 for e in ddp["tensors"].values() for p in e["pieces"] if p["file"] == f)
              for f in ddp["files"]]
    assert min(counts) > 0  # the writing is spread over the replicas
    assert all(len(e["pieces"]) == 1 for e in ddp["tensors"].values())  # each tensor once


def test_loading_the_same_layout_copies_without_rebuilding(tmp_path):
    def run(root):
        trainer = Trainer("zero3", CFG, B, T)
        trainer.step(0)
        save(trainer.state(step=1), f"{root}/a")
        again = Trainer("zero3", CFG, B, T)
        report = load(again.state(step=0), f"{root}/a")
        return report.copied, report.resharded

    copied, resharded = launch(run, 2, str(tmp_path))[0]
    assert resharded == 0 and copied > 0


def test_async_save_holds_the_values_of_its_call_and_a_fresh_optimizer_stays_fresh(tmp_path):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    opt = adamw(model.parameters())
    save(state_dict(model, opt), tmp_path / "fresh")
    assert not opt.state  # state_dict() made zero state to have tensors; the save removed it again
    load(state_dict(model, opt), tmp_path / "fresh")
    assert not opt.state  # the checkpoint held none: still fresh
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with observe.watching(Timeline()) as heard:
        handle = async_save(state_dict(model, opt, step=1), tmp_path / "a")
        with torch.no_grad():
            model.weight.add_(1.0)  # the next step, while the save writes
        handle.wait()
    saved = read_dense(tmp_path / "a")
    torch.testing.assert_close(saved["model.weight"], before["weight"], atol=0, rtol=0)
    held = [*model.parameters(), *opt.state[model.weight].values(), *opt.state[model.bias].values()]
    nbytes = sum(t.numel() * t.element_size() for t in held)
    assert handle.bytes_written == nbytes  # the parameters, both moments and the step counts
    phases = save_phases(heard.events)  # the caller's phases, then the writing thread's
    assert [list(p) for p in phases] == [["plan", "stage", "write", "hash", "commit"]]
    assert all(s >= 0 for s in phases[0].values())



@pytest.mark.parametrize("mode", ["sync", "async"])
def test_measured_stalls_time_every_step_and_every_save_phase(tmp_path, mode):
    out = launch(measure_stalls, 2, "ddp", CFG, B, T, 4, 2, str(tmp_path), mode)
    for rank, r in enumerate(out):
        assert r["rank"] == rank and r["saved"] == [1, 3] and len(r["times"]) == 4
        want = ["plan", "stage", "write", "hash"] + (["commit"] if rank == 0 else [])
        assert [sorted(p) for p in r["phases"]] == [sorted(want)] * 2
        assert r["bytes_per_save"] > 0

def test_save_phases_group_the_spans_by_save():
    spans = (("plan", 0), ("stage", 1), ("write", 2), ("plan", 3), ("write", 4), ("write", 5))
    ev = [Event(0, n, "checkpoint", t, t + 0.5) for n, t in spans]
    ev.append(Event(0, "F", "pipeline", 1.2, 9))  # not a checkpoint's span: not counted
    assert save_phases(ev) == [{"plan": 0.5, "stage": 0.5, "write": 0.5}, {"plan": 0.5, "write": 1.0}]


def test_rng_states_return_at_the_same_world_size_only(tmp_path):
    torch.manual_seed(3)
    save({"rng": RNGState(), "step": 1}, tmp_path / "r")
    want = torch.rand(3)
    torch.manual_seed(4)
    report = load({"rng": RNGState(), "step": 0}, tmp_path / "r")
    assert torch.equal(torch.rand(3), want) and report.not_restored == []

    def other(path):
        return load({"rng": RNGState(), "step": 0}, path).not_restored

    assert launch(other, 2, str(tmp_path / "r")) == [["rng"], ["rng"]]


# --- bad input ------------------------------------------------------------------------------------------


@pytest.fixture()
def saved(tmp_path):
    trainer = Trainer("single", CFG, B, T)
    trainer.step(0)
    save(trainer.state(step=1), tmp_path / "ck")
    return tmp_path / "ck"


def test_a_checkpoint_of_another_model_names_the_tensor(saved):
    other = lambda **kw: Trainer("single", GPTConfig.tiny(**(dict(CFG.__dict__) | kw)), B, T)
    wide = other(n_embd=32)
    with pytest.raises(CheckpointError, match=r"model.wte.weight is \(32, 16\) in the checkpoint and \(32"):
        load(wide.state(step=0), saved)
    deep = other(n_layer=3)
    with pytest.raises(CheckpointError, match=r"does not hold .* 'model.blocks.2"):
        load(deep.state(step=0), saved)
    shallow = other(n_layer=1)
    with pytest.raises(CheckpointError, match=r"no rank asks for, e.g. \['model.blocks.1"):
        load(shallow.state(step=0), saved)


def test_a_truncated_or_altered_shard_is_an_error_naming_the_file(saved):
    fresh = lambda: Trainer("single", CFG, B, T).state(step=0)
    shutil.copytree(saved, saved.with_name("copy"))
    file = saved / "rank00000.pt"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"rank00000.pt is damaged: .* bytes where the save wrote"):
        load(fresh(), saved)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match=r"rank00000.pt is damaged: its SHA-256 differs"):
        load(fresh(), saved)
    load(fresh(), saved.with_name("copy"))  # the intact copy loads


def test_a_missing_rank_file_is_named(tmp_path):
    def run(path):
        trainer = Trainer("zero3", CFG, B, T)
        save(trainer.state(step=0), path)

    launch(run, 2, str(tmp_path / "ck"))
    (tmp_path / "ck" / "rank00001.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks rank00001.pt, written by rank 1 of the 2"):
        load(Trainer("single", CFG, B, T).state(step=0), tmp_path / "ck")


class _DieOnRank1:
    """A per-rank value whose saving kills rank 1: a process lost in the middle of a save."""

    per_rank = True

    def to_saved(self):
        if dist.get_rank() == 1:
            os._exit(3)
        return 0

    def restore(self, saved):
        pass


def test_a_save_killed_half_way_leaves_the_previous_checkpoint_intact(tmp_path):
    def run(path):
        trainer = Trainer("zero3", CFG, B, T)
        save(trainer.state(step=0), path)
        trainer.step(0)
        save(trainer.state(step=1, boom=_DieOnRank1()), path)  # replaces the checkpoint: dies on the way

    with pytest.raises(RankError, match="rank 1 of 2 failed"):
        launch(run, 2, str(tmp_path / "step_000001"), timeout_s=60)
    assert list(tmp_path.glob("step_000001.partial-*"))  # the dead save's staging folder
    state = Trainer("single", CFG, B, T).state(step=-1)
    load(state, tmp_path / "step_000001")
    assert state["step"] == 0  # the first save, whole
    assert latest_checkpoint(tmp_path)[0] == 1
    shutil.rmtree(tmp_path / "step_000001")
    with pytest.raises(CheckpointError, match=r"only step_000001.partial-\w+, a save that never finished"):
        load(state, tmp_path / "step_000001")
    save({"step": 2}, tmp_path / "step_000001")  # the next save of the path removes what the dead one left
    assert not list(tmp_path.glob("step_000001.partial*"))


def test_values_a_checkpoint_cannot_hold_are_refused(tmp_path):
    with pytest.raises(TypeError, match=r"state entry 'data.seen' is a set"):
        save({"data": {"seen": {1, 2}}}, tmp_path / "x")
    with pytest.raises(CheckpointError, match="no checkpoint at .* does not exist"):
        load({"step": 0}, tmp_path / "nothing")
    with pytest.raises(ValueError, match="unknown layout 'zero4'"):
        parse_layout("zero4", 2)
    with pytest.raises(ValueError, match="layout dp2-tp2 needs 4 ranks, not 2"):
        parse_layout("dp2-tp2", 2)


# --- placements ---------------------------------------------------------------------------------------


def test_placement_positions_cuts_and_flat_runs():
    assert runs([0, 1, 2, 8, 9]) == ((0, 3), (8, 10))
    whole = Placement((4, 3))
    assert whole.whole and whole.positions().tolist() == list(range(12))
    rows = Placement((4, 3), cut=(0, ((2, 4),)))
    assert rows.local_shape == (2, 3) and rows.positions().tolist() == [6, 7, 8, 9, 10, 11]
    cols = Placement((4, 3), cut=(1, ((1, 2),)))
    assert cols.positions().tolist() == [1, 4, 7, 10]
    strided = Placement((4, 3), cut=(1, ((0, 2),)), flat=(1, 2, 4))  # every 2nd element of the 8 cut ones
    assert strided.positions().tolist() == [1, 4, 7, 10]
    assert Placement((4, 3), cut=(0, ((0, 4),)), flat=(0, 1, 12)).whole  # normalised: the whole tensor
    assert Placement.from_json(strided.to_json()) == strided and strided.key() != cols.key()
    with pytest.raises(ValueError, match="leaves the 8 elements"):
        Placement((4, 3), cut=(1, ((0, 2),)), flat=(1, 2, 5))
    with pytest.raises(ValueError, match="cut along dim 2 of a 2-D tensor"):
        Placement((4, 3), cut=(2, ((0, 1),)))


# --- the failure drill ------------------------------------------------------------------------------------


def test_a_rank_killed_mid_step_is_survived_on_fewer_ranks(tmp_path, reference):
    cfg_steps, every, batch = 8, 3, 12
    with float64():  # the ranks are forked: they inherit it (the checkpoint's dtype below shows it)
        run = run_elastic(lambda n: "zero3", [4, 3], CFG, batch, T, cfg_steps, every, tmp_path,
                          fail=Failure(2, 5))
    first, second = run.attempts
    assert (first.world_size, first.failed_rank, second.world_size, second.failed_rank) == (4, 2, 3, None)
    assert first.error == "rank 2 died without reporting a result: killed by signal SIGKILL (9)."
    lost = run.lost_work()[0]
    assert lost["resumed_from"] == 3 and lost["steps_redone"] == 3  # steps 3, 4 done again, 5 in progress
    assert lost["compute_lost_s"] > 0 and lost["restart_s"] > 0
    assert all(t.dtype == torch.float64 for t in read_dense(latest_checkpoint(tmp_path)[1]).values()
               if t.is_floating_point())
    with float64():
        trainer, grads = Trainer("single", CFG, batch, T), []
        record = lambda: grads.append(_grad_sizes(trainer.model))  # after backward
        want = [trainer.step(s, between=record) for s in range(cfg_steps)]
    got = run.losses()
    _assert_losses([got[s] for s in range(cfg_steps)], want, _Bounds(grads, n=batch * T))
