"""Wrong: renames the old checkpoint onto ``.prev`` without removing the one already there.

``os.replace`` replaces files atomically, so it looks as if it would replace the older folder too;
but a folder cannot be renamed onto a non-empty folder, and the commit fails after every save but
the first two.
"""
import os
from pathlib import Path


def commit_keeping_previous(new_folder, path) -> Path:
    new_folder, path = Path(new_folder), Path(path)
    prev = path.with_name(path.name + ".prev")
    if path.exists():
        os.replace(path, prev)
    os.replace(new_folder, path)
    return path
