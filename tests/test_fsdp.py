"""Chapter 06: ``fully_shard`` on any module equals one process on the global batch and torch's FSDP2
``fully_shard`` called the same way; and it works the way Rajbhandari et al. 2020 (§5.3, §7.2.2)
and Zhao et al. 2023 (§3) say: Ψ all-gathered in forward, Ψ all-gathered and Ψ reduce-scattered in
backward, (1+1+2)Ψ/n elements of model state per rank (ZeRO's (4+4+8)Ψ/n bytes in fp32), the next
unit's all-gather issued before the current unit computes, hybrid sharding on a 2x2 grid.

Models: the course GPT (a unit per block, then the root), an MLP (a unit per Linear, an empty
root), a model with tied input/output weights, one with a frozen parameter, one whose Linear and
Embedding layers are sharded while its RMSNorm layers stay replicated, and one with a parameter
that never gets a gradient. Mixed precision: bf16 and fp16 ``param_dtype``, the master shards and the
gradient reduction in the full precision of the model (float64 here).

One launch per world size runs every case and returns plain data; the tests only inspect it.
Expected values are computed here, independently of the module: each dense model in one process
(one thread, like a rank) on the global batch, torch's FSDP2 on the same ranks, parameter counts of
the dense model's modules.

Tolerances (derived in tests/_support.py). Every case runs in float64 (``float64()`` around the
ranks' work and the references): the models, their master shards, their gradient reductions. A rank's
mean loss over B/n rows, averaged over n ranks, is the global mean summed in another order: the GPT's
forward and backward with reductions of at most N = B·T = 128 terms (a weight gradient sums B·T rows;
c_proj sums 4·21, the logits 61), GPT_DEPTH = 6·3 + 2 = 20 chained, give ``model_bound(n=128,
depth=20, scale=max(1, |g|))`` ≈ 5.8e-10 on gradients, losses and logits (|g|, |loss|: the largest the
one-process run saw); the weights after STEPS - 1 = 4 updates, ``sgd_bound`` (lr 0.1, momentum 0.9,
≈ 2.3e-9) or ``adam_bound`` (lr 1e-3, eps 1e-6: k·lr·grad_err/eps ≈ 2.3e-6). The small models (an MLP
13-24-24-5, tied and normed language models of width <= 20 on B·6 = 48 tokens, V = 29): reductions of
at most 48 terms, at most 16 deep (NormLM: 2 × (RMSNorm, Linear), RMSNorm, head and the cross-entropy's
sum, as many backward, + 2): ``adam_bound`` over STEPS = 5 updates ≈ 8.7e-7. Step s's loss adds, to its
own reductions' bound, the weights' error by then through the gradient, ‖g‖₁ · (the weights' bound after
s updates), to first order (``_bounds``). A wrong implementation is
far outside: a gradient not averaged, a shard taken from the wrong place, a stale or missing gather
moves SGD's weights by lr·|Δg| ≳ 1e-3 and AdamW's by ~lr = 1e-3 a step. Against FSDP2, which also sums
the n shards' gradients and divides by n, only the order of the n additions is free: bitwise equal at
n = 2 (a + b == b + a), the same bounds at n = 4.

Mixed precision (bf16 / fp16 compute, float64 masters and reduction) against FSDP2 with the same
policy: the same casts in the same places, so the bounds of the accumulation dtype (float64), as above.
Against the float64 process the half-precision run differs by its roundoff, which no first-order
account bounds over several AdamW steps (Adam's 1/eps slope puts any such bound above the weights). What
is derived instead is how far two AdamW runs from the same start can be apart at all: a bias-corrected
update ``m̂/(√v̂ + eps)`` is at most ``ρ_t = (1-β1)/(1-β1^t) · √(Σ_{j<t} β2^j · Σ_{j<t} (β1²/β2)^j)``
in size (Cauchy-Schwarz on m and v; ρ_t <= 1.011 for t <= 5) and the decoupled decay only shrinks a
difference, so after k updates ``2·lr·Σ_t ρ_t`` ≈ 8e-3 (``_adam_reach``). That catches a run that did
not start from the same weights (a shard gathered into the wrong place moves a weight by ~|w| ~ 0.02-1)
or whose weights are not AdamW's (NaN, masters lost to a cast); the precision of the half-precision
path is held by the comparison with FSDP2. Bytes are counted for float64 (8 bytes an element, ELEM),
and for the 2-byte compute dtype where mixed precision gathers.
"""
import functools
import math

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.analysis.fsdp_observers import GatheredUnits
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.zero import (
    FSDPModule,
    MixedPrecisionPolicy,
    full_state_dict,
    fully_shard,
    hybrid_groups,
    sharded_units,
)
from minitorch_dist.memory.zero.fsdp import replicate
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.models.train import train_steps
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import RankError, launch

from _support import adam_bound, case, close, float64, model_bound, refusal, run_cases, sgd_bound

pytestmark = [pytest.mark.ch06, pytest.mark.timeout(240)]

CFG = GPTConfig.tiny(vocab_size=61, block_size=16, n_layer=3, n_head=3, n_embd=21)
B, T, STEPS, SEED = 8, 16, 5, 3
LR, ADAM_EPS, MOMENTUM, BETAS = {"adamw": 1e-3, "sgd": 0.1}, 1e-6, 0.9, (0.9, 0.999)
OPTS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR["adamw"], betas=BETAS, eps=ADAM_EPS, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR["sgd"], momentum=MOMENTUM),
}
N, GPT_DEPTH = B * T, 6 * CFG.n_layer + 2  # the GPT's longest reduction (B·T rows), its chained reductions
ANY_N, ANY_DEPTH = B * 6, 16  # the small models: B·6 tokens; NormLM's chain (see the module docstring)
ELEM = 8  # bytes of a float64 element: every case runs in float64
HALF = 2  # bytes of a bf16 / fp16 element: mixed precision gathers and computes in them


# --- the models -----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in=13, d=24, d_out=5, frozen=False, unused=False):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, d), nn.GELU(), nn.Linear(d, d), nn.GELU(),
                                 nn.Linear(d, d_out))
        if frozen:
            self.net[0].weight.requires_grad_(False)
        self.spare = nn.Linear(d, d) if unused else None  # never called: never gets a gradient

    def forward(self, x, y):
        return nn.functional.mse_loss(self.net(x), y)


class TiedLM(nn.Module):
    """Embedding, a Linear, and an output layer that *is* the embedding (one parameter)."""

    def __init__(self, V=29, d=18):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(V, d), nn.Linear(d, d), nn.Linear(d, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x, y):
        logits = self.head(torch.tanh(self.mid(self.emb(x))))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class NormLM(nn.Module):
    """Embedding -> (RMSNorm -> Linear -> GELU) x 2 -> RMSNorm -> Linear head."""

    def __init__(self, V=29, d=20):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.layers = nn.ModuleList([nn.ModuleDict({"norm": nn.RMSNorm(d), "fc": nn.Linear(d, d)})
                                     for _ in range(2)])
        self.norm, self.head = nn.RMSNorm(d), nn.Linear(d, V)

    def forward(self, x, y):
        h = self.emb(x)  # (B, T, d)
        for layer in self.layers:
            h = h + nn.functional.gelu(layer["fc"](layer["norm"](h)))
        logits = self.head(self.norm(h))  # (B, T, V)
        return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


class Half(nn.Module):
    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.second(nn.functional.gelu(self.first(x)))


class SharedMLP(nn.Module):
    """Two halves that share one Linear (``proj``): x -> a(x) -> b(.), a = (inp, proj), b = (proj, out)."""

    def __init__(self, d=24):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.a, self.b = Half(nn.Linear(13, d), self.proj), Half(self.proj, nn.Linear(d, 5))

    def forward(self, x, y):
        return nn.functional.mse_loss(self.b(nn.functional.gelu(self.a(x))), y)


def _batch(kind, step, rank=0, n=1):
    """Rows ``rank::n``-free: rank r takes the r-th of n equal slices of the global batch."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind in ("mlp", "frozen", "unused", "shared"):
        x, y = torch.randn(B, 13, generator=g), torch.randn(B, 5, generator=g)
    else:
        x, y = torch.randint(0, 29, (B, 6), generator=g), torch.randint(0, 29, (B, 6), generator=g)
    rows = B // n
    return x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]


def _build(kind):
    torch.manual_seed(SEED)
    return {"mlp": MLP, "frozen": lambda: MLP(frozen=True), "unused": lambda: MLP(unused=True),
            "tied": TiedLM, "norm": NormLM, "shared": SharedMLP}[kind]()


def _shard(kind, model, shard=fully_shard, **kw):
    """How each model is sharded: units first, then the root (not for ``norm``: its norms replicate)."""
    if kind in ("mlp", "frozen", "unused"):
        for i in (0, 2, 4):
            shard(model.net[i], **kw)
    elif kind == "tied":
        shard(model.mid, **kw)
    elif kind == "shared":  # the shared module first: a unit of its own, which both halves skip
        for m in (model.proj, model.a, model.b):
            shard(m, **kw)
    elif kind == "norm":
        shard(model.emb, **kw)
        for layer in model.layers:
            shard(layer["fc"], **kw)
        shard(model.head, **kw)
        return replicate(model) if shard is fully_shard else model  # the RMSNorms stay replicated
    return shard(model, **kw)


def _steps(model, kind, rank=0, n=1, grads=None):
    """STEPS AdamW steps of ``model(x, y) -> loss`` on this rank's rows; the losses (the gradients'
    sizes appended to ``grads`` if given)."""
    opt = OPTS["adamw"]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(*_batch(kind, step, rank, n))
        loss.backward()
        if grads is not None:
            _grad_sizes(model, grads)
        opt.step()
        losses.append(loss.item())
    return losses


KINDS = ("mlp", "frozen", "unused", "tied", "norm", "shared")


# --- what each rank runs --------------------------------------------------------------------------


def _events(m):
    return [(e.op, e.nbytes, e.wire_bytes, e.group_size, e.t) for e in m.events]


def _shard_gpt(model, shard=fully_shard, **kw):
    for block in model.blocks:
        shard(block, **kw)
    return shard(model, **kw)


def _gpt(opt, **kw):
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = _shard_gpt(GPT(CFG), **kw)
    run = train_steps(model, STEPS, B, T, optimizer=OPTS[opt], rank=r, world_size=n)
    out = {"losses": run.losses, "full": full_state_dict(model), "events": {"fwd": _events(run.meters[0]),
           "bwd": _events(run.meters[1])}, "tied": model.lm_head.weight is model.wte.weight,
           "names": [k for k, _ in model.named_parameters()], "class": type(model).__name__}
    # One more step by hand, with a fresh optimizer over the same shards: the schedule and peaks of
    # one forward / backward, then the memory meter after the step (outside forward/backward).
    optim = OPTS[opt](list(model.parameters()))
    x, y = MarkovCorpus(CFG.vocab_size, seed=0).batch(STEPS, B, T, r, n)
    with observe.watching(GatheredUnits()) as gathered:
        with comm.meter() as fwd:
            _, loss = model(x, y)
        out["fwd_peak"] = (gathered.peak_units, gathered.peak_bytes)
        with comm.meter() as bwd:
            loss.backward()
    optim.step()
    out["trace"] = [(e, u, i) for i, (e, u) in enumerate(gathered.schedule)]  # i: the order announced
    out["step_events"] = {"fwd": _events(fwd), "bwd": _events(bwd)}
    out["memory"] = MemoryMeter(model, optim).current()
    units = sharded_units(model)
    out["resharded"] = not any(u.gathered for u in units)
    out["shard_numels"] = {u.name: u.shard_numel for u in units}
    return out


def _torch_shard(module, **kw):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    mp = kw.pop("mp_policy", None)
    if mp is not None:
        kw["mp_policy"] = TorchPolicy(param_dtype=mp.param_dtype, reduce_dtype=mp.reduce_dtype)
    return torch_fully_shard(module, mesh=init_device_mesh("cpu", (dist.get_world_size(),)), **kw)


def _gpt_torch(mp=None):
    torch.manual_seed(SEED)
    model = _shard_gpt(GPT(CFG), _torch_shard, mp_policy=mp)
    run = train_steps(model, STEPS, B, T, optimizer=OPTS["adamw"], rank=dist.get_rank(),
                      world_size=dist.get_world_size())
    return {"losses": run.losses,
            "full": {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}}


def _gpt_mp(mp):
    torch.manual_seed(SEED)
    model = _shard_gpt(GPT(CFG), mp_policy=mp)
    run = train_steps(model, STEPS, B, T, optimizer=OPTS["adamw"], rank=dist.get_rank(),
                      world_size=dist.get_world_size())
    dtypes = {p.dtype for p in model.parameters()}
    return {"losses": run.losses, "full": full_state_dict(model), "dtypes": dtypes,
            "events": _events(run.meters[1])}


def _any_model(kind, torch_too=True):
    r, n = dist.get_rank(), dist.get_world_size()
    model = _shard(kind, _build(kind))
    with comm.meter() as m:
        losses = _steps(model, kind, r, n)
    out = {"losses": losses, "full": full_state_dict(model), "ops": sorted({e.op for e in m.events}),
           "bytes": {op: sum(e.nbytes for e in m.events if e.op == op)
                     for op in ("all_gather", "reduce_scatter")},
           "local": {k: p.numel() for k, p in model.named_parameters()}}
    if torch_too:
        ref = _shard(kind, _build(kind), _torch_shard)
        if kind == "norm":
            _torch_shard(ref)  # FSDP2 has no replicated leftovers: its root unit takes the norms
        out["torch_losses"] = _steps(ref, kind, r, n)
        out["torch_full"] = {k: p.full_tensor().detach().clone() for k, p in ref.named_parameters()}
    return out


def _hybrid():
    group, replicate = hybrid_groups(2)
    torch.manual_seed(SEED)
    model = _shard_gpt(GPT(CFG), group=group, replicate_group=replicate)
    run = train_steps(model, STEPS, B, T, optimizer=OPTS["adamw"], rank=dist.get_rank(),
                      world_size=dist.get_world_size())
    ev = lambda m: [(e.op, e.nbytes, e.group_size) for e in m.events]
    return {"losses": run.losses, "full": full_state_dict(model),
            "events": {"fwd": ev(run.meters[0]), "bwd": ev(run.meters[1])},
            "shard_numels": [u.shard_numel for u in sharded_units(model)]}


def _inference():
    """Under no_grad: gather, run, free per unit; logits of the initial weights on this rank's rows."""
    torch.manual_seed(SEED)
    model = _shard_gpt(GPT(CFG))
    x, _ = MarkovCorpus(CFG.vocab_size, seed=0).batch(0, B, T, dist.get_rank(), dist.get_world_size())
    with torch.no_grad():
        logits, loss = model(x)
    return {"logits": logits, "loss": loss,
            "left_gathered": sorted(u.name for u in sharded_units(model) if u.gathered),
            "global_hooks": len(nn.modules.module._global_forward_pre_hooks)}  # the root found per module


def _errors():
    def twice():
        lin = nn.Linear(3, 3)
        fully_shard(lin)
        fully_shard(lin)

    def tied_apart():
        lm = TiedLM()
        fully_shard(lm.emb)
        fully_shard(lm.head)

    def shared_apart():
        model = SharedMLP()
        fully_shard(model.a)
        fully_shard(model.b)

    def top_down():
        mlp = MLP()
        fully_shard(mlp)
        fully_shard(mlp.net[0])

    def refused(call):
        return refusal(call, ValueError, TypeError)

    out = {"twice": refused(twice), "tied": refused(tied_apart), "top_down": refused(top_down),
           "shared": refused(shared_apart),
           "grid": refused(lambda: hybrid_groups(3)),
           "dtype": refused(lambda: fully_shard(nn.Linear(2, 2), mp_policy=MixedPrecisionPolicy(torch.int8))),
           # a dict is not a policy: a TypeError (a ValueError would fail this case)
           "policy": refusal(lambda: fully_shard(nn.Linear(2, 2), mp_policy={"param_dtype": torch.bfloat16}),
                             TypeError),
           "replicate": refused(lambda: fully_shard(nn.Linear(2, 2), replicate_group=dist.group.WORLD)),
           "replicate_alone": refused(lambda: replicate(nn.Linear(2, 2)))}
    others = dist.new_group([1])  # every rank makes it; rank 0 is not in it
    if dist.get_rank() == 0:
        out["outside"] = refused(lambda: fully_shard(nn.Linear(2, 2), group=others))
    return out


def _run_every_case():
    n = dist.get_world_size()
    cases = {"adamw": lambda: _gpt("adamw"), "sgd": lambda: _gpt("sgd"),
             "adamw_no_prefetch": lambda: _gpt("adamw", prefetch=False),
             "keep": lambda: _gpt("adamw", reshard_after_forward=False), "torch": _gpt_torch,
             "inference": _inference, "errors": _errors}
    for kind in KINDS:
        cases[kind] = functools.partial(_any_model, kind)
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        # the masters (the model's float64) and the reduction in full precision, the compute in half
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float64)
        cases[name] = functools.partial(_gpt_mp, mp)
        cases[name + "_torch"] = functools.partial(_gpt_torch, mp)
    if n == 4:
        cases["hybrid"] = _hybrid
    with float64():
        return run_cases(cases)


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=200)


def _case(n, name):
    """Each rank's value of case ``name`` on n ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(n))]


# --- independent references ----------------------------------------------------------------------


def _weight_bound(opt, updates, gmax, n=N, depth=GPT_DEPTH):
    """Weights after ``updates`` steps on gradients (at most ``gmax``) within ``model_bound``."""
    grad_err = model_bound(n=n, depth=depth, scale=max(1.0, gmax))
    if opt == "sgd":
        return sgd_bound(steps=updates, lr=LR["sgd"], grad_err=grad_err, momentum=MOMENTUM)
    return adam_bound(steps=updates, lr=LR["adamw"], grad_err=grad_err, eps=ADAM_EPS)


def _bounds(opt, losses, grads, updates, n=N, depth=GPT_DEPTH):
    """The bounds on a run against the one-process run (its ``losses``, and per step the largest
    gradient and the gradients' 1-norm, ``grads``): on the weights after ``updates`` steps; on step s's
    loss, its own reductions reordered plus the weights' error by then through the gradient
    (|Δloss| <= ‖g‖₁ · max|Δw|, to first order)."""
    gmax = max(g for g, _ in grads)
    loss_bounds = [model_bound(n=n, depth=depth, scale=max(1.0, abs(loss)))
                   + g1 * _weight_bound(opt, s, gmax, n, depth)
                   for s, (loss, (_, g1)) in enumerate(zip(losses, grads, strict=True))]
    return {"bound": _weight_bound(opt, updates, gmax, n, depth), "loss_bounds": loss_bounds}


def _grad_sizes(model, into):
    """After a backward: the largest gradient and the gradients' 1-norm, appended to ``into``."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    into.append((max(g.abs().max().item() for g in grads), sum(g.abs().sum().item() for g in grads)))


def _adam_reach(updates, lr=LR["adamw"], betas=BETAS):
    """How far two AdamW runs from the same weights can be apart after ``updates`` steps, whatever their
    gradients: 2·lr·Σ_t ρ_t, ρ_t the largest |m̂_t/√v̂_t| (see the module docstring); decay only shrinks it."""
    b1, b2 = betas
    rho = [(1 - b1) / (1 - b1 ** t) * math.sqrt(sum(b2 ** j for j in range(t))
                                                 * sum((b1 * b1 / b2) ** j for j in range(t)))
           for t in range(1, updates + 1)]
    return 2 * lr * sum(rho)


@functools.cache
def _dense(opt):
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model, grads = GPT(CFG), []
        run = train_steps(model, STEPS, B, T, optimizer=OPTS[opt],
                          after_backward=lambda: _grad_sizes(model, grads))
        # train_steps takes no update after the last backward: STEPS - 1 updates
        return {"losses": run.losses, "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                **_bounds(opt, run.losses, grads, STEPS - 1)}


@functools.cache
def _dense_any(kind):
    with float64(), single_thread():
        model, grads = _build(kind), []
        init = {k: p.detach().clone() for k, p in model.named_parameters()}
        losses = _steps(model, kind, grads=grads)
        return {"losses": losses, "params": {k: p.detach().clone() for k, p in model.named_parameters()},
                "init": init, **_bounds("adamw", losses, grads, STEPS, ANY_N, ANY_DEPTH)}


def _unit_numels():
    """Ψ_u of each unit in the GPT: the root (wte, wpe, ln_f; lm_head tied) and each block."""
    model = GPT(CFG)
    blocks = {id(p) for p in model.blocks.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in blocks)
    return {"root": root, **{f"blocks.{i}": sum(p.numel() for p in b.parameters())
                             for i, b in enumerate(model.blocks)}}


def _unit_tensors():
    model = GPT(CFG)
    blocks = {id(p) for p in model.blocks.parameters()}
    return {"root": sum(1 for p in model.parameters() if id(p) not in blocks),
            **{f"blocks.{i}": len(list(b.parameters())) for i, b in enumerate(model.blocks)}}


def _close_losses(got, want, bounds, where):
    for s, (a, b, bound) in enumerate(zip(got, want, bounds, strict=True)):
        assert abs(a - b) <= bound, f"{where}: step {s}'s loss {a} vs {b}, bound {bound:.3g}"


def _global_losses(n, key):
    """The mean over ranks of each rank's loss on its B/n rows is the loss of the global batch."""
    per_rank = [run["losses"] for run in _case(n, key)]
    return [sum(step) / len(step) for step in zip(*per_rank)]


# --- equals one process, and torch's FSDP2 ------------------------------------------------------------


def test_sizes_pad_every_unit():
    numels = _unit_numels()
    assert numels["root"] == 1659 and numels["blocks.0"] == 5565
    assert all(k % 2 for k in numels.values())  # so every unit is padded at n = 2 and 4


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_gpt_equals_single_process(n, opt):
    ref = _dense(opt)
    _close_losses(_global_losses(n, opt), ref["losses"], ref["loss_bounds"], f"{opt} n={n}")
    for r, got in enumerate(_case(n, opt)):
        assert got["tied"], "lm_head.weight must stay the same tensor as wte.weight"
        assert got["class"] == "FSDPGPT" and got["names"] == list(ref["params"])  # the module, its names
        for k in ref["params"]:
            close(got["full"][k], ref["params"][k], ref["bound"], f"{opt} n={n} r={r} {k}")


@pytest.mark.parametrize("n", [2, 4])
def test_gpt_equals_torch_fsdp2_fully_shard(n):
    ref = _dense("adamw")
    for r, (ours, theirs) in enumerate(zip(_case(n, "adamw"), _case(n, "torch"), strict=True)):
        _close_losses(ours["losses"], theirs["losses"], ref["loss_bounds"], f"vs FSDP2 n={n} r={r}")
        assert ours["full"].keys() == theirs["full"].keys()
        for k in theirs["full"]:
            close(ours["full"][k], theirs["full"][k], ref["bound"], f"vs FSDP2 n={n} r={r} {k}")
            if n == 2:
                assert torch.equal(ours["full"][k], theirs["full"][k]), f"n=2 should be bitwise: {k}"


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("kind", KINDS)
def test_any_model_equals_single_process_and_torch_fsdp2(n, kind):
    ref = _dense_any(kind)
    _close_losses(_global_losses(n, kind), ref["losses"], ref["loss_bounds"], f"{kind} n={n}")
    for r, got in enumerate(_case(n, kind)):
        assert got["full"].keys() == ref["params"].keys()
        _close_losses(got["losses"], got["torch_losses"], ref["loss_bounds"], f"{kind} vs FSDP2 n={n} r={r}")
        for k in ref["params"]:
            close(got["full"][k], ref["params"][k], ref["bound"], f"{kind} n={n} r={r} {k}")
            close(got["full"][k], got["torch_full"][k], ref["bound"], f"{kind} vs FSDP2 n={n} r={r} {k}")


@pytest.mark.parametrize("n", [2, 4])
def test_frozen_and_gradient_less_parameters_do_not_move(n):
    """requires_grad=False, and a parameter no forward uses: AdamW's weight decay would move both."""
    for kind, name in (("frozen", "net.0.weight"), ("unused", "spare.weight"), ("unused", "spare.bias")):
        init = _dense_any(kind)["init"][name]
        for got in _case(n, kind):
            assert torch.equal(got["full"][name], init), (kind, name)
    moved = _dense_any("frozen")
    assert not torch.equal(moved["params"]["net.2.weight"], moved["init"]["net.2.weight"])  # the rest trains


@pytest.mark.parametrize("n", [2, 4])
def test_norms_left_out_stay_replicated_and_are_all_reduced(n):
    results = _case(n, "norm")
    for got in results:
        assert got["local"]["norm.weight"] == got["local"]["layers.0.norm.weight"] == 20  # whole, every rank
        assert got["ops"] == ["all_gather", "all_reduce", "broadcast", "reduce_scatter"]
    for name, numel in (("head.weight", 29 * 20), ("emb.weight", 29 * 20), ("layers.1.fc.weight", 20 * 20)):
        pieces = [got["local"][name] for got in results]
        assert sum(pieces) == numel and max(pieces) < numel, (name, pieces)  # each element on one rank


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_equals_torch_fsdp2_and_keeps_full_precision_masters(n, dtype):
    ref, reach = _dense("adamw"), _adam_reach(STEPS - 1)
    psi = _unit_numels()
    for r, (ours, theirs) in enumerate(zip(_case(n, dtype), _case(n, dtype + "_torch"), strict=True)):
        assert ours["dtypes"] == {torch.float64}  # the shards are the master weights, in the model's dtype
        _close_losses(ours["losses"], theirs["losses"], ref["loss_bounds"], f"{dtype} vs FSDP2 n={n} r={r}")
        for k in theirs["full"]:
            close(ours["full"][k], theirs["full"][k], ref["bound"], f"{dtype} vs FSDP2 n={n} r={r} {k}")
            close(ours["full"][k], ref["params"][k], reach, f"{dtype} vs float64 n={n} r={r} {k}")
        want = [costmodel.fsdp_unit_elements(psi[u], k, n) for u, k in _unit_tensors().items()]
        gathers = sum(e[1] for e in ours["events"] if e[0] == "all_gather")  # backward: half the gathers
        reduced = sum(e[1] for e in ours["events"] if e[0] == "reduce_scatter")
        assert gathers == HALF * sum(w["all_gather"] for w in want) // 2  # 2-byte elements: the compute dtype
        assert reduced == ELEM * sum(w["reduce_scatter"] for w in want)  # reduced in the masters' float64


@pytest.mark.parametrize("n", [2, 4])
def test_inference_under_no_grad_equals_the_dense_model(n):
    with float64(), single_thread():
        torch.manual_seed(SEED)
        dense = GPT(CFG)
        with torch.no_grad():
            want = dense(MarkovCorpus(CFG.vocab_size, seed=0).batch(0, B, T)[0])[0]
    bound = model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, want.abs().max().item()))
    for r, got in enumerate(_case(n, "inference")):
        assert got["loss"] is None and got["left_gathered"] == [] and got["global_hooks"] == 0
        close(got["logits"], want.chunk(n)[r], bound, f"no_grad logits n={n} r={r}")


# --- the mechanism --------------------------------------------------------------------------------------


def test_hybrid_2x2_equals_single_process_and_reduces_in_groups_of_two():
    ref = _dense("adamw")
    _close_losses(_global_losses(4, "hybrid"), ref["losses"], ref["loss_bounds"], "hybrid")
    units, tensors = _unit_numels(), _unit_tensors()
    S = [math.ceil(units[k] / 2) for k in ("root", "blocks.0", "blocks.1", "blocks.2")]
    F = [tensors[k] for k in ("root", "blocks.0", "blocks.1", "blocks.2")]
    for r, h in enumerate(_case(4, "hybrid")):
        for k in ref["params"]:
            close(h["full"][k], ref["params"][k], ref["bound"], f"hybrid r={r} {k}")
        assert sorted(h["shard_numels"]) == sorted(S)  # sharded 2 ways, not 4
        ag = sorted((nb, g) for op, nb, g in h["events"]["fwd"] if op == "all_gather")
        assert ag == sorted((2 * s * ELEM, 2) for s in S)
        bwd = h["events"]["bwd"]
        rs = sorted((2 * (s + f) * ELEM, 2) for s, f in zip(S, F))  # [S grads | F flags] per rank
        assert sorted((nb, g) for op, nb, g in bwd if op == "reduce_scatter") == rs
        assert sorted((nb, g) for op, nb, g in bwd if op == "all_reduce") == sorted(((s + f) * ELEM, 2)
                                                                                 for s, f in zip(S, F))
        assert {op for op, _, _ in bwd} == {"all_gather", "reduce_scatter", "all_reduce"}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("run", ["adamw", "keep"])
def test_collectives_per_step_are_the_formula(n, run):
    """One all-gather per unit in forward; in backward one more per unit when resharded after forward
    (none when kept), and one reduce-scatter per unit: ``costmodel.fsdp_unit_elements`` exactly.
    Resharded: 3Ψ on the wire, 1.5x the 2Ψ of ZeRO-1/2 (padding and the flags aside)."""
    reshard = run == "adamw"
    psi, tensors = _unit_numels(), _unit_tensors()
    want = {u: costmodel.fsdp_unit_elements(psi[u], tensors[u], n, reshard) for u in psi}
    units = len(psi)
    for got in _case(n, run):
        for ev in (got["events"], got["step_events"]):
            fwd, bwd = ev["fwd"], ev["bwd"]
            assert [e[0] for e in fwd] == ["all_gather"] * units
            assert sorted(e[0] for e in bwd) == (["all_gather"] * (units if reshard else 0)
                                                 + ["reduce_scatter"] * units)
            per_op = lambda evs, op: sum(e[1] for e in evs if e[0] == op)
            assert per_op(fwd + bwd, "all_gather") == ELEM * sum(w["all_gather"] for w in want.values())
            assert per_op(bwd, "reduce_scatter") == ELEM * sum(w["reduce_scatter"] for w in want.values())
            wire = sum(e[2] for e in fwd + bwd)
            elements = sum(w["all_gather"] + w["reduce_scatter"] for w in want.values())
            assert wire == pytest.approx(elements * ELEM * (n - 1) / n, rel=1e-12)
            if reshard:
                zero12 = costmodel.zero_comm_bytes(sum(psi.values()), n, 1, bytes_per_element=ELEM)
                # 3 n·S_u per unit against ZeRO's 2 n·ceil(Ψ/n): apart by the padding (< n per unit, x3)
                # and the flags (n per tensor)
                apart = (3 * n * units + n * sum(tensors.values())) / (3 * sum(psi.values()))
                assert wire / zero12 == pytest.approx(1.5, rel=apart)


@pytest.mark.parametrize("n", [2, 4])
def test_per_rank_memory_is_the_zero3_formula(n):
    """Outside forward/backward, in float64: parameters 8·S, gradients 8·S, AdamW state 16·S (+ an 8-byte
    step per parameter), S summed over units: within padding of ZeRO's (4 + 4 + 8)·Ψ/n of fp32, with
    8-byte elements (8 + 8 + 16)·Ψ/n; nothing gathered left."""
    psi = sum(_unit_numels().values())
    S = {k: math.ceil(v / n) for k, v in _unit_numels().items()}
    steps = ELEM * len(_dense("adamw")["params"])  # AdamW's step counter: a float64 scalar a tensor
    for got in _case(n, "adamw"):
        mem = got["memory"]
        assert got["shard_numels"] == S
        assert got["resharded"]
        assert mem["parameters"] == ELEM * sum(S.values())
        assert mem["gradients"] <= ELEM * sum(S.values())  # a rank's padding has no gradient
        assert mem["optimizer_state"] <= 2 * ELEM * sum(S.values()) + steps
        total = mem["parameters"] + mem["gradients"] + mem["optimizer_state"] - steps
        formula = (1 + 1 + 2) * ELEM * psi / n  # ZeRO's (4 + 4 + 8)·Ψ/n, in float64
        assert formula - 4 * ELEM * len(S) <= total <= formula + 4 * ELEM * len(S)  # each unit pads < n


@pytest.mark.parametrize("n", [2, 4])
def test_forward_holds_the_root_and_at_most_two_blocks(n):
    unit_bytes = {k: ELEM * n * math.ceil(v / n) for k, v in _unit_numels().items()}
    root, block = unit_bytes["root"], unit_bytes["blocks.0"]
    for prefetched, plain, kept in zip(_case(n, "adamw"), _case(n, "adamw_no_prefetch"), _case(n, "keep"),
                                       strict=True):
        assert prefetched["fwd_peak"] == (3, root + 2 * block)  # prefetch: root, current, next
        assert plain["fwd_peak"] == (2, root + block)
        assert kept["fwd_peak"] == (len(unit_bytes), sum(unit_bytes.values()))  # nothing freed
        assert root + 2 * block < sum(unit_bytes.values())  # 3 blocks: never the whole model


def _first(trace, event, unit):
    return next(t for e, u, t in trace if e == event and u == unit)


@pytest.mark.parametrize("n", [2, 4])
def test_prefetch_issues_the_next_all_gather_before_the_current_unit_computes(n):
    """Forward: block i+1's all-gather is issued before block i's forward ends; backward: block i-1's
    before block i's backward ends. Without prefetch, never."""
    L = CFG.n_layer
    for r, res in enumerate(_results(n)):
        for key, prefetch in (("adamw", True), ("adamw_no_prefetch", False)):
            trace = case(res, key, r)["trace"]
            cut = next(k for k, (e, _, _) in enumerate(trace) if e == "backward")
            fwd_trace, bwd_trace = trace[:cut], trace[cut:]
            for i in range(L - 1):
                end_i = _first(fwd_trace, "forward_end", f"blocks.{i}")
                assert (_first(fwd_trace, "all_gather", f"blocks.{i + 1}") < end_i) == prefetch, (key, i)
            for i in range(L - 1, 0, -1):
                end_i = _first(bwd_trace, "backward_end", f"blocks.{i}")
                assert (_first(bwd_trace, "all_gather", f"blocks.{i - 1}") < end_i) == prefetch, (key, i)


@pytest.mark.parametrize("n", [2, 4])
def test_prefetch_and_keeping_change_nothing_but_the_order(n):
    for r, res in enumerate(_results(n)):
        base = case(res, "adamw", r)
        for key in ("adamw_no_prefetch", "keep"):
            other = case(res, key, r)
            assert base["losses"] == other["losses"]  # bitwise: the same sums
            for k, w in base["full"].items():
                assert torch.equal(w, other["full"][k]), (key, k)


# --- errors ---------------------------------------------------------------------------------------------


def test_outside_a_process_group_is_a_clear_error():
    with pytest.raises(RuntimeError, match="launch"):
        fully_shard(GPT(CFG))


@pytest.mark.parametrize("n", [2, 4])
def test_bad_input_is_a_clear_error(n):
    errors = _case(n, "errors")[0]
    assert "already sharded" in errors["twice"]
    assert "weight is already in another unit" in errors["tied"] and "common parent" in errors["tied"]
    assert "top-down" in errors["top_down"]
    assert "Linear is already in another module's unit" in errors["top_down"]
    assert "first (Linear)" in errors["shared"] and "shard it first" in errors["shared"]  # b.first is proj
    assert f"world size {n} is not divisible by shard_size 3" in errors["grid"]
    assert "floating-point" in errors["dtype"] and errors["policy"] is not None  # a TypeError (the case)
    assert "replicate_group needs group" in errors["replicate"]
    assert "call fully_shard on its submodules first" in errors["replicate_alone"]
    assert "rank 0 is not in group [1]" in errors["outside"]


def _raise_in_a_unit():
    class Boom(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            if dist.get_rank() == 1:
                raise RuntimeError("boom in rank 1's unit")
            return self.lin(x)

    model = fully_shard(Boom())
    model(torch.randn(2, 3)).sum().backward()


def test_a_rank_that_raises_inside_a_unit_surfaces_through_launch():
    with pytest.raises(RankError, match="rank 1") as err:
        launch(_raise_in_a_unit, 2, timeout_s=60)
    assert "boom in rank 1's unit" in str(err.value)


def test_an_fsdp_module_is_the_module():
    assert issubclass(FSDPModule, object) and callable(full_state_dict)


@pytest.mark.parametrize("n", [2, 4])
def test_a_frozen_tensor_is_gathered_but_never_reduced(n):
    """MLP units: net.0 = (weight, bias), net.2, net.4; with net.0.weight frozen it is a part of its
    own: all-gathered in forward and backward, absent from the reduce-scatter (fewer bytes)."""
    shapes = {"net.0": [(24, 13), (24,)], "net.2": [(24, 24), (24,)], "net.4": [(5, 24), (5,)]}
    numel = lambda ts: sum(math.prod(s) for s in ts)

    def elements(frozen):  # per step, summed over the units' parts (costmodel.fsdp_unit_elements each)
        ag = rs = 0
        for unit, ts in shapes.items():
            parts = [ts[:1], ts[1:]] if frozen and unit == "net.0" else [ts]
            for k, part in enumerate(parts):
                e = costmodel.fsdp_unit_elements(numel(part), len(part), n)
                ag += e["all_gather"]
                rs += e["reduce_scatter"] if not (frozen and unit == "net.0" and k == 0) else 0
        return ag, rs

    for r, res in enumerate(_results(n)):
        for kind, frozen in (("mlp", False), ("frozen", True)):
            ag, rs = elements(frozen)
            assert case(res, kind, r)["bytes"] == {"all_gather": ELEM * STEPS * ag,
                                                   "reduce_scatter": ELEM * STEPS * rs}
        reduced = {kind: case(res, kind, r)["bytes"]["reduce_scatter"] for kind in ("frozen", "mlp")}
        assert reduced["frozen"] < reduced["mlp"]


def _units_of_different_shapes():
    """Rank 1's second layer is (8, 4) where rank 0's is (4, 8): as many elements, another model."""
    second = nn.Linear(8, 4, bias=False) if dist.get_rank() == 0 else nn.Linear(4, 8, bias=False)
    model = nn.Sequential(nn.Linear(3, 3), second)
    return refusal(lambda: fully_shard(model))


def test_ranks_holding_different_shapes_are_refused_naming_the_parameter():
    for r, error in enumerate(launch(_units_of_different_shapes, 2, timeout_s=60)):
        assert error is not None and error.startswith("fully_shard: the ranks hold different models"), error
        here = " (this rank)" if r == 1 else ""
        assert f"'1.weight' (tensor 2) has shape [8, 4] on rank 1{here} but [4, 8] on rank 0" in error, error
