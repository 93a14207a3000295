"""Chapter 03 — the vocabulary of pipeline schedules: an :class:`Action` (F, B or W of one microbatch on
one model chunk), a :class:`Schedule` (one action list per rank), and where each chunk sits in the model.

The model is cut into ``V = p*v`` consecutive *virtual stages*; each of the ``p`` ranks holds ``v`` of
them, its *chunks*. Two placements are in use:

* ``"loop"`` (Megatron-LM's interleaving, Narayanan et al. 2021 §2.2.2): chunk ``c`` of rank ``r`` is
  virtual stage ``c*p + r``; a microbatch loops ``v`` times through ranks ``0, 1, ..., p-1``.
* ``"v"`` (ZB-V, Qi et al. 2024 §6; DualPipeV, DeepSeek-AI 2024 §3.2.1 and deepseek-ai/DualPipe):
  ``v = 2`` and rank ``r`` holds virtual stages ``r`` (chunk 0) and ``2p-1-r`` (chunk 1). A
  microbatch goes down ranks ``0 .. p-1`` and comes back up ``p-1 .. 0``: the turn at the bottom of the
  V stays on rank ``p-1``, and the first and the last virtual stage (embedding and loss) both sit on
  rank 0::

      virtual stage:  0   1   2   3 | 4   5   6   7        (p = 4)
      rank:           0   1   2   3 | 3   2   1   0

:mod:`.schedules` builds schedules from these pieces; :mod:`.simulator` times them; :mod:`.executor`
runs them.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

KINDS = ("F", "B", "W")
LAYOUTS = ("loop", "v")


class Action(NamedTuple):
    """One unit of work on one stage: ``kind`` F/B/W of microbatch ``mb`` on model ``chunk``.

    B is the *whole* backward unless the schedule also has a W for the same (mb, chunk); then
    B is the input gradient only and W the weight gradient (see :meth:`Schedule.split`).
    """

    kind: str
    mb: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.mb}" if self.chunk == 0 else f"{self.kind}{self.mb}.{self.chunk}"


@dataclass(frozen=True)
class Schedule:
    """The per-stage action lists of one training step. ``schedule[r]`` is rank r's list.

    ``layout`` places the chunks (module docstring): ``"loop"`` or ``"v"``. ``mixed_backward``: only
    some backwards are split (DualPipeV); a B whose (mb, chunk) has no W is then a whole backward, where
    otherwise a schedule with any W must have one for every B. ``overlapped[r]``: positions ``i`` of rank
    r's list where actions ``i`` (an F) and ``i+1`` (a B of the other chunk) form one overlapped "F&B"
    pair (DualPipe's chunk pairs): the pair starts once the inputs of *both* have arrived, then runs
    them one after the other here (:mod:`.simulator`, :mod:`.executor`).
    """

    name: str
    p: int  # pipeline stages (ranks)
    m: int  # microbatches per step
    v: int  # model chunks per rank (1 unless interleaved or V)
    stages: tuple[tuple[Action, ...], ...]
    layout: str = "loop"
    mixed_backward: bool = False
    overlapped: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.layout == "v" and self.v != 2:
            raise ValueError(f"the V layout places exactly 2 chunks per rank; got v={self.v}, use v=2")

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.stages[rank]

    def __len__(self) -> int:
        return self.p

    @property
    def splits_backward(self) -> bool:
        """True when (some) backward is split into B (input gradient) and W (weight gradient)."""
        return any(a.kind == "W" for acts in self.stages for a in acts)

    @cached_property
    def _with_w(self) -> frozenset:
        return frozenset((r, a.mb, a.chunk) for r, acts in enumerate(self.stages)
                         for a in acts if a.kind == "W")

    def split(self, rank: int, mb: int, chunk: int) -> bool:
        """Whether the B of (mb, chunk) on ``rank`` is the input gradient only (a W follows), not the
        whole backward."""
        return (rank, mb, chunk) in self._with_w

    @cached_property
    def _pairs(self) -> dict:
        return {(r, self.stages[r][i]): self.stages[r][i + 1]
                for r, positions in enumerate(self.overlapped) for i in positions}

    def paired_backward(self, rank: int, action: Action) -> Action | None:
        """The B overlapped with ``action`` (an F) on ``rank`` in one "F&B" pair, else None."""
        return self._pairs.get((rank, action)) if self.overlapped else None

    def virtual_stage(self, rank: int, chunk: int) -> int:
        """Position in the ``p*v``-stage model of ``chunk`` on ``rank``: ``chunk*p + rank`` (loop),
        ``rank`` or ``2p-1-rank`` (V)."""
        if self.layout == "v":
            return rank if chunk == 0 else 2 * self.p - 1 - rank
        return chunk * self.p + rank

    def placement(self, virtual_stage: int) -> tuple[int, int]:
        """``(rank, chunk)`` that holds ``virtual_stage``: the inverse of :meth:`virtual_stage`."""
        if self.layout == "v":
            s = virtual_stage
            return (s, 0) if s < self.p else (2 * self.p - 1 - s, 1)
        return virtual_stage % self.p, virtual_stage // self.p

    def table(self) -> str:
        """The schedule as text, one row per stage: ``stage 0 | F0 F1 B0 ...``."""
        return "\n".join(f"stage {r} | " + " ".join(str(a) for a in acts)
                         for r, acts in enumerate(self.stages))

    def __str__(self) -> str:
        return self.table()


def check_sizes(p, m, v=1) -> None:
    """Raise ValueError unless p, m, v are positive ints."""
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int (stages p, microbatches m, chunks v), got {x!r}")
