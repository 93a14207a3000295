"""The measured bubble (analysis/pipeline_measured.py): the per-stage simulation against the chapter's
simulator, the idle breakdown on simulated timelines where every part is known, and one real run.

Tolerances. The per-stage simulation, the chapter's simulator and the timeline's fractions compute the
same sums of durations along chains of events; they are compared at FORMULA = rel 1e-12 or abs 1e-10,
whichever is larger. A simulated time is a chain of at most k = 2E additions (E <= 3·8·4 = 96 events
here, each with its hop), so it is within γ_k·makespan of exact (makespan <= 50 here: 3·γ_200·50 ≈
3e-12 at most); an idle time (makespan - busy) within twice that, a fraction of times within 3γ_k + u
(< 1e-12), a hand formula within ~10u relatively. Durations in quarters make every sum exact; 1.2,
2.1, 0.9, 0.1 and 0.3 do not. One action more or less moves a time by its duration (>= 0.25) and a
fraction by ~1/(m + p): far outside. The real run's breakdown against its idle time: both are sums of
at most 2E + 4 differences of the E events' timestamps, each at most the span, so they agree within
3·γ_{2E+4}·span.
"""
from __future__ import annotations

import pytest
import torch

from minitorch_dist.analysis.pipeline_measured import (
    idle_breakdown,
    late_message,
    measure_pipeline,
    simulate_stages,
)
from minitorch_dist.parallelism.pipeline import make_schedule, simulate
from minitorch_dist.runtime.timeline import Event, bubble_fraction, busy_fraction

from _support import gamma

pytestmark = [pytest.mark.ch03, pytest.mark.timeout(120)]

FORMULA = dict(rel=1e-12, abs=1e-10)  # the simulator against a formula (module docstring)

CASES = [(name, p, m) for name in ("gpipe", "1f1b", "zb-h1") for p in (1, 2, 3, 4) for m in (1, 2, 5, 8)
         if name != "zb-h1" or m >= p]


@pytest.mark.parametrize("p2p", [0.0, 0.3])
def test_equal_stage_times_give_the_simulator(p2p):
    for name, p, m in CASES:
        sched = make_schedule(name, p, m)
        want = simulate(sched, t_f=1.0, t_b=1.5, t_w=0.5, p2p=p2p)
        got = simulate_stages(sched, [{"F": 1.0, "B": 1.5, "W": 0.5}] * p, p2p=p2p)
        assert got["makespan"] == pytest.approx(want.makespan, **FORMULA), (name, p, m)
        assert got["idle"] == pytest.approx([i / want.makespan for i in want.idle], **FORMULA), (name, p, m)
        assert got["bubble"] == pytest.approx(want.bubble_fraction, **FORMULA), (name, p, m)


def test_a_slower_last_stage_sets_the_pace():
    # GPipe, p = 2: the last stage's m forwards and backwards run back to back once the first F
    # has arrived, so makespan = t_F(0) + m * (F + B of stage 1) + B of stage 0.
    sched = make_schedule("gpipe", 2, 4)
    fast, slow = {"F": 1.0, "B": 2.0, "W": 0.0}, {"F": 1.5, "B": 3.0, "W": 0.0}
    got = simulate_stages(sched, [fast, slow])
    assert got["makespan"] == pytest.approx(1.0 + 4 * 4.5 + 2.0, **FORMULA)
    assert got["idle"][1] < got["idle"][0]


def test_simulated_idle_is_the_timeline_s():
    sched = make_schedule("1f1b", 3, 6)
    sim = simulate_stages(sched, [{"F": 1.0, "B": 2.0, "W": 0.0}, {"F": 1.2, "B": 2.1, "W": 0.0},
                                  {"F": 0.9, "B": 2.5, "W": 0.0}], p2p=0.1)
    assert sim["idle"] == pytest.approx([1 - busy_fraction(sim["events"], r) for r in range(3)], **FORMULA)
    assert sim["bubble"] == pytest.approx(bubble_fraction(sim["events"]), **FORMULA)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_breakdown_of_a_simulated_timeline(name):
    sched = make_schedule(name, 2, 4)
    times = [{"F": 1.0, "B": 2.0, "W": 1.0}] * 2
    plain, late = simulate_stages(sched, times), simulate_stages(sched, times, p2p=0.25)
    for sim in (plain, late):
        parts = idle_breakdown(sim["events"], sched)
        for r, part in enumerate(parts):  # the parts add up to the idle time
            assert sum(part.values()) == pytest.approx(sim["idle"][r] * sim["makespan"], **FORMULA)
            assert part["between"] == pytest.approx(0.0, **FORMULA)  # a simulated rank never pauses itself
    assert all(p["message"] == 0.0 for p in idle_breakdown(plain["events"], sched))
    waits = [p["message"] / 0.25 for p in idle_breakdown(late["events"], sched)]
    assert all(w == pytest.approx(round(w), **FORMULA) and w >= 1 for w in waits)  # whole messages of 0.25


def test_breakdown_counts_a_gap_between_actions():
    sched = make_schedule("gpipe", 1, 2)
    events = [Event(0, "F0", "F", 0.0, 1.0), Event(0, "F1", "F", 1.5, 2.5), Event(0, "B0", "B", 2.5, 3.5),
              Event(0, "B1", "B", 3.5, 4.5)]
    assert idle_breakdown(events, sched) == [{"waiting": 0.0, "message": 0.0, "between": 0.5, "drain": 0.0}]


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_measure_a_real_pipeline(name):
    res = measure_pipeline(name, "tiny", 2, reps=2)
    kinds = ("F", "B", "W") if name == "zb-h1" else ("F", "B")
    assert len(res["step_s"]) == 2 and all(t > 0 for t in res["step_s"])
    assert len(res["alone"]) == 2 and all(a[k] > 0 for a in res["alone"] for k in kinds)
    got = sorted((e.rank, e.name) for e in res["events"])
    assert got == sorted((r, str(a)) for r in range(2) for a in res["schedule"][r])
    span = max(e.t_end for e in res["events"]) - min(e.t_start for e in res["events"])
    for r, part in enumerate(idle_breakdown(res["events"], res["schedule"])):
        idle = 1 - busy_fraction(res["events"], r)
        assert 0.0 <= idle < 1.0
        bound = 3 * gamma(2 * len(res["events"]) + 4, torch.float64) * span  # module docstring
        assert abs(sum(part.values()) - idle * span) <= bound


def test_simulate_stages_refuses_interleaving():
    with pytest.raises(ValueError, match="simulator.simulate"):
        simulate_stages(make_schedule("interleaved", 2, 4, 2), [{"F": 1.0, "B": 1.0, "W": 0.0}] * 2)


def test_late_message_times_every_receive():
    waits = late_message(4096, sender_busy_s=0.002, receiver_busy_s=0.001, reps=3)
    assert len(waits) == 3 and all(0.0 <= w < 5.0 for w in waits)
