"""Chapter 00 — the grade report: run each chapter's exercise tests and say, per exercise, where it stands.

``python -m minitorch_dist grade`` runs ``pytest tests/exercises/test_chNN_x.py`` for each written
chapter in a fresh process with ``MTD_IMPL=exercises`` (a student's stubs; ``--impl solutions``
grades the worked answers), reads its JUnit XML report and maps each test to an exercise by name:
a test called ``test_<exercise>`` or ``test_<exercise>_<case>`` belongs to ``<exercise>`` (the
module-level functions and classes holding a ``# BEGIN SOLUTION`` region); a test that maps to
none is reported under its own name. Each exercise gets one status:

    passed   every test that could run passed
    failed   a test failed (the first failure's message is shown)
    todo     a test hit the stub's NotImplementedError: not attempted yet
    blocked  its tests were skipped because they need a GPU this machine lacks
    skipped  its tests were skipped for another reason
    timeout  the chapter's tests ran past --timeout and were killed, with every process they started
    missing  the chapter has no exercise tests file; "no tests": no test maps to the exercise

The command exits 0 whenever grading ran, whatever the results (the report *is* the result);
``--strict`` exits 1 if any exercise is not passed, except ``blocked`` ones, which this machine
cannot run.

**Nothing outlives a chapter's run.** Each pytest run starts in a session of its own, with its
output going to a file (never a pipe that a stray rank could hold open), and with
``MTD_GRADE_RUN=<a fresh id>`` in its environment, which every process it starts inherits. When
the run ends, or passes ``--timeout``, `kill_run` stops and then SIGKILLs the whole tree: pytest,
its descendants (found through ``/proc``, whichever process group they moved to: ``launch``'s
ranks call ``setpgrp``), its process group, and every process whose environment carries the id,
even one whose parent died. Where there is no ``/proc`` (not Linux), only the process group is
killed.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from . import registry
from .exercises import MarkerError, chapter_exercises

_ORDER = ("timeout", "missing", "failed", "todo", "passed", "blocked", "skipped", "no tests")
_TODO = re.compile(r"NotImplementedError\W+exercise:")

#: The environment variable that tags every process of one chapter's run (see the module docstring).
RUN_MARKER = "MTD_GRADE_RUN"


@dataclass(frozen=True)
class TestResult:
    name: str  # the test function's name, parameters included: "test_ring[4]"
    status: str  # passed / failed / todo / blocked / skipped
    message: str = ""


@dataclass(frozen=True)
class Row:
    chapter: str
    exercise: str
    status: str
    tests: str = ""  # "3 passed, 1 blocked"
    detail: str = ""
    kind: str = ""  # build / derive / measure, from the exercise's docstring


def parse_junit(path: Path) -> list[TestResult]:
    """One `TestResult` per ``<testcase>`` of a pytest JUnit XML report."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name, status, msg = case.get("name", "?"), "passed", ""
        for child in case:
            text = f"{child.get('message', '')}\n{child.text or ''}"
            if child.tag in ("failure", "error"):
                status = "todo" if _TODO.search(text) else "failed"
                msg = child.get("message") or (child.text or "").strip()
                break
            if child.tag == "skipped":
                status = "blocked" if "GPU" in text else "skipped"
                msg = child.get("message", "")
        out.append(TestResult(name, status, msg))
    return out


def exercise_for(test_name: str, exercises: list[str]) -> str | None:
    """The exercise a test belongs to: ``test_<ex>`` or ``test_<ex>_<case>`` (parameters ignored)."""
    base = test_name.split("[", 1)[0].lower()
    base = base[len("test_"):] if base.startswith("test_") else base
    for ex in sorted(exercises, key=len, reverse=True):  # longest first: "ring_all_reduce" before "ring"
        if base == ex.lower() or base.startswith(ex.lower() + "_"):
            return ex
    return None


def _first_line(text: str, width: int = 70) -> str:
    """The first line, joined with the next when it only announces it ("rank 0 failed:")."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()] or [""]
    line = " ".join(lines[:2]) if lines[0].endswith(":") else lines[0]
    return line if len(line) <= width else line[: width - 1] + "…"


def summarize(tag: str, exercises: list[str], results: list[TestResult],
              gpu_only: tuple[str, ...] = (), kinds: dict | None = None) -> list[Row]:
    """Fold test results into one row per exercise (plus a row per test that maps to none); ``kinds``
    maps an exercise to its kind (build / derive / measure) for the table."""
    rows = _summarize(tag, exercises, results, gpu_only)
    return [dataclasses.replace(r, kind=(kinds or {}).get(r.exercise) or "") for r in rows]


def _summarize(tag, exercises, results, gpu_only) -> list[Row]:
    groups: dict[str, list[TestResult]] = {ex: [] for ex in exercises}
    for r in results:
        groups.setdefault(exercise_for(r.name, exercises) or r.name, []).append(r)
    rows = []
    for ex, rs in groups.items():
        if not rs:
            rows.append(Row(tag, ex, "blocked" if ex in gpu_only else "no tests"))
            continue
        counts = {s: sum(r.status == s for r in rs) for s in _ORDER if any(r.status == s for r in rs)}
        if "failed" in counts:
            status = "failed"
        elif "todo" in counts:
            status = "todo"
        else:
            status = next(s for s in ("passed", "blocked", "skipped") if s in counts)
        first = next((r for r in rs if r.status == status and r.message), None)
        detail = "" if status == "passed" or not first else \
            "the stub still raises NotImplementedError" if status == "todo" else _first_line(first.message)
        rows.append(Row(tag, ex, status, ", ".join(f"{n} {s}" for s, n in counts.items()), detail))
    return rows


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


def run_pytest(test_file: Path, impl: str, timeout: float, cwd: Path) -> tuple[str, list[TestResult], str]:
    """Run one test file in its own session; return (outcome, results, output).

    outcome is "ok" (pytest ran: its tests may still have failed), "timeout", or "error". However
    it ends (a timeout, Ctrl-C), no process of the run is left behind (`kill_run`).
    """
    run_id = uuid.uuid4().hex
    marker = f"{RUN_MARKER}={run_id}"
    with tempfile.TemporaryDirectory(prefix="mtd-grade-") as tmp:
        report, log = Path(tmp) / "report.xml", Path(tmp) / "output.txt"
        scratch = Path(tmp) / "tmp"  # the run's temporary files (launch's run folders): gone with it,
        scratch.mkdir()  # even when a timeout kills the ranks and their reaper together
        env = dict(os.environ, MTD_IMPL=impl, TMPDIR=str(scratch), **{RUN_MARKER: run_id})
        # no cache, and no notebook plugin (exercise tests are plain tests): ~3 s less to start
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:nbval",
               f"--junitxml={report}", "-o", "junit_family=xunit2", str(test_file)]
        with open(log, "wb") as out:  # a file: a rank holding it open blocks nobody
            proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        outcome = "timeout"
        try:
            proc.wait(timeout=timeout)
            outcome = "ok" if report.exists() else "error"
        except subprocess.TimeoutExpired:
            pass
        finally:  # pytest's pid is safe to walk from only while it is unreaped
            kill_run(marker, proc.pid if proc.returncode is None else None)
            proc.wait()
        output = log.read_text(errors="replace")
        try:
            results = parse_junit(report) if outcome == "ok" else []
        except ET.ParseError as e:
            return "error", [], f"{output}\nunreadable JUnit report: {e}"
        return outcome, results, output


def grade_chapter(ch: registry.Chapter, impl: str = "exercises", timeout: float = 120,
                  verbose: bool = False) -> list[Row]:
    """Grade one chapter: run its exercise tests against `impl` and fold them into rows."""
    try:
        kinds = chapter_exercises(ch)
    except MarkerError as e:
        return [Row(ch.tag, "(solutions)", "failed", detail=_first_line(e))]
    exercises = list(kinds)
    if not ch.exercise_tests.exists():
        return [Row(ch.tag, ex, "missing", detail=f"no {ch.rel(ch.exercise_tests)}")
                for ex in exercises or ["(all)"]]
    outcome, results, output = run_pytest(ch.exercise_tests, impl, timeout, ch.root)
    if verbose or outcome == "error":
        print(output, file=sys.stderr)
    if outcome == "timeout":
        return [Row(ch.tag, ex, "timeout", detail=f"tests ran past {timeout:g} s and were killed")
                for ex in exercises or ["(all)"]]
    if outcome == "error":
        return [Row(ch.tag, "(all)", "failed", detail="pytest wrote no report: " + _first_line(output))]
    return summarize(ch.tag, exercises, results, ch.gpu_only_exercises, kinds)


def report(rows: list[Row], impl: str) -> str:
    """The table and the score line."""
    cells = [[r.chapter, r.exercise, r.kind, r.status, r.tests, r.detail] for r in rows]
    table = registry.format_table(cells, ["chapter", "exercise", "kind", "status", "tests", "detail"])
    counts = {s: sum(r.status == s for r in rows) for s in _ORDER}
    rest = ", ".join(f"{n} {s}" for s, n in counts.items() if n and s != "passed")
    score = f"score: {counts['passed']}/{len(rows)} exercises passed ({impl})" + (f"; {rest}" if rest else "")
    return f"{table}\n\n{score}"


def _seconds(text: str) -> float:
    """``--timeout``: a positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (e.g. --timeout 120), "
                                         f"got {text!r}")
    return value


def add_arguments(p) -> None:
    p.add_argument("--impl", choices=("exercises", "solutions"), default="exercises",
                   help="grade the stubs in exercises/ (default) or the worked solutions/")
    p.add_argument("--chapter",
                   help="comma-separated chapters (ch00, 0 or 00_foundations); default: all written")
    p.add_argument("--timeout", type=_seconds, default=120,
                   help="seconds per chapter before its tests, and every process they started, are killed")
    p.add_argument("--strict", action="store_true",
                   help="exit 1 if any exercise is not passed (blocked excepted)")
    p.add_argument("--root", type=Path,
                   help="grade another course tree laid out like this checkout (ROOT/solutions, "
                        "ROOT/exercises, ROOT/tests/exercises); its tests run in ROOT "
                        "(default: this checkout)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")


def main(args) -> int:
    try:
        chapters = ([registry.chapter(k) for k in args.chapter.split(",") if k.strip()]
                    if args.chapter else registry.written_chapters())
    except KeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    root = getattr(args, "root", None)
    if root is not None:
        if not (root / "tests" / "exercises").is_dir():
            print(f"error: --root {root} has no tests/exercises/ folder; point it at a course tree laid out "
                  f"like this checkout", file=sys.stderr)
            return 2
        chapters = [dataclasses.replace(ch, root=root.resolve()) for ch in chapters]
    if not chapters:
        print("No chapter is written yet: there is nothing to grade. The planned chapters:\n")
        print(registry.planned_table())
        return 0
    rows = []
    for ch in chapters:
        print(f"grading {ch.tag} {ch.slug} against {args.impl}/ ...", file=sys.stderr, flush=True)
        rows += grade_chapter(ch, args.impl, args.timeout, args.verbose)
    print(report(rows, args.impl))
    bad = [r for r in rows if r.status not in ("passed", "blocked")]
    return 1 if args.strict and bad else 0
