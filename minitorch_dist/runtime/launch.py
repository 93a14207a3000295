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
  this process; otherwise ``spawn`` (~2-3 s, CUDA-safe). ``MTD_START_METHOD`` overrides.
- Failure is loud and fast. A rank that raises: the others are killed and :class:`RankError`
  carries that rank's traceback. A rank that hangs (say, a collective only some ranks call):
  after ``timeout_s`` every rank is killed and :class:`LaunchTimeout` lists what each rank was
  last doing, read from the comm meter's status line.
- Teardown: ``barrier()`` before ``destroy_process_group()`` (without it gloo ranks were seen to
  die with SIGABRT at exit), then the rank leaves with ``os._exit`` so no interpreter-exit
  destructor can abort it after its result is safely sent.
- Each rank's ``print`` output is collected and shown after the run, rank by rank, prefixed
  ``[rank r]``: deterministic output a notebook can check.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) there is nothing to start: the process group is
initialised from the environment, ``fn`` runs once in this process, and the results of all
ranks are gathered, so the same notebook code runs unchanged on many GPUs and nodes.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import importlib
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import warnings

import cloudpickle
import torch
import torch.distributed as dist

from . import comm

_STATUS_LEN = 512


class RankError(RuntimeError):
    """A rank raised (or died). ``.rank`` names it; ``.remote_traceback`` is its traceback text."""

    def __init__(self, rank: int, remote_traceback: str, world_size: int):
        self.rank, self.remote_traceback = rank, remote_traceback
        super().__init__(f"rank {rank} of {world_size} failed:\n\n{remote_traceback.rstrip()}")


class LaunchTimeout(RuntimeError):
    """Not every rank finished within ``timeout_s``. ``.last_ops[r]`` is what rank r was last doing."""

    def __init__(self, timeout_s: float, last_ops: dict, finished: set):
        self.last_ops, self.finished = last_ops, finished
        lines = [f"launch timed out after {timeout_s:g} s; every rank was killed. Last op of each rank:"]
        for r, op in sorted(last_ops.items()):
            lines.append(f"  rank {r}: {'finished' if r in finished else op}")
        lines.append("A collective that only some ranks call, or called in a different order, "
                     "hangs like this.")
        super().__init__("\n".join(lines))


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


def default_backend(world_size: int) -> str:
    """``MTD_BACKEND`` if set; NCCL when there is one GPU per rank; else gloo."""
    forced = os.environ.get("MTD_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def _threads_per_rank() -> int:
    return int(os.environ.get("MTD_THREADS", "1"))


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MTD_LAUNCHED_RANK" not in os.environ


# --- the rank process -------------------------------------------------------------------------


def _rank_main(r, n, backend, init_method, payload, conn, status, outdir, threads, timeout_s):
    os.setpgrp()  # its own process group: a kill reaches whatever this rank starts, too
    out = open(os.path.join(outdir, f"rank{r}.out"), "w", buffering=1)
    err = open(os.path.join(outdir, f"rank{r}.err"), "w", buffering=1)
    sys.stdout, sys.stderr = out, err
    os.environ.update(RANK=str(r), WORLD_SIZE=str(n), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(n),
                      MTD_LAUNCHED_RANK=str(r))
    comm.set_status_sink(status)
    comm.set_status("starting (before init_process_group)")
    try:
        torch.set_num_threads(threads)
        if backend == "nccl":
            torch.cuda.set_device(r % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=init_method, rank=r, world_size=n,
                                timeout=datetime.timedelta(seconds=timeout_s))
        fn, args = cloudpickle.loads(payload)
        comm.set_status("running fn (no collective yet)")
        result = fn(*args)
        comm.set_status("fn returned; in the final barrier")
        dist.barrier()
        dist.destroy_process_group()
        msg = ("ok", cloudpickle.dumps(result))
    except BaseException:  # noqa: BLE001 - anything a rank raises goes back to the caller
        msg = ("error", traceback.format_exc())
    out.flush(), err.flush()  # before reporting: the caller kills the rank once it has the result
    try:
        conn.send(msg)
    except Exception:  # e.g. an unpicklable result
        msg = ("error", traceback.format_exc())
        conn.send(msg)
    conn.close()
    if msg[0] == "error":
        # Stay alive (sockets open) until the caller kills every rank: exiting now would make the
        # peers fail with "connection reset" and bury the real error under theirs.
        parent = os.getppid()
        for _ in range(int(timeout_s) + 60):
            if os.getppid() != parent:
                break
            time.sleep(1)
    os._exit(0)


def _pick_start_method(backend: str) -> str:
    forced = os.environ.get("MTD_START_METHOD")
    if forced:
        return forced
    if sys.platform.startswith("linux") and backend == "gloo" and not torch.cuda.is_initialized():
        return "fork"
    return "spawn"


@contextlib.contextmanager
def _main_not_reimported():
    """Under spawn, multiprocessing re-runs the caller's ``__main__`` script in every child (its
    "safe importing of main module" rule), so a script without an ``if __name__ == "__main__"``
    guard would launch again from inside its ranks. ``fn`` travels by value, so the ranks need no
    ``__main__``: hide it from multiprocessing while the ranks start."""
    main = sys.modules["__main__"]
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def _kill(procs) -> None:
    for p in procs:
        if p.pid is not None and p.exitcode is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        p.join(timeout=5)


def _echo_outputs(outdir: str, n: int) -> None:
    """Show what each rank printed, rank by rank, each line prefixed ``[rank r]``."""
    for suffix, stream in ((".out", sys.stdout), (".err", sys.stderr)):
        for r in range(n):
            path = os.path.join(outdir, f"rank{r}{suffix}")
            if os.path.exists(path):
                with open(path) as f:
                    text = f.read()
                for line in text.splitlines():
                    stream.write(f"[rank {r}] {line}\n")
    sys.stdout.flush()


# --- launch ------------------------------------------------------------------------------------


def launch(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 300,
           start_method: str | None = None, threads: int | None = None):
    """Run ``fn(*args)`` on ``world_size`` ranks with torch.distributed initialised; return the
    list of per-rank results (rank 0 first).

    Raises :class:`RankError` if a rank raises or dies, :class:`LaunchTimeout` if the ranks have
    not all returned within ``timeout_s`` seconds.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if _under_torchrun():
        return _launch_torchrun(fn, world_size, args, backend)
    backend = backend or default_backend(world_size)
    if backend == "nccl" and torch.cuda.device_count() < world_size:
        raise ValueError(f"backend nccl needs one GPU per rank: world_size={world_size} but "
                         f"{torch.cuda.device_count()} GPU(s) visible; use backend='gloo' or fewer ranks")
    ctx = mp.get_context(start_method or _pick_start_method(backend))
    if ctx.get_start_method() == "fork":
        # The first optimizer a process builds imports torch._dynamo (~1.5 s; 4 ranks on 2 cores
        # measured 4.2 s per launch). Importing it once here lets every forked rank inherit it.
        importlib.import_module("torch._dynamo")
    rundir = tempfile.mkdtemp(prefix="mtd-launch-")
    job = (backend, "file://" + os.path.join(rundir, "rendezvous"), cloudpickle.dumps((fn, args)), rundir,
           threads or _threads_per_rank(), timeout_s)
    procs, conns, statuses = [], [], []  # filled as ranks start, so a failed start still cleans up
    try:
        _start_ranks(ctx, world_size, job, procs, conns, statuses)
        results = _collect(procs, conns, statuses, timeout_s)
        return [results[r] for r in range(world_size)]
    finally:
        _kill(procs)
        for c in conns:
            c.close()
        _echo_outputs(rundir, world_size)
        shutil.rmtree(rundir, ignore_errors=True)


def _start_ranks(ctx, world_size: int, job: tuple, procs: list, conns: list, statuses: list) -> None:
    """Start one process per rank, each with a pipe for its result and a status line; ``job`` is
    (backend, init_method, payload, rundir, threads, timeout_s), passed on to :func:`_rank_main`."""
    starting = _main_not_reimported() if ctx.get_start_method() != "fork" else contextlib.nullcontext()
    with starting:
        for r in range(world_size):
            recv_end, send_end = ctx.Pipe(duplex=False)
            status = ctx.Array("c", _STATUS_LEN, lock=False)
            backend, init_method, payload, rundir, threads, timeout_s = job
            p = ctx.Process(target=_rank_main, name=f"mtd-rank{r}",
                            args=(r, world_size, backend, init_method, payload, send_end, status,
                                  rundir, threads, timeout_s))
            p.start()
            send_end.close()
            procs.append(p), conns.append(recv_end), statuses.append(status)


def _collect(procs, conns, statuses, timeout_s: float) -> dict:
    """Wait for every rank's report: ``{rank: result}``, or raise the lowest failing rank's error
    (after a short grace for the others' reports) or :class:`LaunchTimeout`."""
    world_size = len(procs)
    results, errors = {}, {}
    deadline = time.monotonic() + timeout_s
    grace_until = None  # after a first failure, wait briefly for the others' reports
    pending = set(range(world_size))
    while pending:
        now = time.monotonic()
        if grace_until is not None and now >= grace_until:
            break
        if now >= deadline:
            last = {r: statuses[r].value.decode("utf-8", "replace") for r in range(world_size)}
            raise LaunchTimeout(timeout_s, last, finished=set(results))
        wait_for = min(deadline, grace_until or deadline) - now
        ready = mp.connection.wait([conns[r] for r in pending], timeout=min(wait_for, 1.0))
        for c in ready:
            r = conns.index(c)
            try:
                kind, data = c.recv()
            except EOFError:  # the rank died without a word: segfault, SIGKILL, os._exit...
                procs[r].join(timeout=5)
                kind, data = "error", f"rank {r} died without reporting (exit code {procs[r].exitcode})"
            pending.discard(r)
            if kind == "ok":
                results[r] = cloudpickle.loads(data)
            else:
                errors[r] = data
                grace_until = grace_until or time.monotonic() + 0.5
    if errors:
        first = min(errors)  # lowest failing rank: the same report every run
        others = sorted(set(errors) - {first})
        tb = errors[first] + (f"\n(ranks {others} failed too)" if others else "")
        raise RankError(first, tb, world_size)
    return results


def _launch_torchrun(fn, world_size, args, backend):
    """Under torchrun this process *is* one rank: initialise from env, run fn, gather results."""
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        warnings.warn(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: "
                      f"running on the {env_world} ranks torchrun started", stacklevel=3)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend, init_method="env://")
        atexit.register(_teardown_at_exit)  # we made the group, so we end it (barrier first)
    result = fn(*args)
    gathered = [None] * env_world
    dist.all_gather_object(gathered, result)
    return gathered


def _teardown_at_exit():
    """Leaving with the group alive has gloo abort the process (SIGABRT): barrier, then destroy."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
