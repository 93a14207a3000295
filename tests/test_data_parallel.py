"""Chapter 01: data parallelism equals one process on the global batch, and torch's own DDP; and
it works the way Li et al. 2020 describe (buckets in reverse order, all-reduces launched during
backward, one all-reduce per k micro-batches under no_sync, 2(n-1)/n of the gradient bytes).

One launch per world size runs every case and returns plain data; the tests only inspect it.
Expected values are computed here, independently of the module: the single-process runs below
(one thread, like a rank), ``torch.nn.parallel.DistributedDataParallel`` run on the same ranks,
byte counts from the parameters' sizes, the bucket rule checked through its properties.

Tolerances (derived in tests/_support.py). Every case runs in float64 (``float64()`` around the
ranks' work and the references). A rank's mean loss over B/n rows, averaged over n ranks, is the
global mean summed in another order: the GPT's forward and backward with its reductions (at most
N = B·T = 512 terms: a weight gradient sums B·T rows; c_proj sums 4·64, the logits 64) reordered,
chained GPT_DEPTH = 6·2 + 2 = 14 deep: ``model_bound(n=512, depth=14, scale=max(1, |g|))`` ≈ 1.6e-9
on the gradients (|g| the largest gradient the one-process run saw, over all its steps). Weights
after k steps: SGD (lr 0.1, momentum 0.9) ``sgd_bound`` ≈ k·1.6e-9 (8e-9 after 5 steps); AdamW
(lr 1e-3, eps 1e-6) ``adam_bound`` = k·lr·grad_err/eps ≈ 8e-6 after 5 (its update has slope up to 1/eps
in g: rounding noise in a nearly-zero gradient moves the weight, which is why eps is 1e-6, not 1e-8).
A wrong implementation is far outside: a gradient not averaged (×n) moves SGD's weights by
lr·(n-1)·|g| ≳ 1e-3; a micro-batch lost or a missing all-reduce changes the gradient by O(|g|), moving
SGD's weights by ~1e-3 and AdamW's by ~lr = 1e-3 a step. (AdamW is blind to a lost 1/n, m/√v being
scale-free: SGD is the case that catches it.) Two layers used on some ranks only (TwoLayers: 8-term dot
products, a 24-term sum, 4 chained): ``model_bound(n=24, depth=4)``. Against torch's DDP, which also
multiplies each gradient by 1/n before summing, the only freedom left is the order in which the backend
adds the n contributions: with n = 2 one addition, a + b == b + a, so the results must be bitwise
equal; with n = 4 the bounds above. Bytes are counted for float64 (8 bytes an element).
"""
import contextlib
import functools

import pytest
import torch
import torch._dynamo  # optimizers import it lazily (~2 s); forked ranks inherit it
import torch.distributed as dist
from torch import nn

from minitorch_dist.analysis.observers import Recorder, launches_during_backward
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism import data_parallel as DP
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import RankError, launch
from minitorch_dist.runtime.timeline import Timeline

from _support import adam_bound, case, close, float64, model_bound, refusal, run_cases, sgd_bound

pytestmark = pytest.mark.ch01

CFG = GPTConfig.tiny()
B, T = 16, 32  # global batch: divisible by n = 2, 4 and by n * K micro-batches
STEPS, K = 5, 4
CAP_MB = 0.05  # ~52 KB buckets: the ~0.86 MB float64 tiny GPT splits into ~17
FIRST_MB = 0.02
SEED = 100  # rank r initialises with SEED + r; the broadcast must make every replica rank 0's
N = B * T  # the longest reduction: a weight gradient sums B·T rows (c_proj sums 4·64, the logits 64)
GPT_DEPTH = 6 * CFG.n_layer + 2  # chained reductions through the GPT
ELEM = 8  # bytes of a float64 element: every case runs in float64
LR, ADAM_EPS, MOMENTUM = {"sgd": 0.1, "adamw": 1e-3}, 1e-6, 0.9
OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=LR["sgd"], momentum=MOMENTUM),
    # eps=1e-6, not 1e-8: see the module docstring (Adam's update has slope up to 1/eps in g; a
    # larger eps keeps the bound on k steps, k·lr·grad_err/eps, far below a real bug's effect)
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=LR["adamw"], eps=ADAM_EPS, weight_decay=0.1),
}


class GPTWithSpare(nn.Module):
    """The GPT plus a layer its forward never uses."""

    def __init__(self):
        super().__init__()
        self.gpt = GPT(CFG)
        self.spare = nn.Linear(4, 4)

    def forward(self, x, y):
        return self.gpt(x, y)


class TwoLayers(nn.Module):
    """`b` is used only when asked: on some ranks, or on none."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, use_b):
        h = self.a(x)
        return (self.b(h) if use_b else h).square().sum()


# --- what runs on the ranks ---------------------------------------------------------------------


def _wrap(kind, model, **kw):
    if kind == "ours":
        return DP.DistributedDataParallel(model,
                                          **{"bucket_cap_mb": CAP_MB, "first_bucket_mb": FIRST_MB, **kw})
    if kind == "torch":
        return nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB, **kw)
    return DP.NaiveDataParallel(model)


def _train(kind, opt_name, steps, accumulate=1, freeze=(), make=lambda: GPT(CFG), **kw):
    """`steps` optimizer steps, each on this rank's rows of the global batch of that step, split
    into `accumulate` micro-batches (no_sync on all but the last)."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED + r)
    model = make()
    for name in freeze:
        model.get_parameter(name).requires_grad_(False)
    dp = _wrap(kind, model, **kw)
    opt = OPTIMIZERS[opt_name](dp.parameters())
    data = MarkovCorpus(CFG.vocab_size, seed=0)
    log = []
    for step in range(steps):
        x, y = data.batch(step, B, T, r, n)
        with comm.meter() as m, observe.watching(Recorder()) as seen:
            for i, (xi, yi) in enumerate(zip(x.chunk(accumulate), y.chunk(accumulate))):
                last = i == accumulate - 1
                with contextlib.nullcontext() if last or kind == "naive" else dp.no_sync():
                    _, loss = dp(xi, yi)
                    (loss / accumulate).backward()
            if kind == "naive":
                dp.average_gradients()
        log.append({"calls": m.calls["all_reduce"], "bytes": m.bytes["all_reduce"],
                    "wire": m.wire_bytes["all_reduce"], "ddp_marks": seen.marks("ddp"),
                    "none_grads": sorted(k for k, p in model.named_parameters() if p.grad is None)})
        opt.step()
        opt.zero_grad(set_to_none=True)
    out = {"params": {k: v.detach().clone() for k, v in model.named_parameters()}, "steps": log}
    if kind == "ours":
        out.update(buckets=dp.buckets, bucket_bytes=dp.bucket_bytes)
    return out


def _grads_of_two_backwards(kind):
    """Two backwards (batches of steps 0 and 1) without a step in between: grads accumulate."""
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED + r)
    dp = _wrap(kind, GPT(CFG))
    data = MarkovCorpus(CFG.vocab_size, seed=0)
    for step in (0, 1):
        dp(*data.batch(step, B, T, r, n))[1].backward()
    return {k: p.grad.clone() for k, p in dp.module.named_parameters()}


def _partial_use(kind, use_b_on):
    """TwoLayers with `b` used on ranks `use_b_on` only; find_unused_parameters=True. Grads after one
    backward."""
    r = dist.get_rank()
    torch.manual_seed(SEED + r)
    model = TwoLayers()
    cap = 600 / 2**20  # 600 bytes: [b.bias, b.weight] (72 float64 elements, 576 B), then [a.bias, a.weight]
    kw = {"bucket_cap_mb": cap, "first_bucket_mb": cap} if kind == "ours" else {}
    dp = (DP.DistributedDataParallel(model, find_unused_parameters=True, **kw) if kind == "ours"
          else nn.parallel.DistributedDataParallel(model, find_unused_parameters=True))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(r))
    with comm.meter() as m:
        dp(x, r in use_b_on).backward()
    grads = {k: None if p.grad is None else p.grad.clone() for k, p in model.named_parameters()}
    return grads, m.calls["all_reduce"]


def _with_timeline():
    r, n = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED + r)
    tl = Timeline()
    dp = DP.DistributedDataParallel(GPT(CFG), bucket_cap_mb=CAP_MB, first_bucket_mb=FIRST_MB)
    tl.align()
    x, y = MarkovCorpus(CFG.vocab_size, seed=0).batch(0, B, T, r, n)
    with observe.watching(tl):  # the timeline records the spans DDP announces
        dp(x, y)[1].backward()
    return [(e.name, e.category, e.t_start, e.t_end) for e in tl.events], len(dp.buckets)


def _unused_raises():
    """find_unused_parameters=False and a parameter the forward skips: a clear error, on every rank."""
    r, n = dist.get_rank(), dist.get_world_size()
    dp = DP.DistributedDataParallel(GPTWithSpare(), bucket_cap_mb=CAP_MB, first_bucket_mb=FIRST_MB)
    x, y = MarkovCorpus(CFG.vocab_size, seed=0).batch(0, B, T, r, n)
    return refusal(lambda: dp(x, y)[1].backward(), RuntimeError)


def _run_every_case():
    n = dist.get_world_size()
    cases = {(kind, opt_name): functools.partial(_train, kind, opt_name, STEPS)
             for opt_name in OPTIMIZERS for kind in ("ours", "torch")}
    cases["naive", "sgd"] = functools.partial(_train, "naive", "sgd", STEPS)
    for kind in ("ours", "torch"):
        cases[kind, "no_sync"] = functools.partial(_train, kind, "sgd", 3, accumulate=K)
        cases[kind, "twice"] = functools.partial(_grads_of_two_backwards, kind)
    cases["tiny_cap"] = functools.partial(_train, "ours", "sgd", 2, bucket_cap_mb=1e-6,
                                          first_bucket_mb=1e-6)  # 1 byte
    cases["huge_cap"] = functools.partial(_train, "ours", "sgd", 2, bucket_cap_mb=1e4, first_bucket_mb=1e4)
    cases["frozen"] = functools.partial(_train, "ours", "sgd", 2, freeze=("wpe.weight",))
    cases["unused_error"] = _unused_raises
    cases["unused_ok"] = functools.partial(_train, "ours", "sgd", 2, make=GPTWithSpare,
                                           find_unused_parameters=True)
    for kind in ("ours", "torch"):
        cases[kind, "partial"] = functools.partial(_partial_use, kind, use_b_on={0})
        cases[kind, "nowhere"] = functools.partial(_partial_use, kind, use_b_on=set())
        cases[kind, "all_but_0"] = functools.partial(_partial_use, kind, use_b_on=set(range(1, n)))
    cases["timeline"] = _with_timeline
    with float64():
        return run_cases(cases)


@functools.cache
def _results(n):
    return launch(_run_every_case, n, timeout_s=120)


def _case(n, name):
    """Each rank's value of case ``name`` on n ranks (a case that raised fails only its own tests)."""
    return [case(res, name, r) for r, res in enumerate(_results(n))]


# --- single-process references (one thread, like a rank) ------------------------------------------


def _grad_err(scale):
    """The GPT's gradients, reductions reordered: see the module docstring."""
    return model_bound(n=N, depth=GPT_DEPTH, scale=max(1.0, scale))


def _weight_bound(opt_name, steps, gmax):
    """Weights after ``steps`` steps on gradients (each at most ``gmax``) within ``_grad_err``."""
    if opt_name == "sgd":
        return sgd_bound(steps=steps, lr=LR["sgd"], grad_err=_grad_err(gmax), momentum=MOMENTUM)
    return adam_bound(steps=steps, lr=LR["adamw"], grad_err=_grad_err(gmax), eps=ADAM_EPS)


def _largest(grads):
    return max(g.abs().max().item() for g in grads if g is not None)


@functools.cache
def _reference(opt_name, steps, freeze=()):
    """One process on the global batch: its weights after ``steps`` steps, and the bound on ours."""
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = GPT(CFG)
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)
        opt = OPTIMIZERS[opt_name](model.parameters())
        data = MarkovCorpus(CFG.vocab_size, seed=0)
        gmax = 0.0
        for step in range(steps):
            model(*data.batch(step, B, T))[1].backward()
            gmax = max(gmax, _largest(p.grad for p in model.parameters()))
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {"params": {k: v.detach().clone() for k, v in model.named_parameters()},
                "bound": _weight_bound(opt_name, steps, gmax)}


@functools.cache
def _reference_two_backwards():
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = GPT(CFG)
        data = MarkovCorpus(CFG.vocab_size, seed=0)
        for step in (0, 1):
            model(*data.batch(step, B, T))[1].backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters()}
        return {"params": grads, "bound": _grad_err(_largest(grads.values()))}


def _names():
    """Registration order, a tied parameter once (its first name), as named_parameters gives it."""
    return [k for k, _ in GPT(CFG).named_parameters()]


def _grad_bytes():
    return sum(p.numel() * ELEM for p in GPT(CFG).parameters())


def _assert_params(got, want, where, bound=None):
    """Each tensor within ``bound`` of ``want``'s; bitwise equal when bound is None."""
    assert got.keys() == want.keys(), where
    for k in want:
        if bound is None:
            assert torch.equal(got[k], want[k]), \
                f"{where}: {k} differs by {(got[k] - want[k]).abs().max():.3g}"
        else:
            close(got[k], want[k], bound, f"{where}, {k}")


# --- results ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_ddp_equals_one_process_and_torch_ddp(n, opt_name):
    ref = _reference(opt_name, STEPS)
    per_rank = _case(n, ("ours", opt_name))
    for r, (run, torch_run) in enumerate(zip(per_rank, _case(n, ("torch", opt_name)), strict=True)):
        ours, theirs = run["params"], torch_run["params"]
        _assert_params(ours, ref["params"], f"ours vs one process, {opt_name}, n={n}, rank {r}", ref["bound"])
        _assert_params(ours, theirs, f"ours vs torch DDP, {opt_name}, n={n}, rank {r}",
                       None if n == 2 else ref["bound"])
        # the replicas are the same bits: every rank applied the same all-reduced gradient
        _assert_params(ours, per_rank[0]["params"], f"rank {r} vs rank 0")


@pytest.mark.parametrize("n", [2, 4])
def test_naive_data_parallel_equals_one_process_with_one_all_reduce_per_parameter(n):
    ref = _reference("sgd", STEPS)
    for r, naive in enumerate(_case(n, ("naive", "sgd"))):
        _assert_params(naive["params"], ref["params"], f"naive, n={n}, rank {r}", ref["bound"])
        for s in naive["steps"]:
            assert s["calls"] == len(_names())  # one per parameter, the tied one once
            assert s["bytes"] == _grad_bytes()


# --- the mechanism: buckets, bytes, overlap ------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_one_all_reduce_per_bucket_carrying_2_n_minus_1_over_n_of_the_gradient(n):
    grad_bytes = _grad_bytes()
    for r, res in enumerate(_results(n)):
        for name in (("ours", "sgd"), ("ours", "adamw"), "tiny_cap", "huge_cap"):
            run = case(res, name, r)
            assert sum(run["bucket_bytes"]) == grad_bytes, name
            for s in run["steps"]:
                assert s["calls"] == len(run["buckets"]), (name, r)
                assert s["bytes"] == grad_bytes, (name, r)
                assert s["wire"] == 2 * (n - 1) / n * grad_bytes, (name, r)


@pytest.mark.parametrize("n", [2, 4])
def test_buckets_launch_in_order_during_backward(n):
    names = _names()
    for r, run in enumerate(_case(n, ("ours", "sgd"))):
        nb = len(run["buckets"])
        assert nb >= 2
        for s in run["steps"]:  # the marks DDP announced: ("grad", {"param"}), ("launch"/"wait", {"bucket"})
            order = [(kind, meta.get("param", meta.get("bucket"))) for kind, meta in s["ddp_marks"]]
            assert sorted(name for kind, name in order if kind == "grad") == sorted(names)
            assert [i for kind, i in order if kind == "launch"] == list(range(nb))
            assert [i for kind, i in order if kind == "wait"] == list(range(nb))
            last_grad = max(k for k, (kind, _) in enumerate(order) if kind == "grad")
            during = sum(kind == "launch" for kind, _ in order[:last_grad])
            assert during >= 1, f"rank {r}: no all-reduce was launched before backward ended: {order}"
            assert launches_during_backward(s["ddp_marks"]) == during
            # a bucket is launched only after each of its gradients arrived
            seen = set()
            for kind, x in order:
                if kind == "grad":
                    seen.add(x)
                elif kind == "launch":
                    assert set(run["buckets"][x]) <= seen, (x, order)


@pytest.mark.parametrize("n", [2, 4])
def test_bucket_assignment_follows_reverse_order_and_caps(n):
    names, sizes = _names(), dict((k, p.numel() * ELEM) for k, p in GPT(CFG).named_parameters())
    res = _results(n)[0]
    tiny, huge, mid = case(res, "tiny_cap", 0), case(res, "huge_cap", 0), case(res, ("ours", "sgd"), 0)
    assert tiny["buckets"] == [[k] for k in reversed(names)]  # a 1-byte cap: one parameter each
    assert huge["buckets"] == [list(reversed(names))]  # a 10 GiB cap: one bucket
    assert [k for b in mid["buckets"] for k in b] == list(reversed(names))
    caps = [int(FIRST_MB * 2**20)] + [int(CAP_MB * 2**20)] * (len(mid["buckets"]) - 1)
    for i, (b, nbytes) in enumerate(zip(mid["buckets"], mid["bucket_bytes"])):
        assert nbytes == sum(sizes[k] for k in b)
        assert len(b) == 1 or nbytes <= caps[i], (i, b, nbytes)  # only a lone param may exceed
        if i + 1 < len(mid["buckets"]):  # closed only because the next parameter did not fit
            assert nbytes + sizes[mid["buckets"][i + 1][0]] > caps[i], (i, b)
    for run in (tiny, huge, mid):  # the tied wte / lm_head: bucketed once, under its first name
        flat = [k for b in run["buckets"] for k in b]
        assert flat.count("wte.weight") == 1 and "lm_head.weight" not in flat
    ref = _reference("sgd", 2)
    _assert_params(tiny["params"], ref["params"], "tiny cap", ref["bound"])
    _assert_params(huge["params"], ref["params"], "huge cap", ref["bound"])


# --- no_sync, accumulation, frozen and unused parameters -------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_no_sync_all_reduces_once_per_k_micro_batches(n):
    ref = _reference("sgd", 3)
    for r, (ours, theirs) in enumerate(zip(_case(n, ("ours", "no_sync")), _case(n, ("torch", "no_sync")),
                                           strict=True)):
        for s in ours["steps"]:  # K backwards per step, one round of bucket all-reduces
            assert s["calls"] == len(ours["buckets"]) and s["bytes"] == _grad_bytes()
        _assert_params(ours["params"], ref["params"], f"no_sync vs one step on the whole batch, n={n}, r={r}",
                       ref["bound"])
        _assert_params(ours["params"], theirs["params"], f"no_sync vs torch, n={n}",
                       None if n == 2 else ref["bound"])


@pytest.mark.parametrize("n", [2, 4])
def test_two_backwards_without_a_step_accumulate_like_torch(n):
    ref = _reference_two_backwards()
    for r, (ours, theirs) in enumerate(zip(_case(n, ("ours", "twice")), _case(n, ("torch", "twice")),
                                           strict=True)):
        _assert_params(ours, ref["params"], f"accumulated grads vs one process, n={n}, r={r}", ref["bound"])
        _assert_params(ours, theirs, f"vs torch, n={n}", None if n == 2 else ref["bound"])


@pytest.mark.parametrize("n", [2, 4])
def test_frozen_parameter_is_not_bucketed_and_stays_put(n):
    ref = _reference("sgd", 2, freeze=("wpe.weight",))
    for r, run in enumerate(_case(n, "frozen")):
        assert "wpe.weight" not in [k for b in run["buckets"] for k in b]
        assert sum(run["bucket_bytes"]) == _grad_bytes() - CFG.block_size * CFG.n_embd * ELEM
        assert all(s["none_grads"] == ["wpe.weight"] for s in run["steps"])
        _assert_params(run["params"], ref["params"], f"frozen wpe, n={n}, rank {r}", ref["bound"])


@pytest.mark.parametrize("n", [2, 4])
def test_unused_parameter_raises_a_clear_error_or_is_handled(n):
    ref = _reference("sgd", 2)
    first = _case(n, "unused_ok")[0]
    for r, (msg, ok) in enumerate(zip(_case(n, "unused_error"), _case(n, "unused_ok"), strict=True)):
        assert msg is not None, f"rank {r}: an unused parameter went unnoticed"
        assert "spare.weight" in msg and "spare.bias" in msg and "find_unused_parameters=True" in msg
        want = {"gpt." + k: v for k, v in ref["params"].items()}
        got = {k: v for k, v in ok["params"].items() if k.startswith("gpt.")}
        _assert_params(got, want, f"find_unused_parameters=True, n={n}, rank {r}", ref["bound"])
        for s in ok["steps"]:
            assert s["none_grads"] == ["spare.bias", "spare.weight"]  # unused everywhere: grad stays None
            assert s["calls"] == len(ok["buckets"]) + 1  # + the bitmap of who has a gradient
        # the spare layer never moved and is rank 0's on every rank (the broadcast)
        assert torch.equal(ok["params"]["spare.weight"], first["params"]["spare.weight"])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("use", ["partial", "nowhere", "all_but_0"])
def test_parameters_unused_on_some_ranks_match_torch(n, use):
    for r, ((ours, calls), (theirs, _)) in enumerate(zip(_case(n, ("ours", use)), _case(n, ("torch", use)),
                                                         strict=True)):
        assert ours.keys() == theirs.keys()
        assert calls == 2 + 1  # two buckets (a, b) and the bitmap
        for k in ours:
            if theirs[k] is None:
                assert ours[k] is None, (use, k)
            else:  # TwoLayers: 8-term dot products, a 24-term sum, 4 reductions chained
                bound = model_bound(n=24, depth=4, scale=max(1.0, theirs[k].abs().max().item()))
                close(ours[k], theirs[k], bound, f"{use} {k}, n={n}, rank {r}")
    if use == "nowhere":
        assert _case(n, ("ours", use))[0][0]["b.weight"] is None


# --- the timeline, errors, the tour -------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_timeline_shows_all_reduces_overlapping_backward(n):
    for r, (events, nb) in enumerate(_case(n, "timeline")):
        spans = {name: (t0, t1) for name, _, t0, t1 in events}
        # "wait": after backward's compute, for the all-reduces still running (short when they hid)
        assert set(spans) == {"backward", "wait"} | {f"all_reduce b{i}" for i in range(nb)}
        assert spans["backward"][1] <= spans["wait"][0] <= spans["wait"][1]
        b0, b1 = spans["backward"]
        assert b0 < b1
        starts = [spans[f"all_reduce b{i}"][0] for i in range(nb)]
        assert starts == sorted(starts)
        assert all(t0 <= t1 for name, _, t0, t1 in events)
        assert starts[0] < b1, f"rank {r}: the first all-reduce started after backward ended"


def test_bad_arguments_are_refused_with_the_fix_named():
    model = GPT(CFG)
    for bad in (0, -1, "25"):
        with pytest.raises(ValueError, match="bucket_cap_mb must be a positive number"):
            DP.DistributedDataParallel(model, bucket_cap_mb=bad)
    with pytest.raises(ValueError, match="first_bucket_mb"):
        DP.DistributedDataParallel(model, first_bucket_mb=0)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters with requires_grad=True"):
        DP.DistributedDataParallel(frozen)
    assert not dist.is_initialized()
    for cls in (DP.DistributedDataParallel, DP.NaiveDataParallel):
        with pytest.raises(RuntimeError, match="launch"):
            cls(model)


def test_unused_parameter_on_one_rank_only_fails_loudly_not_silently():
    """Ranks that disagree on which parameters are used cannot all-reduce the same buckets: the
    rank missing a gradient raises, and launch() reports it instead of hanging."""
    def fn():
        torch.manual_seed(0)
        model = TwoLayers()
        dp = DP.DistributedDataParallel(model, bucket_cap_mb=1e-4)
        dp(torch.randn(3, 8), dist.get_rank() == 0).backward()

    with pytest.raises(RankError, match="b.weight.*find_unused_parameters=True"):
        launch(fn, 2, timeout_s=60)


class Replica(nn.Module):
    """One weight of ``shape`` (the first tensor: a module's own come before its children's), then a layer;
    ranks that pass (4, 8) and (8, 4) hold as many elements."""

    def __init__(self, shape):
        super().__init__()
        self.first = nn.Linear(3, 3)
        self.w = nn.Parameter(torch.zeros(shape))

    def forward(self, x):
        return self.first(x).sum() * self.w.sum()


def _replicas_of_different_shapes():
    shape = (4, 8) if dist.get_rank() == 0 else (8, 4)
    wrappers = (DP.DistributedDataParallel, DP.NaiveDataParallel)
    return [refusal(lambda wrap=wrap: wrap(Replica(shape))) for wrap in wrappers]


def test_replicas_of_different_shapes_are_refused_naming_the_parameter():
    """Rank 1 builds a (8, 4) weight where rank 0 has (4, 8): the broadcast of rank 0's would fit and train
    another model silently (torch's DDP refuses). Every rank refuses, naming it and both shapes."""
    for r, errors in enumerate(launch(_replicas_of_different_shapes, 2, timeout_s=60)):
        for who, error in zip(("DistributedDataParallel", "NaiveDataParallel"), errors):
            assert error is not None and error.startswith(f"{who}: the ranks hold different models"), error
            here = " (this rank)" if r == 1 else ""
            assert f"'w' (tensor 0) has shape [8, 4] on rank 1{here} but [4, 8] on rank 0" in error, error
