"""Chapter 00 — what every exercise states: its kind, its time, and the library file to read beside it.

An exercise is a specification: what to build, its interface, the properties its tests check, the
paper section. Its docstring opens with its kind and the time a capable student needs, and a build or
measure exercise names the library file that is its reference (reading it helps; the exercise asks
for a variant the file does not contain, so copying it does not pass)::

    def ordered_bucket_hooks(model, cap_bytes, group=None):
        \"\"\"Kind: build · about 60 minutes

        ...what it must do, its interface, the properties the tests check...

        Reference: minitorch_dist/parallelism/data_parallel.py (buckets in a fixed order).
        \"\"\"

The chapter's "Exercises" section lists each exercise with the same kind and time, in the words of
that first line, before its summary and collapsed hints (an entry that covers two exercises states
each)::

    2. **Build** `ordered_bucket_hooks(model, cap_bytes, group)` · about 60 minutes — buckets ...

``python -m minitorch_dist.course.statements`` (part of ``make check-exercises``) lists every
exercise that states less, or whose entry says otherwise, and prints each chapter's exercise minutes
(the README's hours use them).
"""
from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass

from . import registry
from .exercises import KINDS, exercise_nodes

__all__ = ["Statement", "statement", "chapter_statements", "statement_problems", "exercises_section",
           "prose_problems", "main"]

_FIRST = re.compile(r"Kind:\s*(\w+)\s*·\s*about\s+(\d+)\s+minutes\.?")
_REFERENCE = re.compile(r"^\s*Reference:\s*`{0,2}(minitorch_dist/[\w/]+\.py)", re.MULTILINE)


@dataclass(frozen=True)
class Statement:
    kind: str | None
    minutes: int | None
    reference: str | None  # a path under the repository root


def statement(node: ast.AST) -> Statement:
    """What an exercise's docstring states (None for what it leaves out)."""
    doc = (ast.get_docstring(node) or "").strip()
    first = doc.splitlines()[0].strip() if doc else ""
    m = _FIRST.fullmatch(first)
    kind = m.group(1).lower() if m else (re.match(r"Kind:\s*(\w+)", first) or [None, None])[1]
    ref = _REFERENCE.search(doc)
    return Statement(kind.lower() if kind else None, int(m.group(2)) if m else None,
                     ref.group(1) if ref else None)


def chapter_statements(chapter) -> dict[str, Statement]:
    return {name: statement(node) for name, node in exercise_nodes(chapter).items()}


def statement_problems(chapter) -> list[str]:
    """Every exercise of ``chapter`` that does not state its kind and time, and every build or measure
    exercise that names no existing reference file."""
    ch = registry.chapter(chapter)
    out = []
    for name, st in chapter_statements(ch).items():
        where = f"{ch.tag} {name}"
        if st.kind not in KINDS or st.minutes is None:
            out.append(f"{where}: the docstring opens with 'Kind: <{'|'.join(KINDS)}> · about N minutes'")
        if st.kind in ("build", "measure"):
            if st.reference is None:
                out.append(f"{where}: name the library file to read beside it, "
                           f"'Reference: minitorch_dist/<file>.py'")
            elif not (ch.root / st.reference).is_file():
                out.append(f"{where}: its reference {st.reference} does not exist")
    return out


def exercises_section(text: str) -> str | None:
    """The "## Exercises" section of a chapter's prose, up to the next heading of its level or above
    (None when it has none)."""
    m = re.search(r"^## Exercises[ \t]*$", text, re.MULTILINE)
    if m is None:
        return None
    end = re.compile(r"^#{1,2} ", re.MULTILINE).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def _entry(name: str) -> re.Pattern[str]:
    """``**Kind** `name(args)``` (then maybe ``/ `alias(args)``` or ``→ `(returns)```) and its time."""
    return re.compile(r"\*\*(\w+)\*\*\s+`" + re.escape(name) + r"(?!\w)[^`]*`(?:\s*(?:/|→)\s*`[^`]*`)*"
                      r"(?:\s*·\s*about\s+(\d+)\s+minutes\b)?")


def prose_problems(chapter) -> list[str]:
    """Every exercise of ``chapter`` whose entry in the prose's Exercises section is missing, or states
    no time, or another kind or time than the docstring's first line (the docstring is the reference)."""
    ch = registry.chapter(chapter)
    where = ch.rel(ch.prose)
    sts = chapter_statements(ch)
    if not sts:
        return []
    section = exercises_section(ch.prose.read_text(encoding="utf-8")) if ch.prose.is_file() else None
    if section is None:
        return [f"{where}: no '## Exercises' section to list the chapter's exercises"]
    out = []
    for name, st in sts.items():
        want = f"'**{(st.kind or 'build').capitalize()}** `{name}(...)` · about {st.minutes or 'N'} minutes'"
        m = _entry(name).search(section)
        if m is None:
            out.append(f"{where}: {name} has no entry in the Exercises section: write {want}")
            continue
        kind, minutes = m.group(1), m.group(2)
        if st.kind in KINDS and kind != st.kind.capitalize():
            out.append(f"{where}: {name} is **{kind}** in its Exercises entry, its docstring says "
                       f"{st.kind}: make it **{st.kind.capitalize()}**")
        if minutes is None:
            out.append(f"{where}: {name}'s Exercises entry states no time: write {want}")
        elif st.minutes is not None and int(minutes) != st.minutes:
            out.append(f"{where}: {name} states about {minutes} minutes in its Exercises entry, its "
                       f"docstring about {st.minutes}: make them agree")
    return out


def main(argv: list[str] | None = None) -> int:
    from ..runtime.tables import format_table

    p = argparse.ArgumentParser(prog="python -m minitorch_dist.course.statements",
                                description="Check that every exercise states its kind, time and reference, "
                                            "and that its chapter's Exercises entry states the same.")
    p.add_argument("--chapter", help="comma-separated chapters; default: every chapter with solutions")
    args = p.parse_args(argv)
    try:
        chapters = [registry.chapter(k) for k in args.chapter.split(",")] if args.chapter else \
            [ch for ch in registry.CHAPTERS if ch.solutions.exists() or ch.exercises.exists()]
    except KeyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, problems = [], []
    for ch in chapters:
        sts = chapter_statements(ch)
        by_kind = {k: sum(s.kind == k for s in sts.values()) for k in KINDS}
        minutes = sum(s.minutes or 0 for s in sts.values())
        rows.append([ch.tag, *by_kind.values(), minutes, f"{minutes / 60:.1f}"])
        problems += statement_problems(ch) + prose_problems(ch)
    print(format_table(rows, ["chapter", *KINDS, "minutes", "hours"], align="lrrrrr"))
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
