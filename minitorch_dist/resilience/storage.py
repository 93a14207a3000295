"""Chapter 13 — a checkpoint on disk: one file per rank, one metadata file, nothing half-written, one save
of a path at a time.

A checkpoint is a directory, with the lock of its saves beside it::

    step_000120/
        metadata.json       every tensor: dense shape, dtype, and each saved piece (file, placement);
                            every file's SHA-256 and size; the plain values (step, data position)
        rank00000.pt        rank 0's pieces (torch.save of {key: tensor}), and its per-rank values
        rank00001.pt        ...
    step_000120.lock        held (``flock``) by the save of step_000120 under way, if any

**Nothing half-written.** Every rank of a save writes into that save's own staging folder,
``step_000120.partial-<random>/`` (rank 0 makes it and names it to the others in the save's plan):
its ``.pt`` file (flushed and ``fsync``-ed), then a small ``rankNNNNN.json`` manifest, written under a
temporary name and renamed (``os.replace`` is atomic on POSIX), so a manifest exists only once its file
is complete. Rank 0 waits for every manifest, merges them into ``metadata.json`` and renames the whole
folder into place: an existing checkpoint of the same name moves aside (``.old``), the new one moves
in, the old is deleted. A rank whose write fails (a full disk) deletes its file and leaves a
``rankNNNNN.failed`` note; rank 0 then removes the staging folder, and the previous checkpoint is
never touched.

**One save at a time.** Rank 0 holds an exclusive advisory lock (:class:`SaveLock`: ``flock`` on
``step_000120.lock``) from before it makes the staging folder until the rename is done. A second save
of the same path (another job, another process) waits for it, up to its timeout, then fails with an
error naming the holder; the two can never mix, damage or delete each other's files. The OS drops
the lock when its holder dies, so a crashed save never blocks the next one; and since no other save
of the path is alive while one holds the lock, the holder removes what dead saves left behind (their
staging folders; an ``.old`` whose replacement was never renamed in is renamed back). The lock file
itself stays: deleting it while a save waits on it would let two saves in.

Reading one save whole, and checking its files' SHA-256s, is :mod:`.reading`.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

import torch

from ..runtime import observe

__all__ = ["CheckpointError", "FORMAT", "VERSION", "METADATA", "rank_file", "lock_file", "staging_dirs",
           "SaveLock", "begin_save", "write_rank", "wait_for_manifests", "commit", "sha256", "sha256_of"]

FORMAT, VERSION = "minitorch_dist checkpoint", 1
METADATA = "metadata.json"
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)  # no room: the disk, the file size limit, the quota


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded as asked; the message says why and what to do."""


def rank_file(r: int) -> str:
    return f"rank{r:05d}.pt"


def lock_file(path) -> Path:
    """The file whose ``flock`` a save of ``path`` holds (beside the checkpoint folder)."""
    path = Path(path)
    return path.with_name(path.name + ".lock")


def staging_dirs(path) -> list[Path]:
    """The staging folders of saves of ``path`` that have not been renamed into place (yet, or ever)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    return sorted(p for p in path.parent.iterdir() if p.name.startswith(path.name + ".partial"))


def sha256(path) -> str:
    with open(path, "rb") as f:
        return sha256_of(f)


def sha256_of(f) -> str:
    """The SHA-256 of an open binary file, read from its start."""
    h = hashlib.sha256()
    f.seek(0)
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


# --- one save at a time ----------------------------------------------------------------------------------


class SaveLock:
    """An exclusive advisory lock on the checkpoint ``path`` (``fcntl.flock`` on :func:`lock_file`),
    waited for up to ``timeout_s``. Released by :meth:`release`, or by the OS when its process dies.
    The holder writes who it is into the file, so that a save that gives up can name it."""

    def __init__(self, path, timeout_s: float):
        self.path, self.file = Path(path), lock_file(path)
        self.file.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    holder = self._holder()
                    os.close(self._fd)
                    raise CheckpointError(
                        f"another save of {self.path} ({holder}) has held {self.file.name} for more than "
                        f"{timeout_s:g} s: wait for it to finish, stop it, or save to another path") from None
                time.sleep(0.02)
        try:  # who holds it, for the error of a save that gives up waiting (not needed: a full disk)
            os.ftruncate(self._fd, 0)
            os.write(self._fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                           "since": time.time()}).encode())
        except OSError:
            pass

    def _holder(self) -> str:
        try:
            who = json.loads(self.file.read_text())
            return f"process {who['pid']} on {who['host']}, since {time.ctime(who['since'])}"
        except (OSError, ValueError, KeyError, TypeError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def begin_save(path) -> Path:
    """Rank 0, holding the :class:`SaveLock` of ``path``: remove what dead saves of it left behind, then
    make this save's staging folder (a new, unique name) and return it."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"cannot save to {path}: it is a file, not a checkpoint folder; choose a "
                              f"folder path (a save makes the folder)")
    for stale in staging_dirs(path):
        shutil.rmtree(stale, ignore_errors=True)
    old = path.with_name(path.name + ".old")
    if old.exists():
        if not path.exists() and (old / METADATA).exists():
            os.replace(old, path)  # a save died between its two renames: the old checkpoint goes back
        else:
            shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=path.name + ".partial-", dir=path.parent))


# --- writing ---------------------------------------------------------------------------------------------


class _Recorded:
    """A file that remembers the ``OSError`` of a failed write: ``torch.save`` reports one only as
    "unexpected pos", which would hide a full disk."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def _failed(e: BaseException, file: Path, r: int) -> CheckpointError:
    """The error of rank r's failed write of ``file``; a full disk is said so."""
    if isinstance(e, OSError) and e.errno in _FULL:
        return CheckpointError(
            f"the disk is full: writing {file} failed with {errno.errorcode[e.errno]} ({e.strerror}); the "
            f"save is abandoned, its staging folder removed and the previous checkpoint left as it was: free "
            f"space on that disk, or save to another one")
    if isinstance(e, FileNotFoundError) and not file.parent.exists():
        return CheckpointError(f"the staging folder {file.parent} was removed while rank {r} wrote into it: "
                               f"another rank's part of this save failed (see its error)")
    return CheckpointError(f"rank {r} could not write {file}: {type(e).__name__}: {e}")


def write_rank(folder: Path, r: int, tensors: dict, per_rank: dict, pieces: dict) -> None:
    """Rank r's file (``tensors``: key -> staged tensor; ``per_rank``: key -> its own values) and then
    its manifest (``pieces``: key -> {placement, dtype, shape}); announces the spans "write"
    (``torch.save`` and ``fsync``) and "hash" (category "checkpoint"). A failed write deletes the file,
    leaves a note that rank 0 reads (:func:`wait_for_manifests`) and raises :class:`CheckpointError`."""
    name = rank_file(r)
    target = folder / name
    try:
        with observe.span("write", "checkpoint", file=str(target)), open(target, "wb") as f:
            out = _Recorded(f)
            try:
                torch.save({"tensors": tensors, "per_rank": per_rank}, out)
            except RuntimeError as e:
                raise (out.error or e) from e
            f.flush()
            os.fsync(f.fileno())
        with observe.span("hash", "checkpoint", file=str(target)), open(target, "rb") as f:
            digest = sha256_of(f)
        manifest = {"rank": r, "file": name, "sha256": digest, "bytes": target.stat().st_size,
                    "pieces": pieces, "per_rank": sorted(per_rank)}
        _write_json(folder / f"rank{r:05d}.json", manifest)
    except Exception as e:  # reported below with the file it was writing
        err = _failed(e, target, r)
        for leftover in (target, folder / f"rank{r:05d}.json.tmp"):
            leftover.unlink(missing_ok=True)  # give the space back at once
        try:
            (folder / f"rank{r:05d}.failed").write_text(str(err))
        except OSError:
            pass  # the folder is gone, or not even a note fits: rank 0 runs into its timeout
        raise err from e


def wait_for_manifests(folder: Path, n: int, timeout_s: float) -> list[dict]:
    """Rank 0: every rank's manifest, once each has finished its file (polling the shared folder)."""
    deadline = time.monotonic() + timeout_s
    paths = [folder / f"rank{r:05d}.json" for r in range(n)]
    while True:
        missing = [r for r, p in enumerate(paths) if not p.exists()]
        if not missing:
            return [json.loads(p.read_text()) for p in paths]
        for r in missing:
            note = folder / f"rank{r:05d}.failed"
            if note.exists():
                raise CheckpointError(f"rank {r} could not write its part of {folder.name}: "
                                      f"{note.read_text() or 'see its error'}")
        if time.monotonic() > deadline:
            raise CheckpointError(f"ranks {missing} had not finished writing their part of {folder} after "
                                  f"{timeout_s:g} s (a rank died during the save?); the previous checkpoint "
                                  f"is untouched")
        time.sleep(0.01)


def commit(folder: Path, path: Path, metadata: dict, manifests: list[dict]) -> None:
    """Rank 0, holding the save's lock: write ``metadata.json`` into the finished ``folder``, then rename
    it to ``path``. A reader that opened the previous checkpoint keeps reading it (:mod:`.reading`)."""
    try:
        _write_json(folder / METADATA, metadata)
    except OSError as e:
        raise _failed(e, folder / METADATA, 0) from e
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
