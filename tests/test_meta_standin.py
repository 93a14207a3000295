"""The CI stand-in for a GPU: every wrapper's forward, backward and optimizer step on ``meta``
parameters under torch's fake process group, at world sizes 8 and 1024.

DESIGN.md: nothing in the library puts a tensor on a fixed device; it follows the parameters. On
``meta`` that is checkable without a GPU: a tensor the library creates on the CPU beside meta
parameters either fails an op (a meta and a CPU operand) or is left behind among the parameters,
gradients or optimizer state, which the worker then names. A ``.item()`` / ``.tolist()`` on a meta
tensor fails too: such a value-dependent step needs a meta path or a clear refusal (expert
parallelism routes tokens by the router's values: it refuses, and that refusal is tested).

The meta models are float64, so a tensor made in the default dtype beside them shows as well; and
a plain-CPU float64 run of the tensor- and sequence-parallel GPTs checks their shards take the
dense model's dtype. The fake process group moves no data (every collective returns at once, with
whatever the output held), so only placement, dtypes and shapes are checked here, never values.

The world sizes run in a fresh process (``python tests/test_meta_standin.py 8 1024``), so the pytest
process never holds a process group; for each world size W it plays rank 0 and rank W-1 (first and
last pipeline stage) in turn, each under its own fake group, and it prints one JSON line: per world
size and wrapper, "ok" or the error. A test per (world size, wrapper) then asserts it, so a failure
names the wrapper.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
import types

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.memory.zero import ShardedOptimizer, ZeroDataParallel, fully_shard
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.data_parallel import DistributedDataParallel
from minitorch_dist.parallelism.mesh import RankGrid, init_groups
from minitorch_dist.parallelism.pipeline import local_stages, make_schedule, run_schedule
from minitorch_dist.parallelism.replicas import broadcast_from_first_rank
from minitorch_dist.parallelism.sequence_parallel import (
    UlyssesAttention,
    allreduce_sequence_parallel_grads,
    parallelize_gpt_sp,
)
from minitorch_dist.parallelism.sequence_parallel.ring_attention import ring_attention
from minitorch_dist.parallelism.tensor_parallel import parallelize_gpt
from minitorch_dist.parallelism.three_d import Model3D
from minitorch_dist.sparsity.expert_parallel import expert_parallel
from minitorch_dist.sparsity.moe_gpt import MoEGPT, MoEGPTConfig

pytestmark = pytest.mark.timeout(240)

WORLD_SIZES = (8, 1024)
WRAPPERS = ("broadcast_from_first_rank", "ddp", "ddp-find_unused_parameters", "sharded_optimizer-1",
            "sharded_optimizer-2", "zero-0", "zero-1", "zero-2", "fully_shard", "tensor_parallel",
            "sequence_parallel", "ulysses", "ring_attention", "pipeline-gpipe", "pipeline-1f1b",
            "pipeline-interleaved", "pipeline-zb-h1", "three_d", "three_d-zero1-recompute",
            "three_d-zero2-sequence_parallel", "expert_parallel",
            "tensor_parallel-fp64-cpu", "sequence_parallel-fp64-cpu")
REFUSED = {"expert_parallel": "expert parallelism routes by values: run it on real tensors"}
SUBPROCESS_TIMEOUT_S = 180

# --- the worker: runs in its own process, one process group at a time ----------------------------

B, T, V, H, HEADS = 4, 16, 64, 64, 8  # rows, sequence, vocab, width, heads
DTYPE = torch.float64


def _init(rank: int, world: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)


def _block_group(size: int):
    """The group of ``size`` consecutive ranks holding this rank (the fake group needs no peers)."""
    base = dist.get_rank() - dist.get_rank() % size
    return dist.new_group(list(range(base, base + size)))


def _cfg(**kw):
    return GPTConfig(**{"vocab_size": V, "block_size": T, "n_layer": 2, "n_head": HEADS, "n_embd": H,
                        "dropout": 0.0, **kw})


def _dense(device="meta", **kw):
    with torch.device(device):
        return GPT(_cfg(**kw)).to(DTYPE)


def _tokens(rows=B, seq=T, device="meta"):
    return (torch.randint(0, V, (rows, seq), device=device), torch.randint(0, V, (rows, seq), device=device))


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, foreach=False)


def _misplaced(named, want=None) -> list[str]:
    """Names of the tensors not on meta, or not of the model's dtype (``want``; None: any dtype)."""
    want = DTYPE if want is None else want
    bad = []
    for name, t in named:
        if t is None:
            continue
        if not t.is_meta or (want is not False and t.is_floating_point() and t.dtype != want):
            bad.append(f"{name} ({t.dtype} on {t.device})")
    return bad


def _state(opt, name="opt"):
    """An optimizer's state tensors; torch keeps AdamW's scalar ``step`` on the CPU by design."""
    out = []
    for i, s in enumerate(opt.state.values()):
        out += [(f"{name}.state[{i}].{k}", v) for k, v in s.items()
                if torch.is_tensor(v) and not (k == "step" and v.dim() == 0)]
    return out


def _check(module, opt=None, extra=(), want=None) -> None:
    named = [(n, p) for n, p in module.named_parameters()]
    named += [(n + ".grad", p.grad) for n, p in module.named_parameters()]
    named += list(extra) + (_state(opt) if opt is not None else [])
    bad = _misplaced(named, want)
    if bad:
        raise AssertionError(f"{len(bad)} tensors left the meta device or the model's dtype: {bad[:8]}")


def _grads_in_flat(params, flat_grad) -> None:
    """ZeRO stages 0 and 1 keep every gradient as a view of one flat buffer: on meta too (where every
    tensor sits at address 0, so a test of addresses cannot tell a view from a copy)."""
    loose = [i for i, p in enumerate(params) if p.grad is not None and p.grad._base is not flat_grad]
    if loose:
        raise AssertionError(f"gradients of parameters {loose[:8]} are copies, not views of the flat buffer")


def _train(model, params, x, y, opt=None, after_backward=None):
    """Forward, backward, (hook), AdamW step: the optimizer, returned for :func:`_check`."""
    _, loss = model(x, y)
    loss.backward()
    if after_backward is not None:
        after_backward()
    opt = opt or _adamw(params)
    opt.step()
    return opt


# --- one function per wrapper: raise on any failure ----------------------------------------------


def run_broadcast_from_first_rank(world):
    model = broadcast_from_first_rank(_dense())
    _check(model)


def run_ddp(world, **kw):
    ddp = DistributedDataParallel(_dense(), bucket_cap_mb=0.05, first_bucket_mb=0.01, **kw)
    opt = _train(ddp, ddp.parameters(), *_tokens())
    _check(ddp, opt, [(f"bucket{i}.flat", b.flat) for i, b in enumerate(ddp._buckets)])


def _run_sharded_optimizer(stage):
    model = _dense()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3, foreach=False,
                           bucket_cap_mb=0.05)
    _train(model, None, *_tokens(), opt=opt)
    part = opt.partition
    if stage < 2:
        _grads_in_flat(part.flat.params, opt.flat_grad)
    _check(model, opt, [("flat_param", part.flat_param), ("shard", part.shard),
                        ("shard.grad", part.shard.grad), ("flat_grad", opt.flat_grad)])


def _run_zero(stage):
    zero = ZeroDataParallel(_dense(), _adamw, stage=stage, bucket_cap_mb=0.05)
    zero.zero_grad()
    _, loss = zero(*_tokens())
    loss.backward()
    zero.step()
    if stage < 2:
        _grads_in_flat(zero.flat.params, zero.flat_grad)
    _check(zero.module, zero.sharded.optim, [("flat_param", zero.flat_param), ("flat_grad", zero.flat_grad),
                                             ("shard.grad", zero.shard.grad)])


def run_fully_shard(world):
    model = _dense()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = _train(model, model.parameters(), *_tokens())
    _check(model, opt)


def _tp_degree(world):
    return min(world, HEADS)


def _run_sliced(world, device, slicer, sequence_parallel=False):
    """A TP (or TP + SP) GPT over the first ranks: one step on meta, or a loss on a real device."""
    group = _block_group(_tp_degree(world))
    model = slicer(_dense(device), group)
    if device != "meta":
        _, loss = model(*_tokens(device=device))
        return _check_cpu(model, loss)
    after = (lambda: allreduce_sequence_parallel_grads(model, group)) if sequence_parallel else None
    opt = _train(model, model.parameters(), *_tokens(), after_backward=after)
    _check(model, opt)


def run_tensor_parallel(world, device="meta"):
    return _run_sliced(world, device, parallelize_gpt)


def run_sequence_parallel(world, device="meta"):
    return _run_sliced(world, device, parallelize_gpt_sp, sequence_parallel=True)


def _check_cpu(model, loss):
    """The plain-CPU float64 run: every shard on the CPU in float64, and a float64 loss."""
    bad = [f"{n} ({p.dtype} on {p.device})" for n, p in model.named_parameters()
           if p.dtype != DTYPE or p.device.type != "cpu"]
    if bad or loss.dtype != DTYPE:
        raise AssertionError(f"shards must take the dense model's dtype and device: {bad[:8]}, "
                             f"loss {loss.dtype}")


def run_ulysses(world):
    attn = UlyssesAttention.from_dense(_dense().blocks[0].attn, _block_group(_tp_degree(world)))
    x = torch.randn(B, T // _tp_degree(world), H, device="meta", dtype=DTYPE)  # this rank's tokens
    attn(x).sum().backward()
    attn.allreduce_gradients()
    opt = _adamw(attn.parameters())
    opt.step()
    _check(attn, opt)


def run_ring_attention(world):
    """A ring of up to 16 ranks (15 hops of K/V, from global rank 1008 at world 1024; each hop's meta ops
    cost ~0.1 s of Python, so 1023 hops would take minutes and show nothing new)."""
    proj = _dense().blocks[0].attn.c_attn
    x = torch.randn(1, 2, H, device="meta", dtype=DTYPE)  # 2 tokens: zigzag halves
    q, k, v = (u.view(1, 2, HEADS, H // HEADS).transpose(1, 2) for u in proj(x).chunk(3, dim=-1))
    ring_attention(q, k, v, _block_group(min(world, 16)), causal=True, layout="zigzag").sum().backward()
    opt = _adamw(proj.parameters())
    opt.step()
    _check(proj, opt)


PIPELINES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def _run_pipeline(name, world):
    """p = 4 stages (of the world's first / last 4 ranks), 4 microbatches; the tied embedding is
    all-reduced between the first and last stage."""
    p, v = min(world, 4), 2 if name == "interleaved" else 1
    group = _block_group(p)
    schedule = make_schedule(name, p, 4, v)
    model = _dense(n_layer=p * v)
    stages = local_stages(model, schedule, dist.get_rank(group))
    res = run_schedule(schedule, stages, *_tokens(rows=8), group=group)
    params = [q for s in stages.values() for q in s.parameters()]
    opt = _adamw(params)
    opt.step()
    for s in stages.values():
        _check(s, opt)
    if res.loss is not None and not isinstance(res.loss, float):
        raise AssertionError(f"PipelineResult.loss must be a float, got {type(res.loss).__name__}")


def _run_three_d(world, zero1=False, checkpoint=False, **kw):
    """dp x tp x pp = 2 x 2 x 2 or 64 x 4 x 4; the model is built in the default dtype (float32)."""
    dp, tp, pp = (2, 2, 2) if world == 8 else (world // 16, 4, 4)
    groups = init_groups(RankGrid(world, dp, tp, pp))
    model = Model3D(_cfg(n_layer=pp), groups, microbatches=2, zero1=zero1, checkpoint=checkpoint,
                    optimizer=_adamw, device="meta", **kw)
    model.step(*_tokens())
    flat = model.zero.flat_param
    _check(model.zero.module, model.zero.sharded.optim, [("flat_param", flat)], want=torch.float32)


def run_expert_parallel(world):
    """Built on meta; its forward must refuse: routing is by the router's values."""
    with torch.device("meta"):
        model = MoEGPT(MoEGPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=HEADS, n_embd=H,
                                    n_experts=8, moe_every=2))
    model = expert_parallel(model, _block_group(min(world, 8)))
    _check(model, want=False)
    try:
        model(*_tokens())
    except RuntimeError as e:
        if REFUSED["expert_parallel"] in str(e):
            return str(e)
        raise
    raise AssertionError("expert parallelism ran a forward on meta tensors instead of refusing")


RUNNERS = {
    "broadcast_from_first_rank": run_broadcast_from_first_rank, "ddp": run_ddp,
    "ddp-find_unused_parameters": lambda w: run_ddp(w, find_unused_parameters=True),
    "sharded_optimizer-1": lambda w: _run_sharded_optimizer(1),
    "sharded_optimizer-2": lambda w: _run_sharded_optimizer(2),
    "zero-0": lambda w: _run_zero(0), "zero-1": lambda w: _run_zero(1), "zero-2": lambda w: _run_zero(2),
    "fully_shard": run_fully_shard, "tensor_parallel": run_tensor_parallel,
    "sequence_parallel": run_sequence_parallel, "ulysses": run_ulysses, "ring_attention": run_ring_attention,
    **{f"pipeline-{s}": (lambda w, s=s: _run_pipeline(s, w)) for s in PIPELINES},
    "three_d": _run_three_d, "three_d-zero1-recompute": lambda w: _run_three_d(w, True, True),
    "three_d-zero2-sequence_parallel": lambda w: _run_three_d(w, zero_stage=2, sequence_parallel=True),
    "expert_parallel": run_expert_parallel,
    "tensor_parallel-fp64-cpu": lambda w: run_tensor_parallel(w, "cpu"),
    "sequence_parallel-fp64-cpu": lambda w: run_sequence_parallel(w, "cpu"),
}


def run_all(world: int) -> dict:
    """``{wrapper: {"ok", "error", "refused", "seconds"}}`` over ranks 0 and world-1."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    out = {name: {"ok": True, "error": "", "refused": "", "seconds": 0.0} for name in RUNNERS}
    for rank in sorted({0, world - 1}):
        _init(rank, world)
        for name, fn in RUNNERS.items():
            t0 = time.perf_counter()
            try:
                refused = fn(world)
                out[name]["refused"] = refused or out[name]["refused"]
            except Exception as e:  # reported per wrapper, the test names it
                out[name]["ok"] = False
                out[name]["error"] += (f"rank {rank} of {world}: {type(e).__name__}: {e}\n"
                                       f"{''.join(traceback.format_exc(limit=-4))}")
            out[name]["seconds"] += time.perf_counter() - t0
    return out


# --- the tests ---------------------------------------------------------------------------------------

_RESULTS: dict = {}


def _results(world: int) -> dict:
    if not _RESULTS:  # one worker plays every world size
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), *map(str, WORLD_SIZES)], cwd=root,
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        assert proc.returncode == 0 and lines, (f"the worker failed (exit {proc.returncode}):\n"
                                                f"{proc.stderr[-4000:]}")
        wall = time.perf_counter() - t0
        _RESULTS.update({int(w): res | {"_wall_s": wall} for w, res in json.loads(lines[-1]).items()})
    return _RESULTS[world]


def test_every_wrapper_is_covered():
    assert set(RUNNERS) == set(WRAPPERS)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_steps_on_meta(world, wrapper):
    res = _results(world)[wrapper]
    assert res["ok"], f"{wrapper} at world size {world}:\n{res['error']}"
    if wrapper in REFUSED:
        assert REFUSED[wrapper] in res["refused"]


def test_the_checks_can_fail():
    """A CPU tensor among meta ones, a float32 one among float64 ones, a CPU parameter and optimizer
    state (torch's scalar ``step`` aside), a CPU float32 shard and a gradient copy are all named."""
    meta = torch.empty(2, device="meta", dtype=torch.float64)
    assert _misplaced([("a", meta)]) == []
    assert _misplaced([("cpu", torch.zeros(2, dtype=torch.float64))]) == ["cpu (torch.float64 on cpu)"]
    assert _misplaced([("f32", torch.empty(2, device="meta"))]) == ["f32 (torch.float32 on meta)"]
    with pytest.raises(AssertionError, match="weight"):
        _check(torch.nn.Linear(2, 2, dtype=torch.float64))
    lin = torch.nn.Linear(2, 2, device="meta", dtype=torch.float64)
    opt = types.SimpleNamespace(state={lin.weight: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(2, 2)}})
    assert [name for name, _ in _state(opt)] == ["opt.state[0].exp_avg"]
    with pytest.raises(AssertionError, match="exp_avg"):
        _check(lin, opt)
    with pytest.raises(AssertionError, match="dtype and device"):
        _check_cpu(torch.nn.Linear(2, 2), torch.zeros((), dtype=torch.float64))
    flat = torch.zeros(4, device="meta")
    lin32 = torch.nn.Linear(1, 2, bias=False, device="meta")
    lin32.weight.grad = flat[:2].view(2, 1)
    _grads_in_flat(list(lin32.parameters()), flat)
    lin32.weight.grad = torch.zeros(2, 1, device="meta")
    with pytest.raises(AssertionError, match="copies"):
        _grads_in_flat(list(lin32.parameters()), flat)


if __name__ == "__main__":
    print(json.dumps({w: run_all(int(w)) for w in sys.argv[1:]}))
