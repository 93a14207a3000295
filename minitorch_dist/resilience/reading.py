"""Chapter 13 — read one save whole: its metadata and its files, checked, while newer saves commit.

A save of a path that already holds a checkpoint renames the old folder away and deletes it
(:func:`.storage.commit`). A reader that read ``metadata.json`` of one save and then opened the rank
files *by name* could get the files of the next: the metadata of one save, the tensors of another,
and no error. So :meth:`RankFiles.open` reads one save through one open folder:

    open the folder (a file descriptor: it stays this folder, whatever is renamed afterwards)
    read metadata.json through it, and open every rank file it lists through it
    if a file was already gone, and the path now names another folder: a newer save committed
        meanwhile, so start again with that one (a save that stays complete is read as it is)

On POSIX a file that was deleted stays readable through a descriptor opened before, so the old save
is read whole even after the writer has removed it. Each file is then checked the first time it is
used: its size and SHA-256 against the metadata, computed by reading the open file, and deserialized
from the same open file (a saved file is never written again: a save writes a new folder). So the
bytes checked are the bytes loaded: a truncated or altered shard is an error naming the file, never
wrong weights.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import torch

from .storage import FORMAT, METADATA, VERSION, CheckpointError, sha256_of, staging_dirs

__all__ = ["RankFiles", "read_metadata", "REQUIRED"]

REQUIRED = ("format", "version", "world_size", "tensors", "files", "plain", "objects")
_RANK_FILE = re.compile(r"^rank(\d{5})\.pt$")


def _missing(path: Path) -> CheckpointError:
    """Why there is no checkpoint at ``path``, and what to do."""
    if path.exists() and not path.is_dir():
        return CheckpointError(f"no checkpoint at {path}: it is a file, not a checkpoint folder; pass the "
                               f"folder that save() wrote (the one holding {METADATA})")
    old, partial = path.with_name(path.name + ".old"), staging_dirs(path)
    if not path.exists() and (old / METADATA).exists():
        return CheckpointError(f"no checkpoint at {path}, but {old} is a complete one: a save was "
                               f"interrupted while replacing it; rename {old.name} back to {path.name} "
                               f"(the next save of {path.name} does it)")
    if partial:
        return CheckpointError(f"no checkpoint at {path}: only {partial[0].name}, a save that never "
                               f"finished (the process died while saving); load an earlier checkpoint")
    what = "is a folder without metadata.json" if path.is_dir() else "does not exist"
    return CheckpointError(f"no checkpoint at {path}: it {what}")


def _parse_metadata(path: Path, text: str) -> dict:
    meta = path / METADATA
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta} is not valid JSON ({e}): the metadata file is damaged") from e
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        what = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise CheckpointError(f"{path} is not a {FORMAT} (format {what!r})")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} is version {data.get('version')} of the format; this code reads "
                              f"version {VERSION}")
    for key in REQUIRED:
        if key not in data:
            raise CheckpointError(f"{meta} has no {key!r} entry (a checkpoint's metadata holds "
                                  f"{', '.join(REQUIRED)}): the file is damaged or was not written by "
                                  f"save(); load an earlier checkpoint")
    for name in data["files"]:
        if not _RANK_FILE.match(name):
            raise CheckpointError(f"{meta} lists a file {name!r}, not a rank file (rankNNNNN.pt): "
                                  f"the metadata file is damaged")
    return data


def _read_at(dirfd: int, name: str) -> str:
    fd = os.open(name, os.O_RDONLY, dir_fd=dirfd)
    with os.fdopen(fd, "r") as f:
        return f.read()


def _replaced(path: Path, dirfd: int) -> bool:
    """Whether ``path`` no longer names the folder open as ``dirfd`` (a newer save was renamed in)."""
    here = os.fstat(dirfd)
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return True
    return (here.st_dev, here.st_ino) != (now.st_dev, now.st_ino) or here.st_nlink == 0


def read_metadata(path) -> dict:
    """The metadata of the checkpoint at ``path``, with errors that say what to do."""
    files = RankFiles.open(path, open_files=False)
    return files.meta


class RankFiles:
    """The metadata and the rank files of one save, opened together (see the module docstring); each
    file is checked against its size and SHA-256 the first time it is used, then loaded from the same
    open file. :meth:`close` (or the end of a ``with`` block) closes the files not used."""

    def __init__(self, path: Path, metadata: dict, handles: dict):
        self.path, self.meta, self._handles, self._loaded = path, metadata, handles, {}

    @classmethod
    def open(cls, path, settle_s: float = 2.0, open_files: bool = True) -> RankFiles:
        """Open one complete save at ``path``. While a newer save is being renamed in (for at most
        ``settle_s``), wait for it and open that one."""
        path, deadline = Path(path), time.monotonic() + settle_s
        while True:
            opened, why = cls._try_open(path, open_files)
            if opened is not None:
                return opened
            if time.monotonic() > deadline:
                raise why
            time.sleep(0.005)

    @classmethod
    def _try_open(cls, path: Path, open_files: bool) -> tuple[RankFiles | None, CheckpointError | None]:
        """``(files, None)``, or ``(None, error)`` when a save was replacing the folder (worth another
        try); an error that another try cannot change is raised."""
        replaced = CheckpointError(f"the checkpoint at {path} was replaced by newer saves again and again "
                                   f"while it was being opened: load it when the saves pause")
        try:
            dirfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:
            if (path.with_name(path.name + ".old") / METADATA).exists():
                return None, _missing(path)  # between a save's two renames (or a save died there)
            raise _missing(path) from None
        except NotADirectoryError:
            raise _missing(path) from None
        handles = {}
        try:
            try:
                meta = _parse_metadata(path, _read_at(dirfd, METADATA))
            except FileNotFoundError:
                if _replaced(path, dirfd):
                    return None, replaced
                raise _missing(path) from None
            for name in meta["files"] if open_files else ():
                try:
                    handles[name] = os.fdopen(os.open(name, os.O_RDONLY, dir_fd=dirfd), "rb")
                except FileNotFoundError:
                    handles[name] = None
            if None in handles.values() and _replaced(path, dirfd):
                for f in handles.values():
                    if f is not None:
                        f.close()
                return None, replaced
            return cls(path, meta, handles), None
        finally:
            os.close(dirfd)

    def get(self, name: str) -> dict:
        """The contents of rank file ``name`` (``{"tensors": ..., "per_rank": ...}``), checked."""
        if name not in self._loaded:
            self._loaded[name] = self._check_and_load(name)
        return self._loaded[name]

    def _check_and_load(self, name: str) -> dict:
        file, info = self.path / name, self.meta["files"].get(name)
        if info is None:
            raise CheckpointError(f"{self.path / METADATA} places a tensor in {name}, which is not among its "
                                  f"files: the metadata file is damaged; load an earlier checkpoint")
        r, n = int(name[4:9]), self.meta["world_size"]
        f = self._handles.pop(name, None)
        if f is None:
            raise CheckpointError(f"checkpoint {self.path} lacks {name}, written by rank {r} of the {n} that "
                                  f"saved it: copy it back, or load an earlier checkpoint")
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != info["bytes"]:
                raise CheckpointError(f"checkpoint file {file} is damaged: {size} bytes where the save wrote "
                                      f"{info['bytes']} (truncated?); load an earlier checkpoint")
            if sha256_of(f) != info["sha256"]:
                raise CheckpointError(f"checkpoint file {file} is damaged: its SHA-256 differs from the one "
                                      f"in {METADATA} (changed after the save); load an earlier checkpoint")
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True)  # host memory; load() moves it

    def close(self) -> None:
        for f in self._handles.values():
            if f is not None:
                f.close()
        self._handles.clear()

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
