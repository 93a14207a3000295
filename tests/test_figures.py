"""The chapters' figures: every figure a chapter links exists, and each committed file is exactly what
its code draws today (``python -m minitorch_dist figures`` regenerates them; ``--check`` lists stale
ones). Each figure is drawn once here; a figure whose code changed without regenerating the file
fails with the command that fixes it."""
import re

import pytest

from minitorch_dist.course import figures
from minitorch_dist.course.figures.base import figure, render_svg
from minitorch_dist.course.registry import CHAPTERS

pytestmark = pytest.mark.timeout(300)

LINK = re.compile(r"!\[[^\]]*\]\(figures/([^)]+)\.svg\)")


def _links(ch) -> list[str]:
    return LINK.findall(ch.prose.read_text()) if ch.prose.exists() else []


@pytest.mark.parametrize("name", figures.names_of(), ids=str)
def test_committed_figure_is_what_its_code_draws(name):
    path = figures.FIGURE_DIR / f"{name}.svg"
    assert path.exists(), f"{path} is missing: run python -m minitorch_dist figures"
    assert path.read_text() == render_svg(name), \
        f"{path.name} differs from what its code draws: run python -m minitorch_dist figures"


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
