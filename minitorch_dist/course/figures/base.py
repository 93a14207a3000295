"""Chapter 00 — how the chapters' figures are drawn: one registered function per figure, saved as SVG.

A chapter's figures live in ``course/figures/chNN_slug.py``; each is a function that returns a
matplotlib ``Figure``, registered under its file name with :func:`figure`::

    @figure("ch00_ring_allreduce")
    def ring_allreduce():
        fig, ax = plt.subplots(figsize=(6, 3))
        ...                                  # drawn from the library's own objects where it can
        return fig

and the prose links it as ``![The ring all-reduce](figures/ch00_ring_allreduce.svg)``. The SVG is
made the same on every run (a fixed hash salt for element ids, text kept as text, no date), so a
test regenerates every figure and compares it with the committed file: a figure in the prose is
always the one its code draws.

**Compared by what it shows** (:func:`same_drawing`). A figure drawn from a computation (a training
run, a power iteration) moves in the 6th digit on a CPU that rounds differently, which no reader can
see. Two drawings are the same when their text and element structure are identical and every number
in them (coordinates, sizes) is within :data:`RESOLUTION` of the other -- element ids, which
matplotlib derives from the drawn paths, are compared by where they first appear, not by name.
"""
from __future__ import annotations

import io
import re
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt

__all__ = ["FIGURES", "figure", "render_svg", "same_drawing", "RESOLUTION", "STYLE"]

#: how far apart two drawings of a figure may put a number and still be the same figure: 0.01 in SVG
#: user units (points, 72 per inch), i.e. 1/7200 inch, a hundredth of a screen pixel
RESOLUTION = 0.01

#: name -> function returning a matplotlib Figure, in registration order
FIGURES: dict[str, Callable] = {}
_NAME = re.compile(r"^ch\d\d_[a-z0-9_]+$")

#: The course's figure style: small, plain, readable on GitHub's white and dark backgrounds alike.
STYLE = {"svg.hashsalt": "minitorch_dist", "svg.fonttype": "none", "font.size": 9,
         "axes.titlesize": 10, "axes.spines.top": False, "axes.spines.right": False,
         "figure.facecolor": "white", "axes.facecolor": "white", "savefig.facecolor": "white"}


def figure(name: str):
    """Register the decorated function as the figure ``name`` (``chNN_what``: also its file name)."""
    if not _NAME.match(name):
        raise ValueError(f"figure name {name!r} must look like 'ch03_schedules' (chNN_, then lowercase)")

    def register(fn: Callable) -> Callable:
        if name in FIGURES:
            raise ValueError(f"figure {name!r} is registered twice")
        FIGURES[name] = fn
        return fn

    return register


def render_svg(name: str) -> str:
    """The SVG text of figure ``name``, the same bytes on every call."""
    with plt.rc_context(STYLE):
        fig = FIGURES[name]()
        buf = io.StringIO()
        fig.savefig(buf, format="svg", bbox_inches="tight",
                    metadata={"Date": None, "Creator": "minitorch_dist figures"})
        plt.close(fig)
    return buf.getvalue()


_NAME_IN_QUOTES = re.compile(r'(?<=["#])([A-Za-z_][\w.-]*)(?=[")])')
_NUMBER = re.compile(r"([-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)")


def _canonical(svg: str) -> list[str]:
    """The SVG as alternating text and number tokens, its element ids renamed id0, id1, ... in the
    order they are defined (references ``#name`` follow)."""
    ids = {name: f"id{i}" for i, name in enumerate(dict.fromkeys(re.findall(r'\bid="([^"]+)"', svg)))}
    svg = _NAME_IN_QUOTES.sub(lambda m: ids.get(m.group(1), m.group(1)), svg)
    return _NUMBER.split(svg)


def same_drawing(a: str, b: str, resolution: float = RESOLUTION) -> str | None:
    """None if SVGs ``a`` and ``b`` draw the same figure (see the module docstring); else the first
    difference, in words."""
    ta, tb = _canonical(a), _canonical(b)
    if len(ta) != len(tb):
        return f"different structure: {len(ta) // 2} numbers against {len(tb) // 2}"
    for i, (x, y) in enumerate(zip(ta, tb)):
        if i % 2 == 0 and x != y:
            return f"different text near token {i}: {x[-60:]!r} against {y[-60:]!r}"
        if i % 2 == 1 and abs(float(x) - float(y)) > resolution:
            return f"a number differs by more than {resolution}: {x} against {y} (after {ta[i - 1][-60:]!r})"
    return None


def holdings(ax, ranks: list[str], rows: list[tuple[str, list[tuple[str, float]]]], moves: list[str] = ()):
    """Draw who holds what: one column per rank, one row per tensor; each cell's text says which part the
    rank holds and its bar how much of the whole (1.0: all of it); ``moves`` are the collectives, written
    under the grid, top to bottom in the order they run."""
    colors = ("#4C72B0", "#DD8452", "#55A868", "#8172B3", "#C44E52")
    for i, (name, cells) in enumerate(rows):
        y = len(rows) - 1 - i
        ax.text(-0.15, y, name, ha="right", va="center", fontsize=8)
        for j, (text, share) in enumerate(cells):
            ax.add_patch(plt.Rectangle((j + 0.05, y - 0.38), 0.9, 0.76, facecolor="white", edgecolor="#999"))
            ax.add_patch(plt.Rectangle((j + 0.05, y - 0.38), 0.9 * share, 0.76, facecolor=colors[i % 5],
                                       alpha=0.35, edgecolor="none"))
            ax.text(j + 0.5, y, text, ha="center", va="center", fontsize=7.5)
    for j, rank in enumerate(ranks):
        ax.text(j + 0.5, len(rows) - 0.35, rank, ha="center", va="bottom", fontsize=8, weight="bold")
    for k, move in enumerate(moves):
        ax.text(len(ranks) / 2, -0.85 - 0.4 * k, move, ha="center", va="center", fontsize=8)
    ax.set_xlim(-2.4, len(ranks) + 0.1), ax.set_ylim(-0.75 - 0.4 * len(moves), len(rows) + 0.1)
    ax.axis("off")
    return ax
