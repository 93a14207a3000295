"""HOGWILD! (Recht et al. 2011): lock-free shared-memory SGD against serial SGD and the optimum.

Every run forks real processes. Tolerances are on the *excess* loss f(x) − f(x*): SGD with a
decaying step ends a few percent of f(x*) above it, and process interleaving on a shared 2-core
machine changes the order of updates, so parallel runs are compared with a stated slack.
"""
import multiprocessing
import time

import pytest
import torch

from minitorch_dist.parallelism.hogwild import (
    HogwildError,
    dense_problem,
    example_order,
    run_hogwild,
    sparse_problem,
)

pytestmark = pytest.mark.ch02

EPOCHS, LR = 10, 0.5
REL_TOL = 0.10  # serial: final loss within 10% of f(x*) (initial loss is ~100x f(x*))
# Several processes: the interleaving is the OS scheduler's, so the trajectory varies run to run;
# measured excess over f(x*) with 4 processes on 2 loaded cores: 0.4% to 10% (serial 0.2%).
PAR_TOL = 0.25


@pytest.fixture(scope="module")
def sparse():
    return sparse_problem(n_features=1000, density=0.01, seed=0)  # Ω = 10, N = 8000


@pytest.fixture(scope="module")
def dense():
    return dense_problem(n_features=50, n_examples=2000, seed=0)


@pytest.fixture(scope="module")
def serial(sparse):
    return run_hogwild(sparse, 1, epochs=EPOCHS, lr=LR)


@pytest.fixture(autouse=True)
def no_process_left():
    yield
    assert multiprocessing.active_children() == []


def _dense_rows(p):
    A = torch.zeros(p.n_examples, p.n_features, dtype=torch.float64)
    return A.scatter_(1, p.idx, p.val.double())


def test_optimum_matches_lstsq(sparse, dense):
    for p in (sparse, dense):
        A = _dense_rows(p)
        x = torch.linalg.lstsq(A, p.b.double().unsqueeze(1)).solution.squeeze(1)
        ref = 0.5 * float(((A @ x - p.b.double()) ** 2).mean())
        assert p.opt_loss == pytest.approx(ref, rel=1e-8)
        assert p.loss(torch.zeros(p.n_features)) == pytest.approx(0.5 * float((p.b.double() ** 2).mean()))
    s, d = sparse.sparsity(), dense.sparsity()
    assert s["Omega"] == 10 and s["Delta"] < 0.05 and s["rho"] < 0.3
    assert d["Omega"] == 50 and d["Delta"] == 1.0 and d["rho"] == 1.0


def test_serial_run_is_plain_sgd_and_reproducible(sparse, serial):
    # independent reference: textbook SGD with dense rows, same visiting order, γ·β^epoch
    small = sparse_problem(n_features=200, density=0.05, seed=3)
    A, b = _dense_rows(small).float(), small.b
    x = torch.zeros(small.n_features)
    for epoch, order in enumerate(example_order(small.n_examples, 0, 1, 3, seed=7)):
        for i in order:
            x -= LR * 0.8 ** epoch * (A[i] @ x - b[i]) * A[i]
    one = run_hogwild(small, 1, epochs=3, lr=LR, seed=7)
    torch.testing.assert_close(one["x"], x, atol=2e-5, rtol=1e-4)
    again = run_hogwild(sparse, 1, epochs=EPOCHS, lr=LR)
    assert torch.equal(again["x"], serial["x"])  # one writer: bitwise deterministic
    assert again["loss_curve"] == serial["loss_curve"]
    assert serial["updates"] == EPOCHS * sparse.n_examples
    assert serial["loss_curve"][0] == pytest.approx(sparse.loss(torch.zeros(sparse.n_features)))
    assert len(serial["loss_curve"]) == EPOCHS + 1


@pytest.mark.parametrize("locked", [False, True], ids=["lock-free", "locked"])
@pytest.mark.parametrize("n_procs", [2, 4])
def test_sparse_converges_like_serial(sparse, serial, n_procs, locked):
    r = run_hogwild(sparse, n_procs, epochs=EPOCHS, lr=LR, locked=locked)
    opt = sparse.opt_loss
    assert serial["final_loss"] - opt < REL_TOL * opt
    assert r["final_loss"] - opt < PAR_TOL * opt, (r["final_loss"], opt)
    assert abs(r["final_loss"] - serial["final_loss"]) < PAR_TOL * opt
    # every example visited once per epoch, split evenly over the processes
    assert r["updates"] == EPOCHS * sparse.n_examples
    assert max(r["per_process"]) - min(r["per_process"]) <= EPOCHS
    assert r["updates_per_s"] > 0 and r["loss_curve"][-1] < 0.05 * r["loss_curve"][0]


def test_dense_converges_and_lock_removes_stale_reads(dense):
    opt = dense.opt_loss
    free = run_hogwild(dense, 4, epochs=EPOCHS, lr=LR, track_conflicts=True)
    lock = run_hogwild(dense, 4, epochs=EPOCHS, lr=LR, locked=True, track_conflicts=True)
    # still SGD, with some gradients computed on stale x: it converges
    assert free["final_loss"] - opt < 2 * PAR_TOL * opt
    assert lock["final_loss"] - opt < 2 * PAR_TOL * opt
    # every example touches every coordinate: 4 processes on 2 cores interleave mid-update
    assert free["stale_update_frac"] > 0
    assert free["stale_coord_frac"] > 0
    assert lock["stale_update_frac"] == 0 and lock["stale_coord_frac"] == 0


def test_crash_is_reported_quickly(sparse):
    t = time.perf_counter()
    with pytest.raises(HogwildError, match=r"process 1 raised(.|\n)*injected failure"):
        run_hogwild(sparse, 2, epochs=500, lr=LR, fail_rank=1)  # ~1 min if it ran to the end
    assert time.perf_counter() - t < 10


def test_timeout_kills_everything(sparse):
    t = time.perf_counter()
    with pytest.raises(HogwildError, match="timeout_s=0.5"):
        run_hogwild(sparse, 2, epochs=500, lr=LR, timeout_s=0.5)
    assert time.perf_counter() - t < 10


def test_bad_input(sparse):
    with pytest.raises(ValueError, match="n_procs must be >= 1"):
        run_hogwild(sparse, 0)
    with pytest.raises(ValueError, match="lr 3.0 is outside"):
        run_hogwild(sparse, 1, lr=3.0)
    with pytest.raises(ValueError, match="density"):
        sparse_problem(100, density=2.0)
