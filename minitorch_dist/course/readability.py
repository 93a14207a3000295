"""Chapter 00 — how long a chapter's core is, and how long its sentences: ``python -m
minitorch_dist.course.readability``.

A chapter's *core* is its prose before the worked problems: what a learner reads in one sitting. It is
counted as a reader meets it: code blocks, display math, tables, figure links, HTML tags and link
targets are not prose; a link's text and inline code are (one word each). A sentence ends at ``.``,
``!`` or ``?`` followed by a space and a capital, a digit or a quote, or at the end of a paragraph or a
list item; a heading is not a sentence. The budget (:data:`CORE_WORDS`, :data:`SENTENCE_WORDS`) is
what a tutor's chapter can hold: about 45 minutes of careful reading at 100 words a minute.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from .registry import CHAPTERS, REPO_ROOT

#: words of prose in a chapter's core, at most
CORE_WORDS = 4500
#: mean words per sentence in a chapter's core, at most
SENTENCE_WORDS = 22

_FENCE = re.compile(r"^```.*?^```[^\n]*$", re.M | re.S)
_DISPLAY_MATH = re.compile(r"\$\$.*?\$\$", re.S)
_IMAGE = re.compile(r"!\[[^\]]*\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\]\([^)]*\)")
_TAG = re.compile(r"</?[A-Za-z][A-Za-z0-9]*(?:\s[^<>\n]*)?/?>")  # <details>, </summary>; not "a < b"
_END = re.compile(r"(?<=[.!?])[\"')\]*_]*\s+(?=[A-Z0-9\"'(`*_])")


def core(text: str) -> str:
    """The chapter's text before its 'Worked problems' heading (all of it when there is none)."""
    m = re.search(r"^#+\s+Worked problems", text, re.M)
    return text[:m.start()] if m else text


def prose_blocks(text: str) -> list[str]:
    """The paragraphs and list items of ``text`` as a reader meets them: no code, math, tables, figures,
    tags, headings or link targets."""
    text = _FENCE.sub("\n\n", text)
    text = _DISPLAY_MATH.sub(" ", text)
    text = _IMAGE.sub(" ", text)
    text = _LINK.sub(r"\1", text)
    text = _TAG.sub(" ", text)
    blocks, current = [], []
    for line in text.splitlines():
        s = line.strip().lstrip(">").strip()
        starts_item = re.match(r"^([-*+]|\d+\.)\s", s)
        if not s or s.startswith("#") or s.startswith("|") or starts_item:
            if current:
                blocks.append(" ".join(current))
            current = []
            if starts_item:
                current = [s[starts_item.end():]]
            continue
        current.append(s)
    if current:
        blocks.append(" ".join(current))
    return [b for b in blocks if b.split()]


#: abbreviations whose period ends no sentence ("Narayanan et al. 2021", "e.g. 8 ranks")
_ABBREVIATIONS = ("al.", "e.g.", "i.e.", "vs.", "cf.", "Fig.", "Eq.", "approx.", "No.", "St.")


def sentences(text: str) -> list[str]:
    """The sentences of ``text``'s prose blocks."""
    out = []
    for block in prose_blocks(text):
        pieces: list[str] = []
        for piece in _END.split(block):
            if pieces and pieces[-1].endswith(_ABBREVIATIONS):
                pieces[-1] += " " + piece
            else:
                pieces.append(piece)
        out += [p for p in pieces if p.split()]
    return out


@dataclass(frozen=True)
class Reading:
    """One chapter's core: its words and the mean length of its sentences."""
    words: int
    sentences: int

    @property
    def mean_sentence(self) -> float:
        return self.words / max(self.sentences, 1)

    def problems(self, where: str) -> list[str]:
        out = []
        if self.words > CORE_WORDS:
            out.append(f"{where}: the core (before 'Worked problems') has {self.words} words of prose, "
                       f"over {CORE_WORDS}: cut, or move what is a second chapter")
        if self.mean_sentence > SENTENCE_WORDS:
            out.append(f"{where}: the core's sentences average {self.mean_sentence:.1f} words, over "
                       f"{SENTENCE_WORDS}: split the long ones")
        return out


def reading(text: str) -> Reading:
    """Words and sentences of a chapter's core (:func:`core` of its markdown)."""
    found = sentences(core(text))
    return Reading(sum(len(s.split()) for s in found), len(found))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", type=Path, help="markdown files (default: every chapter)")
    args = p.parse_args(argv)
    paths = args.paths or [ch.prose for ch in CHAPTERS if ch.prose.exists()]
    rows, problems = [], []
    for path in paths:
        r = reading(path.read_text(encoding="utf-8"))
        rows.append(r)
        rel = path.resolve().relative_to(REPO_ROOT) if path.resolve().is_relative_to(REPO_ROOT) else path
        problems += r.problems(str(rel))
        print(f"{str(rel):45s} {r.words:6d} words {r.sentences:5d} sentences "
              f"{r.mean_sentence:5.1f} words/sentence")
    if len(rows) > 1:
        print(f"{'median':45s} {statistics.median(r.words for r in rows):6.0f} words")
    for line in problems:
        print(line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
