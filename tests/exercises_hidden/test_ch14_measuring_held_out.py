"""Chapter 14, held out: the benchmark on an even number of runs (quartiles between runs), with a set-up
and no warm-up, and on runs all equal; the measurement with one spinner and a single timed run. Exact on
the fake clock; the real steps' bounds as in the visible tests.
"""
import multiprocessing as mp
import statistics
import time

import pytest

pytestmark = [pytest.mark.ch14, pytest.mark.timeout(60)]


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_median_and_spread_on_an_even_number_of_runs_with_a_setup(ex):
    clock = _Clock()
    durations = iter([0.004, 0.001, 0.003, 0.002, 0.010, 0.006])
    got_args = []

    def setup():
        clock.now += 1.0
        return len(got_args)

    def fn(arg):
        got_args.append(arg)
        clock.now += next(durations)
    got = ex.median_and_spread(fn, 6, 0, setup=setup, clock=clock)
    runs = [0.004, 0.001, 0.003, 0.002, 0.010, 0.006]
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive")
    med = statistics.median(runs)
    assert got["runs"] == pytest.approx(runs, abs=1e-12)
    assert got["median"] == pytest.approx(med) and got["q1"] == pytest.approx(q1)
    assert got["q3"] == pytest.approx(q3) and got["spread"] == pytest.approx((q3 - q1) / med)
    assert got_args == [0, 1, 2, 3, 4, 5]


def test_median_and_spread_of_equal_runs_has_no_spread(ex):
    clock = _Clock()

    def fn():
        clock.now += 0.25
    got = ex.median_and_spread(fn, 4, 3, clock=clock)
    assert got["runs"] == [0.25] * 4 and got["median"] == 0.25 and got["spread"] == 0.0


def test_slowdown_under_load_with_one_spinner_and_one_run(ex):
    before = {p.pid for p in mp.active_children()}
    seen = []

    def step():
        seen.append(len([p for p in mp.active_children() if p.pid not in before]))
        time.sleep(0.02)
    got = ex.slowdown_under_load(step, 0.02, busy=1, reps=1, warmup=0)
    assert seen == [1]
    assert got["runs"] == [got["now_s"]] and got["slowdown"] == pytest.approx(got["now_s"] / 0.02)
    assert [p for p in mp.active_children() if p.pid not in before] == []
