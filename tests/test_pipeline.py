"""Chapter 03: the pipeline executor computes the single-process step, and torch's own pipelining
schedules' step, for every schedule at p = 2 and 4; and it works the way the papers say (the
bytes sent point to point, the microbatches each stage stashes, dependencies in the measured
timeline, the zero-bubble B/W split of the backward's FLOPs).

One launch per world size runs every case and returns plain data; the tests only inspect it.
Expected values come from elsewhere: a single-process GPT forward/backward on the whole batch
(one thread, like a rank), ``torch.distributed.pipelining`` on the same ranks, ``costmodel``'s
formulas, the simulator's replay of the schedule.

Tolerances. A pipeline sums m microbatch gradients, each of the mean loss over its rows times
1/m, where one process takes the mean over all rows at once: the same sum in another order, a
few float32 ulps apart (measured ~2e-8 on gradients of size ~1e-2). We allow atol 1e-6 and rtol
1e-5 on gradients and 1e-6 on the loss; a lost or doubled microbatch moves a gradient by ~1/m of
itself, a missing tied-embedding all-reduce by the whole lm_head part: orders of magnitude more.
"""
import functools
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from minitorch_dist.analysis import costmodel
from minitorch_dist.analysis.timeline import Timeline
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.pipeline import executor as X
from minitorch_dist.parallelism.pipeline import schedules as S
from minitorch_dist.parallelism.pipeline import simulator as SIM
from minitorch_dist.parallelism.pipeline import zero_bubble as ZB
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch03

B, T, V, H = 16, 16, 64, 32  # global batch rows, sequence length, vocab, width
SEED = 3
ATOL, RTOL = 1e-6, 1e-5
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
    tl = Timeline(origin=origin) if origin is not None else None
    x, y = _batch()
    with comm.meter() as cm:
        res = X.run_schedule(sched, stages, x, y, timeline=tl)
    events = [(e.name, e.category, e.t_start, e.t_end, e.meta) for e in res.events]
    return {"loss": res.loss, "grads": _owned_grads(model, stages), "comm": cm.summary(),
            "peak": res.peak_stashed, "stashed": res.stashed, "actions": res.actions, "events": events}


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
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))  # noqa: E731
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
    res = X.run_schedule(sched, X.local_stages(model, sched), *_batch(), memory=MemoryMeter(model))
    return res.peak_activation_bytes


def _errors():
    p = dist.get_world_size()
    model = GPT(_cfg(p))
    sched = S.gpipe(p, 4)
    stages = X.local_stages(model, sched)
    out = {}
    for case, call in {
        "batch": lambda: X.run_schedule(sched, stages, *(t[:10] for t in _batch())),
        "world": lambda: X.run_schedule(S.gpipe(p + 1, 4), stages, *_batch()),
        "chunks": lambda: X.run_schedule(sched, {1: stages[0]}, *_batch()),
    }.items():
        try:
            call()
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    return out


def _posting_order(name, v):
    """This rank's step recorded (ops, messages, action marks): where each receive is posted, where waited."""
    from minitorch_dist.analysis.workload import WorkloadRecorder
    p = dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p))
    sched = _schedule(name, p, 2 * p, v)
    stages = X.local_stages(model, sched)
    X.run_schedule(sched, stages, *_batch())  # the recorder's own warm-up
    with WorkloadRecorder() as rec:
        marks = type("Marks", (), {"events": [], "span": staticmethod(rec.span)})()  # the executor's timeline
        X.run_schedule(sched, stages, *_batch(), timeline=marks)
    return [(type(i).__name__, getattr(i, "op", None) or getattr(i, "name", None) or i.ref,
             getattr(i, "edge", None)) for i in rec.items]  # an Op's "op" is None: its name


def _run_every_case(origin):
    p, res = dist.get_world_size(), {}
    for name, v in AVAILABLE:
        for tied in (True, False):
            res[name, tied] = _ours(name, v, 2 * p, tied, origin=origin if tied else None)
        for m in (p, 4 * p):  # how the stash grows with m
            res[name, "m", m] = _ours(name, v, m, tied=False)
    for name in TORCH_SCHEDULES:
        res["torch", name] = _torch(name, 2 * p)
    for name in ("gpipe", "1f1b"):
        res["memory", name] = _memory(name, 4 * p)
    res["errors"] = _errors()
    res["posting"] = _posting_order("1f1b", 1)
    return res


@functools.cache
def _results(p):
    return launch(_run_every_case, p, time.monotonic(), timeout_s=120)


# --- single-process reference (one thread, like a rank) -------------------------------------------


@functools.cache
def _reference(p, tied):
    with single_thread():
        torch.manual_seed(SEED)
        model = GPT(_cfg(p, tied))
        _, loss = model(*_batch())
        loss.backward()
        return loss.item(), {k: q.grad.clone() for k, q in model.named_parameters()}


def _gathered(per_rank, key):
    """Every rank's gradients in one dict; a parameter held by two ranks must agree bit for bit."""
    out = {}
    for r, res in enumerate(per_rank):
        for k, g in res[key]["grads"].items():
            if k in out:
                assert torch.equal(out[k], g), f"{key}: ranks disagree on {k}"
            out[k] = g
    return out


def _assert_grads(got, want, where):
    assert got.keys() == want.keys(), f"{where}: {sorted(set(want) ^ set(got))}"
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=ATOL, rtol=RTOL, msg=lambda s: f"{where}, {k}: {s}")


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
    per_rank = _results(p)
    key = (name, tied)
    _assert_grads(_gathered(per_rank, key), grads, f"{name} p={p} tied={tied}")
    last = (p * v - 1) % p
    assert per_rank[last][key]["loss"] == pytest.approx(loss, abs=1e-6)
    assert all(res[key]["loss"] is None for r, res in enumerate(per_rank) if r != last)
    for m in (p, 4 * p):  # other microbatch counts, untied
        _assert_grads(_gathered(per_rank, (name, "m", m)), _reference(p, False)[1], f"{name} p={p} m={m}")


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_equals_torch_distributed_pipelining(p, name):
    if (name, TORCH_SCHEDULES[name][1]) not in AVAILABLE:
        pytest.skip(f"schedule {name} not written yet")
    per_rank = _results(p)
    ours, theirs = _gathered(per_rank, (name, False)), _gathered(per_rank, ("torch", name))
    _assert_grads(ours, theirs, f"ours vs torch {TORCH_SCHEDULES[name][0]}, p={p}")
    last = (p * TORCH_SCHEDULES[name][1] - 1) % p
    assert per_rank[last][name, False]["loss"] == pytest.approx(per_rank[last]["torch", name]["loss"],
                                                                abs=1e-6)


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
    per_rank, m = _results(p), 2 * p
    act_bytes = (B // m) * T * H * 4  # one microbatch's hidden states, float32
    want = costmodel.pipeline_p2p_bytes(p, m, act_bytes, v)
    for tied in (True, False):
        cs = [res[name, tied]["comm"] for res in per_rank]
        for op in ("send", "recv"):
            assert sum(c[op]["bytes"] for c in cs) == want, (op, tied)
            assert sum(c[op]["calls"] for c in cs) == 2 * m * (p * v - 1), (op, tied)
        # tied embeddings: one all-reduce of V*H floats between the first and the last stage, only there
        reduced = [c.get("all_reduce", {}).get("bytes", 0) for c in cs]
        assert reduced == ([V * H * 4] + [0] * (p - 2) + [V * H * 4] if tied else [0] * p), reduced


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", AVAILABLE, ids=[n for n, _ in AVAILABLE])
def test_stashed_microbatches_match_simulator_and_cost_model(p, name, v):
    per_rank = _results(p)
    for m in (p, 2 * p, 4 * p):
        key = (name, False) if m == 2 * p else (name, "m", m)
        sched = _schedule(name, p, m, v)
        sim = SIM.simulate(sched).peak_stashed
        for r, res in enumerate(per_rank):
            got = res[key]["peak"]
            assert got == sim[r], (m, r)
            assert got == costmodel.pipeline_stashed_microbatches(name, p, m, stage=r, v=v), (m, r)
            assert res[key]["actions"] == [str(a) for a in sched[r]]
        if name == "1f1b":
            assert max(res[key]["peak"] for res in per_rank) <= p  # independent of m
        if name == "gpipe":
            assert all(res[key]["peak"] == m for res in per_rank)  # grows with m


@pytest.mark.parametrize("p", [2, 4])
def test_1f1b_saves_activation_memory_that_gpipe_keeps(p):
    """MemoryMeter's saved-activation peak per stage scales with the stashed microbatches:
    1F1B / GPipe = (p - r) / m on stage r (within 5%: the last stage also saves logits and the
    loss's softmax, and the tokens are one storage shared by all microbatches)."""
    m = 4 * p
    for r, res in enumerate(_results(p)):
        gpipe, one_f = res["memory", "gpipe"], res["memory", "1f1b"]
        want = (costmodel.pipeline_stashed_microbatches("1f1b", p, m, stage=r)
                / costmodel.pipeline_stashed_microbatches("gpipe", p, m, stage=r))
        assert one_f / gpipe == pytest.approx(want, rel=0.05), r


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name,v", AVAILABLE, ids=[n for n, _ in AVAILABLE])
def test_timeline_follows_the_schedule_and_its_dependencies(p, name, v):
    per_rank = _results(p)
    sched = _schedule(name, p, 2 * p, v)
    span = {}
    for r, res in enumerate(per_rank):
        ev = res[name, True]["events"]
        assert [e[0] for e in ev] == [str(a) for a in sched[r]]
        assert [e[1] for e in ev] == [a.kind for a in sched[r]]
        for (nm, kind, t0, t1, meta), a in zip(ev, sched[r]):
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
    for r, res in enumerate(_results(p)):
        items, acts = res["posting"], [str(a) for a in sched[r]]
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
    torch.testing.assert_close(dx, want_dx, atol=1e-7, rtol=1e-6)
    for k, q in stage.named_parameters():
        torch.testing.assert_close(q.grad, want[k], atol=1e-7, rtol=1e-6, msg=lambda s: f"{k}: {s}")


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
    for res in _results(p):
        err = res["errors"]
        assert "10 rows" in err["batch"] and "m=4" in err["batch"] and "multiple of m" in err["batch"]
        assert f"p={p + 1}" in err["world"] and f"{p} ranks" in err["world"]
        assert "chunk" in err["chunks"] and "local_stages" in err["chunks"]
