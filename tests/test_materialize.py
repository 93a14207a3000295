"""Chapter 12: deferred initialisation. FSDP, TP and PP built from a GPT on ``meta`` (never
materialised dense anywhere) and then ``materialize``d hold, on every rank, exactly this rank's part
of the dense GPT initialised with the same seed; and they compute what the dense GPT computes.

The reference is the dense GPT built on ``meta`` and materialised on the CPU in this process; each
rank's expected shard is cut from it here with the test's own slicing (Megatron's layouts written out
again, not taken from the library). Weights are compared bitwise (the same numbers drawn, only
copied).

Tolerances (derived in tests/_support.py). The ranks and the reference run in float64 (``float64()``;
the meta GPTs are built in it, so they materialise in it). A forward loss, and the weights after one
SGD step (lr 0.1) against one process, are the same reductions in another order: at most N = B·T = 128
terms (a weight gradient sums B·T rows; c_proj sums 4·32 = 128), chained 6 per block + 2 deep
(DEPTH: 26 for the 4-layer GPT, 20 for FSDP's 3-layer one): losses within ``model_bound(n=128,
depth, scale=max(1, |loss|))``, weights within ``sgd_bound(steps=1, lr=0.1, grad_err=model_bound(...,
scale=max(1, |g|)))`` <= 1e-10. A shard drawn from another rank's stream, cut from the wrong rows or a
step on a rank's unaveraged gradient moves them by ~0.02 (|w|) or lr·|Δg| ≳ 1e-3. The init's standard
deviations are estimates from n = 256² draws, checked to 6 standard errors (σ/√(2(n-1))).
"""
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.memory.zero import full_state_dict, fully_shard
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.models.init import cut_of, init_dense, materialize, record_cut, stable_hash
from minitorch_dist.parallelism.mesh import RankGrid, init_groups
from minitorch_dist.parallelism.pipeline import local_stages, make_schedule, run_schedule
from minitorch_dist.parallelism.tensor_parallel import parallelize_gpt
from minitorch_dist.parallelism.three_d import Model3D, merge_full_params
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import case, close, float64, model_bound, run_cases, sgd_bound

pytestmark = [pytest.mark.ch12, pytest.mark.timeout(240)]

CFG = GPTConfig.tiny(vocab_size=64, block_size=16, n_layer=4, n_head=4, n_embd=32)  # TP and PP: divisible
CFG_FSDP = GPTConfig.tiny(vocab_size=61, block_size=16, n_layer=3, n_head=3, n_embd=21)  # padded shards
B, T, SEED, LR, MB = 8, 16, 11, 0.1, 4
N = B * T  # the longest reduction: a weight gradient sums B·T rows (c_proj sums 4·32 = 128 too)


def _batch(cfg):
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, cfg.vocab_size, (B, T), generator=g)
    return x, torch.randint(0, cfg.vocab_size, (B, T), generator=g)


def _meta_gpt(cfg):
    with torch.device("meta"):
        return GPT(cfg)


def _on_meta(module) -> list[str]:
    return [k for k, p in module.named_parameters() if p.is_meta]


def _plain(named) -> dict:
    return {k: p.detach().clone() for k, p in named}


# --- what every rank does ------------------------------------------------------------------------


def _fsdp():
    n, r = dist.get_world_size(), dist.get_rank()
    model = _meta_gpt(CFG_FSDP)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    materialize(model, "cpu", SEED)
    out = {"meta_left": _on_meta(model), "init": full_state_dict(model)}
    x, y = _batch(CFG_FSDP)
    rows = slice(r * B // n, (r + 1) * B // n)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss = model(x[rows], y[rows])[1]
    loss.backward()
    opt.step()
    out["step"] = full_state_dict(model)
    return out


def _tp():
    model = parallelize_gpt(_meta_gpt(CFG))
    materialize(model, "cpu", SEED)
    x, y = _batch(CFG)
    with torch.no_grad():
        loss = model(x, y)[1].item()
    return {"meta_left": _on_meta(model), "params": _plain(model.named_parameters()), "loss": loss}


def _pp():
    model = _meta_gpt(CFG)
    sched = make_schedule("1f1b", dist.get_world_size(), MB)
    stages = local_stages(model, sched)
    memo = {}
    for stage in stages.values():
        materialize(stage, "cpu", SEED, memo=memo)
    params = {k: p for s in stages.values() for k, p in s.named_parameters()}
    res = run_schedule(sched, stages, *_batch(CFG))
    return {"meta_left": [k for k, p in params.items() if p.is_meta], "params": _plain(params.items()),
            "loss": res.loss}


GRIDS = {2: (1, 1, 2), 4: (1, 2, 2)}  # world size -> (dp, tp, pp)
SP_GRIDS = {2: (1, 2, 1), 4: (1, 2, 2)}  # sequence parallelism needs t > 1


def _three_d(sequence_parallel=False):
    n = dist.get_world_size()
    groups = init_groups(RankGrid(n, *(SP_GRIDS if sequence_parallel else GRIDS)[n]))
    model = Model3D(CFG, groups, MB, lr=LR, seed=SEED, materialize_on="cpu",
                    sequence_parallel=sequence_parallel)
    out = {"meta_left": [k for k, p in model.zero.module.named_parameters() if p.is_meta],
           "init": model.full_param_pieces()}
    out["loss"], _ = model.step(*_batch(CFG))
    out["step"] = model.full_param_pieces()
    return out


def _every_case():
    with float64():
        return run_cases({"fsdp": _fsdp, "tp": _tp, "pp": _pp, "3d": _three_d,
                          "3d-sp": functools.partial(_three_d, True)})


@functools.cache
def _results(n):
    return launch(_every_case, n, timeout_s=200)


def _case(n, name):
    """Each rank's value of case ``name`` on n ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(n))]


# --- the independent reference -------------------------------------------------------------------


CFGS = {"tp": CFG, "fsdp": CFG_FSDP}


def _depth(which: str) -> int:
    return 6 * CFGS[which].n_layer + 2  # chained reductions: 6 a block, the embedding and the loss


@functools.cache
def _dense(which: str):
    with float64(), single_thread():
        return materialize(_meta_gpt(CFGS[which]), "cpu", SEED)


def _dense_params(which: str) -> dict:
    return _plain(_dense(which).named_parameters())


@functools.cache
def _dense_step(which: str):
    """One SGD step in one process: the weights after it, and their bound (one step on gradients within
    ``model_bound``, scaled by the largest gradient)."""
    with float64(), single_thread():
        model = materialize(_meta_gpt(CFGS[which]), "cpu", SEED)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        model(*_batch(CFGS[which]))[1].backward()
        gmax = max(p.grad.abs().max().item() for p in model.parameters())
        opt.step()
        grad_err = model_bound(n=N, depth=_depth(which), scale=max(1.0, gmax))
        return {"params": _plain(model.named_parameters()),
                "bound": sgd_bound(steps=1, lr=LR, grad_err=grad_err)}


def _dense_loss(which: str) -> float:
    with float64(), single_thread(), torch.no_grad():
        return _dense(which)(*_batch(CFGS[which]))[1].item()


def _close_loss(got: float, which: str, where: str):
    want = _dense_loss(which)
    bound = model_bound(n=N, depth=_depth(which), scale=max(1.0, abs(want)))
    assert abs(got - want) <= bound, f"{where}: loss {got} vs one process's {want} (bound {bound:.3g})"


def _expected_tp_shard(name: str, dense: torch.Tensor, t: int, r: int) -> torch.Tensor:
    """Megatron's layouts: column-parallel c_fc (rows), per-head q|k|v rows of c_attn, row-parallel
    c_proj weights (columns), vocabulary rows of wte; everything else whole."""
    if name.endswith("c_attn.weight") or name.endswith("c_attn.bias"):
        h, d = CFG.n_head, CFG.head_dim
        per = h // t
        rows = [part * h * d + head * d + i for part in range(3)
                for head in range(r * per, (r + 1) * per) for i in range(d)]
        return dense[rows]
    if name.endswith("mlp.c_fc.weight") or name.endswith("mlp.c_fc.bias") or name == "wte.weight":
        return dense.chunk(t, dim=0)[r]
    if name.endswith("c_proj.weight"):
        return dense.chunk(t, dim=1)[r]
    return dense


# --- the tests -----------------------------------------------------------------------------------


def test_init_dense_follows_gpt2_rule_and_its_own_stream():
    n_layer = 4
    ln = init_dense("blocks.0.ln_1.weight", (8,), torch.float32, "cpu", 0, n_layer)
    assert torch.equal(ln, torch.ones(8))
    assert torch.equal(init_dense("blocks.1.mlp.c_fc.bias", (8,), torch.float32, "cpu", 0, n_layer),
                       torch.zeros(8))
    big = init_dense("blocks.0.mlp.c_fc.weight", (256, 256), torch.float32, "cpu", 0, n_layer)
    proj = init_dense("blocks.0.mlp.c_proj.weight", (256, 256), torch.float32, "cpu", 0, n_layer)
    for sample, std in ((big, 0.02), (proj, 0.02 / (2 * n_layer) ** 0.5)):  # to 6 standard errors
        assert abs(sample.std().item() - std) < 6 * std / (2 * (sample.numel() - 1)) ** 0.5
    again = init_dense("blocks.0.mlp.c_fc.weight", (256, 256), torch.float32, "cpu", 0, n_layer)
    assert torch.equal(big, again)  # a stream per (seed, name): the same numbers in any process
    other = init_dense("blocks.1.mlp.c_fc.weight", (256, 256), torch.float32, "cpu", 0, n_layer)
    assert not torch.equal(big, other)
    assert stable_hash(1, "a") != stable_hash(2, "a")


def test_dense_materialize_is_seeded_and_leaves_nothing_on_meta():
    a, b = _dense("tp"), materialize(_meta_gpt(CFG), "cpu", SEED + 1)
    assert not _on_meta(a) and not _on_meta(b)
    assert a.lm_head.weight is a.wte.weight  # the tie survives
    assert not torch.equal(a.wte.weight, b.wte.weight)


def test_a_wrong_cut_is_refused():
    model = _meta_gpt(CFG)
    record_cut(model.wpe.weight, (CFG.block_size * 2, CFG.n_embd), 0, range(3))  # 3 rows, not 16
    with pytest.raises(ValueError, match="recorded cut"):
        materialize(model, "cpu", SEED)


@pytest.mark.parametrize("n", [2, 4])
def test_fsdp_from_meta_holds_the_dense_init_and_takes_the_dense_step(n):
    dense, stepped = _dense_params("fsdp"), _dense_step("fsdp")
    for r, got in enumerate(_case(n, "fsdp")):
        assert got["meta_left"] == []
        assert set(got["init"]) == set(dense)
        for k in dense:
            assert got["init"][k].dtype == torch.float64, (r, k)  # materialised in the meta model's dtype
            assert torch.equal(got["init"][k], dense[k]), (r, k)
        for k, want in stepped["params"].items():
            close(got["step"][k], want, stepped["bound"], f"rank {r} {k}")


@pytest.mark.parametrize("n", [2, 4])
def test_tp_from_meta_holds_each_ranks_slice_and_the_dense_loss(n):
    dense = _dense_params("tp")
    for r, got in enumerate(_case(n, "tp")):
        assert got["meta_left"] == []
        assert set(got["params"]) == set(dense)
        for k, v in got["params"].items():
            assert torch.equal(v, _expected_tp_shard(k, dense[k], n, r)), (r, k)
        _close_loss(got["loss"], "tp", f"tp rank {r}")


@pytest.mark.parametrize("n", [2, 4])
def test_pp_from_meta_holds_each_stages_layers_and_the_dense_loss(n):
    dense = _dense_params("tp")
    seen = set()
    for r, got in enumerate(_case(n, "pp")):
        assert got["meta_left"] == []
        for k, v in got["params"].items():
            want = dense["wte.weight"] if k == "lm_head.weight" else dense[k]  # tied: one stream
            assert torch.equal(v, want), (r, k)
            seen.add(k)
    assert seen >= set(dense)  # every dense parameter lives on some stage
    _close_loss(_case(n, "pp")[-1]["loss"], "tp", "pp's last stage")


def _tp_cuts():
    model = parallelize_gpt(_meta_gpt(CFG))
    return {k: (c.dense_shape, c.dim, c.index.tolist()) for k, p in model.named_parameters()
            if (c := cut_of(p)) is not None}


def test_tp_records_where_each_shard_comes_from():
    """The record itself: rank 1 of 2 holds rows 128..255 of c_fc, columns 16..31 of c_proj."""
    cuts = launch(_tp_cuts, 2, timeout_s=120)[1]
    h = CFG.n_embd
    assert cuts["blocks.0.mlp.c_fc.weight"] == ((4 * h, h), 0, list(range(2 * h, 4 * h)))
    assert cuts["blocks.0.attn.c_proj.weight"] == ((h, h), 1, list(range(h // 2, h)))
    assert cuts["wte.weight"] == ((CFG.vocab_size, h), 0, list(range(CFG.vocab_size // 2, CFG.vocab_size)))
    assert "blocks.0.ln_1.weight" not in cuts and "wpe.weight" not in cuts


@pytest.mark.parametrize("kind", ["3d", "3d-sp"])
@pytest.mark.parametrize("n", [2, 4])
def test_3d_from_meta_holds_the_dense_init_and_takes_the_dense_step(n, kind):
    """Model3D(materialize_on=...): (dp, tp, pp) = (1, 1, 2) at n = 2, (1, 2, 2) at n = 4; with sequence
    parallelism (1, 2, 1) and (1, 2, 2) -- its LayerNorms keep their flag through materialisation, or
    their gradients would stay partial sums."""
    res = _case(n, kind)
    assert all(r["meta_left"] == [] for r in res)
    with float64():  # merge_full_params allocates in the default dtype, not the pieces'
        init, spread = merge_full_params([SimpleNamespace(pieces=r["init"]) for r in res], CFG)
        stepped, _ = merge_full_params([SimpleNamespace(pieces=r["step"]) for r in res], CFG)
    assert spread == 0.0  # replicas (tied embedding, LayerNorms over TP) drew the same numbers
    dense = _dense_params("tp")
    for k in dense:
        assert torch.equal(init[k], dense[k]), k
    want = _dense_step("tp")
    for k, w in want["params"].items():
        close(stepped[k], w, want["bound"], k)
    losses = [r["loss"] for r in res if r["loss"] is not None]
    assert losses
    for v in losses:
        _close_loss(v, "tp", kind)
