"""Chapter 00 — a copy of the course to hand out: everything but the answers.

``make student-repo DEST=../course-2026`` (``python -m minitorch_dist.course.student_repo DEST``) copies
every file the course's git repository tracks — prose, library, notebooks, stubs, tests — except the
worked solutions and their mutants (``solutions/``) and the instructor's held-out tests
(``tests/exercises_hidden/``), into a new folder. In that copy the exercise tests load the stubs (there
is nothing else to load), ``make test`` checks the library and notebooks and leaves the exercises to
``make grade``, and the checks that compare stubs with solutions skip themselves.

The notebooks ask the reader to *predict first*; the course's own copy shows each answer right under
its prompt. The student's copy clears the outputs of the code cells that answer a prompt (from the
markdown cell that asks, to the next markdown cell): the student writes a prediction, then runs them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

from .registry import REPO_ROOT

__all__ = ["course_files", "prediction_answers", "clear_predictions", "make_student_repo", "main"]

#: What a student's copy leaves out: the worked solutions (and their mutants), the held-out tests.
LEFT_OUT = ("solutions/", "tests/exercises_hidden/")
PROMPT = "Predict first"
CHECK_OUTPUT = "# NBVAL_CHECK_OUTPUT"
_NOT_SOURCES = (".git/", ".venv/", "__pycache__/", ".pytest_cache/", ".ruff_cache/", ".ipynb_checkpoints/")


def course_files(root: Path = REPO_ROOT) -> list[str]:
    """The course's files, relative to ``root``: those git tracks, or (no git) every file but caches."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True, timeout=60)
        files = [f for f in out.stdout.decode().split("\0") if f]
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
        files = [f for f in files
                 if not any(f"/{x}" in f"/{f}" for x in _NOT_SOURCES) and ".egg-info" not in f]
    return sorted(files)


def prediction_answers(nb: dict) -> list[int]:
    """Indices of the cells of notebook ``nb`` (as JSON) that answer a "Predict first" prompt: every code
    cell after a markdown cell holding the prompt, up to the next markdown cell."""
    found, answering = [], False
    for i, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") == "markdown":
            answering = PROMPT in "".join(cell.get("source", []))
        elif cell.get("cell_type") == "code" and answering:
            found.append(i)
    return found


def clear_predictions(nb: dict) -> int:
    """Clear the outputs of the cells of ``nb`` that answer a prediction prompt
    (:func:`prediction_answers`). Such a cell also loses its ``# NBVAL_CHECK_OUTPUT`` line (nothing is
    left to compare). Returns how many cells were cleared."""
    answers = prediction_answers(nb)
    for i in answers:
        cell = nb["cells"][i]
        cell["outputs"], cell["execution_count"] = [], None
        lines = "".join(cell.get("source", [])).splitlines(keepends=True)
        cell["source"] = [ln for ln in lines if ln.strip() != CHECK_OUTPUT]
    return len(answers)


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    if src.suffix == ".ipynb":
        nb = json.loads(src.read_text(encoding="utf-8"))
        if clear_predictions(nb):
            dst.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
            return
    shutil.copy2(src, dst)


def make_student_repo(dest, root: Path = REPO_ROOT) -> list[str]:
    """Copy the course at ``root`` without its solutions into ``dest`` (new or empty); return what was
    copied. Refuses a ``dest`` inside the course or one that holds files already."""
    root, dest = Path(root).resolve(), Path(dest).resolve()
    if dest == root or root in dest.parents:
        raise ValueError(f"{dest} is inside the course itself; choose a folder outside {root}")
    if dest.exists() and any(dest.iterdir()):
        raise FileExistsError(f"{dest} is not empty; choose a new folder for the student's copy")
    copied = [f for f in course_files(root) if not f.startswith(LEFT_OUT) and (root / f).is_file()]
    for rel in copied:
        _copy(root / rel, dest / rel)
    return copied


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minitorch_dist.course.student_repo",
                                description="Copy the course without its worked solutions, to hand out.")
    p.add_argument("dest", help="a new (or empty) folder outside the course")
    args = p.parse_args(argv)
    try:
        copied = make_student_repo(args.dest)
    except (ValueError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"copied {len(copied)} files to {args.dest} (solutions/ and tests/exercises_hidden/ left out; the "
          f"answers under the notebooks' prediction prompts cleared). There: `make test` checks the library "
          f"and notebooks; `python -m minitorch_dist grade --chapter ch00` grades an exercise.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
