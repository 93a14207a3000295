"""Chapter 00 — launch(fn, world_size, *args): run one function on many ranks, SPMD style, and get
the results.

Every chapter runs its experiments through this one call::

    def step(x):                      # may be defined in a notebook cell
        t = torch.full((2,), float(rank()))
        comm.all_reduce(t)
        return t

    launch(step, 4, 1.0)              # -> [tensor([6., 6.]), ...]  results of ranks 0..3

How it works (torch.distributed "Writing distributed applications" tutorial, with the sharp
edges filed off):

- ``fn`` and its arguments are serialised *by value* with cloudpickle, so functions from a notebook
  cell (and the globals they read) reach the ranks.
- Each rank is a fresh process that joins the process group through a **file** in a private
  temporary folder (``init_method="file://..."``): no port is chosen, so nothing collides, and two
  launches at once each have their own folder.
- Backend: NCCL with one GPU per rank when there are enough GPUs, else gloo on CPU;
  ``MTD_BACKEND`` overrides. On CPU each rank uses one intra-op thread (``MTD_THREADS``), so
  4 ranks on 2 cores do not fight over a thread pool.
- Start method: ``fork`` on Linux CPU runs (~0.1 s for 4 ranks) when CUDA is not initialised in
  this process; otherwise ``spawn`` (~2-3 s, CUDA-safe). ``MTD_START_METHOD`` overrides (:mod:`.env`
  checks it and ``MTD_THREADS``).
- At most :data:`~.env.RANKS_PER_CORE` ranks per CPU core (16 on 2 cores): ``launch(fn, 1000)``
  is refused at once instead of filling the machine's memory, unless ``oversubscribe=True`` (or
  ``MTD_OVERSUBSCRIBE=1``). ``timeout_s`` counts from the call, start-up included.
- Failure is loud and fast. A rank that raises: the others are killed and :class:`RankError`
  carries that rank's traceback. A rank that dies without a word (``os._exit``, a signal, a gloo
  abort): the error gives its exit code or signal and the tail of its stderr. Peers that failed
  only because it went away ("Connection reset by peer") are listed as consequences, not blamed
  (:mod:`.failures`). A rank that hangs (say, a collective only some ranks call): after
  ``timeout_s`` every rank is killed and :class:`LaunchTimeout` lists what each rank was last
  doing, read from the comm meter's status line.
- No orphans: the ranks die with the calling process, however it dies (SIGKILL included), and
  the run folder goes with them (:mod:`.supervise`). What a rank started dies with the rank, even a
  process in a session of its own (:mod:`.descendants`).
- Teardown: ``barrier()`` before ``destroy_process_group()`` (without it gloo ranks were seen to
  die with SIGABRT at exit), then the rank leaves with ``os._exit`` so no interpreter-exit
  destructor can abort it after its result is safely sent.
- Each rank's ``print`` output is collected and shown after the run, rank by rank, prefixed
  ``[rank r]``: deterministic output a notebook can check.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) there is nothing to start: the process group is
initialised from the environment, ``fn`` runs once in this process, and the results of all
ranks are gathered, so the same notebook code runs unchanged on many GPUs and nodes; a rank
that raises, or a hang, still ends every rank with the same error (:mod:`.torchrun`).
"""
from __future__ import annotations

import contextlib
import datetime
import faulthandler
import importlib
import math
import multiprocessing as mp
import multiprocessing.connection
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import comm, descendants, supervise
from .env import check_world_size, default_backend, requested_start_method, threads_per_rank
from .failures import LaunchTimeout, RankError, blame, death_report, is_peer_gone
from .torchrun import run_under_torchrun

__all__ = ["launch", "rank", "world_size", "device", "default_backend", "RankError", "LaunchTimeout"]

_STATUS_LEN = 512


# --- small helpers every chapter uses inside fn ----------------------------------------------


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MTD_LAUNCHED_RANK" not in os.environ


# --- the rank process -------------------------------------------------------------------------


def _rank_main(r: int, job: dict, conn: mp.connection.Connection, status: Any) -> None:
    """One rank: join the group, run fn, send ``(kind, data, type name)`` back through ``conn``.
    ``job`` is the dict :func:`launch` builds (the same for every rank)."""
    os.setpgrp()  # its own process group: a kill of the group reaches whatever this rank starts
    descendants.become_subreaper()  # ...and what leaves the group stays in this rank's tree
    supervise.die_with_parent(job["parent_pid"], job["rundir"])
    supervise.write_pid_file(job["rundir"], f"rank{r}")
    if job["reaper_fd"] is not None:  # started by fork: the reaper must see the parent's end only
        with contextlib.suppress(OSError):
            os.close(job["reaper_fd"])
    out = open(os.path.join(job["rundir"], f"rank{r}.out"), "w", buffering=1)
    err = open(os.path.join(job["rundir"], f"rank{r}.err"), "w", buffering=1)
    sys.stdout, sys.stderr = out, err
    os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)  # what C++ prints too (a gloo abort, say)
    faulthandler.disable()  # a forked rank inherits it, aimed at the caller's terminal
    n = job["world_size"]
    os.environ.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                      MTD_LAUNCHED_RANK=str(r), **{descendants.MARK_VAR: job["mark"]})
    comm.set_status_sink(status)
    comm.set_status("starting (before init_process_group)")
    msg = _run_fn(r, job)
    out.flush()  # before reporting: the caller kills the rank once it has the result
    err.flush()
    with contextlib.suppress(OSError):  # the caller is gone: the watchdog is ending this rank
        conn.send(msg)
        conn.close()
    if msg[0] == "error":
        # Stay alive (sockets open) until the caller kills every rank: exiting now would make the
        # peers fail with "connection reset" and bury the real error under theirs. The watchdog
        # started by die_with_parent ends this wait if the caller is gone.
        time.sleep(job["timeout_s"] + 60)
    descendants.kill_descendants([os.getpid()])  # what fn started and left running ends with it
    os._exit(0)


def _run_fn(r: int, job: dict) -> tuple:
    try:
        torch.set_num_threads(job["threads"])
        if job["backend"] == "nccl":
            torch.cuda.set_device(r % torch.cuda.device_count())
        dist.init_process_group(job["backend"], init_method=job["init_method"], rank=r,
                                world_size=job["world_size"],
                                timeout=datetime.timedelta(seconds=job["timeout_s"]))
        fn, args = cloudpickle.loads(job["payload"])
        comm.set_status("running fn (no collective yet)")
        result = fn(*args)
        comm.set_status("fn returned; in the final barrier")
        dist.barrier()
        dist.destroy_process_group()
        kind = type(result)
        return "ok", cloudpickle.dumps(result), f"{kind.__module__}.{kind.__qualname__}"
    except BaseException:  # anything a rank raises goes back to the caller
        return "error", traceback.format_exc(), ""


def _pick_start_method(backend: str, start_method: str | None) -> str:
    forced = requested_start_method(start_method)
    if forced:
        return forced
    if sys.platform.startswith("linux") and backend == "gloo" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


@contextlib.contextmanager
def _main_not_reimported() -> Iterator[None]:
    """Under spawn, multiprocessing re-runs the caller's ``__main__`` script in every child (its
    "safe importing of main module" rule), so a script without an ``if __name__ == "__main__"``
    guard would launch again from inside its ranks. ``fn`` travels by value, so the ranks need no
    ``__main__``: hide it from multiprocessing while the ranks start."""
    main = sys.modules["__main__"]
    saved: dict[str, Any] = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _kill(procs: list[mp.process.BaseProcess], mark: str) -> None:
    """Kill every rank and what it started: its tree first (while the rank, a subreaper, holds it
    together), then its process group, then what a rank that died on its own left behind."""
    descendants.kill_descendants([p.pid for p in procs if p.pid is not None and p.exitcode is None])
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        p.join(timeout=5)
    descendants.kill_marked(mark)


#: the marks torch's profiler (Kineto) prints to stderr at each start and stop: a timestamp and a pid,
#: noise in a notebook's output
_PROFILER_MARK = re.compile(r"^(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")


def _echo_outputs(outdir: str, n: int) -> None:
    """Show what each rank printed, rank by rank, each line prefixed ``[rank r]`` (the profiler's
    start and stop marks left out)."""
    for suffix, stream in ((".out", sys.stdout), (".err", sys.stderr)):
        for r in range(n):
            path = os.path.join(outdir, f"rank{r}{suffix}")
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read()
                for line in text.splitlines():
                    if not _PROFILER_MARK.match(line):
                        stream.write(f"[rank {r}] {line}\n")
    sys.stdout.flush()


# --- launch ------------------------------------------------------------------------------------


def _is_number(x: object) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def _check_arguments(world_size: object, timeout_s: object) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if timeout_s is None:
        raise ValueError("timeout_s=None: launch always has a time limit, so that a hang becomes an "
                         "error; for a long run pass a large one, e.g. timeout_s=24 * 3600")
    if not _is_number(timeout_s):
        raise ValueError(f"timeout_s must be a positive, finite number of seconds, got {timeout_s!r}")


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str | None = None,
           timeout_s: float = 300, start_method: str | None = None, threads: int | None = None,
           oversubscribe: bool | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks with torch.distributed initialised; return the
    list of per-rank results (rank 0 first).

    Raises :class:`RankError` if a rank raises or dies (naming the rank to blame, not a peer that
    failed because it went away), :class:`LaunchTimeout` if the ranks have not all returned within
    ``timeout_s`` seconds of this call, start-up included (a positive number; there is always a
    limit). If the calling process dies, its ranks die with it. More than
    :data:`~.env.RANKS_PER_CORE` ranks per CPU core is refused unless ``oversubscribe=True`` (or
    ``MTD_OVERSUBSCRIBE=1``).
    """
    called_at = time.monotonic()  # timeout_s counts from here: starting the ranks takes time too
    _check_arguments(world_size, timeout_s)
    if _under_torchrun():
        return run_under_torchrun(fn, world_size, args, backend, timeout_s)
    check_world_size(world_size, oversubscribe)
    threads = threads_per_rank(threads)
    backend = backend or default_backend(world_size)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl needs one GPU per rank: world_size={world_size} but "
                         f"{torch.cuda.device_count()} GPU(s) visible; use backend='gloo' or fewer ranks")
    ctx = mp.get_context(_pick_start_method(backend, start_method))
    fork = ctx.get_start_method() == "fork"
    if fork:
        # The first optimizer a process builds imports torch._dynamo (~1.5 s; 4 ranks on 2 cores
        # measured 4.2 s per launch). Importing it once here lets every forked rank inherit it.
        importlib.import_module("torch._dynamo")
    rundir = tempfile.mkdtemp(prefix="mtd-launch-")
    reaper = None
    # these three are filled as ranks start, so a failed start still cleans up
    procs: list = []
    conns: list = []
    statuses: list = []
    try:
        # the reaper also kills what a rank started in a session of its own, found by the launch's mark
        reaper = supervise.Reaper(rundir, marker=f"{descendants.MARK_VAR}={os.path.basename(rundir)}")
        job = dict(world_size=world_size, parent_pid=os.getpid(), reaper_fd=reaper.fd if fork else None,
                   backend=backend, init_method="file://" + os.path.join(rundir, "rendezvous"),
                   payload=cloudpickle.dumps((fn, args)), rundir=rundir, mark=os.path.basename(rundir),
                   threads=threads, timeout_s=timeout_s, deadline=called_at + timeout_s)
        _start_ranks(ctx, job, procs, conns, statuses, reaper)
        results = _collect(procs, conns, statuses, job, rundir)
        return [results[r] for r in range(world_size)]
    finally:
        _kill(procs, os.path.basename(rundir))
        for c in conns:
            c.close()
        _echo_outputs(rundir, world_size)
        shutil.rmtree(rundir, ignore_errors=True)
        if reaper is not None:
            reaper.close()


def _last_ops(statuses: list, world_size: int) -> dict:
    """What each rank was last doing (its comm status line); ranks not started yet say so."""
    last = {r: s.value.decode("utf-8", "replace") for r, s in enumerate(statuses)}
    for r in range(len(statuses), world_size):
        last[r] = "not started (the deadline passed while the ranks were being started)"
    return last


def _start_ranks(ctx: Any, job: dict, procs: list, conns: list, statuses: list,
                 reaper: supervise.Reaper) -> None:
    """Start one process per rank, each with a pipe for its result and a status line, and tell the
    reaper each rank's PID. Raises :class:`LaunchTimeout` if the deadline passes meanwhile."""
    starting = _main_not_reimported() if ctx.get_start_method() != "fork" else contextlib.nullcontext()
    with starting:
        for r in range(job["world_size"]):
            if time.monotonic() >= job["deadline"]:
                raise LaunchTimeout(job["timeout_s"], _last_ops(statuses, job["world_size"]), finished=set())
            recv_end, send_end = ctx.Pipe(duplex=False)
            status = ctx.Array("c", _STATUS_LEN, lock=False)
            p = ctx.Process(target=_rank_main, name=f"mtd-rank{r}", args=(r, job, send_end, status))
            p.start()
            reaper.watch(p.pid)
            send_end.close()
            procs.append(p)
            conns.append(recv_end)
            statuses.append(status)


def _receive(r: int, procs: list[mp.process.BaseProcess], conns: list[mp.connection.Connection],
             statuses: list, rundir: str) -> tuple:
    """Rank r's report as ``(kind, data)``: ``("ok", result)``, ``("error", traceback)``, or
    ``("died", death report)`` for a rank that ended without a word (os._exit, a signal...)."""
    try:
        kind, data, type_name = conns[r].recv()
    except (EOFError, OSError):
        procs[r].join(timeout=5)
        last_op = statuses[r].value.decode("utf-8", "replace")
        return "died", death_report(r, procs[r].exitcode, os.path.join(rundir, f"rank{r}.err"), last_op)
    if kind != "ok":
        return kind, data
    try:
        return "ok", cloudpickle.loads(data)
    except Exception as e:  # any unpickling failure is reported with its context
        return "error", (f"rank {r} returned a {type_name}, but it could not be unpickled in the caller:\n"
                         f"{type(e).__name__}: {e}\nReturn plain values (tensors, numbers, lists, "
                         f"dicts), or define the result's class where the caller can import it.")


def _finished_ranks(pending: set[int], procs: list[mp.process.BaseProcess],
                    conns: list[mp.connection.Connection], timeout: float) -> list[int]:
    """The pending ranks with a report to read, or whose process has ended (even if a process it
    started still holds its pipe open)."""
    ready: list[Any] = mp.connection.wait([conns[r] for r in pending], timeout=timeout)  # the conns given
    done = {conns.index(c) for c in ready}
    done |= {r for r in pending if procs[r].exitcode is not None}
    return sorted(done)


def _collect(procs: list[mp.process.BaseProcess], conns: list[mp.connection.Connection], statuses: list,
             job: dict, rundir: str) -> dict[int, object]:
    """Wait for every rank's report: ``{rank: result}``, or raise the :class:`RankError` of the rank
    to blame (after a grace for the others' reports: 0.5 s once a cause is known, up to 3 s while
    every failure so far looks like a consequence) or :class:`LaunchTimeout`."""
    world_size, timeout_s, deadline = len(procs), job["timeout_s"], job["deadline"]
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    died: set[int] = set()
    first_failure = None
    pending = set(range(world_size))
    while pending:
        now = time.monotonic()
        if first_failure is not None:
            has_cause = died or any(not is_peer_gone(t) for t in errors.values())
            if now >= first_failure + (0.5 if has_cause else 3.0):
                break
        if now >= deadline:
            raise LaunchTimeout(timeout_s, _last_ops(statuses, world_size), finished=set(results))
        for r in _finished_ranks(pending, procs, conns, timeout=min(deadline - now, 0.2)):
            kind, data = _receive(r, procs, conns, statuses, rundir)
            pending.discard(r)
            if kind == "ok":
                results[r] = data
                continue
            errors[r] = data
            if kind == "died":
                died.add(r)
            first_failure = first_failure or time.monotonic()
    if errors:
        raise blame(errors, died, world_size)
    return results
