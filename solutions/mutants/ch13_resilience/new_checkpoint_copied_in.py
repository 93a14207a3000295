"""Wrong: copies the new checkpoint into place instead of renaming it.

A copy leaves the staging folder intact until the end, which feels safer; but a copy is not atomic:
a crash half-way leaves a part of a checkpoint under the real name, and it writes every byte again.
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
    shutil.copytree(new_folder, path)
    shutil.rmtree(new_folder)
    return path
