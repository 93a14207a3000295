"""Chapter 13 — a checkpoint on disk: one file per rank, one metadata file, and nothing half-written.

A checkpoint is a directory::

    step_000120/
        metadata.json       every tensor: dense shape, dtype, and each saved piece (file, placement);
                            every file's SHA-256 and size; the plain values (step, data position)
        rank00000.pt        rank 0's pieces (torch.save of {key: tensor}), and its per-rank values
        rank00001.pt        ...

**Nothing half-written.** Every rank writes into ``step_000120.partial/``: its ``.pt`` file (flushed
and ``fsync``-ed), then a small ``rankNNNNN.json`` manifest, written under a temporary name and
renamed (``os.replace`` is atomic on POSIX), so a manifest exists only once its file is complete.
Rank 0 waits for every manifest, merges them into ``metadata.json`` and renames the whole directory
into place. A save that dies half-way leaves only ``.partial`` behind; the previous checkpoint is
never touched. Replacing an existing checkpoint of the same name moves it aside first (``.old``),
then renames the new one in and deletes the old, so at every instant one complete checkpoint exists.

**Damage is detected.** The metadata holds each file's SHA-256; a reader checks a file before it
uses it, so a truncated or altered shard is an error naming the file, never wrong weights.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

__all__ = ["CheckpointError", "FORMAT", "METADATA", "rank_file", "partial_dir", "write_rank",
           "wait_for_manifests", "commit", "read_metadata", "RankFiles", "sha256"]

FORMAT, VERSION = "minitorch_dist checkpoint", 1
METADATA = "metadata.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; the message says why and what to do."""


def rank_file(r: int) -> str:
    return f"rank{r:05d}.pt"


def partial_dir(path) -> Path:
    """Where a save of ``path`` writes until it is complete."""
    path = Path(path)
    return path.with_name(path.name + ".partial")


def sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (POSIX: the directory entry is data of the directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_json(path: Path, obj) -> None:
    """Write ``obj`` as JSON under a temporary name, fsync, rename: the file appears whole or not at all."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_rank(folder: Path, r: int, tensors: dict, per_rank: dict, pieces: dict) -> dict:
    """Rank r's file (``tensors``: key -> staged tensor; ``per_rank``: key -> its own values) and then
    its manifest (``pieces``: key -> {placement, dtype, shape}); returns the seconds spent writing
    (``torch.save`` and ``fsync``) and hashing."""
    name = rank_file(r)
    target = folder / name
    t0 = time.perf_counter()
    with open(target, "wb") as f:
        torch.save({"tensors": tensors, "per_rank": per_rank}, f)
        f.flush()
        os.fsync(f.fileno())
    t1 = time.perf_counter()
    manifest = {"rank": r, "file": name, "sha256": sha256(target), "bytes": target.stat().st_size,
                "pieces": pieces, "per_rank": sorted(per_rank)}
    t2 = time.perf_counter()
    _write_json(folder / f"rank{r:05d}.json", manifest)
    return {"write": t1 - t0, "hash": t2 - t1}


def wait_for_manifests(folder: Path, n: int, timeout_s: float) -> list[dict]:
    """Rank 0: every rank's manifest, once each has finished its file (polling the shared folder)."""
    deadline = time.monotonic() + timeout_s
    paths = [folder / f"rank{r:05d}.json" for r in range(n)]
    while True:
        missing = [r for r, p in enumerate(paths) if not p.exists()]
        if not missing:
            return [json.loads(p.read_text()) for p in paths]
        if time.monotonic() > deadline:
            raise CheckpointError(f"ranks {missing} had not finished writing their part of {folder} after "
                                  f"{timeout_s:g} s (a rank died during the save?); the previous checkpoint "
                                  f"is untouched")
        time.sleep(0.01)


def commit(folder: Path, path: Path, metadata: dict, manifests: list[dict]) -> None:
    """Rank 0: write ``metadata.json`` into the finished ``folder``, then rename it to ``path``."""
    _write_json(folder / METADATA, metadata)
    for m in manifests:
        (folder / f"rank{m['rank']:05d}.json").unlink()
    _fsync_dir(folder)
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)  # one complete checkpoint exists at every instant: the old, then the new
    os.replace(folder, path)
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def read_metadata(path) -> dict:
    """The metadata of the checkpoint at ``path``, with errors that say what to do."""
    path = Path(path)
    meta = path / METADATA
    if not meta.exists():
        old, partial = path.with_name(path.name + ".old"), partial_dir(path)
        if old.exists() and (old / METADATA).exists():
            raise CheckpointError(f"no checkpoint at {path}, but {old} is a complete one: a save was "
                                  f"interrupted while replacing it; rename {old.name} back to {path.name}")
        if partial.exists():
            raise CheckpointError(f"no checkpoint at {path}: only {partial.name}, a save that never finished "
                                  f"(the process died while saving); load an earlier checkpoint")
        what = "is a folder without metadata.json" if path.is_dir() else "does not exist"
        raise CheckpointError(f"no checkpoint at {path}: it {what}")
    try:
        data = json.loads(meta.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta} is not valid JSON ({e}): the metadata file is damaged") from e
    if data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} (format {data.get('format')!r})")
    if data.get("version") != VERSION:
        raise CheckpointError(f"{path} is version {data.get('version')} of the format; this code reads "
                              f"version {VERSION}")
    return data


class RankFiles:
    """The rank files of one checkpoint, each checked against its SHA-256 the first time it is used
    and then memory-mapped (only the pages a piece touches are read)."""

    def __init__(self, path, metadata: dict):
        self.path, self.meta, self._open = Path(path), metadata, {}

    def get(self, name: str) -> dict:
        if name not in self._open:
            self._open[name] = self._check_and_open(name)
        return self._open[name]

    def _check_and_open(self, name: str) -> dict:
        file, info = self.path / name, self.meta["files"][name]
        r, n = int(name[4:9]), self.meta["world_size"]
        if not file.exists():
            raise CheckpointError(f"checkpoint {self.path} lacks {name}, written by rank {r} of the {n} that "
                                  f"saved it: copy it back, or load an earlier checkpoint")
        size = file.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"checkpoint file {file} is damaged: {size} bytes where the save wrote "
                                  f"{info['bytes']} (truncated?); load an earlier checkpoint")
        if sha256(file) != info["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is damaged: its SHA-256 differs from the one in "
                                  f"{METADATA} (changed after the save); load an earlier checkpoint")
        return torch.load(file, map_location="cpu", mmap=True, weights_only=True)
