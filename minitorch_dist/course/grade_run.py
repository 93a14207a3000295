"""Chapter 00 — one chapter's graded run: pytest in a fresh process, and nothing of it outlives the grader.

`run_pytest` runs one exercise tests file and returns what each test did: from pytest's JUnit
report when it ends on its own, else from the log of `minitorch_dist.course.grade_plugin`
(written as each test starts and ends), which still names the test that was running when
``--timeout`` hit or when something ended pytest itself (``os._exit``, a crash), and how the
earlier tests did.

**Nothing outlives a chapter's run**, however the grader ends:

- Each pytest run starts in a session of its own, with its output going to a file (never a pipe
  that a stray rank could hold open), and with ``MTD_GRADE_RUN=<a fresh id>`` in its environment,
  which every process it starts inherits. When the run ends, passes ``--timeout``, or the grader
  is stopped by SIGINT (Ctrl-C), SIGTERM or SIGHUP (`stop_on_signals`: the signal raises
  `GraderStopped`, the grader exits with status 128 + the signal's number), `kill_run` stops and
  then SIGKILLs the whole tree: pytest, its descendants (found through ``/proc``, whichever process
  group they moved to: ``launch``'s ranks call ``setpgrp``), its process group, and every process
  whose environment carries the id, even one whose parent died.
- A grader killed with SIGKILL runs no cleanup: a reaper (`minitorch_dist.runtime.supervise.Reaper`,
  the one ``launch`` uses, given the run's id) sees it die, kills pytest's process group and every
  process that carries the id, and removes the run folder (``mtd-grade-*``: the reports and, as
  the run's ``TMPDIR``, every folder its ``launch`` calls made). On Linux pytest also carries the
  kernel's parent-death signal (`minitorch_dist.runtime.supervise.with_parent_death`), so it dies
  at once with the grader, and its ranks (which carry one too) with it.

Where there is no ``/proc`` (not Linux), only process groups are killed.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from ..runtime import supervise
from .grade_plugin import LOG_ENV, PLUGIN

_TODO = re.compile(r"NotImplementedError\W+exercise:")

#: The environment variable that tags every process of one chapter's run (see the module docstring).
RUN_MARKER = "MTD_GRADE_RUN"
_STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))


@dataclass(frozen=True)
class TestResult:
    name: str  # the test function's name, parameters included: "test_ring[4]"
    status: str  # passed / failed / todo / blocked / skipped / timeout (the test the run was killed in)
    message: str = ""


def _status(failed: bool, skipped: bool, text: str) -> str:
    if failed:
        return "todo" if _TODO.search(text) else "failed"
    if skipped:
        return "blocked" if "GPU" in text else "skipped"
    return "passed"


def parse_junit(path: Path) -> list[TestResult]:
    """One `TestResult` per ``<testcase>`` of a pytest JUnit XML report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name, status, msg = case.get("name", "?"), "passed", ""
        for child in case:
            text = f"{child.get('message', '')}\n{child.text or ''}"
            if child.tag in ("failure", "error"):
                status, msg = _status(True, False, text), child.get("message") or (child.text or "").strip()
                break
            if child.tag == "skipped":
                status, msg = _status(False, True, text), child.get("message", "")
        out.append(TestResult(name, status, msg))
    return out


@dataclass(frozen=True)
class TestLog:
    """What `grade_plugin` logged: the tests collected, those that ended, and the one still running."""
    collected: list[str]
    finished: list[TestResult]
    running: str | None


def read_test_log(path: Path) -> TestLog:
    """Fold the plugin's events (see `grade_plugin`) into one `TestResult` per finished test."""
    collected, reports, running, finished = [], {}, None, []
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:  # a line cut short by a kill
            continue
        if "collected" in event:
            collected = list(event["collected"])
        elif "start" in event:
            running, reports = event["start"], {}
        elif "report" in event:
            reports.setdefault(event["outcome"], event)  # the first failure (setup, call, teardown)
        elif "end" in event and event["end"] == running:
            bad = reports.get("failed") or reports.get("skipped") or {}
            status = _status("failed" in reports, "skipped" in reports,
                             f"{bad.get('message', '')}\n{bad.get('text', '')}")
            finished.append(TestResult(running, status, bad.get("message", "")))
            running = None
    return TestLog(collected, finished, running)


def how_it_ended(returncode: int) -> str:
    """``exit code 7`` or ``killed by SIGSEGV``."""
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:
        return f"killed by signal {-returncode}"


def _proc_table() -> dict[int, tuple[int, int, int]]:
    """pid -> (parent pid, process group, session) of every process, from ``/proc``; {} without it."""
    table = {}
    for d in Path("/proc").glob("[0-9]*"):
        try:
            fields = (d / "stat").read_text().rpartition(")")[2].split()  # after "pid (comm)"
            table[int(d.name)] = (int(fields[1]), int(fields[2]), int(fields[3]))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not a process
    return table


def _carries(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def run_processes(marker: str, root: int | None = None) -> set[int]:
    """The live processes of one run: those whose environment holds ``marker`` (``KEY=value``) and,
    given the still-unreaped pid ``root`` of a session leader: root, its process group, its session
    and all its descendants."""
    table, tag = _proc_table(), marker.encode()
    found = {pid for pid in table if _carries(pid, tag)}
    if root is not None:
        found |= {pid for pid, (_, group, session) in table.items() if root in (group, session)}
        children: dict[int, list[int]] = {}
        for pid, (parent, _, _) in table.items():
            children.setdefault(parent, []).append(pid)
        tree, todo = set(), [root]
        while todo:
            pid = todo.pop()
            if pid not in tree:
                tree.add(pid)
                todo += children.get(pid, [])
        found |= tree
    found.discard(os.getpid())
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _signal(pids, sig) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def kill_run(marker: str, root: int | None = None, rounds: int = 100) -> set[int]:
    """SIGKILL every process of a run (see `run_processes`); return their pids.

    They are first stopped (SIGSTOP), round after round until a scan finds no new one, so none can
    start another, nor be re-parented out of the tree, before all of them die together."""
    stopped: set[int] = set()
    for _ in range(rounds):
        new = run_processes(marker, root) - stopped
        if not new:
            break
        _signal(new, signal.SIGSTOP)
        stopped |= new
        time.sleep(0.005)
    _signal(stopped, signal.SIGKILL)
    if root is not None:
        try:
            os.killpg(root, signal.SIGKILL)  # without /proc, the only kill there is
        except OSError:
            pass
    deadline = time.monotonic() + 2  # SIGKILL is not instant: return once they are gone (or zombies)
    while any(_running(pid) for pid in stopped) and time.monotonic() < deadline:
        time.sleep(0.01)
    return stopped


class GraderStopped(BaseException):
    """A signal (SIGINT, SIGTERM, SIGHUP) stopped the grader; the run in progress dies on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        """The conventional status of a process ended by this signal: 128 + its number."""
        return 128 + self.signum

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


@contextlib.contextmanager
def stop_on_signals():
    """While inside, SIGINT, SIGTERM and SIGHUP raise `GraderStopped` (once: later ones are ignored,
    so the cleanup they start runs to its end). A signal this process was started ignoring stays
    ignored (``nohup`` ignores SIGHUP). Only the main thread can install handlers: elsewhere this
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        for sig in _STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        raise GraderStopped(signum)

    previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_pytest(test_file: Path, impl: str, timeout: float, cwd: Path) -> tuple[str, list[TestResult], str]:
    """Run one test file in its own session; return (outcome, results, output).

    outcome is "ok" (pytest ran: its tests may still have failed; results from its report),
    "timeout" (results: the tests that ended, then the one that was running, status "timeout"),
    "crashed" (pytest ended during a test without a report: that test "failed", saying how, and
    the tests after it "failed" as not run), or "error" (no report, no test running: the output
    says why). However it ends (a timeout, a signal, the grader killed), no process of the run is
    left behind (see the module docstring).
    """
    run_id = uuid.uuid4().hex
    marker = f"{RUN_MARKER}={run_id}"
    tmp = Path(tempfile.gettempdir()) / f"mtd-grade-{run_id}"
    reaper = supervise.Reaper(str(tmp), marker=marker)  # first: it removes tmp if this process dies
    try:
        tmp.mkdir(mode=0o700)
        return _run(test_file, impl, timeout, cwd, tmp, marker)
    finally:
        kill_run(marker)  # a no-op after a normal end; after a signal, whatever _run could not
        shutil.rmtree(tmp, ignore_errors=True)
        reaper.close()


def _run(test_file: Path, impl: str, timeout: float, cwd: Path, tmp: Path, marker: str):
    report, log, events = tmp / "report.xml", tmp / "output.txt", tmp / "tests.jsonl"
    scratch = tmp / "tmp"  # the run's temporary files (launch's run folders): gone with it,
    scratch.mkdir()  # even when a timeout kills the ranks and their reaper together
    plugins = tmp / "plugins"  # the plugin as a plain module: found whatever the tree under test holds
    plugins.mkdir()
    shutil.copyfile(Path(__file__).with_name("grade_plugin.py"), plugins / f"{PLUGIN}.py")
    path = os.pathsep.join(p for p in (str(plugins), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, MTD_IMPL=impl, TMPDIR=str(scratch), PYTHONPATH=path, **{LOG_ENV: str(events)})
    env[RUN_MARKER] = marker.split("=", 1)[1]
    # no cache, and no notebook plugin (exercise tests are plain tests): ~3 s less to start
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbval", "-p", PLUGIN,
           f"--junitxml={report}", "-o", "junit_family=xunit2", str(test_file)]
    with open(log, "wb") as out:  # a file: a rank holding it open blocks nobody
        proc = subprocess.Popen(supervise.with_parent_death(cmd), cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # pytest's pid is safe to walk from only while it is unreaped
        kill_run(marker, proc.pid if proc.returncode is None else None)
        proc.wait()
    output = log.read_text(errors="replace")
    if not timed_out and report.exists():
        try:
            return "ok", parse_junit(report), output
        except ET.ParseError as e:
            return "error", [], f"pytest wrote an unreadable JUnit report ({e}):\n{output}"
    return _without_report(read_test_log(events), timed_out, timeout, proc.returncode, output)


def _without_report(log: TestLog, timed_out: bool, timeout: float, returncode: int, output: str):
    """Results from the plugin's log, for a run killed at the timeout or ended without a report."""
    if timed_out:
        running = [TestResult(log.running, "timeout", f"ran past {timeout:g} s and was killed")] \
            if log.running else []
        return "timeout", log.finished + running, output
    ended = how_it_ended(returncode)
    if log.running is None:
        return "error", log.finished, f"pytest ended ({ended}) and wrote no report:\n{output}"
    done = {r.name for r in log.finished} | {log.running}
    crashed = TestResult(log.running, "failed", f"{log.running} ended pytest itself ({ended})")
    not_run = [TestResult(name, "failed", f"not run: {log.running} ended pytest ({ended})")
               for name in log.collected if name not in done]
    return "crashed", log.finished + [crashed] + not_run, output
