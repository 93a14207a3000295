"""The grader's limits: an exercise that never returns is killed at ``--timeout`` with every process
it started, and nothing of a finished run is left behind; nor of a run whose grader is stopped by
SIGTERM, SIGHUP, Ctrl-C or even SIGKILL. A test that never returns, or that ends pytest itself, is
named in the report. (Bad ``--timeout`` values: test_cli.py.)

The looping exercise lives in a small course tree built in a temporary folder and graded through
``grade --root``, the way a user runs it: ``python -m minitorch_dist grade`` in a subprocess. Its
stub loops forever inside two ``launch`` ranks (which leave pytest's process group: ``launch``
calls ``setpgrp`` in each), and rank 0 first starts a helper whose parent exits at once, so only
the grader's environment tag can still find it. Every process the test starts carries a tag of
its own, so whatever the grader misses, the test finds, reports, and kills.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from minitorch_dist.__main__ import main
from minitorch_dist.course import grade, registry
from minitorch_dist.course.registry import REPO_ROOT

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(),
                                reason="needs Linux /proc to find every process of a run")

SOLUTIONS = textwrap.dedent('''\
    """A course tree with one exercise, for the grader's own tests."""


    def spin(x):
        """Return x."""
        # BEGIN SOLUTION
        return x
        # END SOLUTION
    ''')

# A wrong attempt: it never returns, and rank 0 leaves behind a helper whose parent is gone.
LOOPING_STUB = textwrap.dedent('''\
    import os
    import subprocess
    import sys
    import time

    FLAGS = os.environ["GRADE_TEST_FLAGS"]
    ORPHAN = ("import os, sys, time; open(os.path.join(sys.argv[1], 'orphan'), 'w').close()\\n"
              "while True: time.sleep(0.2)")


    def spin(x):
        if os.environ.get("RANK") == "0":
            middle = ("import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1], "
                      "sys.argv[2]], start_new_session=True)")
            subprocess.run([sys.executable, "-c", middle, ORPHAN, FLAGS], check=True)  # exits at once
        open(os.path.join(FLAGS, "rank" + os.environ.get("RANK", "?")), "w").close()
        while True:
            time.sleep(0.05)
    ''')

EXERCISE_TESTS = textwrap.dedent('''\
    import importlib.util
    import os
    import pathlib

    from minitorch_dist import launch

    path = pathlib.Path(__file__).parents[2] / os.environ.get("MTD_IMPL", "solutions") / "ch00_foundations.py"
    spec = importlib.util.spec_from_file_location("spin_impl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


    def _on_rank():
        return mod.spin(1)


    def test_spin():
        assert launch(_on_rank, 2, timeout_s=600) == [1, 1]
    ''')


def tagged(tag: str) -> set[int]:
    """Live (not zombie) processes whose environment holds ``tag`` (``KEY=value``)."""
    found = set()
    for d in Path("/proc").glob("[0-9]*"):
        try:
            if tag.encode() in (d / "environ").read_bytes().split(b"\0") and \
                    (d / "stat").read_text().rpartition(")")[2].split()[0] != "Z":
                found.add(int(d.name))
        except (OSError, IndexError):
            continue
    return found


@pytest.fixture
def course(tmp_path):
    """A course tree whose only chapter, ch00, has one exercise, `spin`, that loops in its stub."""
    for rel, text in [("solutions/ch00_foundations.py", SOLUTIONS),
                      ("exercises/ch00_foundations.py", LOOPING_STUB),
                      ("tests/exercises/test_ch00_foundations.py", EXERCISE_TESTS)]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / "flags").mkdir()
    return tmp_path


@pytest.mark.timeout(90)
def test_a_looping_exercise_is_killed_at_the_timeout_with_its_ranks(course):
    tag = f"GRADE_TEST_TAG={uuid.uuid4().hex}"
    tmp = course / "tmp"  # the grader's own temporary files; the graded run gets a folder of its own
    tmp.mkdir()
    env = dict(os.environ, GRADE_TEST_FLAGS=str(course / "flags"), TMPDIR=str(tmp), **dict([tag.split("=")]))
    cmd = [sys.executable, "-m", "minitorch_dist", "grade", "--root", str(course), "--chapter", "ch00",
           "--timeout", "8"]
    log = course / "grade.out"
    start = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=60)
        elapsed = time.monotonic() - start
        left = tagged(tag)
    finally:
        grade.kill_run(tag, proc.pid if proc.poll() is None else None)
        proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text
    assert elapsed < 20, f"the grader took {elapsed:.1f} s to give up after an 8 s timeout"
    row = next(line for line in text.splitlines() if line.startswith("ch00"))
    assert row.split()[:3] == ["ch00", "spin", "timeout"] and "ran past 8 s" in row, text
    assert sorted(p.name for p in (course / "flags").iterdir()) == ["orphan", "rank0", "rank1"], \
        "the ranks were not yet looping when the grader gave up: the test proves nothing (raise --timeout)"
    assert not left, f"processes of the graded run outlived it: {sorted(left)}"
    assert not list(tmp.iterdir()), f"the killed run left files behind: {list(tmp.rglob('*'))}"


@pytest.mark.timeout(90)
def test_a_finished_run_leaves_no_stray_process(course, monkeypatch):
    """After a run that ends on its own, what it left behind (here: the orphaned helper of a stub
    that returns) is swept by the run's tag; the grader itself survives."""
    # the stub returns once its orphan has started (on a busy machine the run could end before that, and
    # the sweep would then find no orphan to prove it sweeps)
    stub = LOOPING_STUB.replace("    while True:\n        time.sleep(0.05)\n",
                                "    deadline = time.monotonic() + 60\n"
                                "    while not os.path.exists(os.path.join(FLAGS, 'orphan')) and "
                                "time.monotonic() < deadline:\n"
                                "        time.sleep(0.05)\n"
                                "    return x\n")
    assert stub != LOOPING_STUB
    (course / "exercises" / "ch00_foundations.py").write_text(stub)
    monkeypatch.setenv("GRADE_TEST_FLAGS", str(course / "flags"))
    tag = f"GRADE_TEST_FLAGS={course / 'flags'}"
    try:
        outcome, results, output = grade.run_pytest(course / "tests/exercises/test_ch00_foundations.py",
                                                    "exercises", 60, course)
        left = tagged(tag) - {os.getpid()}
    finally:
        for pid in tagged(tag) - {os.getpid()}:
            os.kill(pid, 9)
    assert outcome == "ok" and [r.status for r in results] == ["passed"], output
    assert (course / "flags" / "orphan").exists()
    assert not left, f"processes of the finished run outlived it: {sorted(left)}"


@pytest.mark.timeout(30)
def test_grade_root_must_hold_exercise_tests(tmp_path, capsys):
    assert main(["grade", "--root", str(tmp_path), "--chapter", "ch00"]) == 2
    assert f"--root {tmp_path} has no tests/exercises/ folder" in capsys.readouterr().err


# --- a grader stopped by a signal leaves nothing behind ----------------------------------------------


def _default_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)


def _until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL, signal.SIGHUP, signal.SIGINT],
                         ids=lambda s: s.name)
def test_a_signalled_grader_leaves_no_process_and_no_run_folder(course, sig):
    """The grader is signalled while the stub loops in two launched ranks (and rank 0's orphaned
    helper runs): pytest, the ranks, the helper and the run folder must all be gone within seconds."""
    tag = f"GRADE_TEST_TAG={uuid.uuid4().hex}"
    tmp = course / "tmp"  # the grader's TMPDIR: its mtd-grade-* run folder lives here
    tmp.mkdir()
    env = dict(os.environ, GRADE_TEST_FLAGS=str(course / "flags"), TMPDIR=str(tmp), **dict([tag.split("=")]))
    cmd = [sys.executable, "-m", "minitorch_dist", "grade", "--root", str(course), "--chapter", "ch00",
           "--timeout", "100"]
    log = course / "grade.out"
    with open(log, "wb") as out:  # the signals' default actions, even if this process ignores some
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=_default_signals)
    try:
        looping = _until(lambda: proc.poll() is not None or {p.name for p in (course / "flags").iterdir()}
                         >= {"orphan", "rank0", "rank1"}, 60)
        assert looping and proc.poll() is None, f"the ranks never started looping:\n{log.read_text()}"
        assert list(tmp.glob("mtd-grade-*")), "no run folder while the run goes on: the test proves nothing"
        sent = time.monotonic()
        os.kill(proc.pid, sig)
        proc.wait(timeout=30)
        clean = _until(lambda: not tagged(tag) and not list(tmp.iterdir()), 10)
        elapsed = time.monotonic() - sent
        left = tagged(tag)
    finally:
        grade.kill_run(tag, proc.pid if proc.poll() is None else None)
        proc.wait(timeout=10)
    text = log.read_text()
    print(f"{sig.name}: everything gone {elapsed:.2f} s after the signal")
    assert not left, f"processes of the graded run outlived the grader: {sorted(left)}\n{text}"
    assert not list(tmp.iterdir()), f"the run folder outlived the grader: {list(tmp.rglob('*'))}"
    assert clean and elapsed < 10, f"cleaning up took {elapsed:.1f} s"
    if sig == signal.SIGKILL:
        assert proc.returncode == -signal.SIGKILL
    else:
        assert proc.returncode == 128 + sig, text
        assert f"stopped by {sig.name}" in text, text


# --- a test that never returns, or that ends pytest itself, is named ---------------------------------

THREE_SOLUTIONS = textwrap.dedent('''\
    """A course tree with three exercises, for the grader's own tests."""


    def fast(x):
        """Kind: build.

        Return x."""
        # BEGIN SOLUTION
        return x
        # END SOLUTION


    def stuck(x):
        """Kind: derive.

        Return x."""
        # BEGIN SOLUTION
        return x
        # END SOLUTION


    def later(x):
        """Kind: measure.

        Return x."""
        # BEGIN SOLUTION
        return x
        # END SOLUTION
    ''')

# `stuck` loops, or ends the process, as STUCK_HOW says; the other two are right.
THREE_STUBS = textwrap.dedent('''\
    import os
    import time


    def fast(x):
        return x


    def stuck(x):
        if os.environ.get("STUCK_HOW") == "exit":
            os._exit(7)
        while True:
            time.sleep(0.05)


    def later(x):
        return x
    ''')

THREE_TESTS = textwrap.dedent('''\
    import importlib.util
    import os
    import pathlib

    path = pathlib.Path(__file__).parents[2] / os.environ.get("MTD_IMPL", "solutions") / "ch00_foundations.py"
    spec = importlib.util.spec_from_file_location("three_impl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)


    def test_fast():
        assert mod.fast(1) == 1


    def test_stuck():
        assert mod.stuck(2) == 2


    def test_later():
        assert mod.later(3) == 3
    ''')


@pytest.fixture
def three(tmp_path):
    """ch00 of a course tree with three exercises: fast and later are right, stuck is not."""
    for rel, text in [("solutions/ch00_foundations.py", THREE_SOLUTIONS),
                      ("exercises/ch00_foundations.py", THREE_STUBS),
                      ("tests/exercises/test_ch00_foundations.py", THREE_TESTS)]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return dataclasses.replace(registry.chapter("ch00"), root=tmp_path)


@pytest.mark.timeout(90)
def test_a_timeout_names_the_test_that_was_running(three):
    rows = {r.exercise: r for r in grade.grade_chapter(three, "exercises", timeout=8)}
    assert {ex: (r.status, r.kind) for ex, r in rows.items()} == {
        "fast": ("timeout", "build"), "stuck": ("timeout", "derive"), "later": ("timeout", "measure")}
    assert rows["stuck"].detail == "test_stuck ran past 8 s and was killed"
    assert rows["fast"].detail == rows["later"].detail == "the run was killed at 8 s in test_stuck"
    assert rows["fast"].tests == "1 passed" and rows["later"].tests == ""


@pytest.mark.timeout(90)
def test_a_test_ending_pytest_is_named_with_its_exit_code(three, monkeypatch):
    monkeypatch.setenv("STUCK_HOW", "exit")
    rows = {r.exercise: r for r in grade.grade_chapter(three, "exercises", timeout=60)}
    assert {ex: (r.status, r.kind) for ex, r in rows.items()} == {
        "fast": ("passed", "build"), "stuck": ("failed", "derive"), "later": ("failed", "measure")}
    assert rows["stuck"].detail == "test_stuck ended pytest itself (exit code 7)"
    assert rows["later"].detail == "not run: test_stuck ended pytest (exit code 7)"
    assert "score: 1/3 exercises passed" in grade.report(list(rows.values()), "exercises")


# --- --chapter: an empty list is an error, a repeated chapter is graded once -------------------------


@pytest.mark.parametrize("spec", [",,", " , ", ""])
def test_grade_chapter_list_naming_no_chapter_exits_2(spec, capsys):
    assert main(["grade", "--chapter", spec]) == 2
    err = capsys.readouterr().err
    assert f"--chapter {spec!r} names no chapter" in err and "ch00" in err and "ch13" in err, err


def test_grade_grades_a_repeated_chapter_once(monkeypatch, capsys):
    graded = []

    def fake_grade(ch, impl, timeout, verbose):
        graded.append(ch.tag)
        return [grade.Row(ch.tag, "spin", "passed")]

    monkeypatch.setattr(grade, "grade_chapter", fake_grade)
    assert main(["grade", "--chapter", "ch00,0,00_foundations,ch00"]) == 0
    assert graded == ["ch00"]
    assert "score: 1/1 exercises passed" in capsys.readouterr().out
