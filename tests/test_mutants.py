"""Mutants (minitorch_dist.course.mutants): a wrong answer is read, checked against its exercise's
signature, loaded in place of the solution (here and in every rank), and run against the exercise
tests in a fork that is killed whole at its timeout. The real course's mutants are checked to parse
and match here; `make check-exercises` runs them (CI too)."""
from __future__ import annotations

import os
import textwrap
import time

import pytest

from minitorch_dist.course import mutants as mu
from minitorch_dist.course import registry
from minitorch_dist.course.registry import Chapter

pytestmark = pytest.mark.timeout(120)

SOLUTIONS = textwrap.dedent('''\
    """A fake chapter's solutions."""


    def double(x, *, times=1):
        """Kind: build"""
        # BEGIN SOLUTION
        return 2 * x * times
        # END SOLUTION


    class Layer:
        """Kind: build"""

        def forward(self, x):
            # BEGIN SOLUTION
            return x / 2
            # END SOLUTION


    def triple(x):
        """Kind: derive"""
        # BEGIN SOLUTION
        return 3 * x
        # END SOLUTION
    ''')

# The fake chapter's tests load the solutions by path and run a mutant after them, as `load` does.
EXERCISE_TESTS = textwrap.dedent('''\
    import os, time
    from pathlib import Path

    src = (Path(__file__).parents[2] / "solutions" / "ch98_fake.py").read_text()
    ns = {}
    exec(src, ns)
    if os.environ.get("MTD_MUTANT"):
        exec(Path(os.environ["MTD_MUTANT"]).read_text(), ns)

    def test_double():
        assert ns["double"](2) == 4 and ns["double"](1, times=3) == 6

    def test_layer():
        assert ns["Layer"]().forward(4) == 2

    def test_triple():
        assert ns["triple"](1) == 3
    ''')


@pytest.fixture
def fake(tmp_path):
    ch = Chapter(98, "98_fake", "Fake", (), written=True, root=tmp_path)
    for path, text in [(ch.solutions, SOLUTIONS), (ch.exercise_tests, EXERCISE_TESTS)]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    mu.mutants_dir(ch).mkdir(parents=True)
    return ch


ADDS_ONE = '"""Wrong: adds one."""\n\n\ndef double(x, *, times=1):\n    return 2 * x * times + 1\n'


def _mutant(ch, name, text):
    path = mu.mutants_dir(ch) / f"{name}.py"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_mutant_is_read_with_what_it_gets_wrong(fake):
    path = _mutant(fake, "off_by_one", '''\
        """Wrong: adds one.

        A longer story."""


        def _helper(x):
            return x + 1


        def double(x, *, times=1):
            return _helper(2 * x * times)


        class Layer(Layer):
            def forward(self, x):
                return x
        ''')
    m = mu.read_mutant(fake, path)
    assert m == mu.Mutant(path, "ch98", ("double", "Layer"), "adds one.")


@pytest.mark.parametrize("text, message", [
    ('def double(x, *, times=1):\n    return 0\n', 'first line says what it gets wrong'),
    ('"""Wrong:"""\ndef double(x, *, times=1):\n    return 0\n', 'first line says what it gets wrong'),
    ('"""Wrong: x"""\ndef double(x):\n    return 0\n', "double takes other parameters"),
    ('"""Wrong: x"""\ndef double(x, times=1):\n    return 0\n', "double takes other parameters"),
    ('"""Wrong: x"""\nclass Layer:\n    def forward(self, x, y):\n        return x\n', "Layer.forward takes"),
    ('"""Wrong: x"""\nclass double:\n    pass\n', "double is a function in the solutions"),
    ('"""Wrong: x"""\ndef quadruple(x):\n    return 4 * x\n', "quadruple, which is not an exercise"),
    ('"""Wrong: x"""\ndef _helper(x):\n    return x\n', "redefines none of ch98's exercises"),
    ('"""Wrong: x"""\ndef double(x:\n', "not valid Python"),
])
def test_a_mutant_that_cannot_be_run_is_refused_naming_the_fix(fake, text, message):
    path = _mutant(fake, "broken", text)
    with pytest.raises(mu.MutantError, match=message) as err:
        mu.read_mutant(fake, path)
    assert "broken.py" in str(err.value)


def test_load_runs_the_mutant_after_the_solutions(fake, monkeypatch):
    monkeypatch.delenv(mu.ENV, raising=False)
    path = _mutant(fake, "halves", '"""Wrong: halves."""\n\n\ndef double(x, *, times=1):\n    return x / 2\n')
    mod = mu.load_mutant(fake, path)
    assert mod.double(4) == 2 and mod.triple(1) == 3  # replaced, and the rest is the solution's
    assert mod.__doc__ == "A fake chapter's solutions."
    assert mu.ENV not in os.environ  # set only while loading
    elsewhere = fake.root / "solutions" / "mutants" / "ch99_other" / "x.py"
    with pytest.raises(mu.MutantError, match="not a mutant of ch98"):
        mu.load_mutant(fake, elsewhere)


def test_each_mutant_is_rejected_survives_or_errs_and_nothing_outlives_its_run(fake, tmp_path):
    _mutant(fake, "adds_one", ADDS_ONE)
    _mutant(fake, "same", ADDS_ONE.replace("adds one", "nothing, in truth").replace(" + 1", ""))
    pidfile = tmp_path / "sleeper.pid"
    _mutant(fake, "hangs", f'''"""Wrong: never returns."""
import os, subprocess, time


def triple(x):
    child = subprocess.Popen(["sleep", "300"])
    open({str(pidfile)!r}, "w").write(str(child.pid))
    time.sleep(300)
''')
    todo = [(fake, m) for m in (mu.read_mutant(fake, p) for p in sorted(mu.mutants_dir(fake).glob("*.py")))]
    start = time.monotonic()
    got = {v.mutant: v for v in mu.run_all(todo, jobs=3, timeout=8)}
    assert time.monotonic() - start < 60
    assert got["adds_one.py"].outcome == "rejected" and "test_double" in got["adds_one.py"].detail
    assert got["same.py"].outcome == "survived"
    assert got["hangs.py"].outcome == "error" and "timeout" in got["hangs.py"].detail
    sleeper = int(pidfile.read_text())
    for _ in range(50):  # the run's grandchild went with it
        try:
            os.kill(sleeper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"process {sleeper}, started by a killed mutant's run, is still alive")


def test_check_counts_the_mutants_each_exercise_has(fake):
    _mutant(fake, "adds_one", ADDS_ONE)
    _mutant(fake, "bad", '"""Wrong: x"""\ndef quadruple(x):\n    return 4 * x\n')
    verdicts, short, none = mu.check([fake], jobs=2, timeout=60)
    assert [(v.mutant, v.outcome) for v in verdicts] == [("bad.py", "error"), ("adds_one.py", "rejected")]
    assert short == [f"ch98 double (build): 1 mutant(s), needs {mu.MIN_MUTANTS}",
                     f"ch98 Layer (build): 0 mutant(s), needs {mu.MIN_MUTANTS}"]  # triple derives
    assert none == []


def test_the_course_mutants_match_their_exercises():
    if not (registry.REPO_ROOT / "solutions").exists():
        pytest.skip("a student's copy of the course has no solutions/ (nor mutants)")
    found = 0
    for ch in registry.CHAPTERS:
        if ch.solutions.exists():
            found += len(mu.chapter_mutants(ch))  # raises MutantError naming a file that no longer fits
    assert found >= 12
