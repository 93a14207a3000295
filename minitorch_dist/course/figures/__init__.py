"""Chapter 00 — the chapters' figures, drawn by code: ``python -m minitorch_dist figures``.

Each chapter's figures are functions in ``course/figures/chNN_slug.py`` (see :mod:`.base`); this
package imports them all, writes ``chapters/figures/<name>.svg`` (:func:`generate`) and lists the
files that differ from what the code draws (:func:`stale`). The prose links the files; a test checks
that every link resolves and that every committed file is what its code draws today, compared by
what it shows (:func:`.base.same_drawing`: the same text, every number within 1/7200 inch), so a
CPU that rounds a computed figure's 6th digit differently neither fails the test nor rewrites it.
"""
from __future__ import annotations

import importlib
from pathlib import Path

from ..registry import CHAPTERS, REPO_ROOT
from .base import FIGURES, render_svg, same_drawing

__all__ = ["FIGURES", "FIGURE_DIR", "load_all", "generate", "stale", "names_of"]

#: where the prose expects its figures: chapters/figures/
FIGURE_DIR = REPO_ROOT / "chapters" / "figures"


def load_all() -> dict:
    """Import every chapter's figure module (those that exist) and return the registry."""
    for ch in CHAPTERS:
        try:
            importlib.import_module(f"{__name__}.{ch.stem}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{ch.stem}":
                raise
    return FIGURES


def names_of(chapter_tag: str | None = None) -> list[str]:
    """Registered figure names, all or one chapter's (``ch03``)."""
    load_all()
    return [n for n in FIGURES if chapter_tag is None or n.startswith(chapter_tag + "_")]


def generate(out_dir=None, chapter: str | None = None) -> list[Path]:
    """Write the figures (all, or one chapter's) as SVG into ``out_dir`` (default: chapters/figures);
    return the files that changed."""
    out = Path(out_dir) if out_dir is not None else FIGURE_DIR
    out.mkdir(parents=True, exist_ok=True)
    changed = []
    for name in names_of(chapter):
        path = out / f"{name}.svg"
        text = render_svg(name)
        if not path.exists() or same_drawing(path.read_text(), text) is not None:
            path.write_text(text)
            changed.append(path)
    return changed


def stale(chapter: str | None = None) -> list[str]:
    """The figures whose committed file is missing or differs from what the code draws now."""
    paths = {n: FIGURE_DIR / f"{n}.svg" for n in names_of(chapter)}
    return [n for n, p in paths.items()
            if not p.exists() or same_drawing(p.read_text(), render_svg(n)) is not None]
