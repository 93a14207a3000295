"""Chapter 00 — mutants: plausible wrong answers that the exercise tests must reject.

A test suite is only as good as the wrong answers it turns away. Beside each chapter's worked
solutions live its *mutants*, ``solutions/mutants/chNN_slug/<name>.py``: each one a plausible wrong
implementation of one exercise — the design a capable student might try first — with one line
saying what it gets wrong::

    \"\"\"Wrong: launches a bucket the moment it is complete, not in bucket order.\"\"\"

    def install_bucketed_gradient_hooks(model, buckets, group=None):
        ...

A mutant redefines one or more of the chapter's exercises, with the solution's parameters (a class
may subclass the solution's class of the same name and override a method); helpers it adds start with
``_``. Everything else is the worked solution's: the mutant's code runs in a copy of the solutions
module, after it. ``python -m minitorch_dist.course.mutants`` (``make check-exercises``) runs, for each
mutant, the chapter's exercise tests of the exercises it redefines, with ``MTD_MUTANT`` naming it
(the exercise tests' ``ex`` fixture then loads it, :func:`load_mutant`), and requires a test to fail.

Each run is a fork of one process that has imported torch and pytest already, so a mutant costs the
time of its tests, not of an interpreter start; the runs go two at a time (``--jobs``), each in its
own session, killed with everything it started at ``--timeout``.
"""
from __future__ import annotations

import argparse
import ast
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import registry
from .exercises import chapter_exercises, load

__all__ = ["Mutant", "MutantError", "mutants_dir", "read_mutant", "chapter_mutants", "load_mutant",
           "run_mutant", "check", "main"]

ENV = "MTD_MUTANT"


class MutantError(ValueError):
    """A mutant file that cannot be run against its exercise (the message names the file and the fix)."""


@dataclass(frozen=True)
class Mutant:
    path: Path
    chapter: str  # "ch01"
    exercises: tuple[str, ...]  # the exercises it redefines
    wrong: str  # what it gets wrong, one line


def mutants_dir(ch: registry.Chapter) -> Path:
    """``solutions/mutants/chNN_slug/``: where the mutants of chapter ``ch`` live."""
    return ch.solutions.parent / "mutants" / ch.stem


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> tuple:
    """A function's parameters as the caller sees them: names, kinds and which have defaults."""
    a = fn.args
    return ([x.arg for x in a.posonlyargs], [x.arg for x in a.args], len(a.defaults),
            a.vararg.arg if a.vararg else None, [x.arg for x in a.kwonlyargs],
            [d is not None for d in a.kw_defaults], a.kwarg.arg if a.kwarg else None)


def _defs(tree: ast.Module) -> dict[str, ast.AST]:
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    return {n.name: n for n in tree.body if isinstance(n, kinds)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef | ast.AsyncFunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _check_redefinition(name: str, mine: ast.AST, theirs: ast.AST, where: str) -> None:
    """``mine`` must be called as the solution's ``theirs`` is: same kind, same parameters."""
    if isinstance(mine, ast.ClassDef) != isinstance(theirs, ast.ClassDef):
        what = "class" if isinstance(theirs, ast.ClassDef) else "function"
        raise MutantError(f"{where}: {name} is a {what} in the solutions; a mutant defines it the same way")
    pairs = [(name, mine, theirs)] if not isinstance(mine, ast.ClassDef) else \
        [(f"{name}.{m}", f, _methods(theirs)[m]) for m, f in _methods(mine).items() if m in _methods(theirs)]
    for qual, f, g in pairs:
        if _signature(f) != _signature(g):
            raise MutantError(f"{where}: {qual} takes other parameters than the solution's "
                              f"({ast.unparse(f.args)!r} vs {ast.unparse(g.args)!r}); a mutant is called as "
                              f"the exercise is: match the signature")


def _solution_defs(ch: registry.Chapter) -> tuple[dict, dict[str, ast.AST]]:
    """Chapter ``ch``'s exercises (name -> kind) and its solutions' top-level definitions: what each
    mutant is checked against, parsed once per chapter."""
    return chapter_exercises(ch), _defs(ast.parse(ch.solutions.read_text(encoding="utf-8")))


def read_mutant(ch: registry.Chapter, path: Path, solution: tuple | None = None) -> Mutant:
    """Parse and check the mutant at ``path`` against chapter ``ch``'s solutions (see the module
    docstring); raises :class:`MutantError` naming the file and what to fix. ``solution``: what
    :func:`_solution_defs` returns, when the caller checks many mutants of one chapter."""
    where = ch.rel(path)
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as e:
        raise MutantError(f"{where}:{e.lineno}: not valid Python: {e.msg}") from e
    doc = (ast.get_docstring(tree) or "").strip()
    if not doc.startswith("Wrong:") or len(doc.splitlines()[0]) <= len("Wrong: "):
        raise MutantError(f'{where}: opens with a docstring whose first line says what it gets wrong: '
                          f'"""Wrong: ..."""')
    exercises, defs = solution or _solution_defs(ch)
    redefined = []
    for name, node in _defs(tree).items():
        if name in exercises:
            _check_redefinition(name, node, defs[name], where)
            redefined.append(name)
        elif not name.startswith("_"):
            raise MutantError(f"{where}: defines {name}, which is not an exercise of {ch.tag} "
                              f"({', '.join(exercises)}); a helper's name starts with _")
    if not redefined:
        raise MutantError(f"{where}: redefines none of {ch.tag}'s exercises ({', '.join(exercises)})")
    return Mutant(path, ch.tag, tuple(redefined), doc.splitlines()[0][len("Wrong:"):].strip())


def chapter_mutants(ch: registry.Chapter) -> list[Mutant]:
    """Every mutant of chapter ``ch``, checked, in name order."""
    folder = mutants_dir(ch)
    if not folder.is_dir():
        return []
    solution = _solution_defs(ch)
    return [read_mutant(ch, p, solution) for p in sorted(folder.glob("*.py"))]


def load_mutant(chapter_key, path: str | os.PathLike) -> ModuleType:
    """The chapter's worked solutions with the mutant at ``path`` run after them, as one module (what
    :func:`.exercises.load` returns for the solutions while ``MTD_MUTANT`` names the mutant, as it does
    in every rank the tests start)."""
    ch = registry.chapter(chapter_key)
    path = Path(path).resolve()
    if path.parent != mutants_dir(ch).resolve():
        raise MutantError(f"{ENV}={path} is not a mutant of {ch.tag}: its mutants live in "
                          f"{ch.rel(mutants_dir(ch))}")
    read_mutant(ch, path)
    before = os.environ.get(ENV)
    os.environ[ENV] = str(path)
    try:
        return load(ch, "solutions", reload=True)
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


# --- running the exercise tests against each mutant ------------------------------------------------------

#: pytest's exit status -> what it says about a mutant.
_OUTCOME = {0: "survived", 1: "rejected"}


@dataclass(frozen=True)
class Verdict:
    chapter: str
    mutant: str  # the file's name
    exercises: str
    outcome: str  # rejected (a test failed) / survived (every test passed) / error (the run says nothing)
    seconds: float
    detail: str = ""


def _pytest_args(ch: registry.Chapter, m: Mutant) -> list[str]:
    """The chapter's exercise tests of the exercises ``m`` redefines, up to the first failure. A verdict
    needs only pass or fail, so each run leaves out what costs a second and says nothing here:
    rewriting the asserts (``--assert=plain``: a failure still names its test), a plugin the tests
    never use (anyio's), and the full garbage collection pytest runs at exit to find unraisable
    exceptions (the fork ends with ``os._exit``)."""
    return [str(ch.exercise_tests), "-x", "-q", "-p", "no:cacheprovider", "-p", "no:nbval", "-p", "no:anyio",
            "-p", "no:unraisableexception", "--assert=plain", "-rfE", "-k", " or ".join(m.exercises)]


def _child(ch: registry.Chapter, m: Mutant, log: str) -> None:
    """In the forked process: a session of its own (killed whole at the timeout), output to ``log``."""
    code = 3
    try:
        os.setsid()
        fd = os.open(log, os.O_WRONLY | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        # streams of our own on the log: this process's may be a caller's capture (pytest's, a notebook's)
        sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
        os.chdir(ch.root)
        os.environ.update({ENV: str(m.path), "MTD_IMPL": "solutions", "MTD_SMOKE": "1"})
        import pytest

        code = int(pytest.main(_pytest_args(ch, m)))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _first_failure(log: str, width: int = 110) -> str:
    """The test that failed first, and the start of its message (pytest's short summary line)."""
    lines = Path(log).read_text(errors="replace").splitlines()
    hit = next((ln for ln in lines if ln.startswith(("FAILED", "ERROR"))), None) or \
        next((ln for ln in lines if ln.startswith("E ")), "")
    hit = hit.split("::", 1)[-1] if "::" in hit else hit  # the test's name, not its file
    return hit if len(hit) <= width else hit[:width - 1] + "…"


@dataclass
class _Run:
    ch: registry.Chapter
    mutant: Mutant
    pid: int
    log: str
    start: float

    def verdict(self, status: int | None) -> Verdict:
        took = time.monotonic() - self.start
        m = self.mutant
        if status is None:
            outcome, detail = "error", f"ran past the timeout after {took:.0f} s (killed)"
        else:
            code = os.waitstatus_to_exitcode(status)
            outcome = _OUTCOME.get(code, "error")
            detail = _first_failure(self.log) if outcome == "rejected" else "" if outcome == "survived" else \
                f"no test of {' / '.join(m.exercises)} ran" if code == 5 else \
                f"pytest ended with status {code}"
        Path(self.log).unlink(missing_ok=True)
        return Verdict(m.chapter, m.path.name, ", ".join(m.exercises), outcome, took, detail)


def _start(ch: registry.Chapter, m: Mutant) -> _Run:
    fd, log = tempfile.mkstemp(prefix="mtd-mutant-", suffix=".log")
    os.close(fd)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(ch, m, log)
    return _Run(ch, m, pid, log, time.monotonic())


def _kill(run: _Run) -> None:
    try:
        os.killpg(run.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    os.waitpid(run.pid, 0)


def _warm_up() -> None:
    """Import once, here, what every run imports (pytest, torch, its compiler front end that DDP and the
    optimizers load, the library), so each fork starts with it loaded instead of paying seconds for it."""
    import importlib

    for name in ("pytest", "torch", "torch.distributed", "torch._dynamo", "minitorch_dist",
                 "minitorch_dist.parallelism", "minitorch_dist.memory", "minitorch_dist.models"):
        importlib.import_module(name)


def run_all(todo: list[tuple[registry.Chapter, Mutant]], jobs: int = 2, timeout: float = 300,
            progress=None) -> list[Verdict]:
    """Run each mutant's tests, ``jobs`` at a time, each in a fork of this process; a run past ``timeout``
    seconds is killed with every process it started. Nothing is left running, whatever ends this."""
    _warm_up()

    queue, running, out = list(todo), [], []
    try:
        while queue or running:
            while queue and len(running) < jobs:
                running.append(_start(*queue.pop(0)))
            time.sleep(0.05)
            for run in list(running):
                pid, status = os.waitpid(run.pid, os.WNOHANG)
                late = not pid and time.monotonic() - run.start > timeout
                if pid or late:
                    if late:
                        _kill(run)
                    running.remove(run)
                    out.append(run.verdict(status if pid else None))
                    if progress:
                        progress(out[-1])
    finally:
        for run in running:
            _kill(run)
            Path(run.log).unlink(missing_ok=True)
    return out


def run_mutant(chapter_key, path: str | os.PathLike, timeout: float = 300) -> Verdict:
    """The exercise tests against one mutant: ``rejected``, ``survived`` or ``error``."""
    ch = registry.chapter(chapter_key)
    return run_all([(ch, read_mutant(ch, Path(path)))], jobs=1, timeout=timeout)[0]


#: Mutants each build and measure exercise needs, in a chapter that has a mutants folder.
MIN_MUTANTS = 3


def coverage_problems(ch: registry.Chapter, mutants: list[Mutant]) -> list[str]:
    """Build and measure exercises of ``ch`` with fewer than :data:`MIN_MUTANTS` mutants."""
    count = {name: sum(name in m.exercises for m in mutants) for name in chapter_exercises(ch)}
    return [f"{ch.tag} {name} ({kind}): {count[name]} mutant(s), needs {MIN_MUTANTS}"
            for name, kind in chapter_exercises(ch).items()
            if kind in ("build", "measure") and count[name] < MIN_MUTANTS]


def check(chapters: list[registry.Chapter], jobs: int = 2, timeout: float = 300,
          progress=None) -> tuple[list[Verdict], list[str], list[str]]:
    """Every mutant of ``chapters`` against its tests. Returns the verdicts (a file that cannot be run is
    an ``error`` verdict naming what to fix), the coverage problems of the chapters that have mutants, and
    the chapters that have none yet."""
    todo, bad, short, none = [], [], [], []
    for ch in chapters:
        folder = mutants_dir(ch)
        if not folder.is_dir():
            none.append(ch.tag)
            continue
        good, solution = [], _solution_defs(ch)
        for path in sorted(folder.glob("*.py")):
            try:
                good.append(read_mutant(ch, path, solution))
            except MutantError as e:
                bad.append(Verdict(ch.tag, path.name, "?", "error", 0.0, str(e)))
        todo += [(ch, m) for m in good]
        short += coverage_problems(ch, good)
    return bad + run_all(todo, jobs, timeout, progress), short, none


def main(argv: list[str] | None = None) -> int:
    from ..runtime.tables import format_table

    p = argparse.ArgumentParser(prog="python -m minitorch_dist.course.mutants",
                                description="Run the exercise tests against every mutant; each must be "
                                            "rejected.")
    p.add_argument("--chapter", help="comma-separated chapters (ch01, 1 or 01_data_parallel); default: all")
    p.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per mutant before its run is killed")
    p.add_argument("--strict", action="store_true",
                   help=f"also fail when a build or measure exercise of a chapter with mutants has "
                        f"fewer than {MIN_MUTANTS}")
    args = p.parse_args(argv)
    try:
        chapters = [registry.chapter(k) for k in args.chapter.split(",")] if args.chapter else \
            [ch for ch in registry.CHAPTERS if ch.solutions.exists()]
    except KeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    verdicts, short, none = check(chapters, max(1, args.jobs), args.timeout,
                                  progress=lambda v: print(f"{v.chapter} {v.mutant}: {v.outcome}",
                                                           file=sys.stderr, flush=True))
    rows = [[v.chapter, v.mutant, v.exercises, v.outcome, f"{v.seconds:.1f}", v.detail] for v in verdicts]
    print(format_table(rows, ["chapter", "mutant", "exercise", "outcome", "s", "caught by / why"],
                       align="llllrl"))
    n_bad = sum(v.outcome != "rejected" for v in verdicts)
    print(f"\n{len(verdicts) - n_bad}/{len(verdicts)} mutants rejected by the exercise tests")
    for line in short:
        print(f"too few mutants: {line}")
    if none:
        print(f"no mutants yet: {', '.join(none)}")
    return 1 if n_bad or (short and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
