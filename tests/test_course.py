"""The course holds together: every written chapter has its parts, stubs match solutions, the
registry is sound, and the course tools (exercise generation, grader, tour) do what they say.

The chapter checks are plain functions returning a list of problems, so they are run on each
written chapter *and* on a fake chapter built in a temporary folder (where each part is broken
in turn, to show the check can fail).
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from minitorch_dist.course import exercises as ex
from minitorch_dist.course import grade, readability, registry, tour
from minitorch_dist.course.registry import CHAPTERS, PROSE_SECTIONS, REPO_ROOT, Chapter
from minitorch_dist.course.student_repo import prediction_answers

# --- the checks -------------------------------------------------------------------------------


def prose_problems(ch: Chapter) -> list[str]:
    text, fenced, headings = ch.prose.read_text(), False, []
    for line in text.splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and (m := re.match(r"#{1,6}\s+(.*)", line)):
            headings.append(m.group(1).lower())
    return [f"{ch.rel(ch.prose)} has no heading containing {kw!r}" for kw in PROSE_SECTIONS
            if not any(kw.lower() in h for h in headings)]


def notebook_problems(ch: Chapter, student_copy: bool = False) -> list[str]:
    """A notebook committed run, with its outputs (in a student's copy, but for the cells that answer a
    prediction prompt, cleared there)."""
    nb, where = json.loads(ch.notebook.read_text()), ch.rel(ch.notebook)
    cleared = set(prediction_answers(nb)) if student_copy else set()
    code = [c for i, c in enumerate(nb.get("cells", []))
            if c["cell_type"] == "code" and "".join(c["source"]).strip() and i not in cleared]
    problems = [f"{where}: code cell {i} was not executed (run `make notebooks`)"
                for i, c in enumerate(code) if c.get("execution_count") is None]
    if not any(c.get("outputs") for c in code):
        problems.append(f"{where} is committed without outputs (run `make notebooks`)")
    counts = [c.get("execution_count") for c in code]
    if None not in counts and counts != sorted(counts):
        problems.append(f"{where} was not run top to bottom (execution counts {counts}): "
                        "run `make notebooks`")
    noise = [i for i, c in enumerate(code) for o in c.get("outputs", []) if PROFILER_NOISE.search(_text(o))]
    if noise:
        problems.append(f"{where}: code cells {sorted(set(noise))} print the profiler's start/stop marks")
    return problems


#: the profiler's timestamped start/stop marks (torch's Kineto), noise in a committed output
PROFILER_NOISE = re.compile(r"^(\[rank \d+\] )?(USDT|STAGE):\S+ \S+ \d+:\d+ ", re.M)


def _text(output: dict) -> str:
    text = output.get("text", "")
    return "".join(text) if isinstance(text, list) else text


def marker_problems(ch: Chapter) -> list[str]:
    mark = re.compile(rf"pytest\.mark\.{ch.tag}\b")
    if any(mark.search(p.read_text()) for p in (ch.root / "tests").rglob("*.py")):
        return []
    return [f"no test under tests/ is marked pytest.mark.{ch.tag}"]


def _raises_not_implemented(node: ast.AST) -> bool:
    for n in ast.walk(node):
        if isinstance(n, ast.Raise) and n.exc is not None:
            target = n.exc.func if isinstance(n.exc, ast.Call) else n.exc
            if isinstance(target, ast.Name) and target.id == "NotImplementedError":
                return True
    return False


def _find(tree: ast.AST, qualname: str):
    node = tree
    for part in qualname.split("."):
        node = next((n for n in ast.iter_child_nodes(node) if getattr(n, "name", None) == part), None)
        if node is None:
            return None
    return node


def stub_problems(ch: Chapter, instructor: bool = True) -> list[str]:
    """exercises/ matches solutions/, and every function holding a solution raises NotImplementedError.
    A stub a student has filled in (its fingerprint no longer matches) is theirs, not a problem, unless
    ``instructor`` (CI: ``MTD_INSTRUCTOR=1``)."""
    if ch.exercises.exists() and ex.stub_is_edited(ch.exercises.read_text()) and not instructor:
        return []
    problems = [f"{ch.rel(p)} is out of sync with solutions/ (run `make exercises`)"
                for p in ex.check_sync(ch)]
    tree = ast.parse(ch.exercises.read_text())
    for r in ex.regions(ch.solutions.read_text(), ch.rel(ch.solutions)):
        node = _find(tree, r.qualname)
        if node is None or not _raises_not_implemented(node):
            problems.append(f"{ch.rel(ch.exercises)}: {r.qualname} does not raise NotImplementedError")
    try:
        ex.load(ch, "exercises", reload=True)
    except Exception as e:  # any import failure is the problem to report
        problems.append(f"{ch.rel(ch.exercises)} does not import: {type(e).__name__}: {e}")
    return problems


#: Words a lab report uses and a textbook does not (and the test paragraph a chapter used to have).
REPORT_WORDS = ("committed run", "acceptance", "**tests.**")
FIGURE_LINK = re.compile(r"!\[[^\]]*\]\(figures/(ch\d\d_[a-z0-9_]+)\.svg\)")


def _section(text: str, keyword: str) -> str:
    """The text under the first heading containing ``keyword``, up to the next heading of its level."""
    m = re.search(rf"^(#+)\s+[^\n]*{re.escape(keyword)}[^\n]*$", text, re.M | re.I)
    if m is None:
        return ""
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}}\s", rest, re.M)
    return rest[:end.start()] if end else rest


def textbook_problems(ch: Chapter) -> list[str]:
    """A chapter reads as a textbook: at least two figures, a "How we know it is right" section, three
    or more worked problems with their answers in ``<details>``, a takeaways box, no lab-report words."""
    text, where = ch.prose.read_text(), ch.rel(ch.prose)
    problems = []
    figures = set(FIGURE_LINK.findall(text))
    if len(figures) < 2:
        problems.append(f"{where} links {len(figures)} figure(s) (![...](figures/{ch.tag}_*.svg)), "
                        f"not at least 2")
    worked = _section(text, "Worked problems")
    if worked.count("<details>") < 3 or worked.count("<details>") != worked.count("</details>"):
        problems.append(f"{where}: a 'Worked problems' section with at least 3 answers in <details> blocks")
    if not re.search(r"^> \*\*Takeaways\*\*", text, re.M):
        problems.append(f"{where}: no takeaways box (a blockquote opening '> **Takeaways**')")
    low = text.lower()
    problems += [f"{where} says {w!r}: a lab report's word; say what the learner needs instead"
                 for w in REPORT_WORDS if w in low]
    problems += readability.reading(text).problems(where)
    pitfalls = len(re.findall(r"^#+ [^\n]*Pitfalls", text, re.M))
    if pitfalls != 1:
        problems.append(f"{where} has {pitfalls} Pitfalls headings: one Pitfalls section per chapter")
    return problems


@functools.cache
def _library_names() -> frozenset[str]:
    """Top-level functions and classes of the library (its course figures aside); parsed once."""
    names = set()
    for path in (REPO_ROOT / "minitorch_dist").rglob("*.py"):
        if "figures" not in path.parts:
            names |= {n.name for n in ast.parse(path.read_text()).body
                      if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return frozenset(names)


def exercise_kind_problems(ch: Chapter) -> list[str]:
    """Each exercise says its kind; a chapter has a build and a measure exercise; no exercise shares
    its name with the library (a student could import the answer)."""
    kinds = ex.chapter_exercises(ch)
    problems = [f"{ch.tag}: exercise {name}'s docstring does not open with 'Kind: build', 'Kind: derive' "
                f"or 'Kind: measure'" for name, kind in kinds.items() if kind not in ex.KINDS]
    problems += [f"{ch.tag} has no {need} exercise" for need in ("build", "measure")
                 if need not in kinds.values()]
    twins = sorted(set(kinds) & _library_names())
    if twins:
        problems.append(f"{ch.tag}: exercises {twins} have the name of a library function or class")
    return problems


#: A student's copy of the course (``make student-repo``) has no solutions: those checks skip there.
STUDENT_COPY = not (REPO_ROOT / "solutions").is_dir()
#: Instructors and CI (``MTD_INSTRUCTOR=1``): a filled-in stub is an error, not a student's work.
INSTRUCTOR = os.environ.get("MTD_INSTRUCTOR") == "1"


def chapter_problems(ch: Chapter, student_copy: bool = False, instructor: bool = True) -> list[str]:
    """Everything a written chapter must satisfy; [] when it does. In a student's copy the solutions
    and the stubs' state (theirs to fill in) are not checked; a stub filled in by a student is checked
    only for an ``instructor``."""
    parts = {k: v for k, v in ch.parts().items() if not (student_copy and k == "solutions")}
    files = dict(parts, **{f"module {m}": f for m, f in zip(ch.modules, ch.module_files)},
                 **{f"library tests of {m}": t for m, t in zip(ch.modules, ch.library_tests)})
    problems = [f"{name} missing: {ch.rel(path)}" for name, path in files.items() if not path.exists()]
    if problems:
        return problems
    problems = prose_problems(ch) + notebook_problems(ch, student_copy) + marker_problems(ch)
    problems += textbook_problems(ch)
    problems += exercise_kind_problems(ch)
    return problems if student_copy else problems + stub_problems(ch, instructor)


# --- every written chapter --------------------------------------------------------------------

by_tag = pytest.mark.parametrize("ch", CHAPTERS, ids=[c.tag for c in CHAPTERS])


def _written(ch: Chapter) -> None:
    if not ch.written:
        pytest.skip(f"{ch.tag} {ch.slug} is not written yet")


@by_tag
def test_written_chapter_is_complete(ch):
    _written(ch)
    assert chapter_problems(ch, STUDENT_COPY, INSTRUCTOR) == []


@by_tag
def test_written_chapter_headline_resolves(ch):
    _written(ch)
    if ch.headline is None:
        pytest.skip(f"{ch.tag} has no headline experiment")
    assert callable(tour.resolve(ch.headline))


@by_tag
def test_written_chapter_solutions_define_every_exercise(ch):
    _written(ch)
    if STUDENT_COPY:
        pytest.skip("a student's copy of the course has no solutions/")
    names = ex.exercise_names(ch)
    assert names, f"{ch.rel(ch.solutions)} has no # BEGIN SOLUTION region"
    solved, stubs = ex.load(ch, "solutions"), ex.load(ch, "exercises")
    assert solved is not stubs
    for name in names:
        assert hasattr(solved, name) and hasattr(stubs, name), name


# --- the registry -----------------------------------------------------------------------------

DESIGN_SLUGS = ("00_foundations 01_data_parallel 02_parameter_servers 03_pipeline 04_tensor_parallel "
                "05_sequence_parallel 06_zero_fsdp 07_checkpointing 08_mixed_precision 09_compression "
                "10_moe 11_fused_kernels 12_putting_it_together 13_resilience 14_measuring").split()


def test_registry_has_the_fourteen_chapters_in_order():  # and the appendix, 14
    assert [c.slug for c in CHAPTERS] == DESIGN_SLUGS
    assert [c.number for c in CHAPTERS] == list(range(15))
    assert len({c.tag for c in CHAPTERS}) == len({c.stem for c in CHAPTERS}) == 15
    for c in CHAPTERS:
        assert c.modules and all(m.startswith("minitorch_dist.") for m in c.modules)
        assert c.headline is None or re.fullmatch(r"[\w.]+:[\w.]+", c.headline), c.headline
        if c.solutions.exists():
            assert set(c.gpu_only_exercises) <= set(ex.exercise_names(c)), c.gpu_only_exercises
    assert registry.written_chapters() == [c for c in CHAPTERS if c.written]


def test_chapter_paths_follow_the_layout():
    c = registry.chapter("ch06")
    assert (c.tag, c.name, c.stem) == ("ch06", "zero_fsdp", "ch06_zero_fsdp")
    rel = {k: c.rel(v) for k, v in c.parts().items()}
    assert rel == {"prose": "chapters/06_zero_fsdp.md", "notebook": "notebooks/06_zero_fsdp.ipynb",
                   "exercises": "exercises/ch06_zero_fsdp.py", "solutions": "solutions/ch06_zero_fsdp.py",
                   "exercise tests": "tests/exercises/test_ch06_zero_fsdp.py"}
    assert [c.rel(p) for p in registry.chapter(2).library_tests] == ["tests/test_parameter_server.py",
                                                                    "tests/test_hogwild.py"]
    assert c.rel(registry.chapter(11).module_files[0]) == "minitorch_dist/kernels/__init__.py"
    assert REPO_ROOT.joinpath("minitorch_dist", "course", "registry.py").exists()


@pytest.mark.parametrize("key", [3, "3", "ch03", "03_pipeline", "CH03"])
def test_chapter_lookup(key):
    assert registry.chapter(key).slug == "03_pipeline"


def test_unknown_chapter_lists_valid_keys():
    with pytest.raises(KeyError, match=r"no chapter 'ch15'.*ch00, ch01.*ch14"):
        registry.chapter("ch15")


def test_chapter_markers_declared_in_pyproject():
    text = (REPO_ROOT / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11

        markers = tomllib.loads(text)["tool"]["pytest"]["ini_options"]["markers"]
    except ImportError:
        markers = re.findall(r'^\s*"([^"]+)",?\s*$', text.split("markers", 1)[1].split("]", 1)[0], re.M)
    declared = {m.split(":", 1)[0].strip() for m in markers}
    assert {c.tag for c in CHAPTERS} | {"gpu"} <= declared


def test_repository_exercises_in_sync():
    if STUDENT_COPY:
        pytest.skip("a student's copy of the course has no solutions/: its stubs are the student's")
    theirs = [ch.exercises.name for ch in CHAPTERS
              if ch.exercises.exists() and ex.stub_is_edited(ch.exercises.read_text())]
    if theirs and not INSTRUCTOR:
        pytest.skip(f"filled in by you: {theirs} (an instructor's check: MTD_INSTRUCTOR=1)")
    assert ex.check_sync() == []


# --- every module opens with its chapter ------------------------------------------------------

CHAPTER_LINE = re.compile(r"^Chapter (\d\d) — ")


def module_docstring_problems(package: Path, chapters=CHAPTERS) -> list[str]:
    """Every module of ``package`` has a docstring whose first line is ``Chapter NN — ...``, NN a
    chapter of ``chapters``; a module a chapter lists in ``Chapter.modules`` names that chapter."""
    listed = {m: c.number for c in chapters for m in c.modules}
    numbers = {c.number for c in chapters}
    problems = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        parts = list(rel.with_suffix("").parts)
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
        match = CHAPTER_LINE.match(doc.splitlines()[0]) if doc and doc.strip() else None
        if match is None:
            first = doc.splitlines()[0] if doc and doc.strip() else "(no docstring)"
            problems.append(f"{rel}: the docstring must open with 'Chapter NN — ', got {first!r}")
        elif int(match[1]) not in numbers:
            problems.append(f"{rel}: chapter {match[1]} does not exist (chapters: {sorted(numbers)})")
        elif dotted in listed and int(match[1]) != listed[dotted]:
            problems.append(f"{rel}: chapter {listed[dotted]:02d} lists this module, "
                            f"its docstring says {match[1]}")
    return problems


def test_every_module_opens_with_its_chapter():
    assert module_docstring_problems(REPO_ROOT / "minitorch_dist") == []


def test_module_docstring_check_catches_each_breakage(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {"__init__.py": '"""Chapter 00 — the package."""\n',
             "good.py": '"""Chapter 03 — pipelines.\n\nMore text.\n"""\nX = 1\n',
             "sub/__init__.py": "",
             "colon.py": '"""Chapter 03: pipelines."""\n',
             "later.py": '"""Pipelines.\n\nChapter 03 — not on the first line.\n"""\n',
             "nowhere.py": '"""Chapter 99 — no such chapter."""\n',
             "listed.py": '"""Chapter 00 — listed under chapter 03."""\n'}
    for name, text in files.items():
        (pkg / name).write_text(text, encoding="utf-8")
    chapters = [Chapter(0, "00_a", "A", ("pkg",)), Chapter(3, "03_b", "B", ("pkg.listed", "pkg.good"))]
    problems = module_docstring_problems(pkg, chapters)
    assert len(problems) == 5, problems
    for name, needle in (("sub/__init__.py", "(no docstring)"), ("colon.py", "Chapter 03: pipelines."),
                         ("later.py", "'Pipelines.'"), ("nowhere.py", "chapter 99 does not exist"),
                         ("listed.py", "chapter 03 lists this module, its docstring says 00")):
        assert any(p.startswith(f"pkg/{name}") and needle in p for p in problems), (name, problems)


# --- exercise generation ----------------------------------------------------------------------

SOLUTIONS = textwrap.dedent('''\
    """A fake chapter's solutions."""
    NOTE = """
    # BEGIN SOLUTION   (inside a string: not a marker)
    """


    def double(x):
        """Kind: build

        Return 2x."""
        # BEGIN SOLUTION
        return 2 * x
        # END SOLUTION


    class Layer:
        """Kind: derive"""

        def forward(self, x):
            """Halve, unless None."""
            if x is None:
                return None
            else:
                # BEGIN SOLUTION
                y = x / 2
                return y
                # END SOLUTION


    def triple(x):
        """Kind: measure"""
        # BEGIN SOLUTION
        return 3 * x
        # END SOLUTION
    ''')


def test_strip_solutions_replaces_regions_and_keeps_the_rest():
    out = ex.strip_solutions(SOLUTIONS, "solutions/ch98_fake.py", "chapters/98_fake.md")
    assert out.startswith("# generated from solutions/ch98_fake.py by `make exercises`: fill in each")
    assert not ex.stub_is_edited(out) and ex.stub_is_edited(out + "x = 1\n")
    assert "2 * x" not in out and "x / 2" not in out and "3 * x" not in out
    assert ('    Return 2x."""\n'
            '    raise NotImplementedError("exercise: double — see chapters/98_fake.md")\n') in out
    assert ('        else:\n            raise NotImplementedError("exercise: Layer.forward — see '
            'chapters/98_fake.md")\n') in out
    assert "# BEGIN SOLUTION   (inside a string" in out  # strings are left alone
    assert out.count("raise NotImplementedError") == 3
    ast.parse(out)
    ns = {}
    exec(compile(out, "stub", "exec"), ns)
    with pytest.raises(NotImplementedError, match="exercise: triple"):
        ns["triple"](1)
    assert ns["Layer"]().forward(None) is None  # code outside the region still runs


def test_exercise_names_are_the_top_level_holders():
    assert ex.exercise_names_in(SOLUTIONS) == ["double", "Layer", "triple"]


@pytest.mark.parametrize("source, message", [
    ("def f():\n    # BEGIN SOLUTION\n    return 1\n", r"fake\.py:2: .*never closed"),
    ("def f():\n    return 1\n    # END SOLUTION\n", r"fake\.py:3: .*without a matching"),
    ("def f():\n    # BEGIN SOLUTION\n    # BEGIN SOLUTION\n    return 1\n    # END SOLUTION\n",
     r"fake\.py:3: nested .*line 2"),
    ("# BEGIN SOLUTION\nX = 1\n# END SOLUTION\n", r"fake\.py:1: .*inside a function or class"),
    ("def f():\n    # BEGIN SOLUTION\n    # END SOLUTION\n    return 1\n",
     r"fake\.py:2: empty solution region"),
    ("def f():\n    return 1  # BEGIN SOLUTION\n", r"fake\.py:2: .*line of its own"),
    ("def f(:\n    pass\n", r"fake\.py:1: not valid Python"),
])
def test_bad_markers_are_clear_errors(source, message):
    with pytest.raises(ex.MarkerError, match=message):
        ex.strip_solutions(source, "solutions/fake.py")


def test_impl_is_checked(monkeypatch):
    monkeypatch.setenv("MTD_IMPL", "exercises")
    assert ex.resolve_impl() == "exercises"
    assert ex.resolve_impl("solutions") == "solutions"
    monkeypatch.delenv("MTD_IMPL")
    assert ex.resolve_impl() == "solutions"
    with pytest.raises(ValueError, match="'solutions' .* or 'exercises'"):
        ex.resolve_impl("answers")


def test_the_tests_load_the_students_stub_once_it_is_filled_in(fake, monkeypatch):
    monkeypatch.delenv("MTD_IMPL", raising=False)
    assert ex.resolve_impl(chapter=fake) == "solutions"  # untouched stubs: the suite stays green
    fake.exercises.write_text(fake.exercises.read_text().replace(
        'raise NotImplementedError("exercise: double — see chapters/98_fake.md")', "return x + x"))
    assert ex.resolve_impl(chapter=fake) == "exercises"  # the student's work is what gets tested
    assert ex.load(fake, reload=True).double(4) == 8
    fake.exercises.write_text(ex.stub_text(fake))
    fake.solutions.unlink()
    assert ex.resolve_impl(chapter=fake) == "exercises"  # a student's copy: no solutions at all


def test_make_exercises_leaves_a_filled_in_stub_alone(fake):
    mine = fake.exercises.read_text().replace('raise NotImplementedError("exercise: double',
                                              'return 2 * x  # ("')
    fake.exercises.write_text(mine)
    fake.solutions.write_text(fake.solutions.read_text() + "\n\nY = 2\n")  # the instructor changed it
    with pytest.raises(ex.StubEdited, match="changed since `make exercises` wrote it .* FORCE=1"):
        ex.generate(fake)
    assert fake.exercises.read_text() == mine
    assert ex.generate(fake, force=True) == [fake.exercises]
    assert not ex.stub_is_edited(fake.exercises.read_text())


def test_kinds_are_read_from_the_docstrings(fake):
    assert ex.chapter_exercises(fake) == {"double": "build", "Layer": "derive", "triple": "measure"}
    stubs_only = ex.chapter_exercises(fake)
    fake.solutions.unlink()  # a student's copy: the stubs say the same
    assert ex.chapter_exercises(fake) == stubs_only


# --- a fake chapter: the checks pass on it, and fail on each broken part -----------------------

EXERCISE_TESTS = textwrap.dedent('''\
    import importlib.util, os, time
    import pytest

    pytestmark = pytest.mark.ch98
    impl = os.environ.get("MTD_IMPL", "solutions")
    path = os.path.join(os.path.dirname(__file__), "..", "..", impl, "ch98_fake.py")
    spec = importlib.util.spec_from_file_location("fake98", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    def test_double():
        assert mod.double(2) == 4

    @pytest.mark.parametrize("x", [-1, 3])
    def test_double_any(x):
        assert mod.double(x) == 2 * x

    def test_layer_on_gpu():
        pytest.skip("needs a CUDA GPU")

    def test_triple():
        if os.environ.get("FAKE_SLOW"):
            time.sleep(60)
        assert mod.triple(2) == 6

    def test_unrelated():
        assert True
    ''')

PROSE = ("# Fake\n" + "".join(f"\n## {kw}\n\ntext\n" for kw in PROSE_SECTIONS)
         + "\n![one](figures/ch98_one.svg) ![two](figures/ch98_two.svg)\n"
         + "\n## How we know it is right\n\ntext\n"
         + "\n## Worked problems\n\n" + "**1.** q\n<details>a</details>\n" * 3
         + "\n> **Takeaways**\n>\n> - one\n")
NOTEBOOK = {"cells": [{"cell_type": "markdown", "metadata": {}, "source": ["# Fake"]},
                      {"cell_type": "code", "execution_count": 1, "metadata": {}, "source": ["print(1)"],
                       "outputs": [{"output_type": "stream", "name": "stdout", "text": ["1\n"]}]}],
            "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture
def fake(tmp_path):
    ch = Chapter(98, "98_fake", "Fake", ("fakepkg.fakemod",), written=True, root=tmp_path)
    for path, text in [(ch.prose, PROSE), (ch.notebook, json.dumps(NOTEBOOK)), (ch.solutions, SOLUTIONS),
                       (ch.exercise_tests, EXERCISE_TESTS), (ch.module_files[0], "X = 1\n"),
                       (ch.library_tests[0], "def test_x():\n    pass\n")]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert ex.generate(ch) == [ch.exercises]
    return ch


def test_generate_then_check_sync(fake):
    assert ex.generate(fake) == []  # already in sync: nothing rewritten
    assert ex.check_sync(fake) == []
    fake.exercises.write_text(fake.exercises.read_text() + "# edited by hand\n")
    assert ex.check_sync(fake) == [fake.exercises]
    fake.solutions.unlink()
    assert ex.check_sync(fake) == [fake.exercises]  # an orphan stub is stale too


def test_exercises_command_line(fake, monkeypatch, capsys):
    monkeypatch.setattr(registry, "CHAPTERS", (fake,))
    assert ex.main(["check"]) == 0
    fake.exercises.unlink()
    assert ex.main(["check"]) == 1
    assert str(fake.exercises) in capsys.readouterr().err
    assert ex.main(["generate", "--chapter", "ch98"]) == 0
    assert f"wrote {fake.exercises}" in capsys.readouterr().out
    assert ex.main(["check"]) == 0
    fake.solutions.write_text("def f():\n    # BEGIN SOLUTION\n    return 1\n")
    assert ex.main(["generate"]) == 2
    assert "solutions/ch98_fake.py:2: '# BEGIN SOLUTION' is never closed" in capsys.readouterr().err


def test_load_both_impls_in_one_process(fake, monkeypatch):
    sol, stub = ex.load(fake, "solutions"), ex.load(fake, "exercises")
    assert sol.double(3) == 6
    with pytest.raises(NotImplementedError, match="exercise: double — see chapters/98_fake.md"):
        stub.double(3)
    monkeypatch.setenv("MTD_IMPL", "exercises")
    assert ex.load(fake) is stub
    fake.exercises.unlink()
    with pytest.raises(FileNotFoundError, match="run `make exercises`"):
        ex.load(fake, "exercises", reload=True)


def test_loaded_functions_pickle_by_value(fake):
    import cloudpickle

    blob = cloudpickle.dumps(ex.load(fake, "solutions").double)
    code = "import sys, pickle; f = pickle.loads(sys.stdin.buffer.read()); print(f(21))"
    out = subprocess.run([sys.executable, "-c", code], input=blob, capture_output=True, timeout=60, cwd="/")
    assert out.stdout.decode().strip() == "42", out.stderr.decode()


def test_checks_pass_on_a_complete_chapter(fake):
    assert chapter_problems(fake) == []


@pytest.mark.parametrize("breakage, expected", [
    (lambda ch: ch.notebook.unlink(), "notebook missing: notebooks/98_fake.ipynb"),
    (lambda ch: ch.module_files[0].unlink(), "module fakepkg.fakemod missing"),
    (lambda ch: ch.prose.write_text(PROSE.replace("Pitfalls", "Gotchas")),
     "no heading containing 'Pitfalls'"),
    (lambda ch: ch.prose.write_text(PROSE.replace("## Worked", "## Pitfalls, again\n\ntext\n\n## Worked")),
     "2 Pitfalls headings"),
    (lambda ch: ch.prose.write_text(PROSE.replace("## Worked", "word " * 4600 + ".\n\n## Worked")),
     "words of prose, over 4500"),
    (lambda ch: ch.prose.write_text(PROSE.replace("## Worked", ("a long sentence " * 15 + ". ") * 20
                                                  + "\n\n## Worked")),
     "sentences average"),
    (lambda ch: ch.prose.write_text(PROSE.replace("## Reading", "Reading")),
     "no heading containing 'Reading'"),
    (lambda ch: ch.notebook.write_text(json.dumps(NOTEBOOK).replace('"execution_count": 1',
                                                                    '"execution_count": null')),
     "code cell 0 was not executed"),
    (lambda ch: ch.notebook.write_text(json.dumps(NOTEBOOK).replace('"outputs": [{', '"x": [{').replace(
        '"metadata": {}, "source": ["print', '"outputs": [], "metadata": {}, "source": ["print')),
     "without outputs"),
    (lambda ch: ch.notebook.write_text(json.dumps(dict(NOTEBOOK, cells=NOTEBOOK["cells"] + [
        dict(NOTEBOOK["cells"][1], execution_count=c) for c in (3, 2)]))), "not run top to bottom"),
    (lambda ch: ch.notebook.write_text(json.dumps(NOTEBOOK).replace(
        '"text": ["1\\n"]',
        '"text": ["[rank 0] USDT:2026-12-07 12:50:09 1:1 Sync.cpp:52] profiler_start\\n"]')),
     "profiler's start/stop marks"),
    (lambda ch: ch.exercise_tests.write_text(EXERCISE_TESTS.replace("pytest.mark.ch98", "pytest.mark.slow")),
     "marked pytest.mark.ch98"),
    (lambda ch: ch.exercises.write_text(ex.stub_text(ch).replace(
        'raise NotImplementedError("exercise: triple', 'return 3 * x  # ("exercise: triple')),
     "triple does not raise NotImplementedError"),
    (lambda ch: ch.solutions.write_text(SOLUTIONS + "\n\ndef extra():\n    # BEGIN SOLUTION\n    pass\n"
                                                    "    # END SOLUTION\n"), "out of sync"),
    (lambda ch: ch.exercises.write_text(ex.stub_text(ch) + "import no_such_module_xyz\n"), "does not import"),
])
def test_checks_catch_each_broken_part(fake, breakage, expected):
    breakage(fake)
    problems = chapter_problems(fake)
    assert any(expected in p for p in problems), problems


# --- the grader -------------------------------------------------------------------------------


def test_exercise_for_maps_by_longest_name():
    names = ["ring", "ring_all_reduce", "Layer"]
    assert grade.exercise_for("test_ring_all_reduce[4]", names) == "ring_all_reduce"
    assert grade.exercise_for("test_ring_all_reduce_uneven", names) == "ring_all_reduce"
    assert grade.exercise_for("test_ring", names) == "ring"
    assert grade.exercise_for("test_layer_backward", names) == "Layer"
    assert grade.exercise_for("test_ringside", names) is None
    assert grade.exercise_for("test_tree", names) is None


def test_parse_junit_and_summarize(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="t" name="test_a"/>'
        '<testcase classname="t" name="test_a_gpu"><skipped type="pytest.skip" message="needs a CUDA '
        'GPU"/></testcase><testcase classname="t" name="test_b[2]"><failure message="NotImplementedError: '
        'exercise: b — see x">tb</failure></testcase>'
        '<testcase classname="t" name="test_c"><failure message="AssertionError: 3 != '
        '4">tb</failure></testcase><testcase classname="t" name="test_d"><skipped type="pytest.skip" '
        'message="needs a CUDA GPU"/></testcase><testcase classname="t" name="test_e"><skipped '
        'message="flaky on macOS"/></testcase><testcase classname="t" name="test_zzz"><error '
        'message="fixture broke">tb</error></testcase></testsuite></testsuites>')
    results = grade.parse_junit(xml)
    assert [r.status for r in results] == ["passed", "blocked", "todo", "failed", "blocked", "skipped",
                                           "failed"]
    rows = {r.exercise: r
            for r in grade.summarize("ch98", ["a", "b", "c", "d", "e", "f", "g"], results, ("g",))}
    assert {k: r.status for k, r in rows.items()} == {
        "a": "passed", "b": "todo", "c": "failed", "d": "blocked", "e": "skipped", "f": "no tests",
        "g": "blocked", "test_zzz": "failed"}
    assert rows["a"].tests == "1 passed, 1 blocked"
    assert rows["c"].detail == "AssertionError: 3 != 4"


def test_grade_chapter_end_to_end(fake):
    solved = {r.exercise: r.status for r in grade.grade_chapter(fake, "solutions", timeout=60)}
    assert solved == {"double": "passed", "Layer": "blocked", "triple": "passed", "test_unrelated": "passed"}
    # a student who got double wrong and has not started triple
    fake.exercises.write_text(ex.stub_text(fake).replace(
        'raise NotImplementedError("exercise: double — see chapters/98_fake.md")', "return x + 2"))
    rows = grade.grade_chapter(fake, "exercises", timeout=60)
    assert {r.exercise: r.status for r in rows} == {
        "double": "failed", "Layer": "blocked", "triple": "todo", "test_unrelated": "passed"}
    text = grade.report(rows, "exercises")
    assert "score: 1/4 exercises passed (exercises); 1 failed, 1 todo, 1 blocked" in text


def test_grade_runs_the_held_out_tests_in_their_own_column(fake):
    fake.hidden_tests.parent.mkdir(parents=True)
    fake.hidden_tests.write_text(EXERCISE_TESTS.split("def test_double():")[0] + textwrap.dedent('''\
        def test_double_large():
            assert mod.double(10 ** 6) == 2 * 10 ** 6
        '''))
    fake.exercises.write_text(ex.stub_text(fake).replace(  # right on the visible cases, wrong beyond them
        'raise NotImplementedError("exercise: double — see chapters/98_fake.md")',
        "return x + x if abs(x) < 100 else 0"))
    rows = {r.exercise: r for r in grade.grade_chapter(fake, "exercises", timeout=60)}
    assert (rows["double"].status, rows["double"].held_out) == ("passed", "failed")
    assert rows["triple"].held_out == "no tests"
    text = grade.report(list(rows.values()), "exercises")
    assert "held-out" in text.splitlines()[0] and "held-out tests: 0/1 exercises passed" in text
    assert "held-out" not in grade.report([dataclasses.replace(r, held_out="") for r in rows.values()], "x")


def test_grade_chapter_timeout_kills_the_tests(fake, monkeypatch):
    monkeypatch.setenv("FAKE_SLOW", "1")
    rows = grade.grade_chapter(fake, "solutions", timeout=4)
    assert {r.status for r in rows} == {"timeout"} and len(rows) == 3


def test_grade_reports_missing_tests(fake):
    fake.exercise_tests.unlink()
    assert {r.status for r in grade.grade_chapter(fake)} == {"missing"}


# --- the tour ---------------------------------------------------------------------------------

HEADLINES = textwrap.dedent('''\
    def good(smoke):
        return {"chapter": "ch97", "experiment": "bytes", "theory": 1.5e6, "measured": 1.5e6, "ok": smoke}

    def many(smoke):
        return [{"chapter": "ch98", "experiment": f"n={n}", "theory": n, "measured": n, "ok": True}
                for n in (2, 4)]

    def broken(smoke):
        raise RuntimeError("boom\\nsecond line")

    def incomplete(smoke):
        return {"chapter": "ch99", "ok": True}

    def slow_machine(smoke):
        return [{"chapter": "ch96", "experiment": "bytes", "theory": 8, "measured": 8, "ok": True},
                {"chapter": "ch96", "experiment": "step (s)", "theory": 0.05, "measured": 0.12, "ok": False,
                 "timing": True, "note": "ratio 0.42, outside; machine 2.4x slower than at calibration"}]
    ''')


def _tour_chapters(tmp_path, monkeypatch, *names):
    (tmp_path / "fake_headlines.py").write_text(HEADLINES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return [Chapter(90 + i, f"{90 + i}_x", "x", ("m",), True, f"fake_headlines:{n}")
            for i, n in enumerate(names)]


def test_tour_all_ok(tmp_path, monkeypatch, capsys):
    assert tour.run(_tour_chapters(tmp_path, monkeypatch, "good", "many"), smoke=True, progress=False) == 0
    out = capsys.readouterr().out
    assert "CPU:" in out.splitlines()[0] and "1.5e+06" in out and "n=4" in out
    assert "3/3 exact experiments agree with theory" in out


def test_tour_reports_failures_and_carries_on(tmp_path, monkeypatch, capsys):
    chapters = _tour_chapters(tmp_path, monkeypatch, "broken", "incomplete", "good")
    assert tour.run(chapters, smoke=False, progress=False) == 1
    out = capsys.readouterr().out
    assert "RuntimeError: boom" in out and "second line" not in out
    assert "without keys ['experiment', 'theory', 'measured']" in out
    assert "0/3 exact experiments agree with theory; 3 did not" in out  # good() reports ok=smoke=False


def test_a_timing_row_outside_its_band_is_reported_and_never_fails_the_tour(tmp_path, monkeypatch, capsys):
    """A busy machine moves a step time, never a byte: the exit status follows the exactness rows."""
    assert tour.run(_tour_chapters(tmp_path, monkeypatch, "slow_machine"), progress=False) == 0
    out = capsys.readouterr().out
    assert "off" in out and "2.4x slower than at calibration" in out
    assert "1/1 exact experiments agree" in out and "0/1 step times within their band" in out
    assert tour.exit_status([{"ok": False, "timing": True}, {"ok": True}]) == 0
    assert tour.exit_status([{"ok": True, "timing": True}, {"ok": False}]) == 1


def test_tour_with_nothing_to_run(capsys):
    assert tour.run([], progress=False) == 0
    out = capsys.readouterr().out
    assert "nothing to run" in out and "ch12" in out and "planned" in out


# --- a student's copy of the course -------------------------------------------------------------------


def test_test_files_have_distinct_names():
    """pytest imports a test file by its name: two of one name in two folders break one session."""
    names = [p.name for p in (REPO_ROOT / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []


def test_a_prediction_prompts_answer_is_cleared_and_no_longer_compared():
    from minitorch_dist.course.student_repo import clear_predictions

    out = [{"output_type": "stream", "name": "stdout", "text": ["42\n"]}]
    code = lambda src: {"cell_type": "code", "execution_count": 3, "metadata": {}, "outputs": list(out),
                        "source": src}
    md = lambda src: {"cell_type": "markdown", "metadata": {}, "source": src}
    nb = {"cells": [md(["## 1\n", "*Predict first:* how many bytes?"]),
                    code(["# NBVAL_CHECK_OUTPUT\n", "print(42)"]), code(["print(43)"]),
                    md(["## 2, no prompt"]), code(["print(44)"])]}
    assert clear_predictions(nb) == 2
    first, second, _, kept = nb["cells"][1:]
    assert first["outputs"] == [] and first["execution_count"] is None and first["source"] == ["print(42)"]
    assert second["outputs"] == [] and kept["outputs"] == out and kept["execution_count"] == 3


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_student_copy_has_no_solutions_and_tests_the_stubs(tmp_path):
    from minitorch_dist.course.student_repo import make_student_repo

    dest = tmp_path / "course"
    copied = make_student_repo(dest)
    assert not any(f.startswith("solutions/") for f in copied) and not (dest / "solutions").exists()
    assert not any(f.startswith("tests/exercises_hidden/") for f in copied)
    hidden = Path("tests") / "exercises_hidden"
    assert (REPO_ROOT / hidden).is_dir() and not (dest / hidden).exists()
    for nb in sorted((dest / "notebooks").glob("[0-9]*.ipynb")):  # no answer under a prediction prompt
        cells = json.loads(nb.read_text())["cells"]
        prompts = [i for i, c in enumerate(cells) if c["cell_type"] == "markdown" and "Predict first" in
                   "".join(c["source"])]
        assert prompts, f"{nb.name}: no prediction prompt found"
        for i in prompts:
            assert cells[i + 1]["cell_type"] == "code" and cells[i + 1]["outputs"] == [], nb.name
    assert (dest / "exercises" / "ch13_resilience.py").read_text() == CHAPTERS[13].exercises.read_text()
    env = dict(os.environ, PYTHONPATH=str(dest), MTD_SMOKE="1")
    env.pop("MTD_IMPL", None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:nbval", "-rA",
                          "tests/test_course.py", "-k", "ch13 or in_sync or define_every",
                          "tests/exercises/test_ch13_resilience.py::test_interval_and_waste_daly_figure"],
                         cwd=dest, env=env, capture_output=True, text=True, timeout=200)
    out = run.stdout
    assert "PASSED tests/test_course.py::test_written_chapter_is_complete[ch13]" in out, out[-3000:]
    assert "SKIPPED" in out and "has no solutions/" in out, out[-3000:]  # the solutions' checks skip
    stub_test = "tests/exercises/test_ch13_resilience.py::test_interval_and_waste_daly_figure"
    assert f"FAILED {stub_test}" in out, out[-3000:]
    assert "NotImplementedError" in out  # the copy's exercise tests ran the stubs
    with pytest.raises(FileExistsError, match="not empty"):
        make_student_repo(dest)
    with pytest.raises(ValueError, match="inside the course"):
        make_student_repo(REPO_ROOT / "tmp-student-copy")


# --- links between the chapters, the cheatsheet and the code ---------------------------------------

MD_LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s#]+)(?:#[^)]*)?\)")


def test_every_relative_link_in_the_chapters_resolves():
    """A chapter's links to other chapters, the cheatsheet, notebooks and code lead to files that exist."""
    broken = []
    for md in sorted((REPO_ROOT / "chapters").glob("*.md")):
        text = re.sub(r"^```.*?^```", "", md.read_text(encoding="utf-8"), flags=re.M | re.S)
        text = re.sub(r"`[^`\n]*`", "", text)
        for target in MD_LINK.findall(text):
            if "://" not in target and not target.startswith("mailto:") and not (md.parent / target).exists():
                broken.append(f"{md.name} -> {target}")
    assert broken == [], broken
