"""Pipeline schedules (chapter 03): golden orders from the papers' figures, structural validity
over a sweep, clear errors, and the simulated bubble / stash of each schedule against the
formulas in :mod:`minitorch_dist.costmodel`.

Tolerances. The simulator's times are sums of durations along chains of events, the formulas a handful
of float64 operations; they are compared at FORMULA = rel 1e-12 or abs 1e-10, whichever is larger. A
simulated time is a chain of at most k = 2E additions (E <= 384 events here: interleaved, p = 4,
m = 12, v = 4; each with its hop), so it is within γ_k·makespan of exact (makespan <= 100 here:
3·γ_800·100 ≈ 3e-11 at most); an idle time (makespan - busy) within twice that, a fraction or ratio of
times within 3γ_k + u (< 1e-12), a formula within ~10u relatively. Durations in halves make every sum
exact; 1/3 and 1/4 of them (chunks of v = 3, 4) need not. One action more or less moves a time by its
duration (>= 0.25) and a bubble fraction by ~1/(m + p): far outside.
"""
from __future__ import annotations

import pytest

from minitorch_dist import costmodel
from minitorch_dist.parallelism.pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    gpipe,
    interleaved_1f1b,
    make_schedule,
    naive,
    one_f_one_b,
    validate_structure,
    zb_h1,
)
from minitorch_dist.parallelism.pipeline.simulator import check_dependencies, simulate

pytestmark = pytest.mark.ch03

FORMULA = dict(rel=1e-12, abs=1e-10)  # the simulator against a formula (module docstring)


def rows(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in acts) for acts in schedule.stages]


# --- golden schedules, written out by hand from the papers' figures ---------------------------

GOLDEN = {
    # Naive model parallelism: one microbatch in flight, same list on every stage.
    ("naive", 2, 2, 1): ["F0 B0 F1 B1", "F0 B0 F1 B1"],
    # GPipe (Huang et al. 2019, Fig. 2c): all forwards, then all backwards.
    ("gpipe", 2, 3, 1): ["F0 F1 F2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"],
    # 1F1B (Megatron-LM Fig. 4 top): p-r-1 warm-up forwards, alternate, drain.
    ("1f1b", 3, 4, 1): [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ],
    # Interleaved 1F1B, p=2 m=4 v=2: groups of p=2 microbatches per chunk; warm-up
    # 2(p-r-1)+(v-1)p = 4 on stage 0, 2 on stage 1; backward enters at chunk 1.
    ("interleaved", 2, 4, 2): [
        "F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3",
        "F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3",
    ],
    # Interleaved 1F1B, p=4 m=8 v=2: Megatron-LM Fig. 4 (bottom), microbatches from 0.
    # Stage 0 warms up with 2*3 + 4 = 10 forwards, stage 3 with 4.
    ("interleaved", 4, 8, 2): [
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 F5 F6 B0.1 F7 B1.1 F4.1 B2.1 F5.1 B3.1 F6.1 B0 "
        "F7.1 B1 B2 B3 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 F3.1 F4 B0.1 F5 B1.1 F6 B2.1 F7 B3.1 F4.1 B0 F5.1 B1 "
        "F6.1 B2 F7.1 B3 B4.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4 B2.1 F5 B3.1 F6 B0 F7 B1 F4.1 B2 "
        "F5.1 B3 F6.1 B4.1 F7.1 B5.1 B6.1 B7.1 B4 B5 B6 B7",
        "F0 F1 F2 F3 F0.1 B0.1 F1.1 B1.1 F2.1 B2.1 F3.1 B3.1 F4 B0 F5 B1 F6 B2 F7 B3 "
        "F4.1 B4.1 F5.1 B5.1 F6.1 B6.1 F7.1 B7.1 B4 B5 B6 B7",
    ],
    # ZB-H1, p=2 m=4: stage 1 defers its W by one microbatch.
    ("zb-h1", 2, 4, 1): [
        "F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
        "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3",
    ],
    # ZB-H1, p=4 m=8: Qi et al. 2024 Fig. 3 (top), microbatches from 0.
    ("zb-h1", 4, 8, 1): [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ],
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=lambda k: "{}-p{}-m{}-v{}".format(*k))
def test_golden_schedules(key):
    name, p, m, v = key
    s = make_schedule(name, p, m, v)
    assert (s.name, s.p, s.m, s.v) == (name, p, m, v)
    assert rows(s) == GOLDEN[key], "\n" + s.table()


def test_action_str_and_table():
    assert str(Action("F", 3)) == "F3" and str(Action("B", 3, 1)) == "B3.1"
    assert gpipe(2, 2).table() == "stage 0 | F0 F1 B0 B1\nstage 1 | F0 F1 B0 B1"


# --- every schedule is a complete, runnable order --------------------------------------------

def _sweep():
    for p in range(1, 6):
        for m in range(1, 10):
            for name in ("naive", "gpipe", "1f1b"):
                yield name, p, m, 1
            if m >= p:
                yield "zb-h1", p, m, 1
            for v in (1, 2, 3):
                if v == 1 or m % p == 0:
                    yield "interleaved", p, m, v


def test_structure_and_dependencies_sweep():
    n = 0
    for name, p, m, v in _sweep():
        s = make_schedule(name, p, m, v)
        validate_structure(s)
        check_dependencies(s)  # no deadlock: every action's inputs are produced before it is due
        assert s.splits_backward == (name == "zb-h1")
        assert len(s.stages) == p
        per_stage = (3 if s.splits_backward else 2) * m * v
        assert all(len(acts) == per_stage for acts in s.stages)
        n += 1
    assert n > 150


def _bad(stages, m=1, v=1, name="bad"):
    return Schedule(name, len(stages), m, v, tuple(tuple(Action(*a) for a in acts) for acts in stages))


@pytest.mark.parametrize("stages, m, v, match", [
    ([[("F", 0), ("B", 0)], [("F", 0)]], 1, 1, r"stage 1 never runs B0"),
    ([[("F", 0), ("F", 0), ("B", 0)]], 1, 1, r"F0 runs twice"),
    ([[("B", 0), ("F", 0)]], 1, 1, r"B0 runs before F0"),
    ([[("F", 0), ("W", 0), ("B", 0)]], 1, 1, r"W0 runs before B0"),
    ([[("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1)]], 2, 1, r"never runs W1"),
    ([[("F", 0, 1), ("B", 0, 1)]], 1, 1, r"F0\.1 outside m=1 microbatches, v=1 chunks"),
    ([[("F", 0), ("X", 0), ("B", 0)]], 1, 1, r"unknown kind"),
])
def test_validate_structure_rejects(stages, m, v, match):
    with pytest.raises(ValueError, match=match):
        validate_structure(_bad(stages, m, v))


def test_validate_structure_wrong_stage_count():
    s = Schedule("bad", 2, 1, 1, ((Action("F", 0), Action("B", 0)),))
    with pytest.raises(ValueError, match=r"1 action lists for p=2"):
        validate_structure(s)


# --- errors name the fix ----------------------------------------------------------------------

@pytest.mark.parametrize("call, match", [
    (lambda: interleaved_1f1b(4, 6, 2), r"m divisible by p.*m=6, p=4; use m=8"),
    (lambda: interleaved_1f1b(4, 2, 2), r"m=2, p=4; use m=4"),
    (lambda: make_schedule("interleaved", 3, 4, 2), r"use m=6"),
    (lambda: zb_h1(4, 3), r"m=3 < p=4; use m=4"),
    (lambda: make_schedule("gpipe", 2, 4, v=2), r"v=2 .*only applies to 'interleaved'"),
    (lambda: make_schedule("pipedream", 2, 4), r"unknown schedule 'pipedream'.*'1f1b'"),
    (lambda: one_f_one_b(0, 4), r"p must be a positive int"),
    (lambda: gpipe(2, 0), r"m must be a positive int"),
    (lambda: interleaved_1f1b(2, 4, 0), r"v must be a positive int"),
    (lambda: naive(2, True), r"m must be a positive int"),
    (lambda: zb_h1(2.0, 4), r"p must be a positive int"),
])
def test_bad_inputs_raise_with_fix(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_registry_and_make_schedule():
    assert set(SCHEDULES) == {"naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"}
    for name, fn in SCHEDULES.items():
        args = (4, 8, 2) if name == "interleaved" else (4, 8)
        assert make_schedule(name, *args) == fn(*args)
        assert make_schedule(name, 4, 8).name == name


@pytest.mark.parametrize("p, m", [(1, 1), (2, 3), (3, 3), (4, 6), (4, 8), (5, 2)])
def test_interleaved_v1_is_1f1b(p, m):
    # Megatron runs the non-interleaved 1F1B for v = 1, so no divisibility is needed either.
    assert interleaved_1f1b(p, m, 1).stages == one_f_one_b(p, m).stages


# --- simulated time and memory equal the papers' formulas -------------------------------------

@pytest.mark.parametrize("p, m", [(2, 2), (2, 5), (3, 3), (4, 4), (4, 8), (5, 11)])
@pytest.mark.parametrize("t_f, t_b, t_w", [(1.0, 1.0, 1.0), (2.0, 2.0, 1.0), (1.0, 1.0, 0.5), (3.0, 2.0, 1.0),
                                           (2.0, 3.0, 2.0)])
def test_zb_h1_idle_matches_costmodel(p, m, t_f, t_b, t_w):
    """Qi et al. 2024 §3.1: every stage idles (p-1)(t_F + t_B - t_W) (regime t_W <= t_F, t_B)."""
    sim = simulate(zb_h1(p, m), t_f, t_b, t_w)
    expected = costmodel.zb_h1_idle_time(p, t_f, t_b, t_w)
    assert sim.idle == pytest.approx([expected] * p, **FORMULA)
    # 1F1B on the same stages idles (p-1)(t_F + t_B + t_W): ZB-H1 saves 2(p-1) t_W.
    base = simulate(one_f_one_b(p, m), t_f, t_b, t_w)
    assert base.idle[0] - sim.idle[0] == pytest.approx(2 * (p - 1) * t_w, **FORMULA)


@pytest.mark.parametrize("p, m", [(2, 4), (3, 3), (4, 8), (4, 5)])
def test_zb_h1_memory_equals_1f1b_peak(p, m):
    """ZB-H1 keeps 1F1B's peak memory: every stage holds as many microbatches (F start .. W end)
    as 1F1B's first stage (the paper: "all workers maintain the same number of in-flight
    microbatches")."""
    sim = simulate(zb_h1(p, m))
    first = costmodel.pipeline_stashed_microbatches("1f1b", p, m, stage=0)
    assert sim.peak_stashed == pytest.approx([first] * p, **FORMULA)
    assert max(sim.peak_stashed) == pytest.approx(max(simulate(one_f_one_b(p, m)).peak_stashed), **FORMULA)


@pytest.mark.parametrize("p, m, v",
                         [(2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 6, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3),
                          (4, 12, 4), (5, 10, 2)])
@pytest.mark.parametrize("t_f, t_b", [(1.0, 1.0), (1.0, 2.0)])
def test_interleaved_bubble_matches_costmodel(p, m, v, t_f, t_b):
    """Narayanan et al. 2021 §2.2.2: bubble over ideal time is (p-1)/(v m) on every stage."""
    sim = simulate(interleaved_1f1b(p, m, v), t_f, t_b, t_w=0.0)
    ideal = m * (t_f + t_b)
    ratio = costmodel.pipeline_bubble_ratio("interleaved", p, m, v)
    assert [i / ideal for i in sim.idle] == pytest.approx([ratio] * p, **FORMULA)
    # ... and the same schedule's bubble fraction of the step
    want = costmodel.pipeline_bubble_fraction("interleaved", p, m, v)
    assert sim.bubble_fraction == pytest.approx(want, **FORMULA)


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (3, 9, 3)])
def test_interleaved_stash_matches_costmodel(p, m, v):
    sim = simulate(interleaved_1f1b(p, m, v))
    want = [costmodel.pipeline_stashed_microbatches("interleaved", p, m, stage=r, v=v) for r in range(p)]
    assert sim.peak_stashed == pytest.approx(want, **FORMULA)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 3), (4, 4), (4, 9)])
def test_gpipe_1f1b_bubble_matches_costmodel(name, p, m):
    sim = simulate(make_schedule(name, p, m))
    assert sim.bubble_fraction == pytest.approx(costmodel.pipeline_bubble_fraction(name, p, m), **FORMULA)
    assert [costmodel.pipeline_stashed_microbatches(name, p, m, stage=r) for r in range(p)] == pytest.approx(
        sim.peak_stashed, **FORMULA)


def test_interleaving_shrinks_the_bubble():
    p, m = 4, 8
    bubbles = [simulate(interleaved_1f1b(p, m, v)).bubble_fraction for v in (1, 2, 4)]
    assert bubbles[0] > bubbles[1] > bubbles[2] > 0
