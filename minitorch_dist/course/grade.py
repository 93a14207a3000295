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
             (the detail names the test that was running)
    missing  the chapter has no exercise tests file; "no tests": no test maps to the exercise

A test that ends pytest itself (``os._exit``, a crash) is "failed", naming the exit code; the
tests it kept from running are "failed" as not run.

**Held-out tests.** Where an instructor keeps tests a student does not see,
``tests/exercises_hidden/test_chNN_x_held_out.py`` (``make student-repo`` leaves that folder out), they
run too, in a session of their own, and each exercise's status on them fills a "held-out" column.

The command exits 0 whenever grading ran, whatever the results (the report *is* the result);
``--strict`` exits 1 if any exercise is not passed (on its tests or the held-out ones), except
``blocked`` ones, which this machine cannot run.

**Nothing outlives a chapter's run**, whatever ends it or the grader (a timeout, Ctrl-C, SIGTERM,
SIGHUP, even SIGKILL): see `minitorch_dist.course.grade_run`. Stopped by a signal, the grader kills
the run in progress and exits with status 128 + the signal's number (130 for Ctrl-C).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from ..runtime.tables import format_table
from . import registry
from .exercises import MarkerError, chapter_exercises
from .grade_run import (
    RUN_MARKER,
    GraderStopped,
    TestResult,
    kill_run,
    parse_junit,
    run_processes,
    run_pytest,
    stop_on_signals,
)
from .statements import chapter_statements

__all__ = ["RUN_MARKER", "GraderStopped", "Row", "TestResult", "exercise_for", "grade_chapter", "kill_run",
           "main", "parse_junit", "report", "run_processes", "run_pytest", "summarize"]

_ORDER = ("timeout", "missing", "failed", "todo", "passed", "blocked", "skipped", "no tests")


@dataclass(frozen=True)
class Row:
    chapter: str
    exercise: str
    status: str
    tests: str = ""  # "3 passed, 1 blocked"
    detail: str = ""
    kind: str = ""  # build / derive / measure, from the exercise's docstring
    held_out: str = ""  # the status on the instructor's held-out tests, when there are any
    minutes: int | None = None  # the time the exercise states (course.statements)


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


def grade_chapter(ch: registry.Chapter, impl: str = "exercises", timeout: float = 120,
                  verbose: bool = False) -> list[Row]:
    """Grade one chapter: run its exercise tests against `impl` and fold them into rows."""
    try:
        kinds = chapter_exercises(ch)
        minutes = {name: s.minutes for name, s in chapter_statements(ch).items()}
    except MarkerError as e:
        return [Row(ch.tag, "(solutions)", "failed", detail=_first_line(e))]
    exercises = list(kinds)
    if not ch.exercise_tests.exists():
        return [Row(ch.tag, ex, "missing", detail=f"no {ch.rel(ch.exercise_tests)}")
                for ex in exercises or ["(all)"]]
    rows = _graded(ch, ch.exercise_tests, exercises, impl, timeout, verbose)
    if ch.hidden_tests.exists():  # an instructor's held-out tests: their own column
        held = {r.exercise: r.status for r in _graded(ch, ch.hidden_tests, exercises, impl, timeout, verbose)}
        rows = [dataclasses.replace(r, held_out=held.get(r.exercise, "no tests")) for r in rows]
    return [dataclasses.replace(r, kind=kinds.get(r.exercise) or "", minutes=minutes.get(r.exercise))
            for r in rows]


def _graded(ch: registry.Chapter, tests: Path, exercises: list[str], impl: str, timeout: float,
            verbose: bool) -> list[Row]:
    """One run of the test file ``tests`` against ``impl``, folded into a row per exercise."""
    outcome, results, output = run_pytest(tests, impl, timeout, ch.root)
    if verbose or outcome == "error":
        print(output, file=sys.stderr)
    if outcome == "timeout":
        return _timeout_rows(ch.tag, exercises, results, timeout)
    if outcome == "error":
        return [Row(ch.tag, "(all)", "failed", detail=_first_line(output))]
    # "ok", or "crashed": the test that ended pytest and those it kept from running failed
    return _summarize(ch.tag, exercises, results, ch.gpu_only_exercises)


def _timeout_rows(tag: str, exercises: list[str], results: list[TestResult], timeout: float) -> list[Row]:
    """Every exercise of a run killed at the timeout is "timeout"; the detail names the test that
    was running (its exercise's row says it ran past the timeout) and the tests column counts how
    the tests that ended did."""
    running = next((r.name for r in results if r.status == "timeout"), None)
    culprit = exercise_for(running, exercises) if running else None
    rows = []
    for ex in exercises or ["(all)"]:
        mine = [r for r in results if exercise_for(r.name, exercises) == ex]
        counts = {s: sum(r.status == s for r in mine) for s in _ORDER if any(r.status == s for r in mine)}
        if running is None:
            detail = f"tests ran past {timeout:g} s and were killed"
        elif ex == culprit:
            detail = f"{running} ran past {timeout:g} s and was killed"
        else:
            detail = f"the run was killed at {timeout:g} s in {running}"
        rows.append(Row(tag, ex, "timeout", ", ".join(f"{n} {s}" for s, n in counts.items()), detail))
    return rows


def report(rows: list[Row], impl: str) -> str:
    """The table and the score line."""
    held = any(r.held_out for r in rows)  # the column only where an instructor has held-out tests
    cells = [[r.chapter, r.exercise, r.kind, "" if r.minutes is None else r.minutes, r.status,
              *([r.held_out or "-"] if held else []), r.tests, r.detail] for r in rows]
    header = ["chapter", "exercise", "kind", "min", "status", *(["held-out"] if held else []), "tests",
              "detail"]
    table = format_table(cells, header, align="lllr" + "l" * (len(header) - 4))
    counts = {s: sum(r.status == s for r in rows) for s in _ORDER}
    rest = ", ".join(f"{n} {s}" for s, n in counts.items() if n and s != "passed")
    score = f"score: {counts['passed']}/{len(rows)} exercises passed ({impl})" + (f"; {rest}" if rest else "")
    if held:
        graded = [r for r in rows if r.held_out not in ("", "no tests")]
        passed = sum(r.held_out == "passed" for r in graded)
        score += f"\nheld-out tests: {passed}/{len(graded)} exercises passed"
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
                   help="exit 1 if any exercise is not passed, on its tests or the held-out ones (blocked "
                        "excepted)")
    p.add_argument("--root", type=Path,
                   help="grade another course tree laid out like this checkout (ROOT/solutions, "
                        "ROOT/exercises, ROOT/tests/exercises); its tests run in ROOT "
                        "(default: this checkout)")
    p.add_argument("-v", "--verbose", action="store_true", help="show pytest's output")


def _chapters(spec: str | None) -> list[registry.Chapter]:
    """The chapters ``--chapter`` names, each once, in the order given; all written ones without it.
    Raises KeyError (its message names the valid chapters) for an unknown or an empty list."""
    if spec is None:
        return registry.written_chapters()
    chapters = [registry.chapter(k) for k in spec.split(",") if k.strip()]
    if not chapters:
        valid = ", ".join(ch.tag for ch in registry.CHAPTERS)
        raise registry.UnknownChapter(f"--chapter {spec!r} names no chapter; give one or more, comma-"
                                      f"separated, e.g. --chapter ch00,ch01 (valid: {valid}; or a "
                                      f"number or a slug)")
    return list({ch.tag: ch for ch in chapters}.values())  # "ch00,0" grades ch00 once


def main(args) -> int:
    try:
        chapters = _chapters(args.chapter)
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
    try:
        with stop_on_signals():
            for ch in chapters:
                print(f"grading {ch.tag} {ch.slug} against {args.impl}/ ...", file=sys.stderr, flush=True)
                rows += grade_chapter(ch, args.impl, args.timeout, args.verbose)
    except GraderStopped as stop:
        with contextlib.suppress(OSError):  # after SIGHUP the terminal may be gone
            print(f"grade: stopped by {stop}; the tests in progress and every process they started were "
                  f"killed", file=sys.stderr, flush=True)
        return stop.exit_status
    print(report(rows, args.impl))
    bad = [r for r in rows if r.status not in ("passed", "blocked")
           or r.held_out not in ("", "passed", "blocked", "no tests")]
    return 1 if args.strict and bad else 0
