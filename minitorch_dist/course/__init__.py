"""Chapter 00 — the course machinery: the chapter table, exercise stubs, the grader and the tour.

    registry    CHAPTERS, chapter(key), written_chapters(): the single source of the chapter map
    exercises   generate exercises/ from solutions/ markers, check they are in sync, load either
    grade       python -m minitorch_dist grade: per-exercise passed / failed / todo / blocked
    tour        python -m minitorch_dist tour: one headline experiment per chapter, theory vs measured
    headlines   chNN_slug.headline(smoke): each chapter's experiment, the rows the tour prints
"""
from .registry import CHAPTERS, REPO_ROOT, Chapter, chapter, written_chapters

__all__ = ["CHAPTERS", "REPO_ROOT", "Chapter", "chapter", "written_chapters"]
