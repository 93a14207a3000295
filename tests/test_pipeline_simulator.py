"""The pipeline simulator against the costmodel's formulas and against closed forms derived here;
dependency checking on hand-made bad schedules; PipeDream / 2BW weight versions.

Tolerances. The simulator's times are sums of durations along chains of events, the formulas a handful
of float64 operations; they are compared at FORMULA = rel 1e-12 or abs 1e-10, whichever is larger. A
simulated time is a chain of at most k = 2E additions (E <= 192 events here: interleaved, p = 4, m = 8,
v = 3; each with its hop), so it is within γ_k·makespan of exact (makespan <= 351 here, naive at p = 5,
m = 9, latency 3: 3·γ_400·351 ≈ 5e-11 at most); an idle time (makespan - busy) within twice that, a
fraction or ratio of times within 3γ_k + u (< 1e-12), a formula within ~10u relatively. Durations in
quarters make every sum exact; 1/3 (a chunk of v = 3) and 0.1, 0.3, 0.7 (latencies) do not. One action
more or less moves a time by its duration (>= 0.1) and a bubble fraction by ~1/(m + p): far outside.
The dependency checks' inequalities allow the same abs 1e-10 (SLACK) for a time rounded on each side.
"""
from __future__ import annotations

import itertools

import pytest

from minitorch_dist import costmodel
from minitorch_dist.parallelism.pipeline import schedules
from minitorch_dist.parallelism.pipeline.pipedream import weight_versions
from minitorch_dist.parallelism.pipeline.schedules import Action, Schedule
from minitorch_dist.parallelism.pipeline.simulator import COLORS, check_dependencies, gantt, simulate

pytestmark = pytest.mark.ch03

FORMULA = dict(rel=1e-12, abs=1e-10)  # the simulator against a formula (module docstring)
SLACK = FORMULA["abs"]  # a dependency's times, each rounded along its chain
FLUSHED = {"gpipe": schedules.gpipe, "1f1b": schedules.one_f_one_b}
SWEEP = [(p, m) for p in range(1, 6) for m in range(1, 10)]


def _needs(name):
    if not hasattr(schedules, name):
        pytest.skip(f"schedules.{name} is not implemented yet")
    return getattr(schedules, name)


def _hand(name, p, m, *lists):
    """A schedule written by hand: lists of action strings like "F0", "B1", "W0"."""
    stages = tuple(tuple(Action(s[0], int(s[1:])) for s in acts.split()) for acts in lists)
    return Schedule(name, p, m, 1, stages)


# --- bubbles --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(FLUSHED))
@pytest.mark.parametrize("t", [(1.0, 1.0, 1.0), (1.0, 2.0, 0.0), (0.5, 1.0, 0.25)])
def test_flushed_bubble_matches_costmodel(name, t):
    t_f, t_b, t_w = t
    for p, m in SWEEP:
        sim = simulate(FLUSHED[name](p, m), t_f, t_b, t_w)
        assert sim.bubble_fraction == pytest.approx(
            costmodel.pipeline_bubble_fraction(name, p, m), **FORMULA), (p, m)
        # The closed form behind it: m + p - 1 slots of one whole forward+backward.
        assert sim.makespan == pytest.approx((m + p - 1) * (t_f + t_b + t_w), **FORMULA), (p, m)
        assert sim.busy == pytest.approx([m * (t_f + t_b + t_w)] * p, **FORMULA)
        assert sim.idle == pytest.approx([sim.makespan - b for b in sim.busy], **FORMULA)


def test_naive_bubble_is_all_but_one_stage():
    # One microbatch in flight: the stages take turns, so only one of p is ever busy.
    t_f, t_b = 1.0, 2.0
    for p, m in SWEEP:
        sim = simulate(schedules.naive(p, m), t_f, t_b, t_w=0.0)
        assert sim.makespan == pytest.approx(m * p * (t_f + t_b), **FORMULA)
        assert sim.bubble_fraction == pytest.approx((p - 1) / p, **FORMULA)


def test_interleaved_bubble_matches_costmodel():
    interleaved = _needs("interleaved_1f1b")
    t_f, t_b, t_w = 1.0, 2.0, 0.0
    for p, v, k in itertools.product(range(2, 5), range(1, 4), (1, 2)):
        m = k * p  # Megatron-LM's interleaving wants m divisible by p
        sim = simulate(interleaved(p, m, v), t_f, t_b, t_w)
        assert sim.bubble_fraction == pytest.approx(
            costmodel.pipeline_bubble_fraction("interleaved", p, m, v), **FORMULA), (p, m, v)
        # The paper's relative form: bubble time over ideal time = (p-1)/(v m).
        assert sum(sim.idle) / sum(sim.busy) == pytest.approx(
            costmodel.pipeline_bubble_ratio("interleaved", p, m, v), **FORMULA)
        # A chunk takes 1/v of the stage's time.
        f = next(e for e in sim.events if e.category == "F")
        assert f.duration == pytest.approx(t_f / v, **FORMULA)


def test_zb_h1_bubble_matches_costmodel():
    zb_h1 = _needs("zb_h1")
    for p in range(2, 6):
        for m in range(p, p + 4):
            sched = zb_h1(p, m)
            assert sched.splits_backward
            sim = simulate(sched, 1.0, 1.0, 1.0)
            assert sim.bubble_fraction == pytest.approx(
                costmodel.pipeline_bubble_fraction("zb-h1", p, m), **FORMULA), (p, m)
            # Qi et al. 2024 §3.1: every stage idles (p-1)(t_F + t_B - t_W), for t_W <= t_F + t_B.
            for t in [(1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5)]:
                sim = simulate(sched, *t)
                assert sim.idle == pytest.approx([costmodel.zb_h1_idle_time(p, *t)] * p, **FORMULA), (p, m, t)


# --- stashed activations --------------------------------------------------------------------

@pytest.mark.parametrize("name,fn", [("naive", schedules.naive)] + sorted(FLUSHED.items()))
def test_peak_stashed_matches_costmodel(name, fn):
    for p, m in SWEEP:
        sim = simulate(fn(p, m))
        expected = [costmodel.pipeline_stashed_microbatches(name, p, m, stage=r) for r in range(p)]
        assert sim.peak_stashed == pytest.approx(expected, **FORMULA), (name, p, m)


def test_interleaved_peak_stashed_matches_costmodel():
    interleaved = _needs("interleaved_1f1b")
    for p, v, k in itertools.product(range(2, 5), range(1, 4), (1, 2)):
        m = k * p
        sim = simulate(interleaved(p, m, v))
        expected = [costmodel.pipeline_stashed_microbatches("interleaved", p, m, stage=r, v=v)
                    for r in range(p)]
        assert sim.peak_stashed == pytest.approx(expected, **FORMULA), (p, m, v)
    # One chunk per rank is plain 1F1B (Megatron-LM falls back to it), stash included, any m.
    for p, m in SWEEP:
        expected = [costmodel.pipeline_stashed_microbatches("1f1b", p, m, stage=r) for r in range(p)]
        assert simulate(interleaved(p, m, 1)).peak_stashed == pytest.approx(expected, **FORMULA), (p, m)


def test_zb_h1_peak_stashed_matches_costmodel():
    # A microbatch stays stashed until its W; deferring W raises every stage to 1F1B's worst
    # stage, and no higher (Qi et al. 2024 §3.1: same peak memory as 1F1B).
    zb_h1 = _needs("zb_h1")
    for p in range(2, 6):
        for m in range(p, p + 4):
            peak = simulate(zb_h1(p, m)).peak_stashed
            expected = [costmodel.pipeline_stashed_microbatches("zb-h1", p, m, stage=r) for r in range(p)]
            assert peak == pytest.approx(expected, **FORMULA), (p, m)
            one_f = simulate(schedules.one_f_one_b(p, m)).peak_stashed
            assert max(peak) == pytest.approx(max(one_f), **FORMULA)


def test_gpipe_stash_grows_with_m_1f1b_stays_bounded():
    p = 4
    gpipe = [max(simulate(schedules.gpipe(p, m)).peak_stashed) for m in range(1, 13)]
    ofob = [max(simulate(schedules.one_f_one_b(p, m)).peak_stashed) for m in range(1, 13)]
    assert gpipe == list(range(1, 13))
    assert all(b <= p for b in ofob) and ofob[-1] == p


# --- latency and the event model ------------------------------------------------------------

def test_p2p_latency_lengthens_gpipe_by_two_hops_per_boundary():
    # Critical path: F down p stages and B back up, each of the 2(p-1) boundaries crossed once.
    t_f, t_b = 1.0, 2.0
    for p, m in SWEEP:
        for lat in (0.0, 0.1, 0.7, 3.0):
            sim = simulate(schedules.gpipe(p, m), t_f, t_b, t_w=0.0, p2p=lat)
            want = (m + p - 1) * (t_f + t_b) + 2 * (p - 1) * lat
            assert sim.makespan == pytest.approx(want, **FORMULA), (p, m, lat)
            naive = simulate(schedules.naive(p, m), t_f, t_b, t_w=0.0, p2p=lat)
            assert naive.makespan == pytest.approx(m * (p * (t_f + t_b) + 2 * (p - 1) * lat), **FORMULA)


def test_events_respect_dependencies_and_stage_order():
    # Re-check the timing rules on the events themselves, for every known schedule.
    scheds = [schedules.naive(4, 8), schedules.gpipe(4, 8), schedules.one_f_one_b(4, 8)]
    if hasattr(schedules, "interleaved_1f1b"):
        scheds.append(schedules.interleaved_1f1b(4, 8, 2))
    if hasattr(schedules, "zb_h1"):
        scheds.append(schedules.zb_h1(4, 8))
    lat = 0.3
    for sched in scheds:
        sim = simulate(sched, 1.0, 1.5, 0.5, p2p=lat)
        at = {(e.rank, e.name): e for e in sim.events}
        assert len(sim.events) == sum(len(s) for s in sched.stages)
        for r in range(sched.p):
            evs = [at[(r, str(a))] for a in sched[r]]
            assert all(a.t_end <= b.t_start + SLACK for a, b in zip(evs, evs[1:]))  # in order, one at a time
            for a, e in zip(sched[r], evs):
                assert e.category == a.kind and e.meta == {"mb": a.mb, "chunk": a.chunk}
                s = sched.virtual_stage(r, a.chunk)
                if a.kind == "F" and s > 0:
                    pr, pc = sched.placement(s - 1)
                    assert e.t_start >= at[(pr, str(Action("F", a.mb, pc)))].t_end + lat - SLACK
                if a.kind == "B" and s < sched.p * sched.v - 1:
                    nr, nc = sched.placement(s + 1)
                    assert e.t_start >= at[(nr, str(Action("B", a.mb, nc)))].t_end + lat - SLACK
        assert sim.makespan == pytest.approx(max(e.t_end for e in sim.events), **FORMULA)


def test_split_backward_times_b_and_w_separately():
    sched = _hand("split", 2, 2, "F0 F1 B0 B1 W0 W1", "F0 F1 B0 W0 B1 W1")
    assert sched.splits_backward
    sim = simulate(sched, t_f=1.0, t_b=2.0, t_w=0.5)
    dur = {e.category: e.duration for e in sim.events}
    assert dur == pytest.approx({"F": 1.0, "B": 2.0, "W": 0.5}, **FORMULA)
    assert sim.busy == pytest.approx([2 * 3.5] * 2, **FORMULA)
    # a microbatch stays stashed until its W: both are held when F1 starts on either stage
    assert sim.peak_stashed == [2.0, 2.0]


# --- invalid schedules ----------------------------------------------------------------------

def test_check_dependencies_accepts_the_library_schedules():
    for p, m in SWEEP:
        for fn in (schedules.naive, schedules.gpipe, schedules.one_f_one_b):
            check_dependencies(fn(p, m))
    if hasattr(schedules, "SCHEDULES"):
        for name in schedules.SCHEDULES:
            check_dependencies(schedules.make_schedule(name, 4, 8, v=2 if name == "interleaved" else 1))


def test_deadlock_names_the_stuck_stages():
    # Stage 0 waits for B0 before sending F1; stage 1 needs F1 before it runs B0.
    bad = _hand("bad", 2, 2, "F0 B0 F1 B1", "F0 F1 B0 B1")
    with pytest.raises(ValueError, match="deadlock") as err:
        check_dependencies(bad)
    msg = str(err.value)
    assert "stage 0 is stuck at B0" in msg and "B0 on stage 1" in msg
    assert "stage 1 is stuck at F1" in msg and "F1 on stage 0" in msg
    with pytest.raises(ValueError, match="deadlock"):
        simulate(bad)


def test_backward_before_own_forward_is_a_deadlock():
    bad = _hand("bad", 1, 1, "B0 F0")
    with pytest.raises(ValueError, match="stage 0 itself runs later"):
        check_dependencies(bad)


def test_missing_duplicate_and_out_of_range_actions():
    with pytest.raises(ValueError, match="missing B1 on stage 1"):
        check_dependencies(_hand("short", 2, 2, "F0 F1 B0 B1", "F0 F1 B0"))
    with pytest.raises(ValueError, match="F1 2 times"):
        check_dependencies(_hand("twice", 1, 2, "F0 F1 F1 B0 B1"))
    with pytest.raises(ValueError, match="outside microbatches 0..1"):
        check_dependencies(_hand("range", 1, 2, "F0 F1 F2 B0 B1 B2"))
    with pytest.raises(ValueError, match="missing W1 on stage 0"):  # split on one mb, not the other
        check_dependencies(_hand("halfsplit", 1, 2, "F0 F1 B0 W0 B1"))
    with pytest.raises(ValueError, match="2 stage lists for p=3"):
        check_dependencies(Schedule("p", 3, 1, 1, schedules.gpipe(2, 1).stages))
    with pytest.raises(ValueError, match="t_f must be a duration >= 0"):
        simulate(schedules.gpipe(2, 2), t_f=-1.0)


# --- PipeDream weight versions --------------------------------------------------------------

def test_pipedream_stashes_p_minus_r_versions():
    for p, m in [(1, 3), (2, 2), (3, 4), (4, 4), (5, 3)]:
        wv = weight_versions(p, m, steps=4, policy="pipedream")
        assert wv.max_versions == [p - r for r in range(p)], (p, m)
        for r in range(p):
            n = len(wv.forward_version[r])
            assert wv.backward_version[r] == wv.forward_version[r]
            # W(t+1) = W(t) - lr grad f(W(t - (p-r-1))): microbatch j sees j - (p-r-1) updates
            assert wv.staleness[r] == [min(j, p - r - 1) for j in range(n)], (p, r)
        # Without stashing every stage but the last would run backwards on newer weights.
        assert all(k > 0 for k in wv.unstashed_mismatches[:-1]) and wv.unstashed_mismatches[-1] == 0


def test_2bw_keeps_two_versions_with_one_step_delay():
    for p, m in [(2, 2), (3, 3), (3, 5), (4, 4), (4, 8)]:
        wv = weight_versions(p, m, steps=4, policy="2bw")
        assert wv.max_versions == [2] * p, (p, m)
        for r in range(p):
            assert wv.backward_version[r] == wv.forward_version[r]
            # batch b computes its gradient at W(b-1): W(t+1) = W(t) - lr grad f(W(t-1))
            assert wv.forward_version[r] == [max(j // m - 1, 0) for j in range(4 * m)], (p, m, r)
            assert wv.staleness[r] == [min(j // m, 1) for j in range(4 * m)]
        # The same version on every stage for a given microbatch (unlike PipeDream's).
        assert all(fv == wv.forward_version[0] for fv in wv.forward_version)
    assert weight_versions(1, 3, policy="2bw").max_versions == [1]  # no pipeline, no delay


def test_weight_versions_rejects_bad_input():
    with pytest.raises(ValueError, match="m >= p"):
        weight_versions(4, 2, policy="2bw")
    with pytest.raises(ValueError, match="unknown policy"):
        weight_versions(2, 2, policy="hogwild")
    with pytest.raises(ValueError, match="steps must be a positive int"):
        weight_versions(2, 2, steps=0)


# --- plotting -------------------------------------------------------------------------------

def test_gantt_colours_by_kind():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgba

    sim = simulate(_hand("split", 2, 2, "F0 F1 B0 B1 W0 W1", "F0 F1 B0 W0 B1 W1"), 1.0, 2.0, 0.5)
    ax = gantt(sim)
    bars = [b for b in ax.patches]
    assert len(bars) == len(sim.events)
    assert {to_rgba(b.get_facecolor()) for b in bars} == {to_rgba(c) for c in COLORS.values()}
    assert ax.get_xlim()[1] >= sim.makespan  # x axis in the simulation's own time units
    assert "bubble" in ax.get_title()
    plt.close(ax.figure)
