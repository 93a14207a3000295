"""Chapter 03 exercises, autograded: GPipe in rounds and 1F1B under a cap, the bubble of a timeline,
ZB-H1, ZB-V, an executor that picks its own order on ranks, and the messages of a step.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: small hand-derived schedules, the library's
own schedules (``parallelism.pipeline.schedules``: GPipe, 1F1B, naive, ZB-H1; a capped 1F1B is the
library's 1F1B of its last stages), its discrete-event simulator (timing, dependency order, stashed
activations), ``runtime.timeline.bubble_fraction``, the formulas of ``costmodel``, and PyTorch's
``ScheduleZBVZeroBubble`` order. For the executor: one process running the whole GPT on the whole
batch, and ``torch.distributed.pipelining``'s ``Schedule1F1B`` on the same ranks; for the messages
and the measured bubble, the comm meter and a ``Timeline`` listening to a real step of the library's
executor.

Ranks are launched three times in all: the executor on 2 and on 4 ranks, the real step on 4. Checks
of bad input first make a valid call, so a stub fails them too.

Tolerances (see tests/_support.py). Schedules, orders, counts and bytes are exact. Bubble fractions,
idle times and makespans are sums of at most a few hundred float64 durations on both sides:
pytest.approx's default rel 1e-6 is far above their k·u (< 1e-13) and far below a schedule's smallest
difference (one slot of one stage, >= 1e-3 of the step here). The real step's bubble is compared
with the timeline module's on the same events: the same sums, so the same rel 1e-6.

The executor runs in float64 (the model and its messages in torch's default dtype, which the test
sets). Its gradients and loss are the same GPT computed in another grouping (the microbatches: a
weight gradient's sum over N = ROWS·SEQ = 256 rows in m parts; the mean loss likewise), GPT_DEPTH =
6 per layer + 2 chained reductions: ``model_bound(n=N, depth=GPT_DEPTH, scale)``, scale the size of
the tensor compared (under 1e-9 of it). A lost or doubled microbatch moves a gradient by 1/m of it
(1/8 or 1/4).
"""
import functools
import random
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.costmodel import pipeline as v_costs
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.models.gpt import GPT, GPTConfig
from minitorch_dist.parallelism.pipeline import schedules
from minitorch_dist.parallelism.pipeline.schedules import Action, Schedule
from minitorch_dist.parallelism.pipeline.simulator import check_dependencies, simulate
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.launch import launch
from minitorch_dist.runtime.timeline import Event, Timeline, bubble_fraction

from _support import close, float64, model_bound, refusal

pytestmark = pytest.mark.ch03

SIZES = [(1, 1), (1, 4), (2, 1), (2, 3), (3, 2), (3, 5), (4, 4), (4, 8), (5, 3), (6, 12)]


def _strings(schedule: Schedule) -> list[list[str]]:
    return [[str(a) for a in acts] for acts in schedule.stages]


def _as_schedule(name: str, stages, m: int) -> Schedule:
    """A Schedule from per-stage lists of "F3" / "B3" / "W3" strings, checked for their form."""
    acts = []
    for r, stage in enumerate(stages):
        assert isinstance(stage, list), f"stage {r}: return a list per stage, got {type(stage).__name__}"
        for a in stage:
            assert isinstance(a, str) and a[:1] in ("F", "B", "W") and a[1:].isdigit(), \
                f"stage {r}: actions are strings like 'F3', 'B3', 'W3'; got {a!r}"
        acts.append(tuple(Action(a[0], int(a[1:])) for a in stage))
    return Schedule(name, len(stages), m, 1, tuple(acts))


# --- 1. gpipe_rounds_schedule ---------------------------------------------------------------------


def test_gpipe_rounds_schedule_hand_worked(ex):
    # an uneven last round: 5 microbatches in rounds of 2, 2, 1
    assert ex.gpipe_rounds_schedule(2, 5, 2) == [
        ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3", "F4", "B4"]] * 2
    assert ex.gpipe_rounds_schedule(3, 3, 1) == [["F0", "B0", "F1", "B1", "F2", "B2"]] * 3
    assert ex.gpipe_rounds_schedule(1, 1, 1) == [["F0", "B0"]]
    assert ex.gpipe_rounds_schedule(2, 3, 5) == [["F0", "F1", "F2", "B0", "B1", "B2"]] * 2


@pytest.mark.parametrize("p,m", SIZES)
def test_gpipe_rounds_schedule_of_one_round_is_gpipe(ex, p, m):
    for k in (m, m + 3):
        got = ex.gpipe_rounds_schedule(p, m, k)
        assert len(got) == p, f"one list per stage: {p} lists, got {len(got)}"
        assert got == _strings(schedules.gpipe(p, m)), f"k={k} >= m={m}: one round, plain GPipe"
    got[0].append("X")  # stages must not share one list
    assert all(stage[-1] != "X" for stage in got[1:]), \
        "every stage needs its own list (not p references to one)"


ROUNDS = [(2, 3, 2), (4, 8, 3), (4, 8, 4), (3, 7, 2), (5, 6, 4), (4, 5, 1), (3, 4, 9)]


@pytest.mark.parametrize("p,m,k", ROUNDS)
def test_gpipe_rounds_schedule_stashes_k_and_pays_a_fill_per_round(ex, p, m, k):
    stages = ex.gpipe_rounds_schedule(p, m, k)
    sched = _as_schedule("gpipe-rounds", stages, m)
    schedules.validate_structure(sched)  # one F and one B per microbatch, in that order
    check_dependencies(sched)
    sim = simulate(sched, t_f=1.0, t_b=2.0, t_w=0.0)
    assert sim.peak_stashed == [min(k, m)] * p, f"peak stash per stage {sim.peak_stashed}, the cap is {k}"
    # a round starts when the one before has drained: each is a GPipe of its own (Huang et al. §2.2)
    sizes = [min(k, m - s) for s in range(0, m, k)]
    assert sim.makespan == pytest.approx(sum((mj + p - 1) * 3.0 for mj in sizes))


def test_gpipe_rounds_schedule_rejects_bad_input(ex):
    ex.gpipe_rounds_schedule(2, 2, 1)  # a valid call first
    with pytest.raises(ValueError, match="k must be"):
        ex.gpipe_rounds_schedule(2, 2, 0)


# --- 2. one_f_one_b_capped --------------------------------------------------------------------------


def _last_stages_of_1f1b(p, m, cap, r):
    """Independent reference: under a cap c <= p, stage r runs what stage r - (p - c) of a c-stage 1F1B
    runs (its first stages, which the cap binds, all run that of stage 0)."""
    c = min(cap, p)
    return _strings(schedules.one_f_one_b(c, m))[max(0, r - (p - c))]


def test_one_f_one_b_capped_hand_worked(ex):
    steady = ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "B5"]
    assert ex.one_f_one_b_capped(4, 6, 2) == [steady, steady, steady,
                                              ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4",
                                               "F5", "B5"]]
    # fewer microbatches than stages and a loose cap: the warm-up is cut to m forwards
    assert ex.one_f_one_b_capped(4, 2, 8) == [
        ["F0", "F1", "B0", "B1"],
        ["F0", "F1", "B0", "B1"],
        ["F0", "F1", "B0", "B1"],
        ["F0", "B0", "F1", "B1"],
    ]


@pytest.mark.parametrize("p,m", SIZES)
def test_one_f_one_b_capped_matches_the_library_at_the_ends(ex, p, m):
    assert ex.one_f_one_b_capped(p, m, p) == _strings(schedules.one_f_one_b(p, m)), "cap = p: plain 1F1B"
    assert ex.one_f_one_b_capped(p, m, p + 2) == _strings(schedules.one_f_one_b(p, m)), "a loose cap: 1F1B"
    assert ex.one_f_one_b_capped(p, m, 1) == _strings(schedules.naive(p, m)), "cap = 1: one at a time"
    for cap in range(1, p + 1):
        assert ex.one_f_one_b_capped(p, m, cap) == [_last_stages_of_1f1b(p, m, cap, r) for r in range(p)], \
            f"cap={cap}"


@pytest.mark.parametrize("p,m", SIZES)
def test_one_f_one_b_capped_holds_exactly_what_the_cap_allows(ex, p, m):
    makespans = []
    for cap in range(1, p + 2):
        stages = ex.one_f_one_b_capped(p, m, cap)
        for r, acts in enumerate(stages):
            in_flight = peak = 0  # in list order: microbatches whose F has run and whose B has not
            for a in acts:
                in_flight += 1 if a[0] == "F" else -1
                peak = max(peak, in_flight)
            assert peak == min(p - r, cap, m), \
                f"cap={cap}, stage {r}: {peak} in flight, expected min(p-r, cap, m) = {min(p - r, cap, m)}"
        sched = _as_schedule("1f1b-capped", stages, m)
        schedules.validate_structure(sched)
        check_dependencies(sched)
        sim = simulate(sched, t_f=1.0, t_b=2.0, t_w=0.0)
        assert sim.peak_stashed == [min(p - r, cap, m) for r in range(p)]
        makespans.append(sim.makespan)
    assert makespans[0] == pytest.approx(m * p * 3.0), "cap = 1: one microbatch in the pipe at a time"
    assert all(a >= b - 1e-9 for a, b in zip(makespans, makespans[1:])), \
        f"a looser cap may not make the step longer: {makespans}"
    assert makespans[-1] == pytest.approx((m + p - 1) * 3.0), "uncapped: 1F1B's (m+p-1)(t_F+t_B)"


def test_one_f_one_b_capped_rejects_bad_input(ex):
    ex.one_f_one_b_capped(2, 2, 1)  # a valid call first
    with pytest.raises(ValueError, match="cap must be"):
        ex.one_f_one_b_capped(2, 2, 0)

# --- 3. bubble_from_timeline ----------------------------------------------------------------------


def test_bubble_from_timeline_hand_worked(ex):
    two = [Event(0, "a", None, 0.0, 2.0), Event(1, "b", None, 1.0, 3.0)]
    assert ex.bubble_from_timeline(two, 2) == pytest.approx(1 / 3)  # T = 3, busy 2 + 2
    # overlapping and nested spans count once: stage 0 busy [0, 3) = 3, stage 1 [1, 2) + [3, 4) = 2
    nested = [Event(0, "step", None, 0.0, 3.0), Event(0, "F0", None, 0.5, 1.0),
              Event(0, "B0", None, 2.0, 3.0), Event(1, "F0", None, 1.0, 2.0),
              Event(1, "B0", None, 3.0, 4.0), Event(1, "F1", None, 1.5, 1.75)]
    assert ex.bubble_from_timeline(nested, 2) == pytest.approx(1 - 5 / 8)
    # a stage with no events idles the whole step; the window starts at the first event, not 0
    assert ex.bubble_from_timeline([Event(0, "F0", None, 10.0, 12.0)], 3) == pytest.approx(2 / 3)


def test_bubble_from_timeline_matches_the_timeline_module_on_random_events(ex):
    rng = random.Random(3)
    for _ in range(200):
        p = rng.randrange(1, 6)
        events = []
        for _ in range(rng.randrange(1, 25)):
            s = rng.uniform(-5, 20)
            events.append(Event(rng.randrange(p), "x", None, s, s + rng.choice([0.0, rng.uniform(0, 6)])))
        if max(e.t_end for e in events) <= min(e.t_start for e in events):
            continue
        assert ex.bubble_from_timeline(events, p) == pytest.approx(bubble_fraction(events, ranks=range(p)))


@pytest.mark.parametrize("name,p,m", [("gpipe", 2, 3), ("gpipe", 4, 8), ("1f1b", 4, 4), ("1f1b", 3, 6)])
def test_bubble_from_timeline_of_a_simulation_is_the_formula(ex, name, p, m):
    make = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}[name]
    sim = simulate(make(p, m), t_f=1.0, t_b=1.5, t_w=0.5)
    got = ex.bubble_from_timeline(sim.events, p)
    assert got == pytest.approx(costmodel.pipeline_bubble_fraction(name, p, m))
    assert got == pytest.approx(sim.bubble_fraction)


def test_bubble_from_timeline_of_a_real_step(ex, counted_sends):
    """A 1F1B step of the library's executor on 4 ranks, as a Timeline heard it: the spans the executor
    announced, on each rank's own clock from one origin."""
    events = [e for c in counted_sends for e in c[1]["events"]]
    assert {e.rank for e in events} == set(range(4)), "every rank recorded its step"
    assert {f"F{i}" for i in range(COUNT_M)} <= {e.name for e in events}, "the executor's actions, heard"
    got = ex.bubble_from_timeline(events, 4)
    assert got == pytest.approx(bubble_fraction(events, ranks=range(4)))
    assert 0 < got < 1, "a real pipeline idles, and not all the time"


def test_bubble_from_timeline_with_unequal_stages(ex):
    # the events as given, not the schedule: with p2p latency the bubble grows beyond the formula
    sim = simulate(schedules.one_f_one_b(3, 5), t_f=1.0, t_b=2.0, t_w=1.0, p2p=0.25)
    busy = sum(sim.busy)
    assert ex.bubble_from_timeline(sim.events, 3) == pytest.approx(1 - busy / (3 * sim.makespan))
    assert ex.bubble_from_timeline(sim.events, 3) > costmodel.pipeline_bubble_fraction("1f1b", 3, 5)


# --- 4. zb_h1_from_1f1b ---------------------------------------------------------------------------


def test_zb_h1_from_1f1b_hand_worked(ex):
    assert ex.zb_h1_from_1f1b(_strings(schedules.one_f_one_b(2, 3))) == [
        ["F0", "F1", "B0", "W0", "F2", "B1", "W1", "B2", "W2"],
        ["F0", "B0", "F1", "B1", "W0", "F2", "B2", "W1", "W2"],
    ]
    # one stage: nothing to wait for, every W right after its B
    assert ex.zb_h1_from_1f1b([["F0", "B0", "F1", "B1"]]) == [["F0", "B0", "W0", "F1", "B1", "W1"]]


@pytest.mark.parametrize("p,m", [(p, m) for p, m in SIZES if m >= p])  # the library's zb_h1 needs m >= p
def test_zb_h1_from_1f1b_matches_the_library(ex, p, m):
    assert ex.zb_h1_from_1f1b(_strings(schedules.one_f_one_b(p, m))) == _strings(schedules.zb_h1(p, m))


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_from_1f1b_keeps_1f1b_and_adds_each_w_after_its_b(ex, p, m):
    one_f_one_b = _strings(schedules.one_f_one_b(p, m))
    zb = ex.zb_h1_from_1f1b([list(s) for s in one_f_one_b])
    assert len(zb) == p
    for r, (old, new) in enumerate(zip(one_f_one_b, zb)):
        assert [a for a in new if a[0] != "W"] == old, f"stage {r}: F and B must keep their 1F1B order"
        ws = [a for a in new if a[0] == "W"]
        assert ws == [f"W{i}" for i in range(m)], \
            f"stage {r}: one W per microbatch, in microbatch order; got {ws}"
        for i in range(m):
            assert new.index(f"W{i}") > new.index(f"B{i}"), f"stage {r}: W{i} must come after B{i}"
    check_dependencies(_as_schedule("zb-h1", zb, m))  # every stage can run its list: no deadlock


@pytest.mark.parametrize("p,m", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (5, 9)])
@pytest.mark.parametrize("t_f,t_b,t_w", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.7), (2.0, 1.0, 1.0), (1.0, 1.0, 0.5)])
def test_zb_h1_from_1f1b_idles_as_the_paper_says(ex, p, m, t_f, t_b, t_w):
    zb = ex.zb_h1_from_1f1b(_strings(schedules.one_f_one_b(p, m)))
    sim = simulate(_as_schedule("zb-h1", zb, m), t_f=t_f, t_b=t_b, t_w=t_w)
    expected = costmodel.zb_h1_idle_time(p, t_f, t_b, t_w)
    assert sim.idle == pytest.approx([expected] * p), f"idle per stage {sim.idle}, Qi et al. §3.1: {expected}"
    # against 1F1B on the same durations (its backward unsplit): (p-1)(t_F+t_B+t_W), less by 2(p-1)t_W
    base = simulate(schedules.one_f_one_b(p, m), t_f=t_f, t_b=t_b, t_w=t_w)
    assert [b - z for b, z in zip(base.idle, sim.idle)] == pytest.approx([2 * (p - 1) * t_w] * p)


@pytest.mark.parametrize("p,m", SIZES)
def test_zb_h1_from_1f1b_stays_in_the_memory_of_1f1b(ex, p, m):
    # the peak over the devices is 1F1B's (stage 0 holds p); no stage may hold more
    zb = ex.zb_h1_from_1f1b(_strings(schedules.one_f_one_b(p, m)))
    sim = simulate(_as_schedule("zb-h1", zb, m))
    base = simulate(schedules.one_f_one_b(p, m))
    assert (max(sim.peak_stashed) == max(base.peak_stashed)
            == costmodel.pipeline_stashed_microbatches("1f1b", p, m, 0))


def test_zb_h1_from_1f1b_on_random_sizes_matches_the_library_and_the_cost_models_stash(ex):
    # 50 seeded (p, m), m < p included. The library's zb_h1 refuses m < p; a stage's lag does not
    # depend on m, so there the expected lists are its schedule of p microbatches with microbatches
    # m.. left out. Everywhere, no deadlock and every stage's peak stash the cost model's
    # pipeline_stashed_microbatches("zb-h1", ...), min(p, m) on every stage (lists and counts: exact)
    rng = random.Random(304)
    for _ in range(50):
        p = rng.randint(1, 8)
        m = rng.randint(1, 3 * p)
        zb = ex.zb_h1_from_1f1b(_strings(schedules.one_f_one_b(p, m)))
        library = [[str(a) for a in acts if a.mb < m] for acts in schedules.zb_h1(p, max(p, m)).stages]
        assert zb == library, f"p={p}, m={m}: not the library's ZB-H1" + (" of p, cut to m" if m < p else "")
        sim = simulate(_as_schedule("zb-h1", zb, m))  # raises on a deadlock
        expected = [costmodel.pipeline_stashed_microbatches("zb-h1", p, m, r) for r in range(p)]
        assert list(sim.peak_stashed) == expected, f"p={p}, m={m}: peak stash per stage"


def test_zb_h1_from_1f1b_idles_as_the_cost_model_says_on_random_durations(ex):
    # 50 seeded (p, m >= p) and durations in the formula's regime t_W <= min(t_F, t_B); the idle is a
    # difference of sums of at most a few hundred float64 durations (module docstring: rel 1e-6)
    rng = random.Random(305)
    for _ in range(50):
        p = rng.randint(2, 7)
        m = rng.randint(p, 3 * p)
        t_f, t_b = rng.uniform(0.5, 2.0), rng.uniform(0.5, 2.0)
        t_w = rng.uniform(0.1, min(t_f, t_b))
        zb = ex.zb_h1_from_1f1b(_strings(schedules.one_f_one_b(p, m)))
        sim = simulate(_as_schedule("zb-h1", zb, m), t_f=t_f, t_b=t_b, t_w=t_w)
        expected = costmodel.zb_h1_idle_time(p, t_f, t_b, t_w)
        assert sim.idle == pytest.approx([expected] * p), \
            f"p={p}, m={m}, t=({t_f:.3f}, {t_b:.3f}, {t_w:.3f}): idle {sim.idle}, model {expected}"


# --- 5. v_stage and zbv_actions_any_m ----------------------------------------------------------------

V_SIZES = [(1, 1), (1, 3), (2, 3), (2, 4), (3, 5), (3, 9), (4, 7), (4, 8), (4, 13), (5, 12)]


def test_v_stage_hand_worked(ex):
    assert [ex.v_stage(4, r, 0) for r in range(4)] == [0, 1, 2, 3]
    assert [ex.v_stage(4, r, 1) for r in range(4)] == [7, 6, 5, 4]
    assert [ex.v_stage(1, 0, c) for c in (0, 1)] == [0, 1]


@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
def test_v_stage_matches_the_library_and_covers_every_stage_once(ex, p):
    sched = schedules.zb_v(p, 2 * p)
    got = {(r, c): ex.v_stage(p, r, c) for r in range(p) for c in (0, 1)}
    assert got == {(r, c): sched.virtual_stage(r, c) for r in range(p) for c in (0, 1)}
    assert sorted(got.values()) == list(range(2 * p))
    # neighbours in the model are on neighbouring ranks, and the turn (p-1 -> p) stays on rank p-1
    rank_of = {s: r for (r, _), s in got.items()}
    assert all(abs(rank_of[s] - rank_of[s + 1]) <= 1 for s in range(2 * p - 1))
    assert rank_of[p - 1] == rank_of[p] == p - 1 and rank_of[0] == rank_of[2 * p - 1] == 0


def test_v_stage_matches_the_library_on_random_placements(ex):
    # 50 seeded (p, rank, chunk) against the library's V (its ZB-V schedule's virtual_stage), and 50
    # seeded stages through its inverse, placement: ints, exact
    rng = random.Random(306)
    v_of = functools.lru_cache(maxsize=None)(lambda p: schedules.zb_v(p, 2 * p - 1))
    for _ in range(50):
        p = rng.randint(1, 24)
        rank, chunk = rng.randrange(p), rng.randrange(2)
        want = v_of(p).virtual_stage(rank, chunk)
        assert ex.v_stage(p, rank, chunk) == want, f"p={p}, rank={rank}, chunk={chunk}: the V has {want}"
        s = rng.randrange(2 * p)
        assert ex.v_stage(p, *v_of(p).placement(s)) == s, f"p={p}: stage {s} is not where the V puts it"


def test_zbv_actions_any_m_hand_worked(ex):
    assert ex.zbv_actions_any_m(2, 3, 0) == ("F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 "
                                            "B0 W0 F2.1 B2.1 W2.1 B1 W1 B2 W2").split()
    assert ex.zbv_actions_any_m(2, 3, 1) == ("F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 "
                                            "F2.1 B1.1 W1.1 B1 B2.1 B2 W1 W2.1 W2").split()
    # fewer microbatches than the published order needs (2p - 1 = 5): the actions that cannot run left out
    assert ex.zbv_actions_any_m(3, 2, 0) == "F0 F1 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 B1 W1".split()
    assert ex.zbv_actions_any_m(3, 2, 2) == "F0 F0.1 F1 F1.1 B0.1 W0.1 B0 B1.1 B1 W0 W1.1 W1".split()


def _zbv(ex, p, m) -> Schedule:
    """All ranks' lists of the student's ZB-V as a Schedule on the V placement."""
    stages = []
    for r in range(p):
        acts = ex.zbv_actions_any_m(p, m, r)
        assert isinstance(acts, list) and all(isinstance(a, str) for a in acts), \
            f"rank {r}: return a list of strings like 'F3' and 'W3.1'"
        stages.append(tuple(Action(a[0], int(a[1:].split(".")[0]), int("." in a)) for a in acts))
    return Schedule("zbv", p, m, 2, tuple(stages), layout="v")


@pytest.mark.parametrize("p,m", V_SIZES)
def test_zbv_actions_any_m_equal_pytorchs_order(ex, p, m):
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble
    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    short = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    for r in range(p):
        want = [f"{short[a.computation_type.name]}{a.microbatch_index}" + ("" if a.stage_index == r else ".1")
                for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(me, r) if a is not None]
        assert ex.zbv_actions_any_m(p, m, r) == want, f"rank {r}"


@pytest.mark.parametrize("p,m", V_SIZES)
def test_zbv_actions_any_m_run_without_deadlock_and_idle_only_the_start_up(ex, p, m):
    sched = _zbv(ex, p, m)
    schedules.validate_structure(sched)  # one F, B, W per microbatch and chunk, in that order
    check_dependencies(sched)
    sim = simulate(sched)  # t_F = t_B = t_W = 1
    assert sim.idle == pytest.approx([v_costs.v_shape_min_idle(p, 1.0)] * p)  # the V's start-up, no more
    assert sim.bubble_fraction == pytest.approx(v_costs.pipeline_bubble_fraction("zbv", p, m))
    assert sim.peak_stashed == [p] * p  # 1F1B's peak (its stage 0), on every rank
    base = simulate(schedules.one_f_one_b(p, m))
    assert max(sim.peak_stashed) == max(base.peak_stashed)


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zbv_actions_any_m_with_fewer_microbatches_than_the_v_needs(ex, p):
    full = simulate(schedules.zb_v(p, 2 * p - 1)).makespan  # the least m the published order takes
    for m in range(1, 2 * p - 1):
        sched = _zbv(ex, p, m)
        schedules.validate_structure(sched)  # every microbatch once per kind and chunk, in order
        check_dependencies(sched)
        sim = simulate(sched)
        assert max(sim.peak_stashed) <= min(p, m), f"p={p}, m={m}: stashes {sim.peak_stashed}"
        assert sim.makespan <= full, f"p={p}, m={m}: {sim.makespan} > {full}, the step with m = 2p - 1"


# --- 6. run_stage_budgeted: the executor on ranks ---------------------------------------------------

ROWS, SEQ, VOCAB, WIDTH, SEED = 16, 16, 64, 32, 3
CFG = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=4, n_head=2, n_embd=WIDTH, tie_embeddings=False)


def _batch():
    return MarkovCorpus(VOCAB, seed=0).batch(0, ROWS, SEQ)


@functools.cache
def _one_process():
    """The whole GPT on the whole batch in this process, in float64: the loss and every gradient."""
    with float64():
        torch.manual_seed(SEED)
        model = GPT(CFG)
        _, loss = model(*_batch())
        loss.backward()
        return loss.item(), {k: q.grad.clone() for k, q in model.named_parameters()}


def _stage_grads(stage):
    return {k: q.grad.clone() for k, q in stage.named_parameters() if q.grad is not None}


class _StashProbe(nn.Module):
    """The stage, watched: the order the executor runs forwards and backwards in ("F3" when the stage's
    forward runs on microbatch 3, "B3" when backward reaches its output), and at each forward how many
    earlier microbatches it still holds (their boundary tensor alive: the stage's output, or on the last
    rank its received input) and how many of those backward has already passed. After B i nothing of
    microbatch i is needed: a correct executor holds at most the one a local variable still names until
    its next action."""

    def __init__(self, stage: nn.Module, last: bool):
        super().__init__()
        self.stage, self.last = stage, last
        self.refs: list = []
        self.done: list[bool] = []
        self.order: list[str] = []
        self.alive: list[int] = []  # at each forward: earlier microbatches still held
        self.held: list[int] = []   # ... of which backward already ran

    def forward(self, x, *rest):
        live = [j for j, ref in enumerate(self.refs) if ref() is not None]
        self.alive.append(len(live))
        self.held.append(sum(self.done[j] for j in live))
        j = len(self.refs)
        self.order.append(f"F{j}")
        out = self.stage(x, *rest)
        self.refs.append(weakref.ref(x if self.last else out))
        self.done.append(False)

        def reached(g, j=j):
            self.done[j] = True
            self.order.append(f"B{j}")
        out.register_hook(reached)
        return out


def _student_step(fn, m, budget):
    """This rank's stage of a fresh GPT, the student's executor on it; losses, gradients, sends counted,
    the order and the microbatches it holds watched."""
    from minitorch_dist.parallelism.pipeline.executor import split_gpt
    p, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(SEED)
    stage = split_gpt(GPT(CFG), p)[r]
    probe = _StashProbe(stage, last=r == p - 1)
    x, y = _batch()
    with comm.meter() as meter:
        losses = fn(probe, list(x.chunk(m)), list(y.chunk(m)), stage.boundary_shape(ROWS // m, SEQ), budget)
    sends = [(e.op, e.nbytes) for e in meter.events if e.op != "recv"]
    return {"losses": list(losses), "grads": _stage_grads(stage), "sends": sends, "order": probe.order,
            "names": [k for k, _ in stage.named_parameters()], "alive": probe.alive, "held": probe.held}


def _torch_1f1b(m):
    """The same step with torch.distributed.pipelining's Schedule1F1B on the same ranks."""
    import torch.distributed.pipelining as pp

    from minitorch_dist.parallelism.pipeline.executor import split_gpt
    p, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(SEED)
    stage = split_gpt(GPT(CFG), p)[r]
    loss_fn = lambda logits, y: F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
    sched = pp.Schedule1F1B(pp.PipelineStage(stage, r, p, torch.device("cpu")), m, loss_fn=loss_fn)
    x, y = _batch()
    sched.step(*([x] if r == 0 else []), target=y if r == p - 1 else None)
    return _stage_grads(stage)


#: (m, budget): a loose budget (1F1B), a tight one, one at a time
RUNS = [(8, 8), (4, 2), (4, 1)]


def _executor_on_ranks(fn):
    """On every rank, in float64: two refused calls, then the student's executor on each (m, budget),
    then torch's Schedule1F1B with the first run's m."""
    out = {"bad": [refusal(lambda: fn(None, [None] * 2, [None] * 3, (1,), 2)),
                   refusal(lambda: fn(None, [None] * 2, [None] * 2, (1,), 0))]}
    with float64():
        for m, budget in RUNS:
            out[m, budget] = _student_step(fn, m, budget)
        out["torch"] = _torch_1f1b(RUNS[0][0])
    return out


@pytest.fixture(scope="module")
def executor_runs(ex, launches):
    """`executor_runs(p)`: every RUN on p ranks, and torch's Schedule1F1B with m = 8."""
    return launches(_executor_on_ranks, ex.run_stage_budgeted, timeout_s=90)


EXECUTOR_CASES = [(p, m, b) for p in (2, 4) for m, b in RUNS]
N_ROWS = ROWS * SEQ  # the longest reduction: a weight gradient's (or the mean loss's) sum over every token
GPT_DEPTH = 6 * CFG.n_layer + 2  # chained reductions: 6 per block, the final LayerNorm and the head


def _bound(want):
    """The GPT computed in another grouping, in float64 (the module docstring)."""
    scale = want.abs().max().item() if torch.is_tensor(want) else abs(want)
    return model_bound(n=N_ROWS, depth=GPT_DEPTH, scale=max(1.0, scale))


@pytest.mark.parametrize("p, m, budget", EXECUTOR_CASES)
def test_run_stage_budgeted_drops_each_microbatch_after_its_backward(executor_runs, p, m, budget):
    """The budget is the point: rank r holds at most min(p − r, budget, m) microbatches."""
    for r, out in enumerate(executor_runs(p)):
        got = out[m, budget]
        assert len(got["alive"]) == m, f"rank {r}: the stage ran {len(got['alive'])} forwards, expected {m}"
        assert max(got["held"]) <= 1, \
            f"rank {r}: at its forwards it still held {got['held']} microbatches whose backward " \
            "had run; drop what a forward kept once its backward is done"
        bound = min(p - r, budget, m)
        assert max(got["alive"]) <= bound, \
            f"rank {r}, budget {budget}: held {max(got['alive'])} microbatches at once; the limit is {bound}"


@pytest.mark.parametrize("p, m, budget", EXECUTOR_CASES)
def test_run_stage_budgeted_runs_the_order_its_budget_allows(executor_runs, p, m, budget):
    """1F1B's order under the cap (the library's 1F1B of the last min(budget, p) stages), decided by
    each rank alone."""
    for r, out in enumerate(executor_runs(p)):
        want = _last_stages_of_1f1b(p, m, budget, r)
        assert out[m, budget]["order"] == want, \
            f"rank {r} of {p}, m={m}, budget={budget}: ran {out[m, budget]['order']}, expected {want}"


@pytest.mark.parametrize("p, m, budget", EXECUTOR_CASES)
def test_run_stage_budgeted_equals_one_process(executor_runs, p, m, budget):
    ref_loss, ref = _one_process()
    ranks = [out[m, budget] for out in executor_runs(p)]
    seen = [k for rk in ranks for k in rk["names"]]
    assert sorted(seen) == sorted(ref), "the stages together hold every parameter of the model, once"
    for r, rk in enumerate(ranks):
        assert set(rk["grads"]) == set(rk["names"]), f"rank {r}: every parameter of its stage has a gradient"
        for k, g in rk["grads"].items():
            # the same sums in other groupings: far below a lost or doubled microbatch (~1/m)
            close(g, ref[k], _bound(ref[k]), f"rank {r}: gradient of {k}")
    *middle, last = ranks
    assert all(rk["losses"] == [] for rk in middle), "only the last rank returns losses"
    assert len(last["losses"]) == m, f"the last rank returns the {m} microbatch losses"
    mean = sum(last["losses"]) / m
    assert abs(mean - ref_loss) <= _bound(ref_loss), f"mean microbatch loss {mean}, {ref_loss}"


@pytest.mark.parametrize("p", [2, 4])
def test_run_stage_budgeted_equals_pytorch_pipelining(executor_runs, p):
    for r, out in enumerate(executor_runs(p)):
        theirs, ours = out["torch"], out[RUNS[0]]["grads"]
        assert set(theirs) == set(ours), f"rank {r}"
        for k in theirs:
            close(ours[k], theirs[k], _bound(theirs[k]), f"rank {r}: {k} vs torch's Schedule1F1B")


@pytest.mark.parametrize("p, m, budget", EXECUTOR_CASES)
def test_run_stage_budgeted_sends_activations_and_gradients_point_to_point(executor_runs, p, m, budget):
    act = (ROWS // m) * SEQ * WIDTH * 8  # one microbatch's hidden states, float64 (the test's dtype)
    for r, out in enumerate(executor_runs(p)):
        sends = out[m, budget]["sends"]
        assert all(op == "send" for op, _ in sends), f"rank {r}: only point-to-point sends, got {set(sends)}"
        want = m * ((r < p - 1) + (r > 0))  # activations forward unless last, gradients back unless first
        assert len(sends) == want, f"rank {r}: {len(sends)} sends, expected {want}"
        assert all(nbytes == act for _, nbytes in sends), f"rank {r}: every message is one activation"


@pytest.mark.parametrize("p", [2, 4])
def test_run_stage_budgeted_rejects_bad_input(executor_runs, p):
    for r, out in enumerate(executor_runs(p)):
        assert out[RUNS[0]]["grads"], "the valid call ran"
        uneven, no_budget = out["bad"]
        assert uneven is not None and "target" in uneven, f"p={p} rank {r}: 2 inputs, 3 targets refused"
        assert no_budget is not None and "budget" in no_budget, f"p={p} rank {r}: a budget of 0 is refused"

# --- 7. predict_pipeline_sends: the messages of a step ----------------------------------------------


@pytest.mark.parametrize("p, m, v", [(2, 4, 1), (4, 8, 1), (4, 8, 2), (8, 32, 1), (8, 32, 4), (3, 6, 3)])
def test_predict_pipeline_sends_adds_up_to_the_step(ex, p, m, v):
    act = 1536
    got = ex.predict_pipeline_sends(p, m, act, v)
    assert len(got["messages"]) == len(got["bytes"]) == p
    assert sum(got["bytes"]) == costmodel.pipeline_p2p_bytes(p, m, act, v), \
        "every boundary, twice per microbatch"
    assert sum(got["messages"]) == 2 * m * (p * v - 1)
    # the two ends: the first rank sends no gradient of its first chunk, the last no activation of its last
    assert got["messages"][0] == got["messages"][-1] == m * (2 * v - 1)
    assert all(k == 2 * m * v for k in got["messages"][1:-1]), "a middle rank: both ways, every chunk"
    assert got["bytes"] == [k * act for k in got["messages"]]


def test_predict_pipeline_sends_one_rank_sends_nothing(ex):
    assert ex.predict_pipeline_sends(1, 4, 100, 1) == {"messages": [0], "bytes": [0]}
    assert ex.predict_pipeline_sends(1, 4, 100, 2) == {"messages": [0], "bytes": [0]}  # handed over in memory


COUNT_M = 4


def _count_library_sends(origin):
    """This rank's sends in a real 1F1B step and a real interleaved step (v = 2) of the chapter's executor,
    and the 1F1B step's timeline: a Timeline listening to the executor, one clock for all ranks
    (CLOCK_MONOTONIC from the parent's ``origin``)."""
    from minitorch_dist.parallelism.pipeline import executor as X
    from minitorch_dist.parallelism.pipeline import schedules as sch
    p, out = dist.get_world_size(), {}
    for name, v in (("1f1b", 1), ("interleaved", 2)):
        torch.manual_seed(SEED)
        cfg = GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=p * v, n_head=2, n_embd=WIDTH,
                        tie_embeddings=False)
        sched = sch.make_schedule(name, p, COUNT_M, v)
        tl = Timeline(origin=origin)
        with comm.meter() as meter, observe.watching(tl):
            X.run_schedule(sched, X.local_stages(GPT(cfg), sched), *_batch())
        out[v] = {"messages": meter.calls["send"], "bytes": meter.bytes["send"], "events": list(tl.events)}
    return out


@pytest.fixture(scope="module")
def counted_sends():
    """A real 1F1B step and a real interleaved step on 4 ranks: sends counted, the timeline recorded."""
    return launch(_count_library_sends, 4, time.monotonic(), timeout_s=90)


@pytest.mark.parametrize("v", [1, 2])
def test_predict_pipeline_sends_counted_on_ranks(ex, counted_sends, v):
    act = (ROWS // COUNT_M) * SEQ * WIDTH * 4
    got = ex.predict_pipeline_sends(4, COUNT_M, act, v)
    assert got["messages"] == [c[v]["messages"] for c in counted_sends], "messages sent per rank"
    assert got["bytes"] == [c[v]["bytes"] for c in counted_sends], "bytes sent per rank"


def test_predict_pipeline_sends_rejects_bad_input(ex):
    ex.predict_pipeline_sends(2, 2, 10)  # a valid call first
    with pytest.raises(ValueError, match="v must be"):
        ex.predict_pipeline_sends(2, 2, 10, 0)
    with pytest.raises(ValueError, match="activation_bytes"):
        ex.predict_pipeline_sends(2, 2, -1)
