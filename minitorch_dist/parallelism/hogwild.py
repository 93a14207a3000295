"""Chapter 02 — HOGWILD!: lock-free stochastic gradient descent on a shared-memory model.

Recht, Ré, Wright & Niu 2011, "HOGWILD!: A Lock-Free Approach to Parallelizing
Stochastic Gradient Descent", NIPS.

**§2, sparse separable costs.** The cost is a sum over hyperedges ``e`` of a hypergraph on the
coordinates ``{1..d}``::

    f(x) = Σ_{e ∈ E} f_e(x_e)        (eq. 2; x_e = the coordinates of x that example e touches)

Here ``f_e(x_e) = ½ (a_e·x_e − b_e)² / N`` (least squares), so the gradient of one term is
``(a_e·x_e − b_e) a_e``, supported on ``e`` alone. The paper's sparsity statistics:
``Ω = max |e|`` (how many coordinates one example touches), ``Δ`` (how many examples share the
most popular coordinate, as a fraction of |E|) and ``ρ`` (how many hyperedges one hyperedge
meets, as a fraction of |E|). When Ω, Δ, ρ are small, two concurrent updates rarely touch the
same coordinate, so running them without locks almost never loses anything (§4, Theorem 4.1:
the same O(1/k) rate as serial SGD as long as the delay τ satisfies ρτ², Δτ small).

**§4, the algorithm.** Each of P processors loops, with no lock anywhere::

    sample e uniformly; read x_e; compute G_e(x) = ∇f_e(x_e)
    for v in e: x_v ← x_v − γ·G_e(x)_v        (component-wise, in place)

We run P ``torch.multiprocessing`` processes (fork on Linux) over one tensor placed in shared
memory with ``share_memory_()``; ``index_add_`` writes only the support ``e``. The paper assumes
an atomic component-wise add; ``index_add_`` across processes is a plain read-add-write per
coordinate, so two processes adding to the same coordinate in the same instant can lose one
increment (an "overwrite"): rare when Ω/d is small, the price of having no lock. The ``locked``
variant wraps read-compute-write in one ``mp.Lock``: no update can see a half-written model, but
only one process makes progress at a time (the paper's "round robin"/locking baseline).

**Measuring conflicts.** With ``track_conflicts=True`` each coordinate carries a version
stamp, bumped by every write. A process compares the stamps of ``e`` at read time and just
before its write: a changed stamp means another process wrote that coordinate in between, so
the gradient was computed on a stale value ("stale coordinates"). On the sparse problem that
fraction is of order Ω/d per concurrently running writer; on the dense one (every example
touches every coordinate) it is a large fraction as soon as two processes actually run at once.
Stamps are themselves bumped without a lock, so this is an estimate (a lower bound).

Examples are split round-robin (process r gets examples r, r+P, …) and each process reshuffles
its share every epoch; one epoch = one pass of all processes over all N examples. The step is
``γ·β^epoch`` (§5: "the step size is diminished by a factor β at the end of each epoch").
"""
from __future__ import annotations

import multiprocessing as _std_mp
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from ..runtime import observe


class HogwildError(RuntimeError):
    """A HOGWILD! worker process raised, died, or the run passed its timeout."""


# --------------------------------------------------------------------------------------------
# Problems: least squares on a hypergraph (each example = one hyperedge with its values)
# --------------------------------------------------------------------------------------------
@dataclass
class Problem:
    """``f(x) = 1/(2N) Σ_i (a_i·x − b_i)²`` with row ``a_i`` stored sparsely as
    ``(idx[i], val[i])`` (its hyperedge and values). ``opt_loss`` = min_x f(x)."""

    name: str
    idx: torch.Tensor  # [N, k] int64: the support e_i of example i
    val: torch.Tensor  # [N, k] float32: the nonzero values of a_i (unit norm rows)
    b: torch.Tensor  # [N] float32
    n_features: int
    x_opt: torch.Tensor  # [d] float64: the minimiser (conjugate gradients)
    opt_loss: float

    @property
    def n_examples(self) -> int:
        return self.idx.shape[0]

    def loss(self, x: torch.Tensor) -> float:
        """f(x), evaluated in float64."""
        x = x.detach().to(torch.float64)
        r = (self.val.double() * x[self.idx]).sum(1) - self.b.double()
        return 0.5 * float((r * r).mean())

    def sparsity(self) -> dict:
        """The paper's Ω, Δ and ρ (§2) for this hypergraph; ρ is estimated on a sample."""
        N, k = self.idx.shape
        counts = torch.bincount(self.idx.flatten(), minlength=self.n_features)
        g = torch.Generator().manual_seed(0)
        sample = torch.randint(N, (min(N, 50),), generator=g)
        hits = torch.zeros(self.n_features, dtype=torch.bool)
        meets = []
        for i in sample.tolist():  # |{e' : e' ∩ e_i ≠ ∅}| / |E|
            hits.zero_()
            hits[self.idx[i]] = True
            meets.append(float(hits[self.idx].any(1).float().mean()))
        return {"Omega": k, "Delta": float(counts.max()) / N, "rho": max(meets)}


def _least_squares(idx, val, b, d, tol=1e-12) -> torch.Tensor:
    """argmin_x ‖Ax − b‖² by conjugate gradients on AᵀA x = Aᵀb, in float64, with A applied
    through its hyperedges (A v = Σ_k val·v[idx]; Aᵀ r scatters back) so A is never dense."""
    val, flat = val.double(), idx.flatten()  # idx, val: (N, Ω); flat: (N·Ω,)
    A = lambda v: (val * v[idx]).sum(1)  # (d,) -> (N,)
    At = lambda r: torch.zeros(d, dtype=torch.float64).index_add_(  # (N,) -> (d,)
        0, flat, (val * r[:, None]).flatten())
    x = torch.zeros(d, dtype=torch.float64)
    r = At(b.double())
    p, rr, rr0 = r.clone(), r @ r, r @ r
    for _ in range(10 * d):
        if rr <= tol * tol * rr0:
            break
        Ap = At(A(p))
        alpha = rr / (p @ Ap)
        x += alpha * p
        r -= alpha * Ap
        rr, rr_old = r @ r, rr
        p = r + (rr / rr_old) * p
    return x


def _make(name, idx, d, noise, seed) -> Problem:
    g = torch.Generator().manual_seed(seed + 1)
    N, k = idx.shape
    val = torch.randn(N, k, generator=g, dtype=torch.float64)
    val /= val.norm(dim=1, keepdim=True)  # unit rows: any γ < 2 is stable for one example
    x_star = torch.randn(d, generator=g, dtype=torch.float64)
    b = (val * x_star[idx]).sum(1) + noise * torch.randn(N, generator=g, dtype=torch.float64)
    x_opt = _least_squares(idx, val, b, d)
    p = Problem(name, idx, val.float(), b.float(), d, x_opt, 0.0)
    p.opt_loss = p.loss(x_opt)
    return p


def sparse_problem(n_features=10_000, n_examples=None, density=0.01, noise=0.1, seed=0) -> Problem:
    """Sparse least squares: each example touches ``round(density·d)`` random coordinates
    (Ω = density·d ≪ d, so Δ and ρ are small). ``n_examples`` defaults to 8·d."""
    k = max(1, round(density * n_features))
    if not 1 <= k <= n_features:
        raise ValueError(f"density {density} gives {k} coordinates per example; need 1..{n_features}")
    n_examples = n_examples or 8 * n_features
    g = torch.Generator().manual_seed(seed)
    # k distinct coordinates per example: draw with replacement, redraw the repeats until none
    idx = torch.randint(n_features, (n_examples, k), generator=g)
    while True:
        idx = idx.sort(1).values
        repeat = torch.zeros_like(idx, dtype=torch.bool)
        repeat[:, 1:] = idx[:, 1:] == idx[:, :-1]
        if not repeat.any():
            break
        idx[repeat] = torch.randint(n_features, (int(repeat.sum()),), generator=g)
    return _make(f"sparse(d={n_features}, Ω={k})", idx, n_features, noise, seed)


def dense_problem(n_features=50, n_examples=None, noise=0.1, seed=0) -> Problem:
    """Dense least squares: every example touches every coordinate (Ω = d, Δ = ρ = 1)."""
    n_examples = n_examples or 80 * n_features
    idx = torch.arange(n_features).expand(n_examples, n_features).contiguous()
    return _make(f"dense(d={n_features})", idx, n_features, noise, seed)


# --------------------------------------------------------------------------------------------
# The algorithm
# --------------------------------------------------------------------------------------------
def example_order(n_examples, rank, n_procs, epochs, seed=0):
    """The examples process ``rank`` visits, epoch by epoch: its share ``rank::n_procs``
    reshuffled each epoch from one generator seeded by (seed, rank)."""
    mine = torch.arange(rank, n_examples, n_procs)
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    return [mine[torch.randperm(len(mine), generator=g)].tolist() for _ in range(epochs)]


def _worker(rank, n_procs, problem, x, version, stats, snaps, cfg, lock, barrier, errors):
    try:
        torch.set_num_threads(1)  # P processes on P cores; intra-op threads would oversubscribe
        orders = example_order(problem.n_examples, rank, n_procs, cfg["epochs"], cfg["seed"])
        rows = list(zip(problem.idx, problem.val, problem.b.tolist()))
        track, updates, stale_updates, stale_coords = cfg["track_conflicts"], 0, 0, 0
        barrier.wait(timeout=60)
        for epoch, order in enumerate(orders):
            with observe.span("epoch", "hogwild", rank=rank, epoch=epoch):
                step = cfg["lr"] * cfg["decay"] ** epoch
                for i in order:
                    e, a, b = rows[i]
                    if lock is not None:
                        lock.acquire()
                    if track:
                        seen = version[e]  # index_select: a copy of the stamps at read time
                    r = float(torch.dot(x[e], a)) - b  # read x_e, G_e = r·a_e
                    if track:
                        n_stale = int((version[e] != seen).sum())
                        stale_coords += n_stale
                        stale_updates += n_stale > 0
                        version.index_add_(0, e, torch.ones_like(seen))
                    x.index_add_(0, e, a, alpha=-step * r)  # x_v -= γ G_v for v in e, in place
                    if lock is not None:
                        lock.release()
                    updates += 1
                    if cfg["fail_rank"] == rank:
                        raise RuntimeError(f"injected failure in process {rank} after {updates} update")
                if rank == 0:  # the loss curve: process 0 snapshots the shared x after each epoch
                    snaps[epoch + 1] = x
        coords_read = updates * problem.idx.shape[1]
        stats[rank, :4] = torch.tensor([updates, stale_updates, stale_coords, coords_read],
                                       dtype=torch.float64)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise SystemExit(1) from None  # the traceback went to the parent through `errors`


class _EpochClock:
    """Observer, in each worker process: writes when its epochs start and end into its row of the
    shared ``stats`` (column 4: the first epoch's start, 5: the last epoch's end; on process 0,
    column 6 + e: the end of epoch e), on one clock every process of this host shares."""

    def __init__(self, stats: torch.Tensor, rank: int):
        self.stats, self.rank = stats, rank

    def on_begin(self, name, category, meta):
        if category == "hogwild" and meta["epoch"] == 0:
            self.stats[self.rank, 4] = time.perf_counter()
        return meta if category == "hogwild" else None

    def on_end(self, meta) -> None:
        if meta is not None:
            t = time.perf_counter()
            self.stats[self.rank, 5] = t
            if self.rank == 0:
                self.stats[0, 6 + meta["epoch"]] = t


def _timed_worker(rank, n_procs, problem, x, version, stats, *args):
    """A worker process: :func:`_worker`, its epochs timed by :class:`_EpochClock`."""
    with observe.watching(_EpochClock(stats, rank)):
        _worker(rank, n_procs, problem, x, version, stats, *args)


def run_hogwild(problem: Problem, n_procs: int, epochs: int = 10, lr: float = 0.5,
                locked: bool = False, seed: int = 0, decay: float = 0.8,
                track_conflicts: bool = False, timeout_s: float = 120.0,
                start_method: str | None = None, fail_rank: int | None = None) -> dict:
    """Run HOGWILD! (or, with ``locked=True``, lock-per-update SGD) with ``n_procs`` processes
    on one shared-memory ``x`` (starting at 0) for ``epochs`` passes over the data.

    Returns a dict: ``x`` (final), ``final_loss``, ``opt_loss``, ``loss_curve`` (f after each
    epoch of process 0, index 0 = start), ``curve_t`` (seconds since start), ``updates``,
    ``updates_per_s``, ``wall_s`` (first start to last finish, process start-up excluded),
    ``launch_s`` (with start-up), ``per_process`` (updates each), and with
    ``track_conflicts`` ``stale_update_frac`` (updates that read ≥1 coordinate another process
    then wrote) and ``stale_coord_frac`` (of all coordinates read). ``fail_rank`` makes that
    process raise after its first update (to show how a crash is reported).
    """
    if n_procs < 1:
        raise ValueError(f"n_procs must be >= 1, got {n_procs}")
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    if not 0 < lr < 2:
        raise ValueError(f"lr {lr} is outside (0, 2): unit-norm rows make SGD unstable there")
    if start_method is None:
        fork_ok = "fork" in _std_mp.get_all_start_methods() and not torch.cuda.is_initialized()
        start_method = "fork" if fork_ok else "spawn"
    ctx = mp.get_context(start_method)
    d = problem.n_features
    shared = dict(  # host tensors in shared memory: every process reads and writes the same pages
        x=problem.val.new_zeros(d).share_memory_(),  # (d,) the model, in the problem's dtype
        version=torch.zeros(d, dtype=torch.int64).share_memory_(),  # (d,) per-coordinate write stamps
        stats=torch.zeros(n_procs, 6 + epochs, dtype=torch.float64).share_memory_(),  # (P, 6 + epochs)
        snaps=problem.val.new_zeros(epochs + 1, d).share_memory_(),  # (epochs + 1, d) process 0's x per epoch
    )
    cfg = dict(epochs=epochs, lr=lr, decay=decay, seed=seed, track_conflicts=track_conflicts,
               fail_rank=fail_rank)
    t0 = time.perf_counter()
    _run_processes(ctx, n_procs, problem, shared, cfg, ctx.Lock() if locked else None, t0, timeout_s)
    out = _summary(problem, shared, epochs, time.perf_counter() - t0, track_conflicts)
    out.update(n_procs=n_procs, locked=locked, epochs=epochs, lr=lr, problem=problem.name)
    return out


def _run_processes(ctx, n_procs, problem, shared, cfg, lock, t0, timeout_s) -> None:
    """Start the ``n_procs`` workers on the shared tensors, wait for them, and never leave one behind."""
    barrier, errors = ctx.Barrier(n_procs), ctx.SimpleQueue()
    procs = [ctx.Process(target=_timed_worker, name=f"hogwild-{r}", daemon=True,
                         args=(r, n_procs, problem, shared["x"], shared["version"], shared["stats"],
                               shared["snaps"], cfg, lock, barrier, errors)) for r in range(n_procs)]
    try:
        for p in procs:
            p.start()
        _wait(procs, errors, t0 + timeout_s, timeout_s)
    finally:  # never leave a process behind, whatever happened
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _summary(problem, shared, epochs, launch_s, track_conflicts) -> dict:
    """The run's numbers from the shared ``stats`` rows (columns: updates, stale updates, stale
    coordinates, coordinates read, start, end, then the time of each epoch's end)."""
    x, stats, snaps = shared["x"], shared["stats"], shared["snaps"]
    start, end = float(stats[:, 4].min()), float(stats[:, 5].max())
    updates = int(stats[:, 0].sum())
    out = dict(
        x=x.clone(), final_loss=problem.loss(x), opt_loss=problem.opt_loss,
        loss_curve=[problem.loss(s) for s in snaps],
        curve_t=[0.0] + [float(t) - start for t in stats[0, 6:6 + epochs]],
        updates=updates, updates_per_s=updates / (end - start), wall_s=end - start,
        launch_s=launch_s, per_process=[int(u) for u in stats[:, 0]],
    )
    if track_conflicts:
        out["stale_update_frac"] = float(stats[:, 1].sum()) / max(updates, 1)
        out["stale_coord_frac"] = float(stats[:, 2].sum()) / max(float(stats[:, 3].sum()), 1)
    return out


def _wait(procs, errors, deadline, timeout_s):
    """Join every process; on the first failure or at the deadline, raise (the caller's
    ``finally`` terminates the rest)."""
    while True:
        if not errors.empty():
            rank, tb = errors.get()
            raise HogwildError(f"HOGWILD! process {rank} raised:\n{tb}")
        for r, p in enumerate(procs):
            if p.exitcode not in (None, 0):
                time.sleep(0.05)  # let its traceback reach the queue
                if not errors.empty():
                    rank, tb = errors.get()
                    raise HogwildError(f"HOGWILD! process {rank} raised:\n{tb}")
                raise HogwildError(f"HOGWILD! process {r} died with exit code {p.exitcode} "
                                   "(negative = killed by that signal, e.g. -9 out of memory)")
        if all(p.exitcode == 0 for p in procs):
            return
        if time.perf_counter() > deadline:
            alive = [r for r, p in enumerate(procs) if p.is_alive()]
            raise HogwildError(f"HOGWILD! run passed timeout_s={timeout_s}: processes {alive} "
                               "still running; raise timeout_s or shrink the problem")
        time.sleep(0.005)


def sweep(problem: Problem, procs=(1, 2, 4), epochs=10, lr=0.5, seed=0, **kw) -> list[dict]:
    """Lock-free and locked runs for each process count: the rows of the chapter's table."""
    rows = []
    for locked in (False, True):
        for n in procs:
            r = run_hogwild(problem, n, epochs=epochs, lr=lr, locked=locked, seed=seed, **kw)
            rows.append({k: r[k] for k in ("problem", "n_procs", "locked", "final_loss",
                                           "opt_loss", "updates_per_s", "wall_s")}
                        | {k: r[k] for k in ("stale_update_frac",) if k in r})
    return rows
