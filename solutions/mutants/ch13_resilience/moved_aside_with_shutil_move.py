"""Wrong: moves the old checkpoint aside with ``shutil.move``, which nests it inside an existing ``.prev``.

``shutil.move`` is the everyday "rename a folder"; but onto an existing folder it moves the source
*into* it, so ``.prev`` ends up holding the older checkpoint with the old one inside.
"""
import os
import shutil
from pathlib import Path


def commit_keeping_previous(new_folder, path) -> Path:
    new_folder, path = Path(new_folder), Path(path)
    prev = path.with_name(path.name + ".prev")
    if path.exists():
        shutil.move(path, prev)
    os.replace(new_folder, path)
    return path
