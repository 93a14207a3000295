"""Chapter 13 — save a sharded training state from any layout, load it into any other.

The problem: at the papers' scale nobody holds the whole model, and the job that reads a checkpoint
may run a different layout on a different number of ranks than the one that wrote it (a restart on
fewer GPUs, a new parallel plan). The idea, as PyTorch's Distributed Checkpoint (DCP) has it: name
every tensor as the *single-process model* names it, and let each rank describe which elements of
that dense tensor it holds (:mod:`.placement`). Then a checkpoint is layout-free::

    save(state, path)       plan    every rank lists its pieces (name, placement, bytes); all ranks
                                    swap the lists (one all_gather_object) and each piece held by
                                    several ranks (replicas: DDP, TP's norms) is written by one
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

import json
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from .layouts import Shard, world
from .placement import Placement
from .storage import FORMAT, CheckpointError, commit, partial_dir, wait_for_manifests, write_rank

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


def set_plain(state: dict, key: str, value) -> None:
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
    on disk, or raises what went wrong. ``seconds``: where this rank's time went, by phase — "plan"
    (list and swap the pieces), "stage" (copy them to host memory; together the time the caller is
    held by an asynchronous save), "write" (``torch.save`` and ``fsync``), "hash" (SHA-256 of the
    file), "commit" (rank 0: wait for every rank, write the metadata, rename). ``bytes_written``:
    the bytes of the tensors this rank wrote."""

    path: Path
    bytes_written: int = 0
    seconds: dict = field(default_factory=dict)
    _thread: threading.Thread | None = None
    _error: list = field(default_factory=list)

    @property
    def stage_s(self) -> float:
        """How long the caller was held before the writing could start (plan + stage)."""
        return self.seconds.get("plan", 0.0) + self.seconds.get("stage", 0.0)

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


_in_flight: list[SaveHandle] = []  # this process's unfinished async save (at most one)


def _plan(tensors: dict) -> tuple[dict, int, int]:
    """Swap every rank's list of pieces; return ``(this rank's pieces to write, rank, world size)``."""
    r, n = world()
    mine = [(k, s.placement.key(), s.local.numel() * s.local.element_size())
            for k, s in sorted(tensors.items())]
    plans = [mine]
    if n > 1:
        plans = [None] * n
        dist.all_gather_object(plans, mine)  # also a barrier: rank 0 has made the .partial folder
    writers = _writers(plans)
    return {k: s for k, s in tensors.items() if writers[(k, s.placement.key())] == r}, r, n


def _metadata(manifests: list[dict], plain: dict, objects: dict, n: int) -> dict:
    meta = {"format": FORMAT, "version": 1, "world_size": n, "saved_at": time.time(), "tensors": {},
            "plain": plain, "objects": objects, "files": {}}
    for m in manifests:
        meta["files"][m["file"]] = {"sha256": m["sha256"], "bytes": m["bytes"]}
        for key, piece in m["pieces"].items():
            entry = meta["tensors"].setdefault(key, {"shape": piece["placement"]["shape"],
                                                     "dtype": piece["dtype"], "pieces": []})
            entry["pieces"].append({"file": m["file"], "placement": piece["placement"]})
    return meta


def _prepare(state: dict, folder: Path, handle: SaveHandle) -> dict:
    """Plan and stage (in the caller): what the writing thread needs, copied out of the live state."""
    t0 = time.perf_counter()
    tensors, plain, objects = flatten(state)
    for shard in [s for s in tensors.values() if s.fresh]:
        shard.if_missing()  # optimizer state made only to be loaded into: not saved, and gone again
    tensors = {k: s for k, s in tensors.items() if not s.fresh}
    if world()[0] == 0:
        shutil.rmtree(folder, ignore_errors=True)  # a save that died here before
        folder.mkdir(parents=True)
    mine, r, n = _plan(tensors)
    t1 = time.perf_counter()
    staged = {k: _stage(s.local) for k, s in mine.items()}
    if any(t.is_pinned() for t in staged.values()):
        torch.cuda.synchronize()
    handle.seconds.update(plan=t1 - t0, stage=time.perf_counter() - t1)
    handle.bytes_written = sum(t.numel() * t.element_size() for t in staged.values())
    pieces = {k: {"placement": s.placement.to_json(), "dtype": str(s.local.dtype).removeprefix("torch."),
                  "shape": list(s.local.shape)} for k, s in mine.items()}
    return {"r": r, "n": n, "staged": staged, "pieces": pieces,
            "per_rank": {k: o.to_saved() for k, o in objects.items() if o.per_rank},
            "shared": json.loads(json.dumps({k: {"per_rank": False, "value": o.to_saved()} if not o.per_rank
                                             else {"per_rank": True} for k, o in objects.items()})),
            "plain": json.loads(json.dumps(plain))}  # the values now, not after the loop moves on


def _write(job: dict, folder: Path, path: Path, handle: SaveHandle, timeout_s: float) -> None:
    """Write this rank's file and manifest; rank 0 then commits the checkpoint (in the thread)."""
    try:
        handle.seconds.update(write_rank(folder, job["r"], job["staged"], job["per_rank"], job["pieces"]))
        if job["r"] == 0:
            t0 = time.perf_counter()
            manifests = wait_for_manifests(folder, job["n"], timeout_s)
            commit(folder, path, _metadata(manifests, job["plain"], job["shared"], job["n"]), manifests)
            handle.seconds["commit"] = time.perf_counter() - t0
    except BaseException as e:  # noqa: BLE001 - surfaced by wait()
        why = f"saving {path} failed on rank {job['r']}: {type(e).__name__}: {e}"
        handle._error.append(e if isinstance(e, CheckpointError) else CheckpointError(why))


def async_save(state: dict, path, timeout_s: float = 300) -> SaveHandle:
    """Start saving ``state`` to the folder ``path`` (every rank calls it): plan and copy to host memory
    now, write in a background thread. The training loop goes on; call ``wait()`` before relying on the
    checkpoint (the next save waits for this one). See :func:`save` for the format."""
    while _in_flight:
        _in_flight.pop().wait()
    path = Path(path)
    folder, handle = partial_dir(path), SaveHandle(path)
    job = _prepare(state, folder, handle)
    handle._thread = threading.Thread(target=_write, args=(job, folder, path, handle, timeout_s),
                                      name=f"mtd-save-{path.name}", daemon=True)
    handle._thread.start()
    _in_flight.append(handle)
    return handle


def save(state: dict, path, timeout_s: float = 300) -> SaveHandle:
    """Save ``state`` (see the module docstring) to the folder ``path``; every rank calls it, and it
    returns once the whole checkpoint is on disk on every rank. An existing checkpoint at ``path`` is
    replaced only when the new one is complete."""
    handle = async_save(state, path, timeout_s)
    _in_flight.remove(handle)
    handle.wait()
    if world()[1] > 1:
        dist.barrier()  # rank 0 has committed the folder: every rank may now use it
    return handle
