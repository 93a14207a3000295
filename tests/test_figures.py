"""The chapters' figures: every figure a chapter links exists, and each committed file is what its code
draws today (``python -m minitorch_dist figures`` regenerates them; ``--check`` lists stale ones).
Each figure is drawn once here; a figure whose code changed without regenerating the file fails with
the command that fixes it.

Compared by what the figure shows (``base.same_drawing``): the same text and structure, and every
number within ``base.RESOLUTION`` = 0.01 pt (1/7200 inch). A figure drawn from a computation moves in
its 6th digit on a CPU that rounds another way (under another MKL code path the PowerSGD figure's
points move by ~1e-4 pt); a change anyone could see moves something by a pixel, 0.75 pt, or more."""
import re

import pytest

from minitorch_dist.course import figures
from minitorch_dist.course.figures.base import RESOLUTION, figure, render_svg, same_drawing
from minitorch_dist.course.registry import CHAPTERS

pytestmark = pytest.mark.timeout(300)

LINK = re.compile(r"!\[[^\]]*\]\(figures/([^)]+)\.svg\)")


def _links(ch) -> list[str]:
    return LINK.findall(ch.prose.read_text()) if ch.prose.exists() else []


@pytest.mark.parametrize("name", figures.names_of(), ids=str)
def test_committed_figure_is_what_its_code_draws(name):
    path = figures.FIGURE_DIR / f"{name}.svg"
    assert path.exists(), f"{path} is missing: run python -m minitorch_dist figures"
    diff = same_drawing(path.read_text(), render_svg(name))
    assert diff is None, \
        f"{path.name} differs from what its code draws ({diff}): run python -m minitorch_dist figures"


def test_every_link_resolves_and_every_figure_is_linked():
    registered = set(figures.names_of())
    linked = {n for ch in CHAPTERS for n in _links(ch)}
    assert linked <= registered, f"linked but drawn by no code: {sorted(linked - registered)}"
    assert registered <= linked, f"drawn but linked by no chapter: {sorted(registered - linked)}"
    for ch in CHAPTERS:
        assert all(n.startswith(ch.tag + "_") for n in _links(ch)), (ch.tag, _links(ch))


def test_figures_are_deterministic_and_named_by_chapter():
    name = figures.names_of()[0]
    assert render_svg(name) == render_svg(name)
    with pytest.raises(ValueError, match="must look like 'ch03_schedules'"):
        figure("Schedules")


def test_same_drawing_sees_what_the_eye_sees():
    """Numbers within RESOLUTION and renamed ids are the same drawing; a point moved by a pixel, other
    text or another element is not."""
    svg = render_svg(figures.names_of()[0])
    nudged = re.sub(r"(\d+\.\d{6})", lambda m: f"{float(m.group(1)) + RESOLUTION / 10:.6f}", svg, count=50)
    assert nudged != svg and same_drawing(svg, nudged) is None
    renamed = svg
    for name in set(re.findall(r'\bid="([^"]+)"', svg)):
        renamed = renamed.replace(f'"{name}"', f'"x{name}"').replace(f"#{name}", f"#x{name}")
    assert same_drawing(svg, renamed) is None
    moved = re.sub(r"(\d+\.\d{6})", lambda m: f"{float(m.group(1)) + 0.75:.6f}", svg, count=1)
    assert "differs by more than" in same_drawing(svg, moved)
    assert "different text" in same_drawing(svg, svg.replace("</text>", "!</text>", 1))
    assert "different structure" in same_drawing(svg, svg.replace("</svg>", '<path d="M 0 0"/></svg>'))
