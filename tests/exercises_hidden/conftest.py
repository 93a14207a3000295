"""An instructor's held-out exercise tests: cases a student never sees, so cannot tune to. `make
student-repo` leaves this folder out; `make grade` runs a chapter's file here when it exists and reports
it in its own column. The fixtures are the visible tests' (tests/_exercise_fixtures.py)."""
from _exercise_fixtures import ex, launches  # noqa: F401
