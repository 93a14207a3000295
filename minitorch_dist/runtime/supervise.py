"""Chapter 00 — no orphans: the ranks of a launch die with the process that launched them.

A parent killed with SIGKILL runs no ``finally`` block, so it cannot kill its ranks itself. Three
guards, two in each rank and one beside them, make sure nothing of a launch outlives it, whatever
kills the parent:

- :func:`die_with_parent`, in each rank: on Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the
  kernel to kill the rank the moment its parent dies; plus a watchdog thread that compares
  ``os.getppid()`` with the parent's PID *captured before the rank was started* (reading it later
  could already see the re-parented value) and, once the parent is gone, removes the run folder
  and kills the rank's process group (the rank and whatever it started). The thread is what works
  where there is no ``prctl`` (macOS).
- :class:`Reaper`: a tiny separate process (``python -I -S reaper.py``, no torch) started in a
  session of its own. The parent tells it each rank's PID (and each rank leaves its PID in the
  run folder, in case the parent died before it could). If the parent dies before saying "done",
  the reaper kills each rank's process group, which also reaches the processes the ranks started
  (the kernel's parent-death signal only kills the rank itself), and removes the run folder.
  Given a marker (``KEY=value`` in the environment of every process of a run), it also kills
  every process that carries it: the grader tags each chapter's run this way.

A process started with an ``exec`` of another program (the grader's pytest) cannot call
:func:`die_with_parent` itself; :func:`with_parent_death` wraps its command line so that the
kernel's parent-death signal is set before the ``exec`` (it survives one).
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

PR_SET_PDEATHSIG = 1
POLL_S = 0.2

_REAPER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask the Linux kernel to send ``sig`` to this process when its parent dies. False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)  # this process's own symbols, libc's among them
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_EXEC_WITH_DEATH_SIGNAL = """
import ctypes, os, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):  # the parent died before the line above took effect
    os._exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


def with_parent_death(argv: list[str]) -> list[str]:
    """``argv`` (a full path first) wrapped so that, on Linux, the program it runs is SIGKILLed by the
    kernel the moment this process dies; ``argv`` unchanged elsewhere. Start it from the main
    thread: the kernel ties the signal to the thread that started the child."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _EXEC_WITH_DEATH_SIGNAL, str(os.getpid()), *argv]


def _end_orphan(rundir: str | None) -> None:
    """The parent is gone: remove the run folder, then kill this process group (this rank included)."""
    if rundir:
        shutil.rmtree(rundir, ignore_errors=True)
    try:
        if os.getpgrp() == os.getpid():  # a group of its own: take what it started along
            os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(1)


def die_with_parent(parent_pid: int, rundir: str | None = None) -> threading.Thread:
    """Make this rank die with ``parent_pid`` (captured by the parent before starting the rank).
    Call it first thing in the rank, after ``os.setpgrp()``. Returns the watchdog thread."""
    set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before the line above took effect
        _end_orphan(rundir)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        _end_orphan(rundir)

    t = threading.Thread(target=watch, name="mtd-parent-watchdog", daemon=True)
    t.start()
    return t


def write_pid_file(rundir: str, name: str) -> None:
    """Leave this process's PID in the run folder, for the reaper (see :class:`Reaper`)."""
    path = os.path.join(rundir, f"{name}.pid")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)  # whole or absent, never half written


class Reaper:
    """Cleans up after a launch whose parent died: see the module docstring. Use as::

        reaper = Reaper(rundir)
        reaper.watch(rank_pid)      # for each rank, once started
        ...
        reaper.close()              # the parent cleaned up itself: the reaper leaves quietly

    If the reaper cannot start, the launch goes on with the guards inside the ranks only. With a
    ``marker`` (``KEY=value``) it also kills every process whose environment holds it (Linux).
    """

    def __init__(self, rundir: str, marker: str | None = None) -> None:
        self.proc: subprocess.Popen[bytes] | None = None
        self._pipe = None  # the reaper's stdin: PIDs to watch, then "done"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-S", _REAPER_SCRIPT, rundir, str(os.getpid()),
                 *([marker] if marker else [])],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                start_new_session=True, close_fds=True)
            self._pipe = self.proc.stdin
        except OSError as e:
            warnings.warn(f"launch: could not start the reaper ({e}); the ranks still die with "
                          "this process, but what they started might not", stacklevel=3)

    @property
    def fd(self) -> int | None:
        """The parent's end of the pipe: a rank started by fork inherits it and must close it."""
        return self._pipe.fileno() if self._pipe is not None else None

    def _send(self, line: str) -> None:
        with contextlib.suppress(ValueError, OSError):  # the reaper is gone (BrokenPipeError)
            if self._pipe is not None:
                self._pipe.write(line.encode() + b"\n")
                self._pipe.flush()

    def watch(self, pid: int) -> None:
        if self.proc:
            self._send(str(pid))

    def close(self) -> None:
        if not self.proc:
            return
        self._send("done")
        with contextlib.suppress(OSError):
            if self._pipe is not None:
                self._pipe.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
