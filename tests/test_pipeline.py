"""Chapter 03: the pipeline executor computes the single-process step, and torch's own pipelining
schedules' step, for every schedule at p = 2 and 4; and it works the way the papers say (the
bytes sent point to point, the microbatches each stage stashes, dependencies in the measured
timeline, the zero-bubble B/W split of the backward's FLOPs).

One launch per world size runs every case and returns plain data; the tests only inspect it.
Expected values come from elsewhere: a single-process GPT forward/backward on the whole batch
(one thread, like a rank), ``torch.distributed.pipelining`` on the same ranks, ``costmodel``'s
formulas, the simulator's replay of the schedule.

Tolerances (derived in tests/_support.py). Every step runs in float64. A pipeline sums m microbatch
gradients, each of the mean loss over its rows times 1/m, where one process takes the mean over all
rows at once: the same sums in another order, at most N = max(B·T, 4H) = 256 terms each (a weight
gradient sums B·T rows), chained 6 deep per block + 2 through the GPT of 2p blocks (as
tests/test_tensor_parallel.py): ``model_bound``, scaled by each tensor's size (at least 1), 1.5e-9
(p = 2) to 3e-9 (p = 4); the loss likewise. Torch's pipelining against ours: the same bound. The
zero-bubble split of one stage's backward (one block, ln_f, lm_head, the loss; in one process) against
autograd: the same sums again, 6 + 2 deep. A lost or doubled microbatch moves a gradient by ~1/m of
itself, a missing tied-embedding all-reduce by the whole lm_head part: many orders of magnitude more.
Bytes are counted for float64 (ELEM = 8 bytes an element).
"""
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from minitorch_dist import costmodel
from minitorch_dist.analysis.pipeline_observers import StashCounter
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.pipeline import executor as X
from minitorch_dist.parallelism.pipeline import schedules as S
from minitorch_dist.parallelism.pipeline import simulator as SIM
from minitorch_dist.parallelism.pipeline import zero_bubble as ZB
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch
from minitorch_dist.runtime.timeline import Timeline

from _support import case, close, float64, model_bound, refusal, run_cases

pytestmark = pytest.mark.ch03

B, T, V, H = 16, 16, 64, 32  # global batch rows, sequence length, vocab, width
SEED = 3
N = max(B * T, 4 * H)  # the longest reduction: a weight gradient sums B·T rows
ELEM = 8  # bytes of a float64 element: every step runs in float64
# (name, schedule function, v): a schedule runs once its function exists in schedules.py
SCHEDULES = [("naive", "naive", 1), ("gpipe", "gpipe", 1), ("1f1b", "one_f_one_b", 1),
             ("interleaved", "interleaved_1f1b", 2), ("zb-h1", "zb_h1", 1)]
AVAILABLE = [(name, v) for name, fn, v in SCHEDULES if hasattr(S, fn)]
TORCH_SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1),
                   "interleaved": ("ScheduleInterleaved1F1B", 2)}


def _cfg(p, tied=True):
    return GPTConfig(vocab_size=V, block_size=T, n_layer=2 * p, n_head=2, n_embd=H, tie_embeddings=tied)


def _schedule(name, p, m, v=1):
    fn = getattr(S, dict((n, f) for n, f, _ in SCHEDULES)[name])
    return fn(p, m, v) if name == "interleaved" else fn(p, m)


def _batch():
    return MarkovCorpus(V, seed=0).batch(0, B, T)


# --- what runs on the ranks ---------------------------------------------------------------------


def _owned_grads(model, stages):
    """This rank's gradients under the model's names (a tied weight under its first name)."""
    mine = {id(q) for s in stages.values() for q in s.parameters()}
    return {k: q.grad.clone() for k, q in model.named_parameters() if id(q) in mine}


def _ours(name, v, m, tied, origin=None):
    p = dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p, tied))
    sched = _schedule(name, p, m, v)
    stages = X.local_stages(model, sched)
    # one clock for all ranks: CLOCK_MONOTONIC from the parent's origin (align()'s barrier would
    # leave each rank its own zero, skewed by the barrier's exit, milliseconds on 2 busy cores)
    tl, stash = Timeline(origin=origin), StashCounter()
    x, y = _batch()
    with comm.meter() as cm, observe.watching(tl), observe.watching(stash):
        res = X.run_schedule(sched, stages, x, y)
    events = [(e.name, e.category, e.t_start, e.t_end, e.meta) for e in tl.events]
    return {"loss": res.loss, "grads": _owned_grads(model, stages), "comm": cm.summary(),
            "peak": stash.peak, "stashed": stash.held, "actions": res.actions, "events": events}


def _torch(name, m):
    """The same step with torch.distributed.pipelining (untied embeddings: torch does not sync them)."""
    import torch.distributed.pipelining as pp
    cls, v = TORCH_SCHEDULES[name]
    r, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p, tied=False))
    stages = X.split_gpt(model, p * v)
    mine = [stages[c * p + r] for c in range(v)]
    pstages = [pp.PipelineStage(s, s.index, p * v, torch.device("cpu")) for s in mine]
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    sched = getattr(pp, cls)(pstages if v > 1 else pstages[0], m, loss_fn=loss_fn)
    x, y = _batch()
    losses = []
    sched.step(*([x] if r == 0 else []), target=y if r == p - 1 else None, losses=losses)
    return {"loss": float(sum(l.detach() for l in losses) / m) if losses else None,
            "grads": _owned_grads(model, dict(enumerate(mine)))}


def _memory(name, m):
    from minitorch_dist.analysis.meters import MemoryMeter
    p = dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p))
    sched = _schedule(name, p, m)
    meter = MemoryMeter(model)
    with meter.track():
        X.run_schedule(sched, X.local_stages(model, sched), *_batch())
    return meter.peak["activations"]


def _errors():
    p = dist.get_world_size()
    model = GPT(_cfg(p))
    sched = S.gpipe(p, 4)
    stages = X.local_stages(model, sched)
    return {name: refusal(call) for name, call in {
        "batch": lambda: X.run_schedule(sched, stages, *(t[:10] for t in _batch())),
        "world": lambda: X.run_schedule(S.gpipe(p + 1, 4), stages, *_batch()),
        "chunks": lambda: X.run_schedule(sched, {1: stages[0]}, *_batch()),
    }.items()}


def _posting_order(name, v):
    """This rank's step recorded (ops, messages, action marks): where each receive is posted, where waited."""
    from minitorch_dist.analysis.workload import WorkloadRecorder
    p = dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p))
    sched = _schedule(name, p, 2 * p, v)
    stages = X.local_stages(model, sched)
    X.run_schedule(sched, stages, *_batch())  # the recorder's own warm-up
    with WorkloadRecorder() as rec, observe.watching(rec):  # it marks each action the executor announces
        X.run_schedule(sched, stages, *_batch())
    return [(type(i).__name__, getattr(i, "op", None) or getattr(i, "name", None) or i.ref,
             getattr(i, "edge", None)) for i in rec.items]  # an Op's "op" is None: its name


def _run_every_case(origin):
    p, cases = dist.get_world_size(), {}
    for name, v in AVAILABLE:
        for tied in (True, False):
            cases[name, tied] = functools.partial(_ours, name, v, 2 * p, tied,
                                                  origin=origin if tied else None)
        for m in (p, 4 * p):  # how the stash grows with m
            cases[name, "m", m] = functools.partial(_ours, name, v, m, tied=False)
    for name in TORCH_SCHEDULES:
        cases["torch", name] = functools.partial(_torch, name, 2 * p)
    for name in ("gpipe", "1f1b"):
        cases["memory", name] = functools.partial(_memory, name, 4 * p)
    cases["errors"] = _errors
    cases["posting"] = functools.partial(_posting_order, "1f1b", 1)
    with float64():
        return run_cases(cases)


@functools.cache
def _results(p):
    return launch(_run_every_case, p, time.monotonic(), timeout_s=120)


def _case(p, key):
    """Each rank's value of case ``key`` on p ranks (a case that raised fails only its own tests)."""
    return [case(res, key, r) for r, res in enumerate(_results(p))]


# --- single-process reference (one thread, like a rank) -------------------------------------------


@functools.cache
def _reference(p, tied):
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = GPT(_cfg(p, tied))
        _, loss = model(*_batch())
        loss.backward()
        return loss.item(), {k: q.grad.clone() for k, q in model.named_parameters()}


def _gathered(p, key):
    """Every rank's gradients in one dict; a parameter held by two ranks must agree bit for bit."""
    out = {}
    for res in _case(p, key):
        for k, g in res["grads"].items():
            if k in out:
                assert torch.equal(out[k], g), f"{key}: ranks disagree on {k}"
            out[k] = g
    return out


def _depth(n_layer):
    return 6 * n_layer + 2  # chained reductions: 6 per block, ln_f and lm_head (module docstring)


def _assert_grads(got, want, n_layer, where):
    assert got.keys() == want.keys(), f"{where}: {sorted(set(want) ^ set(got))}"
    for k in want:
        bound = model_bound(n=N, depth=_depth(n_layer), scale=max(1.0, want[k].abs().max().item()))
        close(got[k], want[k], bound, f"{where}, {k}")


def _assert_loss(got, want, n_layer):
    bound = model_bound(n=N, depth=_depth(n_layer), scale=max(1.0, abs(want)))
    assert abs(got - want) <= bound, f"loss {got} vs {want}: |diff| {abs(got - want):.3g} > bound {bound:.3g}"


def test_every_schedule_of_the_chapter_is_exercised():
    # the schedules module grows during the chapter; once a schedule exists it must be run here
    missing = [fn for _, fn, _ in SCHEDULES if not hasattr(S, fn)]
    if missing:
        pytest.skip(f"schedules not written yet: {missing}")
    assert len(AVAILABLE) == len(SCHEDULES)


# --- results ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name,v", AVAILABLE, ids=[n for n, _ in AVAILABLE])
def test_one_step_equals_one_process(p, tied, name, v):
    loss, grads = _reference(p, tied)
    key, L = (name, tied), _cfg(p).n_layer
    per_rank = _case(p, key)
    _assert_grads(_gathered(p, key), grads, L, f"{name} p={p} tied={tied}")
    last = (p * v - 1) % p
    _assert_loss(per_rank[last]["loss"], loss, L)
    assert all(res["loss"] is None for r, res in enumerate(per_rank) if r != last)
    for m in (p, 4 * p):  # other microbatch counts, untied
        _assert_grads(_gathered(p, (name, "m", m)), _reference(p, False)[1], L, f"{name} p={p} m={m}")


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_equals_torch_distributed_pipelining(p, name):
    if (name, TORCH_SCHEDULES[name][1]) not in AVAILABLE:
        pytest.skip(f"schedule {name} not written yet")
    L = _cfg(p).n_layer
    ours, theirs = _gathered(p, (name, False)), _gathered(p, ("torch", name))
    _assert_grads(ours, theirs, L, f"ours vs torch {TORCH_SCHEDULES[name][0]}, p={p}")
    last = (p * TORCH_SCHEDULES[name][1] - 1) % p
    _assert_loss(_case(p, (name, False))[last]["loss"], _case(p, ("torch", name))[last]["loss"], L)


def test_stage_boundaries_cut_the_model_without_changing_it():
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=5, n_head=2, n_embd=H))
    stages = X.split_gpt(model, 3)
    assert [list(s.blocks) for s in stages] == [["0", "1"], ["2", "3"], ["4"]]  # as even as can be
    names = dict(model.named_parameters())
    for s in stages:  # shared, not copied, under the model's own names
        for k, q in s.named_parameters():
            assert q is model.get_parameter(k)
    assert {k for s in stages for k, _ in s.named_parameters()} == set(names) | {"lm_head.weight"}
    x, y = _batch()
    h = x
    for s in stages[:-1]:
        h = s(h)
    torch.testing.assert_close(stages[-1](h, y), model(x, y)[1], rtol=0, atol=0)


# --- the mechanism -----------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", AVAILABLE, ids=[n for n, _ in AVAILABLE])
def test_point_to_point_bytes_match_the_cost_model(p, name, v):
    m = 2 * p
    act_bytes = (B // m) * T * H * ELEM  # one microbatch's hidden states, float64
    want = costmodel.pipeline_p2p_bytes(p, m, act_bytes, v)
    for tied in (True, False):
        cs = [res["comm"] for res in _case(p, (name, tied))]
        for op in ("send", "recv"):
            assert sum(c[op]["bytes"] for c in cs) == want, (op, tied)
            assert sum(c[op]["calls"] for c in cs) == 2 * m * (p * v - 1), (op, tied)
        # tied embeddings: one all-reduce of V*H floats between the first and the last stage, only there
        reduced = [c.get("all_reduce", {}).get("bytes", 0) for c in cs]
        assert reduced == ([V * H * ELEM] + [0] * (p - 2) + [V * H * ELEM] if tied else [0] * p), reduced


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", AVAILABLE, ids=[n for n, _ in AVAILABLE])
def test_stashed_microbatches_match_simulator_and_cost_model(p, name, v):
    for m in (p, 2 * p, 4 * p):
        per_rank = _case(p, (name, False) if m == 2 * p else (name, "m", m))
        sched = _schedule(name, p, m, v)
        sim = SIM.simulate(sched).peak_stashed
        for r, res in enumerate(per_rank):
            got = res["peak"]
            assert got == sim[r], (m, r)
            assert len(res["stashed"]) == len(sched[r]) and max(res["stashed"]) == got, (m, r)  # per action
            assert got == costmodel.pipeline_stashed_microbatches(name, p, m, stage=r, v=v), (m, r)
            assert res["actions"] == [str(a) for a in sched[r]]
        if name == "1f1b":
            assert max(res["peak"] for res in per_rank) <= p  # independent of m
        if name == "gpipe":
            assert all(res["peak"] == m for res in per_rank)  # grows with m


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_saves_activation_memory_that_gpipe_keeps(p):
    """MemoryMeter's saved-activation peak per stage scales with the stashed microbatches:
    1F1B / GPipe = (p - r) / m on stage r (within 5%: the last stage also saves logits and the
    loss's softmax, and the tokens are one storage shared by all microbatches)."""
    m = 4 * p
    for r, (gpipe, one_f) in enumerate(zip(_case(p, ("memory", "gpipe")), _case(p, ("memory", "1f1b")),
                                           strict=True)):
        want = (costmodel.pipeline_stashed_microbatches("1f1b", p, m, stage=r)
                / costmodel.pipeline_stashed_microbatches("gpipe", p, m, stage=r))
        assert one_f / gpipe == pytest.approx(want, rel=0.05), r


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", AVAILABLE, ids=[n for n, _ in AVAILABLE])
def test_timeline_follows_the_schedule_and_its_dependencies(p, name, v):
    sched = _schedule(name, p, 2 * p, v)
    span = {}
    for r, res in enumerate(_case(p, (name, True))):
        ev = res["events"]
        assert [e[0] for e in ev] == [str(a) for a in sched[r]]
        assert [e[1] for e in ev] == [a.kind for a in sched[r]]
        for (_nm, kind, t0, t1, meta), a in zip(ev, sched[r]):
            assert meta == {"mb": a.mb, "chunk": a.chunk} and t1 >= t0
            span[kind, a.mb, sched.virtual_stage(r, a.chunk)] = (t0, t1)
        assert all(ev[i][3] <= ev[i + 1][2] for i in range(len(ev) - 1))  # one action at a time
    n_vs = p * v
    for (kind, mb, vs), (t0, _) in span.items():  # one clock (CLOCK_MONOTONIC) for every rank
        if kind == "F" and vs > 0:
            assert t0 >= span["F", mb, vs - 1][1], (kind, mb, vs)
        if kind == "B" and vs < n_vs - 1:
            assert t0 >= span["B", mb, vs + 1][1], (kind, mb, vs)
        if kind == "W":
            assert t0 >= span["B", mb, vs][1]


@pytest.mark.parametrize("p", [2, 4])
def test_each_receive_is_posted_one_action_ahead(p):
    """The executor posts the receive of action i+1 before action i runs, and waits for it only when
    i+1 starts: the message can move while this rank computes (chapter 03, a send posted during compute)."""
    sched = _schedule("1f1b", p, 2 * p)
    for r, items in enumerate(_case(p, "posting")):
        acts = [str(a) for a in sched[r]]
        starts = [i for i, (kind, _, edge) in enumerate(items) if kind == "Mark" and edge == "start"]
        assert [items[i][1] for i in starts] == acts
        posted = [i for i, (kind, op, _) in enumerate(items) if kind == "Comm" and op == "recv"]
        waited = {i: next(j for j, it in enumerate(items) if it == ("Wait", i, None)) for i in posted}
        remote = [k for k, a in enumerate(sched[r])
                  if (a.kind == "F" and r > 0) or (a.kind == "B" and r < p - 1)]
        assert len(posted) == len(remote), (r, len(posted), len(remote))
        for i, k in zip(posted, remote):  # its action k: posted before action k-1 starts, waited after it
            if k > 0:
                assert i < starts[k - 1] < waited[i] < starts[k], (r, acts[k], i, starts[k - 1], waited[i])
            else:
                assert waited[i] < starts[0]


def test_zero_bubble_split_b_computes_no_weight_gradient_and_w_the_rest():
    """Qi et al. 2024 §2: B = dL/dx (+ LayerNorm/embedding grads), W = every Linear's dW, db.

    FLOPs (torch's FlopCounterMode): B + W = the whole backward, and W is exactly the 2*N*in*out
    of each Linear's ``dy^T x``: B did none of those matmuls. The gradients equal autograd's.
    """
    with float64():
        _zero_bubble_split()


def _zero_bubble_split():
    torch.manual_seed(SEED)
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=H))
    stage = X.split_gpt(model, 2)[1]  # block 1 + ln_f + (tied) lm_head + loss
    h = torch.randn(4, T, H, requires_grad=True)
    y = torch.randint(0, V, (4, T))
    loss = stage(h, y)
    with FlopCounterMode(display=False) as full:
        loss.backward()
    want = {k: q.grad.clone() for k, q in stage.named_parameters()}
    want_dx = h.grad.clone()
    stage.zero_grad(set_to_none=True)

    taps = ZB.LinearTap([stage])
    taps.active = []
    x = h.detach().requires_grad_(True)
    loss = stage(x, y)
    taps.remove()
    linears = [k for k, mod in stage.named_modules() if isinstance(mod, torch.nn.Linear)]
    with FlopCounterMode(display=False) as b:
        dx, stash = ZB.backward_input(loss, None, x, taps.active,
                                      ZB.b_params(stage))
    assert all(stage.get_submodule(k).weight.grad is None for k in linears)
    assert all(stage.get_submodule(k).bias is None or stage.get_submodule(k).bias.grad is None
               for k in linears)
    assert stage.ln_f.weight.grad is not None  # non-Linear parameters: done in B
    with FlopCounterMode(display=False) as w:
        ZB.backward_weights(stash, {id(q) for q in ZB.b_params(stage)})
    n_tokens = 4 * T
    dw_flops = sum(2 * n_tokens * m.in_features * m.out_features for _, m in stage.named_modules()
                   if isinstance(m, torch.nn.Linear))
    assert w.get_total_flops() == dw_flops
    assert b.get_total_flops() + w.get_total_flops() == full.get_total_flops()
    _assert_grads({"x": dx, **{k: q.grad for k, q in stage.named_parameters()}}, {"x": want_dx, **want}, 1,
                  "zero-bubble B + W against autograd")


# --- errors --------------------------------------------------------------------------------------------


def test_too_few_layers_for_the_stages_is_a_clear_error():
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=H))
    with pytest.raises(ValueError,
                       match=r"n_layer=2 cannot fill 4 pipeline stages; use GPTConfig\(n_layer>=4\)"):
        X.split_gpt(model, 4)
    with pytest.raises(ValueError, match="positive int"):
        X.split_gpt(model, 0)


def test_run_schedule_outside_launch_is_a_clear_error():
    model = GPT(GPTConfig(vocab_size=V, block_size=T, n_layer=2, n_head=2, n_embd=H))
    sched = S.gpipe(2, 2)
    with pytest.raises(RuntimeError, match="launch"):
        X.run_schedule(sched, X.local_stages(model, sched, rank=0), *_batch())


@pytest.mark.parametrize("p", [2, 4])
def test_bad_batch_world_or_stages_are_clear_errors(p):
    for err in _case(p, "errors"):
        assert "10 rows" in err["batch"] and "m=4" in err["batch"] and "multiple of m" in err["batch"]
        assert f"p={p + 1}" in err["world"] and f"{p} ranks" in err["world"]
        assert "chunk" in err["chunks"] and "local_stages" in err["chunks"]
