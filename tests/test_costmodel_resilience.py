"""Chapter 13's formulas (``costmodel.resilience``) against their papers, and against a simulation.

Young 1974: the first-order waste C/τ + τ/2M is least at √(2MC). Daly 2006: his higher-order optimum
reproduces the intervals of his Figs. 3-5 (C = 5 min; M = 24 h, 6 h, 15 min: 117, 57 and 9.1 min), and
his expected run time is least near it. The simulation of :mod:`minitorch_dist.resilience.failures_sim`
(Poisson failures that also strike saves and restarts) agrees with that expected run time within a few
standard errors, and its best interval lies where the formulas say. Llama 3's figures: 419
interruptions in 54 days, one every 3.09 hours.

Tolerances. Daly's figures are read off his plots to the digits printed (117 and 57 min to 0.5, 9.1
to 0.05). A grid's minimiser is the formula's to the grid's step (Young: 0.5 s) or to Daly's own
accuracy as an estimate of the optimum (1%); at C/M = 1e-6 Daly and Young differ by
√(C/2M)/3 + C/τ < 1e-3 (rel 0.01). The simulation is held to 4 standard errors, computed from its
jobs; formulas against formulas by pytest.approx's default rel 1e-6 >> k·u.
"""
import math

import numpy as np
import pytest

from minitorch_dist import costmodel as cm
from minitorch_dist.resilience.failures_sim import simulate_runtime, sweep_intervals

pytestmark = [pytest.mark.ch13, pytest.mark.timeout(60)]


@pytest.mark.parametrize("mtbf_min, want", [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_reproduces_his_figures(mtbf_min, want):
    assert cm.daly_interval(mtbf_min, 5.0) == pytest.approx(want, abs=0.5 if want > 10 else 0.05)


def test_young_minimises_the_first_order_waste():
    M, C = 3600.0, 30.0
    taus = np.linspace(100, 2000, 3801)
    best = taus[np.argmin([cm.first_order_waste(t, M, C) for t in taus])]
    assert best == pytest.approx(cm.young_interval(M, C), abs=0.5)
    assert cm.young_interval(M, C) == pytest.approx(math.sqrt(2 * M * C))


def test_daly_interval_minimises_the_expected_runtime():
    M, C, R, W = 360.0, 5.0, 10.0, 30000.0
    taus = np.linspace(20, 140, 12001)
    best = taus[np.argmin([cm.expected_runtime(W, t, M, C, R) for t in taus])]
    assert best == pytest.approx(cm.daly_interval(M, C), rel=0.01)
    # a small C/M: the formulas agree with each other and with Young's first order
    assert cm.daly_interval(1e6, 1.0) == pytest.approx(cm.young_interval(1e6, 1.0), rel=0.01)
    assert cm.daly_interval(5.0, 20.0) == 5.0  # C >= 2M: save as often as failures come


def test_simulation_agrees_with_the_expected_runtime_and_its_optimum():
    M, C, R, W = 360.0, 5.0, 10.0, 30000.0
    for tau in (20.0, 57.0, 140.0):
        mean, err = simulate_runtime(W, tau, M, C, R, jobs=400, seed=1)
        assert abs(mean - cm.expected_runtime(W, tau, M, C, R)) < 4 * err + 1e-9
    sweep = sweep_intervals(W, [15, 30, 57, 110, 220], M, C, R, jobs=400)
    means = [s["mean_s"] for s in sweep]
    assert int(np.argmin(means)) == 2  # the interval Daly's formula gives wins


def test_without_failures_the_job_only_pays_its_saves():
    mean, err = simulate_runtime(100.0, 10.0, 1e12, 1.0, jobs=10)
    assert mean == pytest.approx(110.0) and err == pytest.approx(0.0, abs=1e-9)


def test_llama3_numbers_and_checkpoint_size():
    assert cm.mtbf_seconds() / 3600 == pytest.approx(54 * 24 / 419)
    assert cm.checkpoint_bytes(405e9) == 405e9 * 14
    assert cm.checkpoint_bytes(10, "fp32-adam") == 120
    assert cm.checkpoint_seconds(2e12, cm.LLAMA3_STORAGE_BYTES_PER_S) == 1.0
    assert cm.expected_lost_work(600.0) == 300.0


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown state kind 'fp64-adam'"):
        cm.checkpoint_bytes(1, "fp64-adam")
    with pytest.raises(ValueError, match="mtbf_s must be > 0"):
        cm.young_interval(0, 1)
    with pytest.raises(ValueError, match="interval_s and mtbf_s must be > 0"):
        simulate_runtime(1.0, 0.0, 1.0, 0.1)
