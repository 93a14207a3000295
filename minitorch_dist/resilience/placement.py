"""Chapter 13 — where a rank's elements sit in the dense tensor: the one idea behind resharding.

Every layout of the course keeps, on each rank, some elements of each *dense* tensor (the tensor of
the single-process model, under its single-process name). Two steps describe all of them:

    cut    an index along one dimension          TP: columns, rows, heads, vocabulary rows (ch04)
    flat   a strided run of the cut, flattened   FSDP: [u, v) of one tensor (ch06, step 1)
                                                 ZeRO-1/2: every n-th element from r (ch06, step n)

so a rank's local tensor is ``dense.index_select(dim, index).reshape(-1)[start::step][:count]``,
viewed in the local tensor's shape. DDP and a pipeline stage keep whole tensors (neither step); 3D
composes the two (a ZeRO-1 shard of a TP slice). :class:`Placement` records the two steps in a
form that fits a JSON file, and :meth:`Placement.positions` turns them into the flat positions
(int64) in the dense tensor of each local element, in the local tensor's order.

Resharding is then one line in each direction: a saved piece scatters its values into the dense
tensor at its positions; a new rank gathers the dense tensor at the positions of its own
placement. Positions cost 8 bytes per dense element, built one tensor at a time: PyTorch's DCP
plans the same reads with boxes (offsets and lengths per dimension, ``ChunkStorageMetadata``) so
that no rank ever builds a whole tensor, but a box cannot describe the interleaved shards of
chapter 06's ZeRO-1/2 (every n-th element), and positions describe any layout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["Placement", "runs", "from_runs"]


def runs(index) -> tuple[tuple[int, int], ...]:
    """A sorted or unsorted 1-D list of positions as ``[start, stop)`` runs of consecutive values, in
    order: ``[0, 1, 2, 8, 9] -> ((0, 3), (8, 10))``. TP's cuts are one to three runs."""
    values = [int(v) for v in (index.tolist() if torch.is_tensor(index) else index)]
    out: list[list[int]] = []
    for v in values:
        if out and v == out[-1][1]:
            out[-1][1] += 1
        else:
            out.append([v, v + 1])
    return tuple((a, b) for a, b in out)


def from_runs(spans) -> torch.Tensor:
    """The positions ``runs`` compressed (int64)."""
    parts = [torch.arange(a, b) for a, b in spans]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass(frozen=True)
class Placement:
    """This rank's elements of a dense tensor of ``shape``: ``cut`` (a dimension and runs of indices
    along it, or None) then ``flat`` (``(start, step, count)`` over the flattened cut, or None).

    >>> Placement((8, 4)).numel                                  # the whole tensor: 32
    >>> Placement((8, 4), cut=(0, ((4, 8),))).local_shape        # rows 4..7: (4, 4)
    >>> Placement((8, 4), flat=(1, 2, 16)).positions()[:3]       # every 2nd element from 1: 1, 3, 5
    """

    shape: tuple
    cut: tuple | None = None  # (dim, ((start, stop), ...))
    flat: tuple | None = None  # (start, step, count)

    def __post_init__(self):
        shape = tuple(int(s) for s in self.shape)
        object.__setattr__(self, "shape", shape)
        if self.cut is not None:
            dim, spans = self.cut
            object.__setattr__(self, "cut", (int(dim), tuple((int(a), int(b)) for a, b in spans)))
            if not 0 <= self.cut[0] < len(shape):
                raise ValueError(f"cut along dim {dim} of a {len(shape)}-D tensor of shape {shape}")
            if any(a < 0 or b > shape[self.cut[0]] or a > b for a, b in self.cut[1]):
                raise ValueError(f"cut {self.cut[1]} leaves dim {dim} of size {shape[self.cut[0]]}")
        if self.cut is not None and self.cut[1] == ((0, shape[self.cut[0]]),):
            object.__setattr__(self, "cut", None)  # the whole dimension, in order: no cut
        if self.flat is not None:
            start, step, count = (int(v) for v in self.flat)
            if count == 0:
                start, step = 0, 1  # an empty run (a rank whose shard misses this tensor)
            if (start, step, count) == (0, 1, self.cut_numel):
                object.__setattr__(self, "flat", None)  # every element, in order: no flat run
                return
            object.__setattr__(self, "flat", (start, step, count))
            if step < 1 or start < 0 or count < 0 or (count and start + step * (count - 1) >= self.cut_numel):
                raise ValueError(f"flat run (start {start}, step {step}, count {count}) leaves the "
                                 f"{self.cut_numel} elements of its tensor")

    @property
    def cut_shape(self) -> tuple:
        """The shape after the cut (before ``flat``)."""
        if self.cut is None:
            return self.shape
        dim, spans = self.cut
        out = list(self.shape)
        out[dim] = sum(b - a for a, b in spans)
        return tuple(out)

    @property
    def cut_numel(self) -> int:
        return math.prod(self.cut_shape)

    @property
    def numel(self) -> int:
        """How many elements this rank holds."""
        return self.flat[2] if self.flat is not None else self.cut_numel

    @property
    def local_shape(self) -> tuple:
        """The shape a local tensor of this placement has when nothing reshaped it: the cut shape,
        or 1-D for a flat run."""
        return (self.numel,) if self.flat is not None else self.cut_shape

    @property
    def whole(self) -> bool:
        """Every element of the dense tensor, in order (DDP, a pipeline stage, a replicated norm)."""
        return self.cut is None and self.flat is None

    def positions(self) -> torch.Tensor:
        """(numel,) int64: the flat position in the dense tensor of each local element, in order."""
        index = torch.arange(math.prod(self.shape)).view(self.shape)  # (dense numel,) -> dense shape
        if self.cut is not None:
            dim, spans = self.cut
            index = index.index_select(dim, from_runs(spans))
        index = index.reshape(-1)  # the cut, flattened: what ``flat`` counts in
        if self.flat is not None:
            start, step, count = self.flat
            index = index[start::step][:count]
        return index

    def then_flat(self, start: int, step: int, count: int) -> Placement:
        """This placement followed by a flat run over *its* local elements: a ZeRO-1/2 shard of a TP
        slice (3D). Needs this placement to have no flat run yet."""
        if self.flat is not None:
            raise ValueError("a placement takes one flat run; this one has one already")
        return Placement(self.shape, self.cut, (start, step, count))

    def key(self) -> str:
        """A short stable text naming this placement: equal placements have equal keys (replicas)."""
        cut = "" if self.cut is None else f"c{self.cut[0]}:" + ",".join(f"{a}-{b}" for a, b in self.cut[1])
        flat = "" if self.flat is None else "f" + ",".join(map(str, self.flat))
        return f"{'x'.join(map(str, self.shape))}|{cut}|{flat}"

    def to_json(self) -> dict:
        return {"shape": list(self.shape),
                "cut": None if self.cut is None else [self.cut[0], [list(s) for s in self.cut[1]]],
                "flat": None if self.flat is None else list(self.flat)}

    @classmethod
    def from_json(cls, d: dict) -> Placement:
        cut = None if d["cut"] is None else (d["cut"][0], tuple(tuple(s) for s in d["cut"][1]))
        return cls(tuple(d["shape"]), cut, None if d["flat"] is None else tuple(d["flat"]))

    @classmethod
    def of_cut(cls, dense_shape, dim: int, index) -> Placement:
        """From a TP cut as :func:`..models.init.record_cut` notes it (a dim and int64 positions)."""
        return cls(tuple(dense_shape), (dim, runs(index)))
