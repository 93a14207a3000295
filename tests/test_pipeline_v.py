"""Chapter 03, zero bubble in a V: ZB-V (Qi et al. 2024 §6) and DualPipeV (DeepSeek-V3 §3.2.1).

The orders are PyTorch's (``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``); the simulator's bubble and
stash match the papers' formulas (DeepSeek-V3 Table 2, the ZB-V claims) in their regimes; on 2 and 4
gloo ranks the executor computes the single process's gradients and torch.distributed.pipelining's,
sends the bytes the cost model says, stashes what the simulator says, and waits for both inputs of an
overlapped F&B pair before running it.

Expected values come from elsewhere: a single-process GPT backward on the whole batch, torch's own
schedules on the same ranks, ``costmodel`` formulas (papers), the simulator's replay.

Tolerances (derived in tests/_support.py). The steps on ranks run in float64 and are bounded as in
tests/test_pipeline.py: a sum of m microbatch gradients in another order, at most N = max(B·T, 4H) =
256 terms each, 6 deep per block + 2 through the GPT of 2p blocks: ``model_bound``, scaled by each
tensor's size (at least 1), 1.5e-9 to 3e-9; a lost or doubled microbatch moves a gradient by ~1/m of
itself. Bytes are counted for float64 (ELEM = 8 bytes an element). The simulator's times are sums of
durations that are multiples of 1/8 (quarters, halved for a V's chunks), far below 2^53/8: every sum
and difference is exact in float64; the papers' formulas are a handful of float64 operations (~10u
relatively, u = 1.1e-16), a bubble fraction one division more on each side. So the simulator and the
formulas are compared at rel = abs = 1e-12 (FORMULA): a bubble of one action too many moves a time by
1/8 or more and a fraction by ~1/(m + p).
"""
import functools
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from minitorch_dist.analysis.pipeline_observers import StashCounter
from minitorch_dist.costmodel import pipeline as cm
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.pipeline import executor as X
from minitorch_dist.parallelism.pipeline import schedules as S
from minitorch_dist.parallelism.pipeline import simulator as SIM
from minitorch_dist.parallelism.pipeline.actions import Action, Schedule
from minitorch_dist.parallelism.pipeline.messages import Messages
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.runtime.launch import launch

from _support import case, close, float64, model_bound, run_cases

pytestmark = [pytest.mark.ch03, pytest.mark.timeout(300)]

B, T, V, H = 16, 16, 64, 32  # global batch rows, sequence length, vocab, width
SEED = 3
N = max(B * T, 4 * H)  # the longest reduction: a weight gradient sums B·T rows
ELEM = 8  # bytes of a float64 element: the steps on ranks run in float64
FORMULA = dict(rel=1e-12, abs=1e-12)  # the simulator against a formula: exact sums, one division (docstring)
NAMES = ("zbv", "dualpipev")
HALF_SPLIT = (Action("F", 0), Action("B", 0), Action("W", 0), Action("F", 1), Action("B", 1))
TORCH = {"zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


def _cfg(p, tied=True):
    return GPTConfig(vocab_size=V, block_size=T, n_layer=2 * p, n_head=2, n_embd=H, tie_embeddings=tied)


# --- the orders are PyTorch's -----------------------------------------------------------------------

_TORCH_KIND = {"FORWARD": ("F", None), "BACKWARD_INPUT": ("B", True), "FULL_BACKWARD": ("B", False),
               "BACKWARD_WEIGHT": ("W", None)}


def _torch_order(order):
    """torch's per-rank compute actions as (kind, mb, stage, split, overlapped); None slots dropped."""
    out = []
    for a in order:
        if a is None:
            continue
        for sub in a.sub_actions or (a,):
            kind, split = _TORCH_KIND[sub.computation_type.name]
            out.append((kind, sub.microbatch_index, sub.stage_index, split, a.sub_actions is not None))
    return out


def _our_order(s, r):
    pairs = set(s.overlapped[r]) if s.overlapped else set()
    paired = pairs | {i + 1 for i in pairs}
    return [(a.kind, a.mb, s.virtual_stage(r, a.chunk), s.split(r, a.mb, a.chunk) if a.kind == "B" else None,
             i in paired) for i, a in enumerate(s[r])]


def test_orders_equal_torch_for_many_p_and_m():
    """torch's schedule classes compute each rank's list from (p, m) alone; ask them directly."""
    from torch.distributed.pipelining import schedules as TS
    n = 0
    for p in range(1, 7):
        for name in NAMES:
            least = cm.v_min_microbatches(name, p)
            for m in range(least, 4 * p + 3):
                me = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
                s = S.make_schedule(name, p, m)
                for r in range(p):
                    want = _torch_order(getattr(TS, TORCH[name])._calculate_single_rank_operations(me, r))
                    assert _our_order(s, r) == want, (name, p, m, r)
                n += 1
    assert n > 100


def test_worked_examples_and_placement():
    z = S.zb_v(2, 3)
    assert z.table() == ("stage 0 | F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 F2.1 B2.1 W2.1 B1 W1 B2 W2\n"
                         "stage 1 | F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 B1 B2.1 B2 W1 W2.1 W2")
    d = S.dualpipe_v(2, 4)
    assert d.overlapped == ((7, 9, 12), (6, 8, 10)) and d.mixed_backward
    assert [str(a) for a in d[1][6:12]] == ["F2.1", "B0", "F3", "B1.1", "F3.1", "B1"]
    assert not d.split(1, 0, 0) and d.split(1, 3, 0) and not d.split(0, 1, 1)  # whole, split, whole
    for s in (z, d):
        assert s.layout == "v" and s.v == 2
        p = s.p
        assert [s.virtual_stage(r, c) for c in (0, 1) for r in range(p)] == [0, 1, 3, 2]
        assert all(s.placement(s.virtual_stage(r, c)) == (r, c) for r in range(p) for c in (0, 1))
    # Megatron's loop is unchanged: chunk c of rank r is virtual stage c*p + r
    assert S.interleaved_1f1b(2, 4, 2).virtual_stage(1, 1) == 3


# --- the simulator against the papers' formulas ------------------------------------------------------


def test_zbv_bubble_and_memory():
    """Qi et al. 2024 §6: zero bubble at t_F = t_B = t_W beyond the V's start-up, and 1F1B's peak
    activation memory, on every rank alike."""
    for p in range(1, 9):
        for m in range(2 * p - 1, 5 * p + 1):
            s = S.zb_v(p, m)
            S.validate_structure(s)
            SIM.check_dependencies(s)
            sim = SIM.simulate(s)  # t = 1
            least = cm.v_shape_min_idle(p, 1.0)  # the least possible
            assert sim.idle == pytest.approx([least] * p, **FORMULA), (p, m)
            assert sim.bubble_fraction == pytest.approx(cm.pipeline_bubble_fraction("zbv", p, m), **FORMULA)
            one_f = SIM.simulate(S.one_f_one_b(p, m)).peak_stashed
            assert sim.peak_stashed == [p] * p == [cm.pipeline_stashed_microbatches("zbv", p, m, r)
                                                   for r in range(p)]
            assert max(sim.peak_stashed) == max(one_f)  # "the same activation memory as 1F1B"
            if m >= p:  # and never more idle than ZB-H1, a third of 1F1B's
                assert max(sim.idle) < max(SIM.simulate(S.zb_h1(p, m)).idle) or p == 1


def test_zbv_idle_formula_in_its_regime():
    rng = random.Random(0)
    for _ in range(150):
        t_b = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0])
        t_f = rng.choice([x / 4 for x in range(1, 13) if x / 4 <= t_b])
        t_w = rng.choice([x / 4 for x in range(0, 13) if x / 4 <= t_b])
        p = rng.randint(1, 7)
        m = rng.randint(2 * p - 1, 5 * p)
        sim = SIM.simulate(S.zb_v(p, m), t_f, t_b, t_w)
        want = cm.zbv_idle_time(p, t_f, t_b, t_w)
        assert sim.idle == pytest.approx([want] * p, **FORMULA), (p, m, t_f, t_b, t_w)
    with pytest.raises(ValueError, match="t_f <= t_b and t_w <= t_b"):
        cm.zbv_idle_time(4, 2.0, 1.0, 1.0)


def test_dualpipev_bubble_is_deepseek_table_2():
    """DeepSeek-V3 Table 2: DualPipe idles (PP/2 - 1)(F&B + B - 3W); DualPipeV is PP = 2p chunks on p
    ranks. With the pair run back to back (F&B = F + B) the simulator agrees where t_F = t_B >= t_W."""
    rng = random.Random(1)
    for _ in range(150):
        t_b = rng.choice([0.5, 1.0, 1.5, 2.0, 3.0])
        t_w = rng.choice([x / 4 for x in range(0, 13) if x / 4 <= t_b])
        p = rng.randint(1, 7)
        m = rng.randint(2 * p, 5 * p)
        sim = SIM.simulate(S.dualpipe_v(p, m), t_b, t_b, t_w)
        f, b_full, w = t_b / 2, (t_b + t_w) / 2, t_w / 2
        want = cm.dualpipe_idle_time(2 * p, f + b_full, b_full, w)  # the table's formula, chunk times
        assert sim.idle == pytest.approx([want] * p, **FORMULA), (p, m, t_b, t_w)
        assert want == pytest.approx(cm.dualpipev_idle_time(p, t_b, t_b, t_w), **FORMULA)
    for p in (2, 4, 8):
        for m in (2 * p, 3 * p, 8 * p):
            sim = SIM.simulate(S.dualpipe_v(p, m))
            assert sim.idle == pytest.approx([p - 1.0] * p, **FORMULA)  # t = 1: ZB-H1's (p-1) t, twice ZB-V's
            bubble = cm.pipeline_bubble_fraction("dualpipev", p, m)
            assert sim.bubble_fraction == pytest.approx(bubble, **FORMULA)
            # "PP+1" activations per device: 2p + 1 chunks of half a rank's share
            want = [cm.pipeline_stashed_microbatches("dualpipev", p, m, r) for r in range(p)]
            assert sim.peak_stashed == [p + 0.5] * p == want


def test_a_pair_starts_when_both_inputs_are_there():
    """The simulator's pair rule: without it the replay would let the F of an F&B pair start before
    its B's gradient arrived, and DualPipeV would idle less than DeepSeek's formula says."""
    s = S.dualpipe_v(4, 8)
    times = SIM._replay(s, lambda r, a: 1.0, 0.0)
    n = 0
    for r in range(s.p):
        for i in s.overlapped[r]:
            f, b = s[r][i], s[r][i + 1]
            remote = [d for d in SIM._dependencies(s, r, b) if d[0] != r]  # none for the loss's chunk
            assert all(times[(r, f)][0] >= times[d][1] for d in remote), (r, f, b)
            n += len(remote)
    assert n >= 10
    unpaired = Schedule(s.name, s.p, s.m, s.v, s.stages, s.layout, s.mixed_backward)
    assert max(SIM.simulate(unpaired).idle) < max(SIM.simulate(s).idle)


def test_parameters_are_held_once_in_a_v():
    """DeepSeek-V3 Table 2 gives DualPipe 2× parameters per device; DualPipeV (and ZB-V) hold 1×: each
    block on exactly one rank, as many per rank as 1F1B puts there; the embedding and the head both
    on rank 0 (the two ends of the V)."""
    assert cm.pipeline_parameter_copies("dualpipe") == 2
    assert all(cm.pipeline_parameter_copies(n) == 1 for n in ("1f1b", "zb-h1", "zbv", "dualpipev"))
    for p in (2, 4):
        torch.manual_seed(SEED)
        model = GPT(_cfg(p))
        for name in NAMES:
            sched, one = S.make_schedule(name, p, 2 * p), S.one_f_one_b(p, 2 * p)
            owner = {}
            for r in range(p):
                for st in X.local_stages(model, sched, rank=r).values():
                    for k, q in st.named_parameters():
                        assert owner.setdefault(id(q), r) == r, f"{k} on ranks {owner[id(q)]} and {r}"
            blocks = {k: q for k, q in model.named_parameters() if k.startswith("blocks.")}
            assert {id(q) for q in blocks.values()} <= set(owner)
            for r in range(p):
                mine = sum(q.numel() for q in blocks.values() if owner[id(q)] == r)
                theirs = sum(q.numel() for k, q in X.local_stages(model, one, rank=r)[0].named_parameters()
                             if k.startswith("blocks."))
                assert mine == theirs == sum(q.numel() for q in blocks.values()) // p
            assert owner[id(model.wte.weight)] == owner[id(model.lm_head.weight)] == 0


@pytest.mark.parametrize("name", NAMES)
def test_a_broken_v_order_is_a_clear_deadlock(name):
    s = S.make_schedule(name, 2, 4)
    acts = list(s[1])
    i, j = acts.index(Action("F", 0, 0)), acts.index(Action("F", 0, 1))
    acts[i], acts[j] = acts[j], acts[i]  # the turn of the V before the way down
    bad = Schedule(s.name, s.p, s.m, s.v, (s[0], tuple(acts)), s.layout, s.mixed_backward)
    with pytest.raises(ValueError, match=r"(?s)deadlocks.*stage 1 is stuck at F0\.1.*F0, which stage 1 "):
        SIM.check_dependencies(bad)


@pytest.mark.parametrize("call, match", [
    (lambda: S.zb_v(4, 6), r"ZB-V needs at least 7 microbatches for p=4 .*use m=7"),
    (lambda: S.dualpipe_v(4, 7), r"DualPipeV needs at least 8 microbatches for p=4 .*use m=8"),
    (lambda: S.make_schedule("zbv", 4, 8, v=3), r"exactly 2 chunks per rank.*leave v out"),
    (lambda: Schedule("x", 2, 2, 3, ((),) * 2, layout="v"), r"exactly 2 chunks per rank; got v=3, use v=2"),
    (lambda: Schedule("x", 2, 2, 2, ((),) * 2, layout="zigzag"), r"layout must be one of"),
    (lambda: cm.pipeline_bubble_fraction("dualpipev", 4, 6), r"needs m >= 8 .*use m=8"),
    (lambda: cm.dualpipe_idle_time(5, 1, 1, 1), r"even number of stages"),
    (lambda: S.validate_structure(Schedule("x", 1, 2, 1, (HALF_SPLIT,))), r"never runs W1"),  # not mixed
])
def test_bad_input_names_the_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_mixed_backward_allows_a_whole_b_beside_a_split_one():
    s = Schedule("x", 1, 2, 1, (HALF_SPLIT,), mixed_backward=True)
    S.validate_structure(s)
    sim = SIM.simulate(s, 1.0, 2.0, 0.5)
    assert sim.busy == [1 + 2 + 0.5 + 1 + 2.5]  # B0 split (2, then W 0.5), B1 whole (2.5)


# --- on ranks ------------------------------------------------------------------------------------------


def _batch(rows=B):
    return MarkovCorpus(V, seed=0).batch(0, rows, T)


def _owned_grads(model, stages):
    """This rank's gradients under the model's names (a tied weight under its first name)."""
    mine = {id(q) for s in stages.values() for q in s.parameters()}
    return {k: q.grad.clone() for k, q in model.named_parameters() if id(q) in mine}


def _ours(name, m, tied, rows=B):
    p = dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p, tied))
    sched = S.make_schedule(name, p, m)
    stages = X.local_stages(model, sched)
    log = []  # the executor's events in order: an action starting, a message waited for
    starts = SimpleNamespace(on_begin=lambda action, category, meta: log.append(("start", action)))
    stash = StashCounter()

    ready = Messages.ready

    def logged_ready(self, *key):
        log.append(("ready", key))
        return ready(self, *key)

    Messages.ready = logged_ready  # this rank's process only
    try:
        with comm.meter() as meter, observe.watching(starts), observe.watching(stash):
            res = X.run_schedule(sched, stages, *_batch(rows))
    finally:
        Messages.ready = ready
    return {"loss": res.loss, "grads": _owned_grads(model, stages), "comm": meter.summary(),
            "peak": stash.peak, "actions": res.actions, "log": log}


def _torch(name, m):
    """The same step with torch.distributed.pipelining's V schedule (untied: torch syncs no embeddings)."""
    import torch.distributed.pipelining as pp
    r, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = GPT(_cfg(p, tied=False))
    stages = X.split_gpt(model, 2 * p)
    mine = [stages[r], stages[2 * p - 1 - r]]  # the V: rank r holds stages r and 2p-1-r
    pstages = [pp.PipelineStage(s, s.index, 2 * p, torch.device("cpu")) for s in mine]
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
    sched = getattr(pp, TORCH[name])(pstages, m, loss_fn=loss_fn)
    x, y = _batch()
    losses = []
    sched.step(*([x] if r == 0 else []), target=y if r == 0 else None, losses=losses)  # both ends on rank 0
    return {"loss": float(sum(l.detach() for l in losses) / m) if losses else None,
            "grads": _owned_grads(model, dict(enumerate(mine))),
            "order": _torch_order(sched.pipeline_order[r])}


def _least_rows(p):
    """ZB-V's least m = 2p-1 must divide the batch: two rows per microbatch."""
    return 2 * (2 * p - 1)


def _run_every_case():
    p, cases = dist.get_world_size(), {}
    for name in NAMES:
        for tied in (True, False):
            cases[name, tied] = functools.partial(_ours, name, 2 * p, tied)
        cases[name, "torch"] = functools.partial(_torch, name, 2 * p)
    cases["zbv", "least"] = functools.partial(_ours, "zbv", 2 * p - 1, False, rows=_least_rows(p))
    cases["dualpipev", "more"] = functools.partial(_ours, "dualpipev", 4 * p, False)
    with float64():
        return run_cases(cases)


@functools.cache
def _results(p):
    return launch(_run_every_case, p, timeout_s=240)


def _case(p, key):
    """Each rank's value of case ``key`` on p ranks (a case that raised fails only its own tests)."""
    return [case(res, key, r) for r, res in enumerate(_results(p))]


@functools.cache
def _reference(p, tied, rows=B):
    """The single process on the same global batch (one thread, like a rank)."""
    with float64(), single_thread():
        torch.manual_seed(SEED)
        model = GPT(_cfg(p, tied))
        _, loss = model(*_batch(rows))
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


def _depth(p):
    return 6 * _cfg(p).n_layer + 2  # chained reductions: 6 per block, ln_f and lm_head


def _assert_grads(got, want, p, where):
    assert got.keys() == want.keys(), f"{where}: {sorted(set(want) ^ set(got))}"
    for k in want:
        close(got[k], want[k], model_bound(n=N, depth=_depth(p), scale=max(1.0, want[k].abs().max().item())),
              f"{where}, {k}")


def _assert_loss(got, want, p):
    bound = model_bound(n=N, depth=_depth(p), scale=max(1.0, abs(want)))
    assert abs(got - want) <= bound, f"loss {got} vs {want}: |diff| {abs(got - want):.3g} > bound {bound:.3g}"


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", NAMES)
def test_one_step_equals_one_process(p, tied, name):
    loss, grads = _reference(p, tied)
    per_rank = _case(p, (name, tied))
    _assert_grads(_gathered(p, (name, tied)), grads, p, f"{name} p={p} tied={tied}")
    _assert_loss(per_rank[0]["loss"], loss, p)  # the loss is on rank 0
    assert all(res["loss"] is None for res in per_rank[1:])


@pytest.mark.parametrize("p", [2, 4])
def test_other_microbatch_counts_equal_one_process(p):
    _assert_grads(_gathered(p, ("zbv", "least")), _reference(p, False, _least_rows(p))[1], p,
                  f"zbv p={p} m={2 * p - 1}")
    _assert_grads(_gathered(p, ("dualpipev", "more")), _reference(p, False)[1], p,
                  f"dualpipev p={p} m={4 * p}")


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_equals_torch_distributed_pipelining(p, name):
    _assert_grads(_gathered(p, (name, False)), _gathered(p, (name, "torch")), p,
                  f"ours vs torch {TORCH[name]}, p={p}")
    _assert_loss(_case(p, (name, False))[0]["loss"], _case(p, (name, "torch"))[0]["loss"], p)
    sched = S.make_schedule(name, p, 2 * p)
    for r, res in enumerate(_case(p, (name, "torch"))):  # the order torch ran is ours
        assert res["order"] == _our_order(sched, r)


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_point_to_point_bytes_match_the_cost_model(p, name):
    """2(p-1) messages each way per microbatch (the turn of the V is a hand-over on rank p-1): twice
    1F1B's bytes; and no all-reduce of a tied embedding, both of whose uses sit on rank 0."""
    m = 2 * p
    act_bytes = (B // m) * T * H * ELEM  # one microbatch's hidden states, float64
    for tied in (True, False):
        cs = [res["comm"] for res in _case(p, (name, tied))]
        for op in ("send", "recv"):
            assert sum(c[op]["bytes"] for c in cs) == cm.v_pipeline_p2p_bytes(p, m, act_bytes), (op, tied)
            assert sum(c[op]["calls"] for c in cs) == 4 * m * (p - 1), (op, tied)
        assert cm.v_pipeline_p2p_bytes(p, m, act_bytes) == 2 * cm.pipeline_p2p_bytes(p, m, act_bytes)
        assert [c.get("all_reduce", {}).get("bytes", 0) for c in cs] == [0] * p, tied


@pytest.mark.parametrize("p", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_stash_counted_by_the_executor_equals_the_simulator(p, name):
    for key, m in (((name, False), 2 * p), (("zbv", "least"), 2 * p - 1), (("dualpipev", "more"), 4 * p)):
        if key[0] != name:
            continue
        sched = S.make_schedule(name, p, m)
        sim = SIM.simulate(sched).peak_stashed
        for r, res in enumerate(_case(p, key)):
            assert res["actions"] == [str(a) for a in sched[r]], (key, r)
            assert res["peak"] == sim[r] == cm.pipeline_stashed_microbatches(name, p, m, r), (key, r)


@pytest.mark.parametrize("p", [2, 4])
def test_an_overlapped_pair_waits_for_both_inputs_before_its_forward(p):
    """DualPipe launches an F&B pair once both inputs are there: the executor waits for the B's
    gradient before the F starts (the simulator's pair rule); other receives wait at their own action."""
    sched = S.dualpipe_v(p, 2 * p)
    n_pairs = 0
    for r, res in enumerate(_case(p, ("dualpipev", True))):
        log = res["log"]
        starts = {a: i for i, (what, a) in enumerate(log) if what == "start"}
        for i in sched.overlapped[r]:
            f, b = sched[r][i], sched[r][i + 1]
            vs = sched.virtual_stage(r, b.chunk)
            if vs == 2 * p - 1 or sched.placement(vs + 1)[0] == r:
                continue  # the B's input is the loss, or a hand-over on this rank
            waited = log.index(("ready", (vs + 1, b.mb, vs, 1)))
            assert waited < starts[str(f)], (r, str(f), str(b))
            n_pairs += 1
    assert n_pairs >= p


def test_the_schedule_command_draws_both(capsys):
    from minitorch_dist.__main__ import main
    assert main(["schedule", "--name", "zbv", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(": ", 1)[1].split() for line in out.splitlines() if line.startswith("stage ")]
    assert len(rows) == 4 and rows[3][:5] == ["....", "....", "....", "F0", "F0.1"]  # the turn of the V
    assert f"bubble fraction {cm.pipeline_bubble_fraction('zbv', 4, 8):.3f}" in out
    assert "peak stashed microbatches per stage [4.0, 4.0, 4.0, 4.0]" in out
    assert main(["schedule", "--name", "dualpipev", "-p", "4", "-m", "8"]) == 0  # 2m-3p+r+1 pairs, last: -1
    out = capsys.readouterr().out
    assert "overlapped F&B pairs per stage [5, 6, 7, 7]" in out and "[4.5, 4.5, 4.5, 4.5]" in out
    assert main(["schedule", "--name", "dualpipev", "-p", "4", "-m", "6"]) == 2
    assert "use m=8 or more" in capsys.readouterr().err
