"""Chapter 12 — the rank grid of 3D parallelism: each rank a point (dp, tp, pp), each axis its groups.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21), §2.3 and §3: combine data (d), tensor (t) and pipeline (p) parallelism on
n = d·t·p GPUs. Each rank belongs to exactly one group per axis:

    TP group   the t ranks that split one layer's matrices       (all-reduce b·s·h, 4x per layer)
    PP group   the p ranks that hold consecutive stages          (send/recv b·s·h per microbatch)
    DP group   the d ranks that hold the same shard of weights   (all-reduce the gradients, once a step)

**Which rank is which point.** The ``order`` lists the axes fastest-varying first. Megatron's
order is ``"tp-dp-pp"``::

    rank = tp + t * (dp + d * pp)

so a TP group is t *consecutive* ranks -- on one node, on the fast NVLink, since TP talks four
times per layer (§3.2: "tensor model parallelism [...] within a multi-GPU server") -- then DP,
and pipeline stages are the farthest apart: PP sends the least and tolerates the slow links
between nodes. This is Megatron-LM's ``initialize_model_parallel`` layout (in
``megatron/core/parallel_state.py``); its docstring's example, 16 GPUs with t=2, p=4 (so d=2), is
reproduced by ``RankGrid(16, dp=2, tp=2, pp=4)``: TP groups [0, 1], [2, 3] ..., DP groups [0, 2],
[1, 3], [4, 6] ..., PP groups [0, 4, 8, 12], [1, 5, 9, 13] ...

Inside each group, members are listed by their coordinate on that axis, which is also the order
of their global ranks (``rank`` grows with every coordinate); ``torch.distributed.new_group``
numbers a group's members in that same (sorted) order, so group rank i = coordinate i.

Torch's own grid is :class:`torch.distributed.device_mesh.DeviceMesh`: an n-d array of ranks,
row-major, slowest axis first. Our grid in order ``"tp-dp-pp"`` is the mesh of shape (p, d, t)
with ``mesh_dim_names=("pp", "dp", "tp")``; :func:`init_groups` can take its groups from there
(``use_device_mesh=True``), and the tests check the two give the same ranks for every shape.
Megatron also makes an *embedding group* per pipeline: its first and last stage, which both hold
the (tied) word embedding and sum its gradient (:mod:`.three_d`).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch.distributed as dist

from ..runtime import require_process_group

__all__ = ["AXES", "Coords", "RankGrid", "ParallelGroups", "init_groups", "init_device_mesh", "check_model"]

AXES = ("dp", "tp", "pp")


class Coords(NamedTuple):
    """A rank's place in the grid: data-, tensor- and pipeline-parallel coordinates."""

    dp: int
    tp: int
    pp: int


def _positive_int(name, v):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name} must be a positive int, got {v!r}")


class RankGrid:
    """The d x t x p grid of ``world_size`` ranks; pure arithmetic, no process group needed.

    >>> g = RankGrid(8, dp=2, tp=2, pp=2)
    >>> g.coords(5)                      # 5 = tp 1 + 2·(dp 0 + 2·pp 1)
    Coords(dp=0, tp=1, pp=1)
    >>> g.groups("tp")                   # consecutive ranks
    [[0, 1], [2, 3], [4, 5], [6, 7]]
    """

    def __init__(self, world_size: int, dp: int, tp: int, pp: int, order: str = "tp-dp-pp"):
        for name, v in (("world_size", world_size), ("dp", dp), ("tp", tp), ("pp", pp)):
            _positive_int(name, v)
        if dp * tp * pp != world_size:
            raise ValueError(f"dp·tp·pp = {dp}·{tp}·{pp} = {dp * tp * pp} does not equal the world size "
                             f"{world_size}; choose degrees whose product is {world_size} "
                             f"(e.g. dp={world_size // (tp * pp)} if tp·pp={tp * pp} divides {world_size})")
        axes = tuple(order.split("-")) if isinstance(order, str) else ()
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"order {order!r} must name each of dp, tp, pp once, fastest-varying first, "
                             f"joined by '-' (Megatron's is 'tp-dp-pp')")
        self.world_size, self.order = world_size, order
        self.sizes = {"dp": dp, "tp": tp, "pp": pp}
        self.axes_fast_to_slow = axes
        # stride of an axis = product of the sizes of the axes varying faster than it
        self.strides, s = {}, 1
        for a in axes:
            self.strides[a] = s
            s *= self.sizes[a]

    dp = property(lambda self: self.sizes["dp"])
    tp = property(lambda self: self.sizes["tp"])
    pp = property(lambda self: self.sizes["pp"])

    def __repr__(self) -> str:
        return f"RankGrid({self.world_size}, dp={self.dp}, tp={self.tp}, pp={self.pp}, order={self.order!r})"

    def coords(self, rank: int) -> Coords:
        """(dp, tp, pp) of ``rank``: its digits in the mixed radix of the order."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside the grid of {self.world_size} ranks")
        return Coords(**{a: rank // self.strides[a] % self.sizes[a] for a in AXES})

    def rank_of(self, dp: int, tp: int, pp: int) -> int:
        """The rank at (dp, tp, pp): ``sum(coordinate · stride)``."""
        c = {"dp": dp, "tp": tp, "pp": pp}
        for a in AXES:
            if isinstance(c[a], bool) or not isinstance(c[a], int) or not 0 <= c[a] < self.sizes[a]:
                raise ValueError(f"{a} coordinate {c[a]!r} is outside 0..{self.sizes[a] - 1}")
        return sum(c[a] * self.strides[a] for a in AXES)

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the ranks that differ only in that coordinate, listed by it.
        The groups come in order of their first rank; together they partition the ranks."""
        if axis not in AXES:
            raise ValueError(f"unknown axis {axis!r}; choose one of {AXES}")
        others = [a for a in AXES if a != axis]
        out = []
        for fixed in itertools.product(*(range(self.sizes[a]) for a in others)):
            at = dict(zip(others, fixed))
            out.append([self.rank_of(**{**at, axis: i}) for i in range(self.sizes[axis])])
        return sorted(out)

    def group_of(self, rank: int, axis: str) -> list[int]:
        """The ``axis`` group that ``rank`` belongs to."""
        c = self.coords(rank)._asdict()
        return [self.rank_of(**{**c, axis: i}) for i in range(self.sizes[axis])]

    def embedding_groups(self) -> list[list[int]]:
        """[first, last] stage of every pipeline (Megatron's embedding groups); none when pp = 1."""
        return [[g[0], g[-1]] for g in self.groups("pp")] if self.pp > 1 else []

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The DeviceMesh shape of this grid: the axes slowest first (row-major layout)."""
        return tuple(self.sizes[a] for a in reversed(self.axes_fast_to_slow))

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return tuple(reversed(self.axes_fast_to_slow))

    def table(self) -> str:
        """One line per rank: ``rank 5 | dp 0 tp 1 pp 1``."""
        return "\n".join(f"rank {r:>{len(str(self.world_size))}} | dp {c.dp} tp {c.tp} pp {c.pp}"
                         for r in range(self.world_size) for c in [self.coords(r)])


def check_model(cfg, tp: int = 1, pp: int = 1, virtual_stages: int = 1) -> None:
    """Raise ``ValueError`` naming the fix unless the GPT ``cfg`` splits t ways and into p·v stages:
    heads (hence the width), the MLP width and the vocabulary over t (Shoeybi et al. 2019, §3);
    the layers evenly over the p·v (virtual) stages, as Megatron requires."""
    for name, v in (("tp", tp), ("pp", pp), ("virtual_stages", virtual_stages)):
        _positive_int(name, v)
    if hasattr(cfg, "n_kv_head"):  # the Llama-shaped model: its kv heads are split or replicated (ch04)
        from .tensor_parallel_llama import kv_layout

        kv_layout(cfg.n_head, cfg.n_kv_head, tp)  # raises, naming the degrees that work
        widths = (("n_head", cfg.n_head), ("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size))
    else:
        widths = (("n_head", cfg.n_head), ("n_embd", cfg.n_embd),
                  ("MLP width (mlp_ratio * n_embd)", cfg.mlp_ratio * cfg.n_embd),
                  ("vocab_size", cfg.vocab_size))
    for what, n in widths:
        if n % tp:
            raise ValueError(f"{what} {n} is not divisible by tp={tp}; choose a tensor-parallel degree that "
                             f"divides {n} (or pad {what} to a multiple of {tp})")
    stages = pp * virtual_stages
    if cfg.n_layer % stages:
        raise ValueError(f"n_layer {cfg.n_layer} is not divisible by pp·v = {pp}·{virtual_stages} = {stages} "
                         f"pipeline stages; choose n_layer as a multiple of {stages} or fewer stages")


@dataclass
class ParallelGroups:
    """This rank's process groups (and the grid they come from), what a 3D training step needs.

    ``dp_group``, ``tp_group``, ``pp_group``: torch process groups this rank belongs to;
    ``embedding_group``: its pipeline's first and last stage, or None (pp = 1 or not one of them).
    ``*_ranks``: the same groups as lists of global ranks. ``mesh``: the DeviceMesh, when used.
    """

    grid: RankGrid
    rank: int
    coords: Coords
    dp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    pp_group: dist.ProcessGroup | None
    embedding_group: dist.ProcessGroup | None = None
    ranks: dict = field(default_factory=dict)  # axis ("dp", "tp", "pp", "embedding") -> global ranks
    mesh: object = None

    def group(self, axis: str) -> dist.ProcessGroup | None:
        return {"dp": self.dp_group, "tp": self.tp_group, "pp": self.pp_group,
                "embedding": self.embedding_group}[axis]


def init_device_mesh(grid: RankGrid, device_type: str | None = None):
    """Torch's DeviceMesh for ``grid`` (shape: the axes slowest first, dims named after them).

    Creating it is itself collective: every rank must call it (it builds one group per axis slice).
    """
    from torch.distributed.device_mesh import init_device_mesh as _init

    if device_type is None:
        from ..runtime.launch import device
        device_type = device().type
    return _init(device_type, grid.mesh_shape, mesh_dim_names=grid.mesh_dim_names)


def init_groups(grid: RankGrid, use_device_mesh: bool = False) -> ParallelGroups:
    """Create the process groups of ``grid`` and return this rank's. A collective: every rank calls it.

    ``torch.distributed.new_group`` must be entered by *every* rank of the job, members or not,
    and in the same order on every rank (its documentation says so): each call takes the next
    group number and sets its group up by rendezvous keys named after it, so a rank that skipped
    a call, or made them in another order, would pair up different groups with the others and
    hang or talk to the wrong peers. Hence the loops below run over *all* groups of every axis
    on every rank, keeping only the handles of the groups this rank is in.

    ``use_device_mesh=True`` takes the DP, TP and PP groups from :func:`init_device_mesh`
    (torch's native way, which makes the same calls inside); the embedding groups, which a mesh
    has no notion of, are made here either way.
    """
    require_process_group("init_groups")
    n, me = dist.get_world_size(), dist.get_rank()
    if n != grid.world_size:
        raise ValueError(f"the grid has {grid.world_size} ranks but the job has {n}; build "
                         f"RankGrid({n}, dp, tp, pp) or launch {grid.world_size} ranks")
    mine, mesh = {}, None
    if use_device_mesh:
        mesh = init_device_mesh(grid)
        for axis in AXES:
            mine[axis] = mesh.get_group(axis)
    else:
        for axis in AXES:
            for ranks in grid.groups(axis):
                g = dist.new_group(ranks)  # every rank makes every group: see above
                if me in ranks:
                    mine[axis] = g
    mine["embedding"] = None
    for ranks in grid.embedding_groups():
        g = dist.new_group(ranks)
        if me in ranks:
            mine["embedding"] = g
    coords = grid.coords(me)
    ranks = {a: grid.group_of(me, a) for a in AXES}
    ranks["embedding"] = next((g for g in grid.embedding_groups() if me in g), [])
    return ParallelGroups(grid, me, coords, mine["dp"], mine["tp"], mine["pp"], mine["embedding"], ranks,
                          mesh)
