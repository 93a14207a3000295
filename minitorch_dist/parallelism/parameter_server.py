"""Chapter 02 — a parameter server with three consistency models: BSP, ASP and SSP(s).

Papers:
- Li et al. 2014, "Scaling Distributed Machine Learning with the Parameter Server", OSDI,
  §3: parameters are (key, value) pairs; workers *push* gradients and *pull* values; the keys are
  range-partitioned over the server nodes (§3.1 key ranges, §3.3 push/pull).
- Ho et al. 2013, "More Effective Distributed ML via a Stale Synchronous Parallel Parameter
  Server", NIPS, §2-3: SSP. Each worker has a clock c (clocks it has completed). A worker at clock c
  may read only when the slowest worker has reached clock c - s. s = 0 is BSP (bulk synchronous),
  s = inf is ASP (fully asynchronous).

Roles inside ``launch(fn, S + W)``: ranks 0..S-1 are servers, ranks S..S+W-1 are workers. The
parameters are one flat fp32 vector of P keys; server k owns keys ``key_ranges(P, S)[k]``.

Protocol (torch.distributed point-to-point on gloo; ``recv(src=None)`` receives from any source)::

    worker -> server   header [op, worker, clock, pulled_version, pulled_clock, 0]  (int64, tag 1)
                       op PUSH: followed by the gradient slice (fp32, tag 2)
                       op PULL: the server answers when the consistency rule admits it
                       op DONE: this worker has finished
    server -> worker   header [version, server_clock, ...]  (tag 3), then the slice (tag 4)

Point-to-point rather than ``torch.distributed.rpc``: a server is then a plain loop
``recv header from anyone -> act -> answer the pulls that became admissible``, the message sizes are
visible, and it uses the same process group (and failure handling) as every other chapter.

Consistency, with ``done[w]`` = pushes this server received from worker w (its clock, as seen here)
and ``server_clock = min_w done[w]`` (every update of clocks < server_clock is in the parameters):

- admission: a PULL from a worker at clock c is answered once ``c - server_clock <= s``.
- BSP (s = 0): the server sums the W gradients of clock t and applies their *mean* once all have
  arrived, ``x -= lr * mean_w g_w``: exactly synchronous SGD on the concatenated batches.
- ASP (s = inf), SSP (finite s): each push is applied on arrival with ``x -= (lr / W) * g`` (scaled by
  1/W so that one clock of W pushes is one averaged SGD step, the same step size as BSP).

Staleness of an applied push (in clocks, Ho et al.'s definition): the push of worker w for clock c
was computed on parameters with server clock m (recorded when its pull was answered); it is
logically an update of clock c, which under BSP would have read server clock c. So
``staleness = c - m``: the number of clocks whose updates it may not have seen. SSP admission
guarantees ``0 <= staleness <= s``. We also record ``delay`` = pushes applied to the shard between
the pull and this push (the "tau" of asynchronous SGD analyses).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..runtime import comm, observe
from ..runtime.launch import launch

PUSH, PULL, DONE = 0, 1, 2
TAG_REQ, TAG_GRAD, TAG_REPLY, TAG_VALUES = 1, 2, 3, 4
_HDR = 6  # header length (int64)
_MODES = ("bsp", "asp", "ssp")


def key_ranges(n_keys: int, n_servers: int) -> list[tuple[int, int]]:
    """Range partition of keys 0..n_keys-1 over servers (Li et al. §3.1): server k owns [lo, hi).

    Sizes differ by at most one key; the first ``n_keys % n_servers`` servers get the extra key."""
    if n_servers < 1 or n_keys < n_servers:
        raise ValueError(f"cannot split {n_keys} keys over {n_servers} servers: "
                         f"need 1 <= n_servers <= n_keys")
    base, extra = divmod(n_keys, n_servers)
    bounds, lo = [], 0
    for k in range(n_servers):
        hi = lo + base + (1 if k < extra else 0)
        bounds.append((lo, hi))
        lo = hi
    return bounds


# --- the convex problem -----------------------------------------------------------------------


class LeastSquares:
    """f(x) = 1/(2N) ||A x - b||^2 with b = A x_true + noise; known optimum x_opt = argmin f.

    Worker w owns rows ``shard(w)``; at clock c it uses ``batch_size`` rows of its shard drawn by a
    generator seeded from (seed, w, c), so every process (and the reference loop) sees the same
    batches. Everything is deterministic given ``seed``.
    """

    def __init__(self, n_params=101, n_rows=1024, n_workers=2, batch_size=64, noise=0.1, seed=0):
        if n_rows < n_workers * batch_size:
            raise ValueError(f"n_rows {n_rows} < n_workers * batch_size = {n_workers * batch_size}: "
                             f"each worker's shard must hold one batch; use more rows or a smaller batch")
        g = torch.Generator().manual_seed(seed)
        self.n_params, self.n_rows, self.n_workers, self.batch_size, self.seed = (
            n_params, n_rows, n_workers, batch_size, seed)
        self.A = torch.randn(n_rows, n_params, generator=g)
        self.x_true = torch.randn(n_params, generator=g) / math.sqrt(n_params)
        self.b = self.A @ self.x_true + noise * torch.randn(n_rows, generator=g)
        A64, b64 = self.A.double(), self.b.double()
        self.x_opt = torch.linalg.lstsq(A64, b64.unsqueeze(1)).solution.squeeze(1)
        self.loss_opt = float(0.5 * ((A64 @ self.x_opt - b64) ** 2).mean())

    def shard(self, w: int) -> range:
        per = self.n_rows // self.n_workers
        return range(w * per, (w + 1) * per)

    def batch_rows(self, w: int, clock: int) -> torch.Tensor:
        s = self.shard(w)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + w * 10_007 + clock)
        return s.start + torch.randperm(len(s), generator=g)[: self.batch_size]

    def loss(self, x: torch.Tensor) -> float:
        """Full-data loss (for logs), in float64."""
        r = self.A.double() @ x.double() - self.b.double()
        return float(0.5 * (r ** 2).mean())

    def grad(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Gradient of the batch loss 1/(2B) ||A_B x - b_B||^2: A_B^T (A_B x - b_B) / B."""
        A, b = self.A[rows], self.b[rows]  # (B, n_params), (B,)
        return A.t() @ (A @ x - b) / len(rows)  # (n_params,)


# --- messages ---------------------------------------------------------------------------------


def _send(t, dst, tag, what):
    comm.record("send", t.numel() * t.element_size(), 2, t.dtype, t.shape)
    comm.set_status(f"in send {what} to rank {dst}")
    dist.send(t, dst, tag=tag)
    comm.set_status(f"after send {what} to rank {dst}")


def _recv(t, src, tag, what):
    comm.record("recv", t.numel() * t.element_size(), 2, t.dtype, t.shape)
    comm.set_status(f"in recv {what} from {'any rank' if src is None else f'rank {src}'}")
    got = dist.recv(t, src, tag=tag)
    comm.set_status(f"after recv {what} from rank {got}")
    return got


def _header(*vals):
    h = torch.zeros(_HDR, dtype=torch.int64)
    h[: len(vals)] = torch.tensor(vals, dtype=torch.int64)
    return h


@dataclass
class PSConfig:
    mode: str
    bound: float  # staleness bound s in clocks: 0 (BSP), s (SSP), inf (ASP)
    n_servers: int
    n_workers: int
    clocks: int
    lr: float
    straggler: dict
    crash: dict


# --- server -----------------------------------------------------------------------------------


class _Shard:
    """One server's keys ``[lo, hi)`` and its bookkeeping: the workers' clocks as seen here, the
    pulls not yet admitted, the replies still being sent, and the log of applied pushes."""

    def __init__(self, cfg: PSConfig, problem: LeastSquares):
        self.cfg, self.k = cfg, dist.get_rank()
        self.lo, self.hi = key_ranges(problem.n_params, cfg.n_servers)[self.k]
        self.x = torch.zeros(self.hi - self.lo)  # (hi - lo,) this server's keys, initialised at 0
        self.done = [0] * cfg.n_workers         # pushes received per worker = its clock as seen here
        self.pending, self.in_flight = [], []   # admitted-later pulls (w, c, src); isend handles
        self.version = 0                        # pushes applied to this shard
        self.bsp_sum, self.bsp_n = torch.zeros_like(self.x), 0
        self.pushes, self.events = [], []       # per applied push; ordered event log (for checks)

    def push(self, w: int, c: int, v_pulled: int, m_pulled: int, grad: torch.Tensor) -> None:
        """Worker ``w``'s gradient of clock ``c``: BSP averages the W gradients of a clock, ASP/SSP
        apply each on arrival scaled by 1/W."""
        cfg, W = self.cfg, self.cfg.n_workers
        if c != self.done[w]:
            raise RuntimeError(f"server {self.k}: worker {w} pushed clock {c}, expected {self.done[w]}")
        self.done[w] += 1
        observe.mark("push", "ps", server=self.k, worker=w, clock=c)
        self.pushes.append(dict(worker=w, clock=c, staleness=c - m_pulled, delay=self.version - v_pulled))
        self.events.append(("push", w, c))
        if cfg.mode == "bsp":  # wait for all W gradients of clock c, apply their mean
            self.bsp_sum += grad
            self.bsp_n += 1
            if self.bsp_n == W:
                self.x -= cfg.lr * (self.bsp_sum / W)
                self.version += W
                self.bsp_sum.zero_()
                self.bsp_n = 0
        else:
            self.x -= (cfg.lr / W) * grad
            self.version += 1

    def answer_pulls(self) -> None:
        """Answer every pull the consistency rule now admits (Ho et al.: read at clock c once the
        slowest worker has reached c - s). isend on a snapshot: x keeps changing meanwhile."""
        server_clock = min(self.done)
        waiting = []
        for w, c, src in self.pending:
            if c - server_clock <= self.cfg.bound:
                self.events.append(("reply", w, c))
                comm.record("send", 8 * _HDR, 2, torch.int64, (_HDR,))             # header, then values
                x = self.x
                comm.record("send", x.element_size() * x.numel(), 2, x.dtype, tuple(x.shape))
                self.in_flight += [dist.isend(_header(self.version, server_clock), src, tag=TAG_REPLY),
                                   dist.isend(self.x.clone(), src, tag=TAG_VALUES)]
            else:
                waiting.append((w, c, src))
        self.pending = waiting
        self.in_flight = [h for h in self.in_flight if not h.is_completed()]

    def result(self) -> dict:
        for h in self.in_flight:
            h.wait()
        return dict(role="server", server=self.k, key_range=(self.lo, self.hi), params=self.x,
                    version=self.version, pushes=self.pushes, events=self.events,
                    staleness=[p["staleness"] for p in self.pushes], delay=[p["delay"] for p in self.pushes])


def _server(cfg: PSConfig, problem: LeastSquares) -> dict:
    """Serve requests until every worker said DONE: push, pull or done, each after a header."""
    shard = _Shard(cfg, problem)
    hdr, grad = torch.zeros(_HDR, dtype=torch.int64), torch.empty_like(shard.x)
    finished = set()
    while len(finished) < cfg.n_workers:
        src = _recv(hdr, None, TAG_REQ, "request header")
        op, w, c, v_pulled, m_pulled = hdr[:5].tolist()
        if op == PUSH:
            _recv(grad, src, TAG_GRAD, "gradient")
            shard.push(w, c, v_pulled, m_pulled, grad)
        elif op == PULL:
            shard.pending.append((w, c, src))
        elif op == DONE:
            finished.add(w)
        else:
            raise RuntimeError(f"server {shard.k}: unknown op {op} from rank {src}")
        shard.answer_pulls()
    out = shard.result()
    comm.set_status("server finished")
    return out


# --- worker -----------------------------------------------------------------------------------


def _pull(cfg, ranges, w, c):
    """Pull every shard for clock c (blocks until each server admits it); return the values and
    each server's (version, server_clock) of the snapshot."""
    hdrs = [torch.zeros(_HDR, dtype=torch.int64) for _ in ranges]
    vals = [torch.empty(hi - lo) for lo, hi in ranges]
    # Post the receives first, so a server's reply never waits for us.
    works = [dist.irecv(t, s, tag=tag) for s in range(cfg.n_servers)
             for t, tag in ((hdrs[s], TAG_REPLY), (vals[s], TAG_VALUES))]
    for s in range(cfg.n_servers):
        _send(_header(PULL, w, c), s, TAG_REQ, f"pull (clock {c})")
    comm.set_status(f"waiting for pull replies (clock {c})")
    for h in works:
        h.wait()
    for h, v in zip(hdrs, vals):          # metered once they have arrived, as a blocking recv is
        comm.record("recv", 8 * _HDR, 2, h.dtype, tuple(h.shape))
        comm.record("recv", v.element_size() * v.numel(), 2, v.dtype, tuple(v.shape))
    return torch.cat(vals), [(int(h[0]), int(h[1])) for h in hdrs]  # n_servers x (hi - lo,) -> (n_params,)


def _worker(cfg: PSConfig, problem: LeastSquares) -> dict:
    r = dist.get_rank()
    w = r - cfg.n_servers
    ranges = key_ranges(problem.n_params, cfg.n_servers)
    log = dict(role="worker", worker=w, rank=r, clock=[], loss=[])
    for c in range(cfg.clocks + 1):       # the last pull (clock T) only logs the final loss
        with observe.span("pull", "ps", worker=w, clock=c):
            x, snap = _pull(cfg, ranges, w, c)
        log["clock"].append(c)
        log["loss"].append(problem.loss(x))
        if c == cfg.clocks:
            break
        g = problem.grad(x, problem.batch_rows(w, c))
        if r in cfg.straggler:
            time.sleep(cfg.straggler[r])
        if cfg.crash.get(r) == c:
            raise RuntimeError(f"worker {w} (rank {r}) crashed at clock {c} (injected failure)")
        for s, (lo, hi) in enumerate(ranges):
            version, server_clock = snap[s]
            _send(_header(PUSH, w, c, version, server_clock), s, TAG_REQ, f"push header (clock {c})")
            _send(g[lo:hi].contiguous(), s, TAG_GRAD, f"gradient (clock {c})")
    for s in range(cfg.n_servers):
        _send(_header(DONE, w, cfg.clocks), s, TAG_REQ, "done")
    comm.set_status("worker finished")
    return log


class _Clock:
    """Observer on one rank: when each of its pulls was asked and answered, when each push reached it;
    seconds since ``t0``, one origin for all ranks (CLOCK_MONOTONIC is shared by a host's processes)."""

    def __init__(self, t0: float):
        self.t0 = t0
        self.pulls: list[tuple[float, float]] = []  # (asked, answered) per pull, in order
        self.pushes: list[float] = []               # applied at, per push, in order

    def on_begin(self, name, category, meta):
        return time.monotonic() - self.t0 if (category, name) == ("ps", "pull") else None

    def on_end(self, asked) -> None:
        if asked is not None:
            self.pulls.append((asked, time.monotonic() - self.t0))

    def on_mark(self, name, category, meta) -> None:
        if (category, name) == ("ps", "push"):
            self.pushes.append(time.monotonic() - self.t0)

    def stamp(self, out: dict) -> dict:
        """A worker's log gains ``time`` (each pull answered) and ``wait`` (seconds blocked in it); a
        server's pushes gain ``time`` (applied)."""
        if out["role"] == "worker":
            out["time"] = [answered for _, answered in self.pulls]
            out["wait"] = [answered - asked for asked, answered in self.pulls]
        else:
            for push, t in zip(out["pushes"], self.pushes, strict=True):
                push["time"] = t
        return out


def _ps_main(cfg: PSConfig, problem_kwargs: dict, t0: float):
    problem = LeastSquares(**problem_kwargs)
    dist.barrier()                        # a common start
    with observe.watching(_Clock(t0)) as clock:
        out = _server(cfg, problem) if dist.get_rank() < cfg.n_servers else _worker(cfg, problem)
    return clock.stamp(out)


# --- the public runner ------------------------------------------------------------------------


def run_parameter_server(mode="bsp", staleness=None, n_servers=2, n_workers=2, clocks=30, lr=0.2,
                         straggler=None, crash=None, seed=0, n_params=101, n_rows=1024,
                         batch_size=64, noise=0.1, timeout_s=60) -> dict:
    """Run S servers and W workers (``launch(..., S + W)``) on a :class:`LeastSquares` problem.

    mode: "bsp" (s = 0), "asp" (s = inf) or "ssp" (needs ``staleness=s``, an int >= 0).
    straggler: ``{rank: seconds}`` extra sleep per clock for worker ranks (ranks S..S+W-1).
    crash: ``{rank: clock}`` makes that worker raise at that clock (fault-injection for tests).

    Returns a dict: ``params`` (final, gathered from the servers), ``loss`` (final full-data loss),
    ``loss_opt``, ``x_opt``, ``workers`` (per worker: clock, time, loss of the pulled parameters,
    wait = seconds blocked in the pull), ``servers`` (per server: key_range, pushes, staleness,
    delay, events), ``staleness`` (all applied pushes, all servers), ``wall_s`` (launch included),
    ``run_s`` (first pull to the last worker's final pull), ``pushes_per_s`` (per server, over run_s).
    """
    if mode not in _MODES:
        raise ValueError(f"mode {mode!r} is not one of {_MODES}")
    if mode == "ssp":
        if staleness is None or int(staleness) != staleness or staleness < 0:
            raise ValueError(f"mode 'ssp' needs staleness=s, an int >= 0 (got {staleness!r})")
        bound = int(staleness)
    elif staleness is not None:
        raise ValueError(f"staleness={staleness!r} is only for mode 'ssp' ('{mode}' fixes it)")
    else:
        bound = 0 if mode == "bsp" else math.inf
    straggler, crash = dict(straggler or {}), dict(crash or {})
    workers = range(n_servers, n_servers + n_workers)
    for name, d in (("straggler", straggler), ("crash", crash)):
        bad = [r for r in d if r not in workers]
        if bad:
            raise ValueError(f"{name} ranks {bad} are not workers: workers are ranks "
                             f"{n_servers}..{n_servers + n_workers - 1} "
                             f"(ranks 0..{n_servers - 1} are servers)")
    cfg = PSConfig(mode, bound, n_servers, n_workers, clocks, lr, straggler, crash)
    pk = dict(n_params=n_params, n_rows=n_rows, n_workers=n_workers, batch_size=batch_size,
              noise=noise, seed=seed)
    key_ranges(n_params, n_servers)       # validate before starting processes
    problem = LeastSquares(**pk)
    t = time.monotonic()
    out = launch(_ps_main, n_servers + n_workers, cfg, pk, t, timeout_s=timeout_s)
    wall = time.monotonic() - t
    servers, workers_ = out[:n_servers], out[n_servers:]
    _from_the_first_pull(servers, workers_)
    params = torch.cat([s["params"] for s in servers])
    n_push = sum(len(s["pushes"]) for s in servers) / n_servers
    run_s = max(wl["time"][-1] for wl in workers_)
    return dict(mode=mode, bound=bound, n_servers=n_servers, n_workers=n_workers, clocks=clocks,
                lr=lr, straggler=straggler, params=params, loss=problem.loss(params),
                loss_opt=problem.loss_opt, x_opt=problem.x_opt, workers=workers_, servers=servers,
                staleness=[st for s in servers for st in s["staleness"]], wall_s=wall, run_s=run_s,
                pushes_per_s=n_push / run_s)


def _from_the_first_pull(servers: list, workers: list) -> None:
    """Every stamp moved, in place, to seconds since the first pull any worker asked for."""
    start = min(wl["time"][0] - wl["wait"][0] for wl in workers)
    for wl in workers:
        wl["time"] = [t - start for t in wl["time"]]
    for push in (p for srv in servers for p in srv["pushes"]):
        push["time"] -= start


def synchronous_sgd(problem: LeastSquares, clocks: int, lr: float) -> torch.Tensor:
    """The single-process reference BSP must equal: x -= lr * mean_w grad_w(x) on each clock's batches."""
    x = torch.zeros(problem.n_params)
    for c in range(clocks):
        grads = [problem.grad(x, problem.batch_rows(w, c)) for w in range(problem.n_workers)]
        x = x - lr * sum(grads) / problem.n_workers
    return x
