"""The fixtures of the exercise tests: ``ex`` and ``launches`` (tests/_exercise_fixtures.py)."""
from _exercise_fixtures import ex, launches  # noqa: F401
