"""Chapter 00 — the reaper: cleans up after a launch whose calling process died.

Run as a plain script (``python -I -S reaper.py RUNDIR PARENT_PID [MARKER]``), so it starts in
milliseconds and imports nothing but the standard library. It reads rank PIDs from stdin, one a
line, until the parent writes ``done``. If instead the parent dies (stdin reaches its end, or
``os.getppid()`` changes), it kills the process group of every rank (the rank and whatever it
started), including ranks it finds only by the PID file they write into the run folder, and
removes the run folder. Given a ``MARKER`` (``KEY=value``, Linux: read from ``/proc``), it first
also kills every process whose environment holds it, even one that left every group and lost its
parent (the grader tags each run this way). :class:`minitorch_dist.runtime.supervise.Reaper`
starts it.
"""
import os
import select
import shutil
import signal
import sys
import time
from collections.abc import Callable


def read_pids(parent: int) -> tuple[list[int], bool]:
    """The PIDs the parent sent, and whether it said ``done`` (False: the parent is gone)."""
    pids: list[int] = []
    buf = b""
    while os.getppid() == parent:
        ready, _, _ = select.select([0], [], [], 0.2)
        if not ready:
            continue
        chunk = os.read(0, 4096)
        if not chunk:
            return pids, False
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line == b"done":
                return pids, True
            if line.strip():
                pids.append(int(line))
    return pids, False


def pids_in(rundir: str) -> list[int]:
    """The PIDs the ranks left in the run folder (``rank{r}.pid``)."""
    pids: list[int] = []
    try:
        names = [n for n in os.listdir(rundir) if n.endswith(".pid")]
    except OSError:
        return pids
    for name in names:
        try:
            with open(os.path.join(rundir, name)) as f:
                pids.append(int(f.read()))
        except (OSError, ValueError):
            pass
    return pids


def marked(marker: bytes) -> set[int]:
    """The live processes whose environment holds ``marker`` (none without ``/proc``), this one aside."""
    found: set[int] = set()
    try:
        names = [n for n in os.listdir("/proc") if n.isdigit()]
    except OSError:
        return found
    for name in names:
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if marker in f.read().split(b"\0"):
                    found.add(int(name))
        except OSError:  # gone meanwhile, or another user's
            continue
    found.discard(os.getpid())
    return found


def kill_marked(marker: bytes, rounds: int = 100) -> None:
    """Stop every marked process, scan after scan until none is new (so none can start another),
    then SIGKILL them all."""
    stopped: set[int] = set()
    for _ in range(rounds):
        new = marked(marker) - stopped
        if not new:
            break
        for pid in new:
            _kill(os.kill, pid, signal.SIGSTOP)
        stopped |= new
        time.sleep(0.005)
    for pid in stopped:
        _kill(os.kill, pid, signal.SIGKILL)


def _kill(kill: Callable[[int, int], None], pid: int, sig: int) -> None:
    try:
        kill(pid, sig)
    except OSError:
        pass


def reap(pids: list[int], rundir: str, marker: bytes = b"") -> None:
    for pid in pids:
        for kill in (os.killpg, os.kill):
            _kill(kill, pid, signal.SIGKILL)
    if marker:
        kill_marked(marker)
    for _ in range(20):  # a rank still dying may write one last file
        shutil.rmtree(rundir, ignore_errors=True)
        if not os.path.exists(rundir):
            return
        time.sleep(0.1)


def main() -> None:
    rundir, parent = sys.argv[1], int(sys.argv[2])
    marker = sys.argv[3].encode() if len(sys.argv) > 3 else b""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids, done = read_pids(parent)
    if not done:
        reap(pids + pids_in(rundir), rundir, marker)
    os._exit(0)


if __name__ == "__main__":
    main()
