"""Chapter 13 — save a sharded training state from any layout, load it into any other.

The problem: at the papers' scale nobody holds the whole model, and the job that reads a checkpoint
may run a different layout on a different number of ranks than the one that wrote it (a restart on
fewer GPUs, a new parallel plan). The idea, as PyTorch's Distributed Checkpoint (DCP) has it: name
every tensor as the *single-process model* names it, and let each rank describe which elements of
that dense tensor it holds (:mod:`.placement`). Then a checkpoint is layout-free::

    save(state, path)       plan    every rank lists its pieces (name, placement, bytes); all ranks
                                    swap the lists (one all_gather_object; rank 0, holding the
                                    save's lock, also names the staging folder) and each piece held
                                    by several ranks (replicas: DDP, TP's norms) is written by one
                                    holder, the least loaded (DCP's ``dedup_save_plans``)
                            stage   each rank copies the pieces it writes into host memory
                            write   each rank writes one file; rank 0 the metadata, last (:mod:`.storage`)
    load(state, path)       for each tensor this rank asks for: if a saved piece has exactly its
                            placement, copy it; else rebuild the dense tensor from the saved pieces
                            (scatter each at its positions) and gather this rank's positions

``state`` is what :func:`.layouts.state_dict` gives (or any nested dict of :class:`.layouts.Shard` s,
tensors, plain values and objects with ``to_saved`` / ``restore``). Keys are joined with dots as DCP
joins them (``"optim.state.wte.weight.exp_avg"``), so a DCP checkpoint of the same state has the same
names and :mod:`.dcp` reads it through the same :func:`load`.

Cost: a save writes each distinct element once (``costmodel.resilience.checkpoint_bytes``); a load
reads the pieces that overlap each rank's tensors. Loading in the same layout reads exactly one's
own pieces; resharding builds each dense tensor once per rank that needs part of it, one at a time.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..runtime import observe
from ..runtime.timing import sync
from .layouts import Shard, world
from .placement import Placement
from .storage import FORMAT, CheckpointError, SaveLock, begin_save, commit, wait_for_manifests, write_rank

__all__ = ["save", "async_save", "SaveHandle", "flatten", "set_plain", "CheckpointError"]

PLAIN = (int, float, str, bool, type(None))


# --- the state as a flat list of named items -----------------------------------------------------------


def _is_object(v) -> bool:
    return hasattr(v, "to_saved") and hasattr(v, "restore")


def _check_plain(key: str, v) -> None:
    if isinstance(v, PLAIN):
        return
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _check_plain(f"{key}[{i}]", x)
        return
    if isinstance(v, dict):
        for k, x in v.items():
            _check_plain(f"{key}.{k}", x)
        return
    raise TypeError(f"state entry {key!r} is a {type(v).__name__}: a checkpoint holds tensors (or Shards), "
                    f"numbers, strings, lists and dicts of them, and objects with to_saved()/restore()")


def flatten(state: dict, prefix: str = "") -> tuple[dict, dict, dict]:
    """``(tensors, plain, objects)`` keyed by dotted names: tensors as :class:`Shard` s (a bare tensor
    is a whole one), plain values (numbers, strings, lists), objects with ``to_saved`` / ``restore``."""
    tensors, plain, objects = {}, {}, {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, Shard):
            tensors[key] = v
        elif torch.is_tensor(v):
            tensors[key] = Shard(v.detach(), Placement(tuple(v.shape)))
        elif _is_object(v):
            objects[key] = v
        elif isinstance(v, dict):
            t, p, o = flatten(v, key + ".")
            tensors.update(t), plain.update(p), objects.update(o)
        else:
            _check_plain(key, v)
            plain[key] = list(v) if isinstance(v, tuple) else v
    return tensors, plain, objects


def set_plain(state: dict, key: str, value: Any) -> None:
    """Replace the plain value at dotted ``key`` (the dict's own keys may contain dots)."""
    node, rest = state, key
    while rest not in node:
        head = next((k for k in node if isinstance(node[k], dict) and rest.startswith(f"{k}.")), None)
        if head is None:
            raise KeyError(key)
        node, rest = node[head], rest[len(head) + 1:]
    node[rest] = value


# --- save -------------------------------------------------------------------------------------------------


def _writers(plans: list[list]) -> dict:
    """Every rank's ``[(key, placement key, nbytes)]`` -> ``{(key, placement key): writer rank}``: each
    distinct piece once, by the holder that has been given the fewest bytes so far (every rank
    computes the same answer from the same lists)."""
    holders: dict = {}
    for r, plan in enumerate(plans):
        for key, pk, nbytes in plan:
            holders.setdefault((key, pk), (nbytes, []))[1].append(r)
    load, out = [0] * len(plans), {}
    for piece in sorted(holders):
        nbytes, ranks = holders[piece]
        r = min(ranks, key=lambda q: (load[q], q))
        out[piece], load[r] = r, load[r] + nbytes
    return out


def _stage(t: torch.Tensor) -> torch.Tensor:
    """A compact host copy (a view would save its whole storage: a flat buffer, a strided piece)."""
    if t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.detach().clone(memory_format=torch.contiguous_format)


@dataclass
class SaveHandle:
    """A save under way: ``wait()`` returns once this rank's part (on rank 0: the whole checkpoint) is
    on disk, or raises what went wrong. ``bytes_written``: the bytes of the tensors this rank wrote.

    Where the time goes is announced (:mod:`..runtime.observe`, category "checkpoint"), phase by phase:
    "plan" (list and swap the pieces), "stage" (copy them to host memory; together the time the caller
    is held by an asynchronous save), "write" (``torch.save`` and ``fsync``), "hash" (SHA-256 of the
    file), "commit" (rank 0: wait for every rank, write the metadata, rename); :mod:`.stall` listens."""

    path: Path
    bytes_written: int = 0
    _thread: threading.Thread | None = None
    _error: list = field(default_factory=list)
    _group_hook: weakref.finalize | None = None  # waits for this save if the process group ends first

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout_s: float | None = None) -> SaveHandle:
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise CheckpointError(f"the save of {self.path} is still writing after {timeout_s} s")
        if self._error:
            raise self._error[0]
        return self


# This process's unfinished asynchronous save (at most one: the next save waits for it). The chapter's
# only process-global state, and only for the exit hook: a save must be on disk before its process ends.
_in_flight: list[SaveHandle] = []


def _finish_in_flight() -> None:
    """Wait for this process's asynchronous save, reporting a failure on stderr. Run at interpreter exit
    (a writer thread still running then would abort the interpreter) and when the default process group
    is destroyed: ``launch`` ends a rank with ``os._exit`` right after, which runs no exit hook."""
    while _in_flight:
        handle = _in_flight.pop()
        if handle._thread is threading.current_thread():
            continue  # the writer itself let go of the group: it is finishing anyway
        try:
            _retire(handle)
        except CheckpointError as e:
            print(f"minitorch_dist: {e}", file=sys.stderr, flush=True)


atexit.register(_finish_in_flight)


def _retire(handle: SaveHandle) -> None:
    """Wait for ``handle``; its process-group hook is no longer needed."""
    if handle._group_hook is not None:
        handle._group_hook.detach()
    handle.wait()


def _finish_before_the_group_ends(handle: SaveHandle) -> None:
    """Run :func:`_finish_in_flight` when this process's default process group goes away (it is
    destroyed at the end of every rank ``launch`` runs, before the rank reports its result)."""
    group = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if group is not None:
        handle._group_hook = weakref.finalize(group, _finish_in_flight)
        handle._group_hook.atexit = False  # at exit, the atexit hook above waits


def _plan(tensors: dict, lead: dict) -> tuple[dict, dict, int, int]:
    """Swap every rank's list of pieces; rank 0's entry also carries ``lead``: the save's staging folder,
    or why the save cannot start. Returns ``(this rank's pieces to write, rank 0's lead, rank, world
    size)``; every rank raises rank 0's error together."""
    r, n = world()
    mine = [(k, s.placement.key(), s.local.numel() * s.local.element_size())
            for k, s in sorted(tensors.items())]
    plans: list[Any] = [(mine, lead)]
    if n > 1:
        plans = [None] * n
        dist.all_gather_object(plans, (mine, lead))  # also a barrier: rank 0 has made the staging folder
    lead = plans[0][1]
    if lead.get("error"):
        raise CheckpointError(lead["error"])
    writers = _writers([plan for plan, _ in plans])
    return {k: s for k, s in tensors.items() if writers[(k, s.placement.key())] == r}, lead, r, n


def _metadata(manifests: list[dict], plain: dict, objects: dict, n: int, save_id: str) -> dict:
    meta: dict[str, Any] = {"format": FORMAT, "version": 1, "world_size": n, "saved_at": time.time(),
                            "save_id": save_id, "tensors": {}, "plain": plain, "objects": objects,
                            "files": {}}
    for m in manifests:
        meta["files"][m["file"]] = {"sha256": m["sha256"], "bytes": m["bytes"]}
        for key, piece in m["pieces"].items():
            entry = meta["tensors"].setdefault(key, {"shape": piece["placement"]["shape"],
                                                     "dtype": piece["dtype"], "pieces": []})
            entry["pieces"].append({"file": m["file"], "placement": piece["placement"]})
    return meta


def _begin(path: Path, timeout_s: float) -> tuple[SaveLock | None, dict]:
    """Rank 0: take the lock of ``path`` (waiting for another save of it) and make this save's staging
    folder. Returns the lock and the lead for the other ranks: the folder's name, or the error."""
    if world()[0] != 0:
        return None, {}
    try:
        lock = SaveLock(path, timeout_s)
    except CheckpointError as e:
        return None, {"error": str(e)}
    except OSError as e:
        return None, {"error": f"cannot save to {path}: {e}"}
    try:
        return lock, {"staging": begin_save(path).name}
    except (CheckpointError, OSError) as e:
        lock.release()
        return None, {"error": str(e) if isinstance(e, CheckpointError) else f"cannot save to {path}: {e}"}


def _stage_all(mine: dict, handle: SaveHandle) -> dict:
    staged = {k: _stage(s.local) for k, s in mine.items()}
    for device in {s.local.device for s in mine.values() if s.local.device.type == "cuda"}:
        sync(device)  # the non-blocking copies from it into pinned memory have landed
    handle.bytes_written = sum(t.numel() * t.element_size() for t in staged.values())
    return staged


def _prepare(state: dict, path: Path, handle: SaveHandle, timeout_s: float) -> dict:
    """Plan and stage (in the caller): what the writing thread needs, copied out of the live state."""
    with observe.span("plan", "checkpoint", path=str(path)):
        tensors, plain, objects = flatten(state)
        for shard in [s for s in tensors.values() if s.fresh]:
            shard.if_missing()  # optimizer state made only to be loaded into: not saved, and gone again
        tensors = {k: s for k, s in tensors.items() if not s.fresh}
        lock, lead = _begin(path, timeout_s)
        try:
            mine, lead, r, n = _plan(tensors, lead)
        except BaseException:
            _abandon(lock, path, lead)
            raise
    try:
        with observe.span("stage", "checkpoint", path=str(path)):
            staged = _stage_all(mine, handle)
        pieces = {k: {"placement": s.placement.to_json(), "dtype": str(s.local.dtype).removeprefix("torch."),
                      "shape": list(s.local.shape)} for k, s in mine.items()}
        per_rank = {k: o.to_saved() for k, o in objects.items() if o.per_rank}
        shared = json.loads(json.dumps({k: {"per_rank": False, "value": o.to_saved()} if not o.per_rank
                                        else {"per_rank": True} for k, o in objects.items()}))
    except BaseException:
        _abandon(lock, path, lead)
        raise
    return {"r": r, "n": n, "folder": path.parent / lead["staging"], "lock": lock, "staged": staged,
            "pieces": pieces, "per_rank": per_rank, "shared": shared,
            "plain": json.loads(json.dumps(plain))}  # the values now, not after the loop moves on


def _abandon(lock: SaveLock | None, path: Path, lead: dict) -> None:
    """Rank 0 (the one holding the lock): the save ends here, before any writing."""
    if lock is not None:
        shutil.rmtree(path.parent / lead["staging"], ignore_errors=True)
        lock.release()


def _write(job: dict, path: Path, handle: SaveHandle, timeout_s: float) -> None:
    """Write this rank's file and manifest; rank 0 then commits the checkpoint and releases the lock (in
    the thread). A failure on rank 0 removes the staging folder: the previous checkpoint stays."""
    folder = job["folder"]
    try:
        write_rank(folder, job["r"], job["staged"], job["per_rank"], job["pieces"])
        if job["r"] == 0:
            with observe.span("commit", "checkpoint", path=str(path)):
                manifests = wait_for_manifests(folder, job["n"], timeout_s)
                save_id = folder.name.rsplit("-", 1)[-1]
                meta = _metadata(manifests, job["plain"], job["shared"], job["n"], save_id)
                commit(folder, path, meta, manifests)
    except BaseException as e:  # surfaced by wait()
        if job["r"] == 0:
            shutil.rmtree(folder, ignore_errors=True)
        why = f"saving {path} failed on rank {job['r']}: {type(e).__name__}: {e}"
        handle._error.append(e if isinstance(e, CheckpointError) else CheckpointError(why))
    finally:
        if job["lock"] is not None:
            job["lock"].release()


def async_save(state: dict, path: str | os.PathLike, timeout_s: float = 300) -> SaveHandle:
    """Start saving ``state`` to the folder ``path`` (every rank calls it): plan and copy to host memory
    now, write in a background thread. The training loop goes on; call ``wait()`` before relying on the
    checkpoint (the next save waits for this one, and so does the end of the process, or of the process
    group). ``timeout_s``: how long to wait for another save of ``path`` to finish, and for every rank's
    part. See :func:`save` for the format."""
    while _in_flight:
        _retire(_in_flight.pop())
    path = Path(path)
    handle = SaveHandle(path)
    job = _prepare(state, path, handle, timeout_s)
    handle._thread = threading.Thread(target=_write, args=(job, path, handle, timeout_s),
                                      name=f"mtd-save-{path.name}", daemon=True)
    handle._thread.start()
    _in_flight.append(handle)
    _finish_before_the_group_ends(handle)
    return handle


def save(state: dict, path: str | os.PathLike, timeout_s: float = 300) -> SaveHandle:
    """Save ``state`` (see the module docstring) to the folder ``path``; every rank calls it, and it
    returns once the whole checkpoint is on disk on every rank. An existing checkpoint at ``path`` is
    replaced only when the new one is complete; another save of the same ``path`` (another process)
    is waited for, up to ``timeout_s`` (:mod:`.storage`)."""
    handle = async_save(state, path, timeout_s)
    _in_flight.remove(handle)
    _retire(handle)
    if world()[1] > 1:
        dist.barrier()  # rank 0 has committed the folder: every rank may now use it
    return handle
