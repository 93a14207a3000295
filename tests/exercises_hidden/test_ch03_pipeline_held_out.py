"""Chapter 03, held-out: the schedule exercises on seeded random sizes the visible tests do not use.

Expected values as in the visible tests: the library's schedules and simulator. Schedules and stashes
are exact; makespans are sums of a few hundred float64 durations, compared with pytest.approx's rel
1e-6 (far above their k·u, far below one slot of one stage).
"""
import random

import pytest

from minitorch_dist.parallelism.pipeline import schedules
from minitorch_dist.parallelism.pipeline.schedules import Action, Schedule
from minitorch_dist.parallelism.pipeline.simulator import check_dependencies, simulate
from minitorch_dist.runtime.timeline import Event, bubble_fraction

pytestmark = pytest.mark.ch03


def _strings(schedule):
    return [[str(a) for a in acts] for acts in schedule.stages]


def _as_schedule(stages, m):
    return Schedule("hidden", len(stages), m, 1,
                    tuple(tuple(Action(a[0], int(a[1:])) for a in stage) for stage in stages))


def _sizes(seed, n=25):
    rng = random.Random(seed)
    return [(rng.randrange(1, 9), rng.randrange(1, 20), rng.randrange(1, 12)) for _ in range(n)]


@pytest.mark.parametrize("p,m,k", _sizes(31))
def test_gpipe_rounds_schedule_random_sizes(ex, p, m, k):
    stages = ex.gpipe_rounds_schedule(p, m, k)
    sched = _as_schedule(stages, m)
    schedules.validate_structure(sched)
    check_dependencies(sched)
    sim = simulate(sched, t_f=1.0, t_b=1.5, t_w=0.0)
    assert sim.peak_stashed == [min(k, m)] * p
    sizes = [min(k, m - s) for s in range(0, m, k)]
    assert sim.makespan == pytest.approx(sum((mj + p - 1) * 2.5 for mj in sizes))
    want = []
    for s in range(0, m, k):  # the rounds, each the library's GPipe renumbered
        want += [f"{a[0]}{int(a[1:]) + s}" for a in _strings(schedules.gpipe(1, min(k, m - s)))[0]]
    assert stages == [want] * p


@pytest.mark.parametrize("p,m,cap", _sizes(32))
def test_one_f_one_b_capped_random_sizes(ex, p, m, cap):
    c = min(cap, p)
    want = [_strings(schedules.one_f_one_b(c, m))[max(0, r - (p - c))] for r in range(p)]
    got = ex.one_f_one_b_capped(p, m, cap)
    assert got == want
    sim = simulate(_as_schedule(got, m), t_f=1.0, t_b=2.0, t_w=0.0)
    assert sim.peak_stashed == [min(p - r, cap, m) for r in range(p)]


def test_bubble_from_timeline_touching_and_instant_spans(ex):
    # spans that touch count as one run; an instant inside a gap is busy for no time
    events = [Event(0, "a", None, 0.0, 1.0), Event(0, "b", None, 1.0, 2.0), Event(0, "mark", None, 3.0, 3.0),
              Event(1, "c", None, 0.5, 4.0)]
    assert ex.bubble_from_timeline(events, 2) == pytest.approx(1 - (2.0 + 3.5) / 8)
    rng = random.Random(33)
    for _ in range(100):
        p = rng.randrange(1, 8)
        events = [Event(rng.randrange(p), "x", None, s, s + rng.uniform(0, 3))
                  for s in (rng.uniform(100, 110) for _ in range(rng.randrange(2, 30)))]
        assert ex.bubble_from_timeline(events, p) == pytest.approx(bubble_fraction(events, ranks=range(p)))


@pytest.mark.parametrize("p", [6, 7])
def test_zbv_actions_any_m_larger_pipes(ex, p):
    """Sizes the visible tests do not reach: every m from 1 to 2p + 1 on 6 and 7 ranks."""
    full = simulate(schedules.zb_v(p, 2 * p - 1)).makespan
    for m in range(1, 2 * p + 2):
        stages = tuple(tuple(Action(a[0], int(a[1:].split(".")[0]), int("." in a))
                             for a in ex.zbv_actions_any_m(p, m, r)) for r in range(p))
        sched = Schedule("zbv", p, m, 2, stages, layout="v")
        schedules.validate_structure(sched)
        check_dependencies(sched)
        sim = simulate(sched)
        assert max(sim.peak_stashed) <= min(p, m)
        if m >= 2 * p - 1:
            assert [tuple(s) for s in sched.stages] == [tuple(s) for s in schedules.zb_v(p, m).stages]
        else:
            assert sim.makespan <= full
