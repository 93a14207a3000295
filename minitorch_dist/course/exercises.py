"""Chapter 00 — exercise stubs, generated from the worked solutions; and loading either one by name.

A solutions file marks the part a student writes::

    def ring_all_reduce(t):
        \"\"\"Sum `t` over all ranks with the ring algorithm ...\"\"\"
        # BEGIN SOLUTION
        ...the worked answer...
        # END SOLUTION

`strip_solutions` replaces every region, markers included, by one
``raise NotImplementedError("exercise: ring_all_reduce — see chapters/NN_slug.md")`` at the
marker's indentation, so the signature and docstring (which sit before the marker) stay; the
docstring's "Worked solutions." paragraph becomes the student's instructions.

**Who edits what.** Instructors edit ``solutions/`` and run ``make exercises``
(``python -m minitorch_dist.course.exercises generate``) to regenerate ``exercises/``; students fill in
``exercises/``. Each stub carries the *fingerprint* of its generated text, so ``make exercises``
knows a stub a student has filled in and leaves it alone (``FORCE=1`` replaces it); ``check`` lists
stubs out of sync with their solutions (an instructor's and CI's check).

`load` imports a chapter's solutions or stubs by file path. Which one the exercise tests load:
``MTD_IMPL=exercises|solutions`` when set; otherwise a chapter's stubs if there are no solutions (a
student's copy of the course, ``make student-repo``) or if its stub has been filled in, and its worked
solutions if the stub is untouched (so the suite stays green on a fresh checkout).
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.util
import io
import os
import re
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from . import registry
from .registry import Chapter

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_MARKER = re.compile(r"#\s*(BEGIN|END) SOLUTION\s*")
IMPLS = ("solutions", "exercises")


class MarkerError(ValueError):
    """Solution markers that cannot be turned into stubs (unbalanced, nested, misplaced)."""


@dataclass(frozen=True)
class Region:
    begin: int  # 1-based line of "# BEGIN SOLUTION"
    end: int  # 1-based line of "# END SOLUTION"
    indent: str  # the BEGIN marker's indentation: the stub's `raise` goes there
    qualname: str  # "ring_all_reduce" or "Ring.forward": the innermost def/class around it
    exercise: str  # the module-level function or class that holds the region


def _marker_lines(source: str, origin: str) -> list[tuple[int, str, str]]:
    """(line, "BEGIN"/"END", indentation) of each marker comment; comments only, not strings."""
    found, lines = [], source.splitlines()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT or not (m := _MARKER.fullmatch(tok.string)):
                continue
            line, col = tok.start
            prefix = lines[line - 1][:col]
            if prefix.strip():
                raise MarkerError(f"{origin}:{line}: '{tok.string.strip()}' must be on a line of its own")
            found.append((line, m.group(1), prefix))
    except (tokenize.TokenError, SyntaxError) as e:
        raise MarkerError(f"{origin}: cannot tokenize: {e}") from e
    return found


def _enclosing(tree: ast.AST, first: int, last: int) -> list[ast.AST]:
    """The def/class nodes (outermost first) whose lines contain lines first..last."""
    chain, body = [], getattr(tree, "body", [])
    while True:
        inner = [n for n in ast.walk(ast.Module(body=body, type_ignores=[]))
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                 and n.lineno < first and n.end_lineno >= last]
        if not inner:
            return chain
        node = min(inner, key=lambda n: n.lineno)  # the outermost of those left is the first
        chain.append(node)
        body = node.body


def regions(source: str, origin: str = "<source>") -> list[Region]:
    """The solution regions of `source`, checked: balanced, not nested, inside a def or class."""
    try:
        tree = ast.parse(source, filename=origin)
    except SyntaxError as e:
        raise MarkerError(f"{origin}:{e.lineno}: not valid Python: {e.msg}") from e
    out, open_at, src = [], None, source.splitlines()
    for line, kind, indent in _marker_lines(source, origin):
        if kind == "BEGIN":
            if open_at is not None:
                raise MarkerError(f"{origin}:{line}: nested '{BEGIN}' (the region opened at line "
                                  f"{open_at[0]} has no '{END}' yet)")
            open_at = (line, indent)
            continue
        if open_at is None:
            raise MarkerError(f"{origin}:{line}: '{END}' without a matching '{BEGIN}'")
        begin, indent = open_at
        open_at = None
        code = [n for n in range(begin + 1, line)
                if src[n - 1].strip() and not src[n - 1].lstrip().startswith("#")]
        if not code:
            raise MarkerError(f"{origin}:{begin}: empty solution region (lines {begin}-{line})")
        chain = _enclosing(tree, code[0], code[-1])
        if not chain:
            raise MarkerError(f"{origin}:{begin}: a solution region must sit inside a function or "
                              "class body, after its signature and docstring")
        out.append(Region(begin, line, indent, ".".join(n.name for n in chain), chain[0].name))
    if open_at is not None:
        raise MarkerError(f"{origin}:{open_at[0]}: '{BEGIN}' is never closed by '{END}'")
    return out


#: The paragraph of a solutions file's docstring that speaks to the instructor; a stub replaces it.
_WORKED = re.compile(r"^Worked solutions\..*?(?=\n\s*\n)", re.S | re.M)
_FINGERPRINT = re.compile(r"^# fingerprint ([0-9a-f]{16}) ")
KINDS = ("build", "derive", "measure")


def fingerprint(body: str) -> str:
    """16 hex digits of SHA-256 of a stub's text below its header."""
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def header(origin: str, body: str) -> str:
    """Two comment lines: where the stub comes from, and the fingerprint of the text below them, which
    tells ``make exercises`` an untouched stub (safe to regenerate) from one a student filled in."""
    return (f"# generated from {origin} by `make exercises`: fill in each NotImplementedError\n"
            f"# fingerprint {fingerprint(body)} of the text below (once you change it, `make exercises` "
            f"leaves it alone)\n")


def student_docstring(source: str, tag: str) -> str:
    """The solutions' module docstring with its "Worked solutions." paragraph replaced by the
    student's: what to fill in and the one command that checks it."""
    note = ("Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest\n"
            "(imports, argument checks, helpers) is given. The first line of each exercise's docstring\n"
            "says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,\n"
            f"then run). Check your work: ``python -m minitorch_dist grade --chapter {tag}``.")
    return _WORKED.sub(lambda _: note, source, count=1)


def strip_solutions(source: str, origin: str = "<source>", prose: str = "the chapter",
                    tag: str = "chNN") -> str:
    """The stub text for solutions `source`: each region becomes a `raise NotImplementedError`, the
    docstring speaks to the student, and a header carries the fingerprint of the text."""
    lines = source.splitlines(keepends=True)
    out, pos = [], 0
    for r in regions(source, origin):
        out.extend(lines[pos:r.begin - 1])
        out.append(f'{r.indent}raise NotImplementedError("exercise: {r.qualname} — see {prose}")\n')
        pos = r.end
    out.extend(lines[pos:])
    body = student_docstring("".join(out), tag)
    try:
        ast.parse(body)
    except SyntaxError as e:  # e.g. a region that was a whole `if` branch but for its marker
        raise MarkerError(f"{origin}: the generated stub is not valid Python at line {e.lineno}: "
                          f"{e.msg}") from e
    return header(origin, body) + body


def stub_is_edited(text: str) -> bool:
    """Has a student changed this stub since ``make exercises`` wrote it (its text below the header no
    longer matches the fingerprint in it)? A file without a fingerprint counts as edited."""
    lines = text.splitlines(keepends=True)
    m = _FINGERPRINT.match(lines[1]) if len(lines) > 1 else None
    return m is None or fingerprint("".join(lines[2:])) != m.group(1)


def kind_of(node) -> str | None:
    """``build`` / ``derive`` / ``measure`` from the first line of an exercise's docstring ("Kind: build",
    maybe followed by its time, "Kind: build · about 60 minutes": :mod:`.statements`)."""
    doc = (ast.get_docstring(node) or "").strip().splitlines()
    m = re.match(r"Kind:\s*(\w+)\b", doc[0].strip()) if doc else None
    return m.group(1).lower() if m else None


def _raises_exercise(node) -> bool:
    """Does this def/class raise the stub's ``NotImplementedError("exercise: ...")``?"""
    for n in ast.walk(node):
        if isinstance(n, ast.Raise) and isinstance(n.exc, ast.Call) and getattr(n.exc.func, "id", "") == \
                "NotImplementedError" and n.exc.args and isinstance(n.exc.args[0], ast.Constant) and \
                str(n.exc.args[0].value).startswith("exercise:"):
            return True
    return False


def chapter_exercises(chapter) -> dict[str, str | None]:
    """``{exercise: kind}`` of a chapter, in file order: from its solutions (the regions' holders), or,
    in a student's copy without ``solutions/``, from its stubs (the defs that raise the stub's error)."""
    return {name: kind_of(node) for name, node in exercise_nodes(chapter).items()}


def exercise_nodes(chapter) -> dict[str, ast.FunctionDef | ast.ClassDef]:
    """``{exercise: its def or class}`` of a chapter, in file order (see :func:`chapter_exercises`)."""
    ch = registry.chapter(chapter)
    if ch.solutions.exists():
        tree, names = ast.parse(ch.solutions.read_text()), exercise_names(ch)
    elif ch.exercises.exists():
        tree = ast.parse(ch.exercises.read_text())
        names = [n.name for n in tree.body
                 if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and _raises_exercise(n)]
    else:
        return {}
    nodes = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    return {name: nodes[name] for name in names}


def exercise_names_in(source: str, origin: str = "<source>") -> list[str]:
    """Module-level functions/classes that hold a solution region, in file order, once each."""
    return list(dict.fromkeys(r.exercise for r in regions(source, origin)))


def exercise_names(chapter) -> list[str]:
    """The exercises of a chapter: the names the grader looks for in ``test_<name>...``."""
    ch = registry.chapter(chapter)
    return exercise_names_in(ch.solutions.read_text(), ch.rel(ch.solutions))


def stub_text(ch: Chapter) -> str:
    """What ``exercises/chNN_x.py`` must contain for chapter `ch`."""
    return strip_solutions(ch.solutions.read_text(), ch.rel(ch.solutions), ch.rel(ch.prose), ch.tag)


def _chapters(chapter) -> list[Chapter]:
    return list(registry.CHAPTERS) if chapter is None else [registry.chapter(chapter)]


class StubEdited(RuntimeError):
    """``make exercises`` would overwrite stubs a student has filled in; ``.paths`` lists them."""

    def __init__(self, paths: list[Path]):
        self.paths = paths
        shown = ", ".join(_show(p) for p in paths)
        super().__init__(f"{shown}: changed since `make exercises` wrote it (your work?); it was left as it "
                         f"is. To replace it with the fresh stub anyway: make exercises FORCE=1")


def generate(chapter=None, force: bool = False) -> list[Path]:
    """Write the stubs of `chapter` (default: every chapter with a solutions file); return those changed.
    A stub that was filled in (:func:`stub_is_edited`) is not overwritten unless ``force``: the others
    are written, then :class:`StubEdited` names the ones left alone."""
    changed, kept = [], []
    for ch in _chapters(chapter):
        if not ch.solutions.exists():
            if chapter is not None:
                raise FileNotFoundError(f"{ch.rel(ch.solutions)} does not exist: nothing to generate")
            continue
        text = stub_text(ch)
        if ch.exercises.exists() and ch.exercises.read_text() == text:
            continue
        if ch.exercises.exists() and stub_is_edited(ch.exercises.read_text()) and not force:
            kept.append(ch.exercises)
            continue
        ch.exercises.parent.mkdir(parents=True, exist_ok=True)
        ch.exercises.write_text(text)
        changed.append(ch.exercises)
    if kept:
        raise StubEdited(kept)
    return changed


def check_sync(chapter=None) -> list[Path]:
    """Stub files that differ from what their solutions generate (or lack a solutions file)."""
    stale = []
    for ch in _chapters(chapter):
        if ch.solutions.exists():
            if not ch.exercises.exists() or ch.exercises.read_text() != stub_text(ch):
                stale.append(ch.exercises)
        elif ch.exercises.exists():
            stale.append(ch.exercises)  # an orphan: its solutions were removed or renamed
    return stale


def resolve_impl(impl: str | None = None, chapter=None) -> str:
    """`impl`, else ``$MTD_IMPL``, else the default: a chapter's stubs when there is nothing else to test
    (no ``solutions/``: a student's copy of the course) or when a student has filled them in
    (:func:`stub_is_edited`), its worked solutions otherwise; checked."""
    chosen = impl or os.environ.get("MTD_IMPL")
    if chosen is None:
        chosen = "solutions"
        if chapter is not None:
            ch = registry.chapter(chapter)
            edited = ch.exercises.exists() and stub_is_edited(ch.exercises.read_text())
            if edited or not ch.solutions.exists():
                chosen = "exercises"
    chosen = chosen.strip().lower()
    if chosen not in IMPLS:
        raise ValueError(f"MTD_IMPL / impl is {chosen!r}; use 'solutions' "
                         "(worked answers) or 'exercises' (stubs)")
    return chosen


def load(chapter_key, impl: str | None = None, *, reload: bool = False) -> ModuleType:
    """Import chapter `chapter_key`'s solutions or exercises (`impl`, default ``$MTD_IMPL``).

    Each (impl, chapter) gets its own module name (``mtd_solutions_ch00_foundations``), so a test
    can hold both. The module is registered with cloudpickle to be pickled by value, so its
    functions can be sent to spawned ranks that cannot import it by that name.
    """
    ch = registry.chapter(chapter_key)
    impl = resolve_impl(impl, ch)
    path = ch.exercises if impl == "exercises" else ch.solutions
    if not path.exists():
        fix = "run `make exercises`" if impl == "exercises" and ch.solutions.exists() else \
            f"chapter {ch.tag} has no worked solutions yet"
        raise FileNotFoundError(f"{ch.rel(path)} does not exist; {fix}")
    mutant = _mutant_of(ch) if impl == "solutions" else None
    name = f"mtd_{impl}_{ch.stem}" + (f"__{mutant.stem}" if mutant else "")
    old = sys.modules.get(name)
    if old is not None and not reload and getattr(old, "__file__", None) == str(path):
        return old
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        if mutant is not None:  # its definitions replace the solutions' (course.mutants)
            doc = module.__doc__
            exec(compile(mutant.read_text(encoding="utf-8"), str(mutant), "exec"), module.__dict__)
            module.__doc__ = doc
    except BaseException:
        sys.modules.pop(name, None)
        raise
    try:
        import cloudpickle

        cloudpickle.register_pickle_by_value(module)
    except (ImportError, AttributeError, ValueError):  # old cloudpickle: fork-started ranks still work
        pass
    return module


def _mutant_of(ch: Chapter) -> Path | None:
    """``$MTD_MUTANT`` when it names one of ``ch``'s mutants (``solutions/mutants/<stem>/x.py``)."""
    given = os.environ.get("MTD_MUTANT")
    path = Path(given).resolve() if given else None
    return path if path is not None and path.parent == (ch.solutions.parent / "mutants" / ch.stem).resolve() \
        else None


def _show(path: Path) -> str:
    try:
        return str(path.relative_to(registry.REPO_ROOT))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitorch_dist.course.exercises",
                                description="Generate exercises/ from solutions/, or check they are in sync.")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="write exercises/chNN_*.py from solutions/chNN_*.py")
    g.add_argument("--chapter", help="one chapter (ch00, 0 or 00_foundations); default all")
    g.add_argument("--force", action="store_true", help="also overwrite stubs that were filled in")
    c = sub.add_parser("check", help="exit 1 listing stubs out of sync with their solutions")
    c.add_argument("--chapter", help="one chapter; default all")
    args = p.parse_args(argv)
    try:
        if args.cmd == "generate":
            try:
                changed = generate(args.chapter, force=args.force)
            except StubEdited as e:
                print(f"left alone: {e}", file=sys.stderr)
                return 1
            for path in changed:
                print(f"wrote {_show(path)}")
            print(f"{len(changed)} exercise file(s) written, the rest already in sync")
            return 0
        stale = check_sync(args.chapter)
    except (MarkerError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stale:
        print("exercises out of sync with solutions (run `make exercises`):", file=sys.stderr)
        for path in stale:
            print(f"  {_show(path)}", file=sys.stderr)
        return 1
    print("exercises/ is in sync with solutions/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
