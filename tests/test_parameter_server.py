"""Parameter server (ch02): BSP == synchronous SGD, SSP's staleness bound, ASP/SSP convergence,
key-range sharding, clean shutdown, a crashing worker surfaces as RankError.

Tolerances (tests/_support.py). The runs are in float64 (``float64()`` around them: the ranks are
forked and inherit it, so the problem, the servers' keys and the pushes are float64; checked). BSP
against one process is synchronous SGD on the least squares 1/(2B)‖A_B x − b_B‖² summed in another
order: each clock's gradient Aᵀ(Ax − b)/B within ``reorder_bound`` of its two reductions (n + 1 terms
for a residual, B = W·64 rows for the gradient, the residual's error carried through |A|ᵀ), and the
update x ← x − γg is affine with the non-expansive linear part I − γA_BᵀA_B/B (γ·λ_max <= 2, computed),
so the clocks' errors add up with no growth (``_bsp_bound``); the workers' losses, read at iterates
that far apart, within ‖∇f‖·δ + ½·λ_max(AᵀA/N)·δ². Convergence is a stated goal, TARGET, not a
rounding tolerance: the final loss within 2e-3 of the optimum, from a start more than 100 times that
far (checked).
"""
import multiprocessing
import os
import time

import pytest
import torch

from minitorch_dist.parallelism.parameter_server import LeastSquares, key_ranges, run_parameter_server
from minitorch_dist.runtime import RankError

from _support import float64, reorder_bound, roundoff

pytestmark = pytest.mark.ch02

S, W, CLOCKS, LR = 2, 2, 30, 0.2
STRAGGLER = {S + W - 1: 0.03}            # the last worker sleeps 30 ms per clock
TARGET = 2e-3                            # stated goal: final loss <= loss_opt + 2e-3 (the start is
                                         # more than 100 times further: checked)


@pytest.fixture(scope="module")
def runs():
    """One run per consistency model, all with the same straggler (shared by several tests)."""
    before = _children()
    with float64():  # forked ranks inherit it
        out = {"children_before": before,
               ("bsp", None): run_parameter_server("bsp", n_servers=S, n_workers=W, clocks=CLOCKS, lr=LR)}
        for mode, s in (("asp", None), ("ssp", 1), ("ssp", 2)):
            out[(mode, s)] = run_parameter_server(mode, staleness=s, n_servers=S, n_workers=W,
                                                  clocks=CLOCKS, lr=LR, straggler=STRAGGLER)
    return out


def _children() -> set:
    """(pid, state) of this process's children, read from /proc."""
    me, kids = str(os.getpid()), set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:            # fields: state, ppid, ...
                kids.add(pid)
    return kids


def _no_children_left(before: set):
    """No rank outlived its run. Children that existed before it (e.g. the multiprocessing resource
    tracker an earlier test started, which lives as long as the interpreter) are not ours."""
    assert multiprocessing.active_children() == []
    left = _children() - before
    assert not left, f"child processes left behind: {sorted(left)}"


def test_key_ranges_cover_all_keys_without_overlap():
    for n_keys, n_servers in ((101, 2), (101, 3), (7, 7), (10, 4), (1, 1)):
        r = key_ranges(n_keys, n_servers)
        assert len(r) == n_servers
        owned = [k for lo, hi in r for k in range(lo, hi)]
        assert owned == list(range(n_keys))                     # every key once, in order
        sizes = [hi - lo for lo, hi in r]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    with pytest.raises(ValueError, match="3 keys over 4 servers"):
        key_ranges(3, 4)


def test_bad_arguments_name_the_fix():
    with pytest.raises(ValueError, match="needs staleness"):
        run_parameter_server("ssp")
    with pytest.raises(ValueError, match="not one of"):
        run_parameter_server("hogwild")
    with pytest.raises(ValueError, match="ranks 0..1 are servers"):
        run_parameter_server("asp", straggler={0: 0.1})


def _bsp_bound(A, b, x, g, lr):
    """One clock's contribution to how far two evaluations of x - lr·Aᵀ(Ax - b)/B can be apart after
    it (2-norm): the gradient's two reductions reordered, the update's own rounding (module docstring)."""
    B, n = A.shape
    absA = A.abs()
    r_err = reorder_bound(n + 1, (absA @ x.abs() + b.abs()).max(), torch.float64)  # each residual
    r = A @ x - b
    g_err = (reorder_bound(B, (absA.t() @ r.abs()).max(), torch.float64)
             + (absA.t() @ torch.full_like(r, r_err)).max().item()) / B
    u = roundoff(torch.float64)
    return n ** 0.5 * (lr * g_err + 2 * u * (x.abs().max().item() + lr * g.abs().max().item()))


def _loss_eval_err(p, x):
    """How far ``p.loss(x)`` (float64) can be from the exact f(x): the residuals' dot products (n + 1
    terms each) and the mean of N squares, each rounded (one evaluation; two evaluations: twice it)."""
    r = p.A @ x - p.b
    r_err = reorder_bound(p.n_params + 1, p.A.abs() @ x.abs() + p.b.abs(), torch.float64) / 2  # one order
    return reorder_bound(p.n_rows, 0.5 * (r * r).mean(), torch.float64) / 2 + (r.abs() * r_err).mean().item()


def test_bsp_equals_synchronous_sgd_on_concatenated_batches(runs):
    r = runs[("bsp", None)]
    assert r["params"].dtype == torch.float64
    with float64():
        p = LeastSquares(n_workers=W)                            # the runner's defaults, in float64
    # Independent reference: one process, autograd on the concatenation of the W batches.
    x = torch.zeros(p.n_params, dtype=torch.float64, requires_grad=True)
    lam_full = torch.linalg.eigvalsh(p.A.t() @ p.A / p.n_rows).max().item()  # the loss's curvature, at most
    losses, loss_bounds, apart = [], [], 0.0  # apart: how far the two iterates can be by now (2-norm)

    def read_loss():  # f at the reference iterate, and how far f at the other one can be from it
        xd = x.detach()
        grad = (p.A.t() @ (p.A @ xd - p.b) / p.n_rows).norm().item()
        losses.append(p.loss(xd))
        loss_bounds.append(grad * apart + 0.5 * lam_full * apart ** 2 + 2 * _loss_eval_err(p, xd))

    for c in range(CLOCKS):
        read_loss()
        rows = torch.cat([p.batch_rows(w, c) for w in range(W)])
        A_B, b_B = p.A[rows], p.b[rows]
        loss = 0.5 * ((A_B @ x - b_B) ** 2).mean()
        (g,) = torch.autograd.grad(loss, x)
        lam = torch.linalg.eigvalsh(A_B.t() @ A_B / len(rows)).max().item()
        assert LR * lam <= 2  # I - γ A_BᵀA_B/B is non-expansive: the errors do not grow
        apart += _bsp_bound(A_B, b_B, x.detach(), g, LR)
        with torch.no_grad():
            x -= LR * g
    read_loss()
    torch.testing.assert_close(r["params"], x.detach(), atol=apart, rtol=0)
    for wl in r["workers"]:                                     # every pull saw the BSP iterate
        assert wl["clock"] == list(range(CLOCKS + 1))
        for c, (got, want, bound) in enumerate(zip(wl["loss"], losses, loss_bounds, strict=True)):
            assert abs(got - want) <= bound, (c, got, want, bound)
    assert set(r["staleness"]) == {0}
    # mechanism: pulls of t+1 after all pushes of t
    for srv in r["servers"]:
        pushed = [0] * W
        for kind, w, c in srv["events"]:
            if kind == "push":
                pushed[w] += 1
            else:
                assert min(pushed) >= c, f"BSP answered a pull of clock {c} with pushes {pushed}"


def _reconstruct_staleness(events, n_workers):
    """From a server's ordered event log alone: staleness of each push = its clock minus the
    slowest worker's clock when that worker's pull for the same clock was answered."""
    pushed, read_at, out = [0] * n_workers, {}, []
    for kind, w, c in events:
        if kind == "reply":
            read_at[(w, c)] = min(pushed)
        else:
            pushed[w] += 1
            out.append(c - read_at[(w, c)])
    return out


@pytest.mark.parametrize("s", [1, 2])
def test_ssp_staleness_never_exceeds_bound_and_binds_with_a_straggler(runs, s):
    r = runs[("ssp", s)]
    for srv in r["servers"]:
        assert len(srv["pushes"]) == W * CLOCKS                 # every push reached every server
        assert srv["staleness"] == _reconstruct_staleness(srv["events"], W)
    assert min(r["staleness"]) >= 0
    assert max(r["staleness"]) == s, f"SSP({s}) staleness histogram: {sorted(r['staleness'])}"


def test_asp_staleness_is_unbounded_by_s(runs):
    r = runs[("asp", None)]
    for srv in r["servers"]:
        assert srv["staleness"] == _reconstruct_staleness(srv["events"], W)
    assert max(r["staleness"]) > 2        # more than SSP(2) would ever allow


@pytest.mark.parametrize("key", [("asp", None), ("ssp", 1), ("ssp", 2), ("bsp", None)])
def test_reaches_stated_loss_on_the_convex_problem(runs, key):
    r = runs[key]
    first = r["workers"][0]["loss"][0]
    assert first > 100 * TARGET                                 # it had far to go
    assert r["loss"] <= r["loss_opt"] + TARGET, (key, r["loss"], r["loss_opt"])
    for wl in r["workers"]:
        assert len(wl["time"]) == CLOCKS + 1 and wl["time"] == sorted(wl["time"])
        assert len(wl["wait"]) == CLOCKS + 1 and all(0 <= w <= t for w, t in zip(wl["wait"], wl["time"]))
    for srv in r["servers"]:  # each push stamped when it was applied, in the order applied
        times = [p["time"] for p in srv["pushes"]]
        assert len(times) == W * CLOCKS and times == sorted(times) and times[-1] <= r["run_s"]


def test_shutdown_returns_server_logs_and_leaves_no_process(runs):
    for key, r in runs.items():
        if key == "children_before":
            continue
        assert [s["role"] for s in r["servers"]] == ["server"] * S
        assert [w["worker"] for w in r["workers"]] == list(range(W))
    _no_children_left(runs["children_before"])


def test_crashing_worker_raises_rank_error_quickly():
    crash_rank, timeout = S + 1, 30
    before = _children()
    t = time.monotonic()
    with pytest.raises(RankError) as e:
        run_parameter_server("bsp", n_servers=S, n_workers=W, clocks=CLOCKS, crash={crash_rank: 5},
                             timeout_s=timeout)
    elapsed = time.monotonic() - t
    assert e.value.rank == crash_rank
    assert f"worker 1 (rank {crash_rank}) crashed at clock 5" in str(e.value)
    assert elapsed < timeout / 3, f"took {elapsed:.1f} s to report the crash"
    _no_children_left(before)
