"""Wrong: deletes the previous checkpoint once the new one is in, as a plain commit does.

Moving the old checkpoint aside and removing it at the end is the library's commit, crash-safe at
every instant; but the exercise keeps it at ``.prev`` for a rollback, and this leaves nothing there.
"""
import os
import shutil
from pathlib import Path


def commit_keeping_previous(new_folder, path) -> Path:
    new_folder, path = Path(new_folder), Path(path)
    prev = path.with_name(path.name + ".prev")
    if path.exists():
        if prev.exists():
            shutil.rmtree(prev)
        os.replace(path, prev)
    os.replace(new_folder, path)
    if prev.exists():
        shutil.rmtree(prev)
    return path
