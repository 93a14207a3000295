"""What every exercise states (minitorch_dist.course.statements): its kind and time on the docstring's
first line, for a build or measure exercise the library file to read beside it, and the same kind and
time in its entry of the chapter's Exercises section. Each missing or broken part is a problem that
names the fix; the real course states everything."""
from __future__ import annotations

import ast
import re
import sys
import textwrap

import pytest

from minitorch_dist.course import registry
from minitorch_dist.course import statements as st
from minitorch_dist.course.registry import Chapter

pytestmark = pytest.mark.timeout(60)

GOOD = textwrap.dedent('''\
    def make(x):
        """Kind: build · about 45 minutes

        Make it.

        Reference: ``minitorch_dist/runtime/comm.py`` (how the wrappers meter).
        """
        # BEGIN SOLUTION
        return x
        # END SOLUTION


    def derive(x):
        """Kind: derive · about 20 minutes"""
        # BEGIN SOLUTION
        return x
        # END SOLUTION
    ''')


def _node(src: str):
    return ast.parse(textwrap.dedent(src)).body[0]


def test_a_statement_is_read_from_the_docstring():
    make, derive = ast.parse(GOOD).body
    assert st.statement(make) == st.Statement("build", 45, "minitorch_dist/runtime/comm.py")
    assert st.statement(derive) == st.Statement("derive", 20, None)
    assert st.statement(_node('def f():\n    """Kind: measure"""\n')) == st.Statement("measure", None, None)
    assert st.statement(_node("def f():\n    pass\n")) == st.Statement(None, None, None)
    bare = ('def f():\n    """Kind: build · about 5 minutes\n\n'
            '    Reference: minitorch_dist/a/b.py (why).\n    """\n')
    assert st.statement(_node(bare)) == st.Statement("build", 5, "minitorch_dist/a/b.py")


@pytest.fixture
def fake(tmp_path):
    ch = Chapter(98, "98_fake", "Fake", (), written=True, root=tmp_path)
    ch.solutions.parent.mkdir(parents=True)
    (tmp_path / "minitorch_dist" / "runtime").mkdir(parents=True)
    (tmp_path / "minitorch_dist" / "runtime" / "comm.py").write_text("x = 1\n")
    return ch


def test_a_chapter_that_states_everything_has_no_problem(fake):
    fake.solutions.write_text(GOOD)
    assert st.statement_problems(fake) == []


@pytest.mark.parametrize("change, problem", [
    (("Kind: build · about 45 minutes", "Kind: build"), "make: the docstring opens with 'Kind: "),
    (("Kind: build · about 45 minutes", "Kind: tinker · about 45 minutes"), "make: the docstring opens"),
    (("Reference: ``minitorch_dist/runtime/comm.py`` (how the wrappers meter).", ""), "make: name the"),
    (("runtime/comm.py", "runtime/gone.py"), "make: its reference minitorch_dist/runtime/gone.py does not"),
])
def test_each_missing_part_is_a_problem_naming_the_fix(fake, change, problem):
    fake.solutions.write_text(GOOD.replace(*change))
    found = st.statement_problems(fake)
    assert len(found) == 1 and found[0].startswith(f"ch98 {problem}"), found


def test_every_course_exercise_states_its_kind_time_and_reference():
    chapters = [ch for ch in registry.CHAPTERS if ch.solutions.exists() or ch.exercises.exists()]
    assert [p for ch in chapters for p in st.statement_problems(ch)] == []


# --- the chapter's Exercises section states the same kind and time ---------------------------------
PROSE = textwrap.dedent("""\
    # Fake

    ## Exercises

    In `exercises/ch98_fake.py`.

    1. **Build** `make(x)` · about 45 minutes — make it.

       <details><summary>Hint 1</summary>Return x.</details>

    2. **Derive** `derive(x)` · about 20 minutes — derive it.

    ## Reading list

    A book.
    """)


@pytest.mark.parametrize("entries", [
    "1. **Build** `make(x)` · about 45 minutes, and **Derive** `derive(x)` · about 20 minutes — both.",
    "1. **Build** `make` / `make_it(x,\n   y)` → `(a,\n   b)` · about\n   45 minutes: it.\n"
    "2. **Derive** `derive(x)`\n   · about 20 minutes — it.",
])
def test_an_exercises_section_that_states_the_docstrings_kind_and_time_has_no_problem(fake, entries):
    fake.solutions.write_text(GOOD)
    fake.prose.parent.mkdir()
    fake.prose.write_text(PROSE, encoding="utf-8")
    assert st.prose_problems(fake) == []
    start, end = PROSE.index("1. **Build**"), PROSE.index("\n\n## Reading")
    fake.prose.write_text(PROSE[:start] + entries + PROSE[end:], encoding="utf-8")
    assert st.prose_problems(fake) == []


@pytest.mark.parametrize("change, problem", [
    (("about 45 minutes", "about 40 minutes"),
     "make states about 40 minutes in its Exercises entry, its docstring about 45: make them agree"),
    (("**Derive** `derive", "**Build** `derive"),
     "derive is **Build** in its Exercises entry, its docstring says derive: make it **Derive**"),
    (("2. **Derive** `derive(x)` · about 20 minutes — derive it.\n", ""), "derive has no entry in the"),
    (("**Derive** `derive(x)` · about 20 minutes —", "`derive(x)` (derive, about 20 minutes) —"),
     "derive has no entry in the Exercises section: write '**Derive** `derive(...)` · about 20 minutes'"),
    (("`make(x)` · about 45", "`make_it(x)` · about 45"), "make has no entry"),
    (("`make(x)` · about 45 minutes", "`make(x)`, 45 minutes"), "make's Exercises entry states no time"),
    (("2. **Derive**", "## Reading list\n\n2. **Derive**"), "derive has no entry"),
    (("## Exercises", "## Problems"), "no '## Exercises' section"),
])
def test_each_disagreement_of_the_exercises_section_is_a_problem_naming_the_fix(fake, change, problem):
    fake.solutions.write_text(GOOD)
    fake.prose.parent.mkdir()
    fake.prose.write_text(PROSE.replace(*change), encoding="utf-8")
    found = st.prose_problems(fake)
    assert len(found) == 1 and found[0].startswith(f"chapters/98_fake.md: {problem}"), found


def test_every_chapters_exercises_section_states_its_exercises_kind_and_time():
    chapters = [ch for ch in registry.CHAPTERS if ch.solutions.exists() or ch.exercises.exists()]
    assert [p for ch in chapters for p in st.prose_problems(ch)] == []


def test_the_command_line_check_fails_on_a_problem_of_the_exercises_section(monkeypatch, capsys):
    assert st.main(["--chapter", "ch00"]) == 0
    monkeypatch.setattr(st, "prose_problems", lambda ch: [f"{ch.rel(ch.prose)}: bruck_all_gather states ..."])
    assert st.main(["--chapter", "ch00"]) == 1
    assert "chapters/00_foundations.md: bruck_all_gather states ..." in capsys.readouterr().err


# --- README's hours follow the exercises ------------------------------------------------------------
# A chapter's hours: its prose read carefully (100 words a minute: technical text, with its figures and
# formulas), half an hour for its notebook, and the minutes its exercises state. `python
# tests/test_statements.py` rewrites README's table cells from them.
WORDS_PER_MINUTE, NOTEBOOK_HOURS = 100, 0.5
README = registry.REPO_ROOT / "README.md"
_PATH = re.compile(r"A short path to .*?: ((?:\d\d(?: → )?)+) \(about (\d+) hours\)")
_ROW = re.compile(r"^\| (\d\d) \| ([^|]+) \| [^|]+ \| [^|]+ \| [^|]+ \| ([^|]+) \|$")


def chapter_hours(ch) -> tuple[float, float]:
    """(reading and notebook, exercises) hours of chapter ``ch``."""
    reading = len(ch.prose.read_text(encoding="utf-8").split()) / WORDS_PER_MINUTE / 60 + NOTEBOOK_HOURS
    exercises = sum(s.minutes or 0 for s in st.chapter_statements(ch).values()) / 60
    return reading, exercises


def hours_rows(text: str) -> str:
    """README's text with each chapter row's three hour cells, and the short path's total, computed."""
    out = []
    for line in text.splitlines():
        if m := _ROW.match(line):
            reading, exercises = chapter_hours(registry.chapter(m.group(1)))
            line = (f"| {m.group(1)} | {m.group(2).strip()} | {reading:.1f} | {exercises:.1f} | "
                    f"{reading + exercises:.1f} | {m.group(3).strip()} |")
        elif m := _PATH.search(line):
            total = sum(sum(chapter_hours(registry.chapter(k))) for k in re.findall(r"\d\d", m.group(1)))
            line = line[:m.start(2)] + f"{total:.0f}" + line[m.end(2):]
        out.append(line)
    return "\n".join(out) + ("\n" if text.endswith("\n") else "")


def test_readme_hours_are_the_chapters_reading_and_stated_exercise_times():
    text = README.read_text(encoding="utf-8")
    assert sum(bool(_ROW.match(line)) for line in text.splitlines()) == len(registry.CHAPTERS)
    assert hours_rows(text) == text, "README's hours are out of date: run python tests/test_statements.py"


if __name__ == "__main__":
    README.write_text(hours_rows(README.read_text(encoding="utf-8")), encoding="utf-8")
    print("README.md hours rewritten", file=sys.stderr)
