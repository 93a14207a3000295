"""Chapter 14 exercises (the appendix), autograded: a benchmark that reports its median and spread after a
warm-up, and a step timed while other processes spin on the cores, against its time at calibration.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs).

The benchmark is driven by a fake clock that only the tests advance: a run "takes" exactly what the test
says, so every expected median, quartile and spread is computed here with ``statistics`` from the runs the
test chose, and compared exactly. The measurement runs real processes: each test step records, at every
call, which processes are alive and the CPU time each has used (``/proc/<pid>/stat``), so the spinners are
checked to be running during every call, to spin (a process that sleeps uses no CPU), and to be gone
afterwards. The times of the real steps are sleeps the tests set; their bounds are loose (a sleep of 10 ms
may last longer on a loaded machine, never shorter), and every ratio is checked exactly against the
returned times.
"""
import multiprocessing as mp
import os
import statistics
import time

import pytest

pytestmark = [pytest.mark.ch14, pytest.mark.timeout(60)]


# --- 1. median_and_spread ---------------------------------------------------------------------------------


class FakeClock:
    """A clock that moves only when a run or a set-up says it took time."""

    def __init__(self):
        self.now = 100.0
        self.reads = 0

    def __call__(self):
        self.reads += 1
        return self.now

    def take(self, seconds):
        self.now += seconds


def _fn(clock, durations, calls=None):
    """A run taking the next of ``durations`` seconds (and recording what it was passed)."""
    it = iter(durations)

    def fn(*args):
        if calls is not None:
            calls.append(args)
        clock.take(next(it))
    return fn


def _expected(runs):
    med = statistics.median(runs)
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive") if len(runs) > 1 else (med, med, med)
    return {"median": med, "q1": q1, "q3": q3, "spread": (q3 - q1) / med if med else 0.0, "runs": list(runs)}


def _same(got, want):
    assert set(got) >= {"median", "q1", "q3", "spread", "runs"}, sorted(got)
    assert got["runs"] == pytest.approx(want["runs"], rel=1e-12, abs=1e-12), (got["runs"], want["runs"])
    for k in ("median", "q1", "q3", "spread"):
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-12), (k, got[k], want[k])


@pytest.mark.parametrize("durations, reps, warmup", [
    ([0.5, 0.010, 0.012, 0.011, 0.013, 0.014], 5, 1),
    ([0.9, 0.8, 0.020, 0.021, 0.5], 3, 2),            # slow warm-up runs must be dropped
    ([0.030, 0.031, 0.029, 0.9, 0.032, 0.030, 0.028], 7, 0),   # one outlier: the median ignores it
    ([0.004], 1, 0),                                  # one run
    ([0.2, 0.003, 0.001, 0.002, 0.008], 4, 1),         # runs kept in the order they ran
])
def test_median_and_spread_reports_the_timed_runs(ex, durations, reps, warmup):
    clock = FakeClock()
    got = ex.median_and_spread(_fn(clock, durations), reps, warmup, clock=clock)
    _same(got, _expected(durations[warmup:]))


def test_median_and_spread_is_the_median_not_the_mean(ex):
    clock = FakeClock()
    runs = [0.010, 0.010, 0.011, 0.012, 1.0]
    got = ex.median_and_spread(_fn(clock, runs), 5, 0, clock=clock)
    assert got["median"] == pytest.approx(0.011), got["median"]  # the mean would be 0.2086


def test_median_and_spread_never_times_the_setup(ex):
    clock = FakeClock()
    calls, made = [], []

    def setup():
        clock.take(5.0)  # a set-up that takes long: a flush, fresh inputs
        made.append(object())
        return made[-1]
    durations = [0.3, 0.020, 0.022, 0.021]
    got = ex.median_and_spread(_fn(clock, durations, calls), 3, 1, setup=setup, clock=clock)
    _same(got, _expected(durations[1:]))
    assert len(made) == 4, \
        f"setup() must run before every run, warm-up included: {len(made)} calls for 4 runs"
    assert [c for c in calls] == [(m,) for m in made], "each run gets what the set-up before it returned"


def test_median_and_spread_calls_fn_without_argument_when_there_is_no_setup(ex):
    clock, calls = FakeClock(), []
    ex.median_and_spread(_fn(clock, [0.1, 0.2, 0.3], calls), 2, 1, clock=clock)
    assert calls == [(), (), ()], calls


def test_median_and_spread_reads_the_given_clock(ex):
    clock = FakeClock()
    got = ex.median_and_spread(_fn(clock, [0.0, 0.0, 0.0]), 3, 0, clock=clock)
    assert clock.reads >= 6, "read the clock passed in, before and after each timed run"
    assert got["runs"] == [0.0, 0.0, 0.0] and got["spread"] == 0.0  # a zero median: spread 0, no error


def test_median_and_spread_on_a_real_function(ex):
    got = ex.median_and_spread(lambda: time.sleep(0.002), 5, 1)
    assert len(got["runs"]) == 5 and all(0.002 <= t < 1.0 for t in got["runs"]), got["runs"]
    assert got["q1"] <= got["median"] <= got["q3"]


def test_median_and_spread_rejects_bad_input(ex):
    clock = FakeClock()
    ex.median_and_spread(_fn(clock, [0.1, 0.1]), 1, 1, clock=clock)  # a valid call first
    with pytest.raises(ValueError, match="reps"):
        ex.median_and_spread(lambda: None, 0)
    with pytest.raises(ValueError, match="warmup"):
        ex.median_and_spread(lambda: None, 3, -1)


# --- 2. slowdown_under_load -------------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid):
    """User + system CPU seconds of process ``pid`` so far (None once it is gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK


class Watched:
    """A step that sleeps ``durations`` (the next at each call) and records the processes alive and the CPU
    time each has used at every call."""

    def __init__(self, durations):
        self.durations, self.calls = list(durations), []
        self.before = {p.pid for p in mp.active_children()}  # another test's processes are not ours

    def __call__(self):
        kids = [p for p in mp.active_children() if p.pid not in self.before]
        self.calls.append({p.pid: _cpu_seconds(p.pid) for p in kids})
        time.sleep(self.durations[min(len(self.calls) - 1, len(self.durations) - 1)])


def _ours(before):
    return [p for p in mp.active_children() if p.pid not in before]


@pytest.fixture
def no_children():
    """The processes a test leaves behind (those alive before it are not its own)."""
    before = {p.pid for p in mp.active_children()}
    yield before
    left = _ours(before)
    for p in left:
        p.kill()
    assert left == [], f"processes left running after the measurement: {left}"


def test_slowdown_under_load_spins_during_every_call(ex, no_children):
    step = Watched([0.06])
    got = ex.slowdown_under_load(step, 0.05, busy=2, reps=4, warmup=1)
    assert len(step.calls) == 5, f"warmup + reps = 5 calls of the step, got {len(step.calls)}"
    for i, alive in enumerate(step.calls):
        assert len(alive) == 2, \
            f"call {i}: {len(alive)} spinning processes alive, want 2 (all of them, every call)"
    pids = set(step.calls[0])
    assert all(set(c) == pids for c in step.calls), "the same spinners throughout the measurement"
    used = step.calls[-1]
    assert all(v is not None and v >= 0.02 for v in used.values()), \
        f"CPU seconds used by each spinner by the last call: {used}; a spinner must spin, not sleep"
    assert got["busy"] == 2


def test_slowdown_under_load_leaves_no_process_behind(ex, no_children):
    ex.slowdown_under_load(Watched([0.01]), 0.01, busy=3, reps=2, warmup=0)
    assert _ours(no_children) == []


def test_slowdown_under_load_stops_the_spinners_when_the_step_fails(ex, no_children):
    def failing():
        raise RuntimeError("the step failed")
    with pytest.raises(RuntimeError, match="the step failed"):
        ex.slowdown_under_load(failing, 0.01, busy=2, reps=2, warmup=0)
    assert _ours(no_children) == [], "the spinners must be stopped when the step raises"


def test_slowdown_under_load_without_load_starts_nothing(ex, no_children):
    step = Watched([0.01])
    got = ex.slowdown_under_load(step, 0.01, busy=0, reps=3, warmup=1)
    assert [len(c) for c in step.calls] == [0, 0, 0, 0]
    assert got["busy"] == 0


def test_slowdown_under_load_is_now_over_calibration(ex, no_children):
    got = ex.slowdown_under_load(Watched([0.01]), 0.004, busy=0, reps=5, warmup=1)
    assert set(got) >= {"now_s", "calibrated_s", "slowdown", "busy", "runs"}, sorted(got)
    assert len(got["runs"]) == 5 and all(0.01 <= t < 1.0 for t in got["runs"]), got["runs"]
    assert got["now_s"] == pytest.approx(statistics.median(got["runs"]), rel=1e-12)
    assert got["calibrated_s"] == 0.004
    assert got["slowdown"] == pytest.approx(got["now_s"] / 0.004, rel=1e-12)
    assert got["slowdown"] > 2  # a sleep of 10 ms never lasts less than 10 ms


def test_slowdown_under_load_drops_the_warm_up_and_takes_the_median(ex, no_children):
    # two slow warm-up calls, then 10, 10 and 250 ms: the median is about 10 ms
    got = ex.slowdown_under_load(Watched([0.25, 0.25, 0.01, 0.01, 0.25]), 0.01, busy=0, reps=3, warmup=2)
    assert len(got["runs"]) == 3, got["runs"]
    assert got["now_s"] < 0.06, f"now_s {got['now_s']:.3f} s: the median of the timed runs, after the warm-up"


def test_slowdown_under_load_rejects_bad_input(ex, no_children):
    ex.slowdown_under_load(lambda: None, 0.01, busy=0, reps=1, warmup=0)  # a valid call first
    with pytest.raises(ValueError, match="calibrated_s"):
        ex.slowdown_under_load(lambda: None, 0.0)
    with pytest.raises(ValueError, match="busy"):
        ex.slowdown_under_load(lambda: None, 0.01, busy=-1)
