"""Chapter 00 — what a rank started ends with it, even a process that left the rank's process group.

Killing a rank's process group reaches what the rank started, unless a child moved to a session of
its own (``subprocess.Popen(..., start_new_session=True)``, a daemon) or was started with a process
group of its own. Such a child would outlive the launch. Two nets catch it (Linux; elsewhere these
functions do nothing):

- **The rank is a child subreaper** (:func:`become_subreaper`, ``prctl(PR_SET_CHILD_SUBREAPER)``):
  a descendant whose parent exits is re-parented to the rank, not to ``init``, so while the rank
  lives every process it started, however deep and in whatever session, is in its process tree.
  :func:`kill_descendants` walks that tree through ``/proc`` and kills it (the rank at its own
  exit, the caller before it kills a rank).
- **A mark in the environment**: each rank sets ``MTD_LAUNCH_ID`` (unique per launch), which its
  children inherit. A descendant of a rank that died on its own (its subreaper gone) is re-parented
  out of the tree; :func:`kill_marked` finds it by that mark in ``/proc/<pid>/environ``.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

from . import reaper

PR_SET_CHILD_SUBREAPER = 36
MARK_VAR = "MTD_LAUNCH_ID"
ROUNDS = 20  # a process may fork while the tree is being killed: walk again until nothing is left


def become_subreaper() -> bool:
    """Make the orphaned descendants of this process its children (Linux). False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _live_parents() -> dict[int, int]:
    """``{pid: parent pid}`` of every live process (zombies left out: they are already dead)."""
    parents: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return parents
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] not in (b"Z", b"X"):
            parents[int(name)] = int(fields[1])
    return parents


def descendants(roots: Iterable[int]) -> list[int]:
    """The live descendants of the processes ``roots`` (the roots themselves not included)."""
    children: dict[int, list[int]] = {}
    for pid, ppid in _live_parents().items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _kill(pids: Iterable[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone already, or not ours
            pass


def kill_descendants(roots: Iterable[int]) -> None:
    """SIGKILL every live descendant of ``roots``, walking again until none is left (bounded)."""
    roots = [pid for pid in roots if pid]
    for _ in range(ROUNDS):
        found = descendants(roots)
        if not found:
            return
        _kill(found)
        time.sleep(0.005)


def kill_marked(mark: str) -> None:
    """SIGKILL what a launch's ranks started and left behind (found by their environment mark, as the
    reaper finds them when the caller itself dies)."""
    reaper.kill_marked(f"{MARK_VAR}={mark}".encode())
