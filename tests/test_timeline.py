"""Timeline records nested spans in order, merges ranks, plots one bar per span, and measures
the idle fraction of a schedule whose bubble is known by hand.

Tolerances: times come from a fake clock (whole seconds), so the fractions are ratios of small sums of
float64 integers: pytest.approx's default rel 1e-6 only absorbs the final division's rounding."""
import os
import pickle
import tempfile

import matplotlib

matplotlib.use("Agg")

import pytest
import torch.distributed as dist

from minitorch_dist.runtime.timeline import Event, Timeline, bubble_fraction, busy_fraction, plot_gantt


class FakeClock:
    """A clock that advances by one second per reading: every time below is known exactly."""

    def __init__(self, start=100.0):
        self.t = start - 1.0

    def __call__(self):
        self.t += 1.0
        return self.t


def test_spans_nest_and_keep_start_order():
    tl = Timeline(rank=3, clock=FakeClock())  # origin = 100
    with tl.span("step", category="step", it=0):  # 101
        with tl.span("forward", category="compute") as ev:  # 102
            ev.meta["tokens"] = 8
        # forward ends 103
        tl.mark("allreduce launched", category="comm")  # 104
    # step ends 105
    names = [e.name for e in tl.events]
    assert names == ["step", "forward", "allreduce launched"]
    step, fwd, mark = tl.events
    assert (step.t_start, step.t_end, step.depth) == (1.0, 5.0, 0)
    assert (fwd.t_start, fwd.t_end, fwd.depth) == (2.0, 3.0, 1)
    assert mark.t_start == mark.t_end == 4.0 and mark.duration == 0
    assert step.meta == {"it": 0} and fwd.meta == {"tokens": 8}
    assert {e.rank for e in tl.events} == {3}


def test_span_is_closed_when_the_block_raises():
    tl = Timeline(clock=FakeClock())
    with pytest.raises(KeyError):
        with tl.span("boom"):
            raise KeyError("x")
    assert tl.events[0].t_end == 2.0
    with tl.span("after"):
        pass
    assert tl.events[1].depth == 0


def test_real_clock_spans_are_ordered_and_positive():
    tl = Timeline()
    with tl.span("outer"):
        with tl.span("inner"):
            sum(range(1000))
    outer, inner = tl.events
    assert 0 <= outer.t_start <= inner.t_start <= inner.t_end <= outer.t_end


def test_merge_sorts_by_start_and_events_pickle():
    a = Timeline(rank=0, origin=0.0, clock=FakeClock(1.0))
    b = Timeline(rank=1, origin=0.0, clock=FakeClock(1.5))
    for tl in (a, b):
        for i in range(2):
            with tl.span(f"F{i}", category="forward", mb=i):
                pass
    # rank 0 spans [1,2], [3,4]; rank 1 spans [1.5,2.5], [3.5,4.5]
    returned = pickle.loads(pickle.dumps([a.events, b]))  # what launch hands back
    merged = Timeline.merge(returned)
    assert [(e.rank, e.t_start) for e in merged] == [(0, 1.0), (1, 1.5), (0, 3.0), (1, 3.5)]
    assert merged[0] == Event(0, "F0", "forward", 1.0, 2.0, {"mb": 0}, 0)
    assert Timeline.merge([merged[3], [merged[0]]]) == [merged[0], merged[3]]


def test_shared_origin_and_align_shift_times():
    clock = FakeClock(10.0)
    tl = Timeline(rank=0, origin=5.0, clock=clock)
    tl.mark("a")  # clock 10 -> 5 s after the shared origin
    assert tl.events[0].t_start == 5.0
    new_origin = tl.align()  # no process group: just a new time zero at clock 11
    assert new_origin == 11.0
    assert tl.events[0].t_start == -1.0  # the mark keeps its place, 1 s before the new zero
    tl.mark("b")  # clock 12
    assert tl.events[1].t_start == 1.0


def test_align_under_a_process_group():
    with tempfile.TemporaryDirectory() as d:  # file rendezvous: no network port
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'rdv')}", rank=0, world_size=1)
        try:
            tl = Timeline()
            assert tl.rank == 0
            tl.align()
            with tl.span("x"):
                pass
            assert tl.events[0].t_start >= 0
        finally:
            dist.destroy_process_group()


def test_add_rejects_a_span_ending_before_it_starts():
    tl = Timeline()
    assert tl.add("F", 1.0, 2.0, category="forward").duration == 1.0
    with pytest.raises(ValueError, match="ends"):
        tl.add("B", 2.0, 1.0)


def gpipe_forward(p, m, t=1.0):
    """Stage s runs micro-batch j in slot s + j: the fill-and-drain picture of GPipe's forward."""
    return [Event(s, f"F{j}", "forward", (s + j) * t, (s + j + 1) * t) for s in range(p) for j in range(m)]


@pytest.mark.parametrize("p,m", [(3, 4), (4, 8), (2, 1)])
def test_bubble_fraction_of_gpipe_equals_the_hand_value(p, m):
    events = gpipe_forward(p, m)
    # Makespan m + p - 1 slots, each stage busy m of them: idle share (p - 1) / (m + p - 1).
    assert bubble_fraction(events) == pytest.approx((p - 1) / (m + p - 1))
    assert busy_fraction(events, 0) == pytest.approx(m / (m + p - 1))


def test_busy_fraction_counts_overlap_once_and_filters_categories():
    events = [
        Event(0, "step", "step", 0.0, 10.0),
        Event(0, "a", "compute", 1.0, 4.0),
        Event(0, "b", "compute", 3.0, 5.0),  # overlaps a: union [1, 5]
        Event(0, "c", "comm", 7.0, 8.0),
        Event(0, "tick", "comm", 9.0, 9.0),  # an instant is not busy time
        Event(1, "d", "compute", 2.0, 7.0),
    ]
    assert busy_fraction(events, 0) == pytest.approx(1.0)  # the enclosing step covers everything
    assert busy_fraction(events, 0, categories=["compute"]) == pytest.approx(4 / 10)
    assert busy_fraction(events, 0, categories=["compute", "comm"]) == pytest.approx(5 / 10)
    assert busy_fraction(events, 1) == pytest.approx(5 / 10)
    assert busy_fraction(events, 0, window=(2.0, 4.0), categories=["compute"]) == pytest.approx(1.0)
    assert bubble_fraction(events, categories=["compute"]) == pytest.approx(1 - (0.4 + 0.5) / 2)
    with pytest.raises(ValueError, match="no events"):
        bubble_fraction([])


def test_plot_gantt_draws_one_bar_per_span():
    events = gpipe_forward(3, 2, t=0.002)  # 2 ms slots
    events.append(Event(1, "sync", "comm", 0.001, 0.001))  # an instant: a tick, not a bar
    ax = plot_gantt(events, title="GPipe forward", colors={"forward": "tab:blue"})
    assert isinstance(ax, matplotlib.axes.Axes)
    bars = ax.patches
    assert len(bars) == 6
    # Bars are in ms from the first start, one row per rank, rank 0 on top.
    geom = sorted((round(r.get_x(), 9), round(r.get_width(), 9), r.get_y() + r.get_height() / 2)
                  for r in bars)
    expected = sorted((round((s + j) * 2.0, 9), 2.0, float(s)) for s in range(3) for j in range(2))
    assert geom == expected
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax.get_ylim()[0] > ax.get_ylim()[1]
    assert ax.get_title() == "GPipe forward" and ax.get_xlabel() == "time (ms)"
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"forward", "comm"}
    ax.figure.canvas.draw()  # renders headless
    matplotlib.pyplot.close(ax.figure)


def test_plot_gantt_on_given_axes_from_timelines():
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots()
    tl = Timeline(rank=0, clock=FakeClock())
    with tl.span("outer"):
        with tl.span("inner"):
            pass
    assert plot_gantt([tl], ax=ax) is ax
    outer, inner = sorted(ax.patches, key=lambda r: -r.get_height())
    assert inner.get_height() < outer.get_height()  # nested spans drawn thinner
    plt.close(fig)


def test_plot_gantt_row_of_gives_each_rank_several_lanes():
    import matplotlib
    matplotlib.use("Agg")
    evs = [Event(rank=r, name=n, category=c, t_start=t0, t_end=t1)
           for r in (0, 1)
           for n, c, t0, t1 in (("backward", "backward", 0.0, 1.0),
                                ("all_reduce b0", "all_reduce", 0.5, 1.5))]
    lane = lambda e: f"rank {e.rank} " + ("comm" if e.category == "all_reduce" else "compute")
    ax = plot_gantt(evs, row_of=lane)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 comm", "rank 0 compute", "rank 1 comm",
                                                            "rank 1 compute"]
    # the two overlapping spans of one rank sit on different rows
    ys = sorted({round(p.get_y() + p.get_height() / 2, 6) for p in ax.patches})
    assert len(ys) == 4
