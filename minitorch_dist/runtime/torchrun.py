"""Chapter 00 — launch() under torchrun: each process is one rank, and failures still reach every rank.

Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set) there is nothing to start: the process group is
initialised from the environment and ``fn`` runs once in this process. What is left is to make a
failure look the same as in a local launch. A rank that raises cannot simply raise: its peers may
be blocked in a collective it will never join, or waiting for its result. So the ranks talk through
torchrun's key-value store (``MASTER_ADDR:MASTER_PORT``), which keeps answering while ranks hang.
Keys live under ``mtd-launch/<run>/<call>/``:

- ``status/r``: rank r's last op (from the comm meter), kept current by a watcher thread;
- ``ok/r`` once fn returned on rank r; ``err/r`` = its traceback if it raised (and ``nfail`` += 1);
- ``cause``: the culprit, written once (compare-and-set) so every rank names the same one;
- ``seen/r``: rank r has seen the error (the failing rank waits for these before raising, so
  that its exit does not kill a peer before the peer has reported);
- ``left/r``: the culprit is about to raise; the others leave just after it, so that torchrun's
  own summary of the failure names the culprit as its root cause.

A rank that finished fn waits on the store: when every rank is ``ok`` the results are gathered
(``all_gather_object``); on an error it raises the same :class:`RankError` as the failing rank; at
the deadline it raises :class:`LaunchTimeout`. A rank still inside fn (perhaps stuck in a
collective, which Python cannot interrupt) is handled by its watcher thread: it prints the
RankError or LaunchTimeout to stderr and ends the process (exit code 1); torchrun then stops the
rest.

If torchrun itself dies (its agent killed, say by the OOM killer or a lost node), its store goes
with it and nobody is left to stop the ranks: the watcher notices (its parent, the agent, is gone,
or the store stops answering) and ends the rank at once with one line saying so, rather than
training on to the deadline.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import itertools
import os
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from . import comm
from .failures import LaunchTimeout, RankError, blame, is_peer_gone

POLL_S = 0.05
WATCH_S = 0.2
GRACE_S = 0.5  # after a first error, how long to wait for other ranks' errors before naming a cause
ACK_S = 10.0  # how long a failing rank waits for its peers to see the error before raising
LEAVE_S = 3.0  # how long the other ranks wait for the culprit to leave first
_calls = itertools.count()
_state: dict = {"failed": False, "base": None}


class _StoreGone(Exception):
    """torchrun's store stopped answering: the agent that hosts it is gone."""


class _Store:
    """The call's keys in torchrun's store, with a lock: the main thread and the watcher share it.
    Every call raises :class:`_StoreGone` once the store's connection is lost."""

    def __init__(self, call: int):
        if _state["base"] is None:
            _state["base"] = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                           is_master=False, timeout=datetime.timedelta(seconds=60))
        env = os.environ
        run = f"{env.get('TORCHELASTIC_RUN_ID', 'run')}.{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        self.kv = dist.PrefixStore(f"mtd-launch/{run}/{call}/", _state["base"])
        self.lock = threading.Lock()
        self.where = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"

    @contextlib.contextmanager
    def _talking(self) -> Iterator[None]:
        with self.lock:
            try:
                yield
            except (RuntimeError, OSError) as e:
                if not (isinstance(e, dist.DistNetworkError) or is_peer_gone(str(e))):
                    raise
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                raise _StoreGone(f"torchrun's store at {self.where} stopped answering ({first})") from None

    def set(self, key: str, value: str) -> None:
        with self._talking():
            self.kv.set(key, value)

    def get(self, key: str) -> str | None:
        with self._talking():
            return self.kv.get(key).decode("utf-8", "replace") if self.kv.check([key]) else None

    def has(self, keys: list) -> bool:
        with self._talking():
            return self.kv.check(keys)

    def add(self, key: str, amount: int) -> int:
        with self._talking():
            return int(self.kv.add(key, amount))

    def first(self, key: str, value: str) -> str:
        """Set ``key`` to ``value`` unless it is set already; return what it holds."""
        with self._talking():
            return self.kv.compare_set(key, "", value).decode()


def _agent_pid() -> int | None:
    """The torchrun agent's PID (this worker's parent) when torchrun started this process, else None."""
    return os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else None


def _leave_quietly(me: int, why: str) -> None:
    """torchrun is gone: no one is left to stop this rank or hear its error. Say so, and end it."""
    _state["failed"] = True
    with contextlib.suppress(OSError, ValueError):  # the terminal or pipe may be gone as well
        sys.stdout.flush()
        sys.stderr.write(f"[rank {me}] launch: {why}, so this rank stops now: no one is left to stop it "
                         f"or to hear its result (last op: {comm.last_op()}).\n")
        sys.stderr.flush()
    os._exit(1)


def _decide(store: _Store, me: int, n: int) -> RankError:
    """The error every rank reports: gather the errors posted so far, name one culprit (the first
    rank to decide writes it; the rest read it), and say this rank has seen it."""
    time.sleep(GRACE_S)
    errors = {r: e for r in range(n) if (e := store.get(f"err/{r}")) is not None}
    culprit = int(store.first("cause", str(blame(errors, set(), n).rank)))
    if culprit not in errors:
        errors[culprit] = store.get(f"err/{culprit}") or "(no traceback)"
    store.set(f"seen/{me}", "1")
    return blame(errors, set(), n, culprit=culprit)


def _timeout(store: _Store, n: int, timeout_s: float) -> LaunchTimeout:
    last = {r: store.get(f"status/{r}") or "unknown (no status posted)" for r in range(n)}
    return LaunchTimeout(timeout_s, last, finished={r for r in range(n) if store.has([f"ok/{r}"])})


class _Watcher(threading.Thread):
    """Posts this rank's last op; ends the process if a peer failed (or the deadline passed) while
    the main thread is still inside fn."""

    def __init__(self, store: _Store, me: int, n: int, timeout_s: float, deadline: float, agent: int | None):
        super().__init__(name="mtd-torchrun-watcher", daemon=True)
        self.store, self.me, self.n, self.timeout_s, self.deadline = store, me, n, timeout_s, deadline
        self.agent = agent
        self.lock, self.done = threading.Lock(), threading.Event()
        self.in_exchange: bool | None = False  # None: the watcher took over

    def enter_exchange(self) -> bool:
        """The main thread now handles failures itself. False if the watcher is already acting."""
        with self.lock:
            if self.in_exchange is None:
                return False
            self.in_exchange = True
            return True

    def _take_over(self) -> bool:
        with self.lock:
            if self.in_exchange:
                return False
            self.in_exchange = None  # the watcher acts; the main thread must not
            return True

    def run(self) -> None:
        posted, failed_at = None, None
        while not self.done.wait(WATCH_S):
            if self.agent is not None and os.getppid() != self.agent:
                _leave_quietly(self.me, f"torchrun's agent (pid {self.agent}) is gone")
            try:
                op = comm.last_op()
                if op != posted:
                    self.store.set(f"status/{self.me}", op)
                    posted = op
                if failed_at is None and self.store.add("nfail", 0) > 0:
                    failed_at = time.monotonic()
                if failed_at is not None and time.monotonic() - failed_at > GRACE_S and self._take_over():
                    self._stop_process(_decide(self.store, self.me, self.n), "a peer failed")
            except _StoreGone as e:
                _leave_quietly(self.me, str(e))
            except Exception:  # a slow store: keep the deadline
                pass
            if time.monotonic() >= self.deadline and self._take_over():
                try:
                    err = _timeout(self.store, self.n, self.timeout_s)
                except Exception:  # no store: report this rank only
                    err = LaunchTimeout(self.timeout_s, {self.me: comm.last_op()}, set())
                self._stop_process(err, "the deadline passed")

    def _stop_process(self, err: Exception, why: str) -> None:
        _state["failed"] = True
        sys.stdout.flush()
        sys.stderr.write(f"[rank {self.me}] launch: {why} while this rank was still in fn "
                         f"(last op: {comm.last_op()}); ending this process.\n"
                         f"{type(err).__module__}.{type(err).__name__}: {err}\n")
        sys.stderr.flush()
        if isinstance(err, RankError):  # it has said its piece: wait for torchrun to stop it
            _after_the_culprit(self.store, self.me, err.rank, linger=LEAVE_S)
        os._exit(1)


def _init_group(world_size: int, backend: str | None, timeout_s: float) -> int:
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        warnings.warn(f"launch(world_size={world_size}) under torchrun with WORLD_SIZE={env_world}: "
                      f"running on the {env_world} ranks torchrun started", stacklevel=4)
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        # The watcher enforces timeout_s; the group's own timeout is only a backstop behind it.
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=max(timeout_s + 60, 1800)))
        atexit.register(_teardown_at_exit)  # we made the group, so we end it (barrier first)
    return env_world


def run_under_torchrun(fn: Callable[..., Any], world_size: int, args: tuple, backend: str | None,
                       timeout_s: float) -> list:
    """This process *is* one rank: initialise from env, run fn, agree on the outcome, gather results."""
    deadline, agent = time.monotonic() + timeout_s, _agent_pid()
    n = _init_group(world_size, backend, timeout_s)
    me, store = dist.get_rank(), _Store(next(_calls))
    watcher = _Watcher(store, me, n, timeout_s, deadline, agent)
    watcher.start()
    comm.set_status("running fn (no collective yet)")
    try:
        payload = _run_and_agree(fn, args, store, watcher, deadline)
    except _StoreGone as e:
        _leave_quietly(me, str(e))
    finally:
        watcher.done.set()
    gathered = [None] * n
    dist.all_gather_object(gathered, payload)
    return [cloudpickle.loads(p) for p in gathered]


def _run_and_agree(fn: Callable[..., Any], args: tuple, store: _Store, watcher: _Watcher,
                   deadline: float) -> bytes:
    """Run fn; return its pickled result once every rank's is ready, or raise the shared error."""
    me, n, timeout_s = watcher.me, watcher.n, watcher.timeout_s
    try:
        payload = cloudpickle.dumps(fn(*args))
    except BaseException:  # any error of fn is reported to every rank
        _state["failed"] = True
        if not watcher.enter_exchange():
            time.sleep(3600)  # the watcher is ending this process
        store.set(f"err/{me}", traceback.format_exc())
        store.add("nfail", 1)
        err = _decide(store, me, n)
        _wait_for_peers_to_see(store, me, n, min(deadline, time.monotonic() + ACK_S))
        _after_the_culprit(store, me, err.rank)
        raise err from None
    if not watcher.enter_exchange():
        time.sleep(3600)
    store.set(f"ok/{me}", "1")
    _wait_for_all(store, me, n, timeout_s, deadline)
    return payload


def _wait_for_all(store: _Store, me: int, n: int, timeout_s: float, deadline: float) -> None:
    """Return once every rank is ok; raise the shared RankError, or LaunchTimeout at the deadline."""
    oks = [f"ok/{r}" for r in range(n)]
    while not store.has(oks):
        if store.add("nfail", 0) > 0:
            _state["failed"] = True
            err = _decide(store, me, n)
            _after_the_culprit(store, me, err.rank)
            raise err
        if time.monotonic() >= deadline:
            _state["failed"] = True
            raise _timeout(store, n, timeout_s)
        time.sleep(POLL_S)


def _wait_for_peers_to_see(store: _Store, me: int, n: int, until: float) -> None:
    others = [f"seen/{r}" for r in range(n) if r != me]
    while others and not store.has(others) and time.monotonic() < until:
        time.sleep(POLL_S)


def _after_the_culprit(store: _Store, me: int, culprit: int, linger: float = LEAVE_S / 5) -> None:
    """Leave after the culprit (bounded), so that torchrun's summary ("Root Cause (first observed
    failure)") names the rank that failed, not a peer that stopped because of it. ``linger``: how
    long to give its process to end and torchrun to notice (torchrun then stops this one)."""
    if me == culprit:
        store.set(f"left/{me}", "1")
        return
    until = time.monotonic() + LEAVE_S
    while not store.has([f"left/{culprit}"]) and time.monotonic() < until:
        time.sleep(POLL_S)
    time.sleep(linger)


def _teardown_at_exit() -> None:
    """Leaving with the group alive has gloo abort the process (SIGABRT): barrier, then destroy.
    After a failed launch the peers may be gone or stuck, so there is no barrier to wait at."""
    if dist.is_initialized():
        if not _state["failed"]:
            dist.barrier()
        dist.destroy_process_group()
