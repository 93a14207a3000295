"""Chapter 13 — load a checkpoint into a state of any layout: resharding is a gather at positions.

``load(state, path)`` fills ``state`` (what :func:`.layouts.state_dict` gives for the *new* layout) in
place, whatever layout and world size wrote ``path``::

    for each tensor this rank asks for (its Shard: a local tensor and a placement):
        a saved piece has exactly this placement   ->  copy it                  (same layout: no resharding)
        otherwise  dense[piece positions] = piece, for every saved piece      (scatter: rebuild the tensor)
                   local = dense[my positions]                                (gather: this rank's elements)

The checks come first, so that a wrong checkpoint is an error that names the problem instead of a
model that silently trains from wrong weights: every name asked for exists (else: a checkpoint of
another model, or an optimizer saved before its first step, whose state is then left fresh), no
rank is left without a name the checkpoint holds (``strict``), shapes agree, every file is there and
matches its SHA-256 (:class:`.reading.RankFiles`), and every element of a rebuilt tensor was saved.
The metadata and the files read all belong to one save, even while a newer save of the same path
commits (:mod:`.reading`).

Values saved once per rank (random number generators) come back only at the world size that saved
them; elsewhere they are listed in the report as not restored. A DCP checkpoint (a folder with
``.metadata``) is read through :mod:`.dcp` and loads the same way.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .checkpoint import flatten, set_plain
from .layouts import world
from .placement import Placement
from .reading import RankFiles
from .storage import CheckpointError

if TYPE_CHECKING:
    from .dcp import DCPCheckpoint

__all__ = ["load", "LoadReport", "SavedCheckpoint", "open_checkpoint", "read_dense"]


@dataclass
class LoadReport:
    """What a load did on this rank."""

    saved_world_size: int
    world_size: int
    copied: int = 0  # tensors whose saved piece had this rank's placement exactly
    resharded: int = 0  # tensors rebuilt from other placements
    left_fresh: list = field(default_factory=list)  # optimizer states the checkpoint did not hold
    not_restored: list = field(default_factory=list)  # per-rank values saved at another world size
    seconds: float = 0.0


class SavedCheckpoint:
    """A checkpoint written by :func:`.checkpoint.save`, read piece by piece."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files = RankFiles.open(self.path)  # the metadata and the files of one save, opened together
        self.meta = self.files.meta
        self.save_id = self.meta.get("save_id")  # which save: every rank must read the same one
        self.world_size = self.meta["world_size"]
        self.plain = self.meta["plain"]
        self.objects = self.meta["objects"]

    def names(self) -> set:
        return set(self.meta["tensors"])

    def shape(self, key: str) -> tuple:
        return tuple(self.meta["tensors"][key]["shape"])

    def fill(self, key: str, placement: Placement) -> tuple[torch.Tensor, bool]:
        """This placement's elements of tensor ``key`` (1-D, the saved dtype) and whether it took a
        rebuild of the dense tensor (False: one saved piece had exactly this placement)."""
        entry = self.meta["tensors"][key]
        pieces = [(p["file"], Placement.from_json(p["placement"])) for p in entry["pieces"]]
        for file, pl in pieces:
            if pl == placement:
                return self.files.get(file)["tensors"][key].reshape(-1), False
        dense = torch.empty(math.prod(placement.shape), dtype=getattr(torch, entry["dtype"]))  # (numel,)
        covered = torch.zeros(dense.numel(), dtype=torch.bool)
        for file, pl in pieces:
            pos = pl.positions()
            dense[pos] = self.files.get(file)["tensors"][key].reshape(-1)
            covered[pos] = True
        want = placement.positions()
        if not covered[want].all():
            lost = int((~covered[want]).sum())
            raise CheckpointError(f"{self.path}: {lost} elements of {key} that this rank needs are in no "
                                  f"saved piece; the checkpoint is incomplete")
        return dense[want], True

    def per_rank(self, key: str, rank: int) -> Any:
        return self.files.get(f"rank{rank:05d}.pt")["per_rank"][key]

    def close(self) -> None:
        """Close the files not read (each file read is closed once loaded)."""
        self.files.close()


def open_checkpoint(path: str | os.PathLike) -> SavedCheckpoint | DCPCheckpoint:
    """A reader for ``path``: ours (``metadata.json``), or PyTorch DCP's (``.metadata``)."""
    path = Path(path)
    if (path / ".metadata").exists() and not (path / "metadata.json").exists():
        from .dcp import DCPCheckpoint  # DCP's reader pulls in torch.distributed.checkpoint

        return DCPCheckpoint(path)
    return SavedCheckpoint(path)


def _asked_by_anyone(names: set, source) -> set:
    """The union of every rank's requested names (a collective when there are several ranks). The same
    collective checks that every rank opened the same save of the checkpoint."""
    r, n = world()
    if n == 1:
        return set(names)
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, (sorted(names), getattr(source, "save_id", None)))
    if len({save for _, save in everyone}) > 1:
        raise CheckpointError(f"the ranks opened different saves of {source.path}: another save of it "
                              f"committed during this load; load again once that save is done")
    return set().union(*(set(asked) for asked, _ in everyone))


def _check_names(tensors: dict, source, strict: bool) -> None:
    have = source.names()
    missing = sorted(k for k, s in tensors.items() if k not in have and s.if_missing is None)
    if missing:
        raise CheckpointError(f"{getattr(source, 'path', source)} does not hold {len(missing)} tensor(s) "
                              f"this state asks for, e.g. {missing[:3]}: it was saved from a different model")
    for k, s in tensors.items():
        if k in have and source.shape(k) != s.placement.shape:
            raise CheckpointError(f"tensor {k} is {source.shape(k)} in the checkpoint and "
                                  f"{s.placement.shape} here: it was saved from a different model")
    if strict:
        extra = sorted(have - _asked_by_anyone(set(tensors), source))
        if extra:
            raise CheckpointError(f"the checkpoint holds {len(extra)} tensor(s) no rank asks for, e.g. "
                                  f"{extra[:3]}: it was saved from a different model "
                                  f"(strict=False loads the rest)")


def _restore_objects(objects: dict, source, report: LoadReport, strict: bool) -> None:
    r, n = world()
    for key, obj in objects.items():
        saved = source.objects.get(key)
        if saved is None:
            if strict:
                raise CheckpointError(f"the checkpoint has no {key!r} (strict=False skips it)")
            report.not_restored.append(key)
        elif obj.per_rank and saved.get("per_rank"):
            if source.world_size == n:
                obj.restore(source.per_rank(key, r))
            else:
                report.not_restored.append(key)
        else:
            obj.restore(saved["value"])


def load(state: dict, path: str | os.PathLike, strict: bool = True) -> LoadReport:
    """Fill ``state`` in place from the checkpoint at ``path`` (every rank calls it). Tensors are
    copied into the state's own (live) tensors, cast to their dtype; plain values (the step, the data
    position) replace the state's; objects (optimizer hyperparameters, RNG states) are restored.
    ``strict``: every tensor of the checkpoint must be asked for by some rank. Returns a
    :class:`LoadReport`."""
    t0 = time.perf_counter()
    source = open_checkpoint(path)
    try:
        report = _load_from(source, state, strict)
    finally:
        source.close()
    report.seconds = time.perf_counter() - t0
    return report


def _load_from(source, state: dict, strict: bool) -> LoadReport:
    tensors, plain, objects = flatten(state)
    _check_names(tensors, source, strict)
    report = LoadReport(source.world_size, world()[1])
    for key, shard in sorted(tensors.items()):
        if key not in source.names():
            shard.if_missing()
            report.left_fresh.append(key)
            continue
        values, rebuilt = source.fill(key, shard.placement)
        with torch.no_grad():
            shard.local.copy_(values.view(shard.local.shape))  # the live tensor, in place: a cast if needed
        report.resharded += rebuilt
        report.copied += not rebuilt
    for key in plain:
        if key in source.plain:
            set_plain(state, key, source.plain[key])
        elif strict:
            raise CheckpointError(f"the checkpoint has no value {key!r} (strict=False keeps this state's)")
    _restore_objects(objects, source, report, strict)
    return report


def read_dense(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (ours or DCP's) as the single-process model would hold it:
    ``{dotted name: dense tensor}``, in one process. How a notebook inspects a checkpoint, and how
    two checkpoints of the same state are compared."""
    source = open_checkpoint(path)
    out = {}
    try:
        for key in sorted(source.names()):
            values, _ = source.fill(key, Placement(source.shape(key)))
            out[key] = values.reshape(source.shape(key)).clone()  # (numel,) -> the dense shape
    finally:
        source.close()
    return out
