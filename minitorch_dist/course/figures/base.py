"""Chapter 00 — how the chapters' figures are drawn: one registered function per figure, saved as SVG.

A chapter's figures live in ``course/figures/chNN_slug.py``; each is a function that returns a
matplotlib ``Figure``, registered under its file name with :func:`figure`::

    @figure("ch00_ring_allreduce")
    def ring_allreduce():
        fig, ax = plt.subplots(figsize=(6, 3))
        ...                                  # drawn from the library's own objects where it can
        return fig

and the prose links it as ``![The ring all-reduce](figures/ch00_ring_allreduce.svg)``. The SVG is
made byte for byte the same on every run (a fixed hash salt for element ids, text kept as text, no
date), so a test regenerates every figure and compares it with the committed file: a figure in the
prose is always the one its code draws.
"""
from __future__ import annotations

import io
import re
from collections.abc import Callable

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["FIGURES", "figure", "render_svg", "STYLE"]

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
