"""Chapter 01 — one model on every rank: the tensors' shapes compared across a group, once, at construction.

Data parallelism (chapter 01) and FSDP (chapter 06) make every replica the group's first rank's by
broadcasting its tensors one by one (or flattened). A broadcast only needs the element counts to agree:
a rank that built another model with the same counts (a (4, 8) weight where rank 0 has (8, 4), a
transposed layer, two layers swapped) receives rank 0's values, reshaped, and trains something else
without a word. PyTorch's DDP refuses such replicas when it is built
(``torch.distributed.utils._verify_param_shape_across_processes``); so does :func:`check_same_shapes`,
with two small all-gathers: how long each rank's signature is, then the signatures (per tensor: its
number of dimensions, then its sizes).
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from . import comm
from .launch import device

__all__ = ["check_same_shapes", "shape_signature"]


def shape_signature(shapes: Iterable[Sequence[int]]) -> list[int]:
    """``[ndim, *sizes]`` of each shape in turn: one list of ints that two ranks compare."""
    return [x for s in shapes for x in (len(s), *s)]


def _shapes(signature: list[int]) -> list[tuple]:
    """The shapes a :func:`shape_signature` encodes."""
    out, i = [], 0
    while i < len(signature):
        out.append(tuple(signature[i + 1:i + 1 + signature[i]]))
        i += 1 + signature[i]
    return out


def _gather(values: list[int], group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every rank's ``values`` (of any length), in group order. Each buffer starts as this rank's own, so
    under a backend that moves nothing (torch's fake group, where a dry run plays one rank) all agree."""
    n = dist.get_world_size(group)
    where = device() if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = torch.tensor([len(values)], dtype=torch.int64, device=where)
    lengths = mine.repeat(n)
    comm.all_gather(lengths, mine, group=group)
    width = max(1, int(lengths.max()))
    padded = torch.full((width,), -1, dtype=torch.int64, device=where)
    padded[:len(values)] = torch.tensor(values, dtype=torch.int64)
    rows = padded.repeat(n)
    comm.all_gather(rows, padded, group=group)
    return [row[:k] for row, k in zip(rows.view(n, width).tolist(), lengths.tolist())]


def check_same_shapes(named: Iterable[tuple[str, torch.Tensor]], group: dist.ProcessGroup | None = None, *,
                      who: str) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless every rank's ``named``
    (``[(name, tensor), ...]``, in the order the ranks will exchange them) has rank 0's shapes; it names
    the first tensor that differs, its shape on the first rank that differs and on rank 0. ``who``
    (e.g. ``"DistributedDataParallel"``) starts the message. A collective: every rank of the group calls
    it; on a group of one rank it does nothing."""
    named = list(named)
    if dist.get_world_size(group) == 1:
        return
    signatures = _gather(shape_signature(t.shape for _, t in named), group)
    bad = next((r for r, s in enumerate(signatures) if s != signatures[0]), None)
    if bad is None:
        return
    theirs, ours = _shapes(signatures[bad]), _shapes(signatures[0])
    i = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
    rank = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
    here = " (this rank)" if dist.get_rank(group) == bad else ""
    if i < len(theirs) and i < len(ours):
        name = named[i][0] if i < len(named) else f"tensor {i}"
        what = (f"{name!r} (tensor {i}) has shape {list(theirs[i])} on rank {rank(bad)}{here} but "
                f"{list(ours[i])} on rank {rank(0)}")
    else:
        what = f"rank {rank(bad)}{here} has {len(theirs)} tensors, rank {rank(0)} has {len(ours)}"
    raise ValueError(f"{who}: the ranks hold different models: {what}. Every rank must build the same "
                     f"model (same class and configuration) before wrapping it; a broadcast of rank "
                     f"{rank(0)}'s weights would only reshape them")
