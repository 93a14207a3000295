"""Chapter 00 — the reaper: cleans up after a launch whose calling process died.

Run as a plain script (``python -I -S reaper.py RUNDIR PARENT_PID``), so it starts in
milliseconds and imports nothing but the standard library. It reads rank PIDs from stdin, one a
line, until the parent writes ``done``. If instead the parent dies (stdin reaches its end, or
``os.getppid()`` changes), it kills the process group of every rank (the rank and whatever it
started), including ranks it finds only by the PID file they write into the run folder, and
removes the run folder. :class:`minitorch_dist.runtime.supervise.Reaper` starts it.
"""
import os
import select
import shutil
import signal
import sys
import time


def read_pids(parent: int) -> tuple[list[int], bool]:
    """The PIDs the parent sent, and whether it said ``done`` (False: the parent is gone)."""
    pids, buf = [], b""
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
    pids = []
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


def reap(pids: list[int], rundir: str) -> None:
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    for _ in range(20):  # a rank still dying may write one last file
        shutil.rmtree(rundir, ignore_errors=True)
        if not os.path.exists(rundir):
            return
        time.sleep(0.1)


def main() -> None:
    rundir, parent = sys.argv[1], int(sys.argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pids, done = read_pids(parent)
    if not done:
        reap(pids + pids_in(rundir), rundir)
    os._exit(0)


if __name__ == "__main__":
    main()
