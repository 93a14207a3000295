"""Chapter 03 — what a pipeline step holds: the microbatches whose activations a rank keeps.

The executor (:func:`..parallelism.pipeline.executor.run_schedule`) announces each action as a span
(category F, B or W) and each change of its activation stash as ``count("stash", ±1/v)``: an F keeps
one chunk's activations, the last backward step of that chunk (B, or W when the backward is split)
frees them. :class:`StashCounter` listens to both and keeps what GPipe's and 1F1B's memory argument
is about -- how many microbatches the rank held as each action began, and the most at once::

    stash = StashCounter()
    with observe.watching(stash):
        run_schedule(schedule, stages, x, y)
    stash.peak       # 1F1B: p - r on stage r; GPipe: m (the simulator's peak_stashed, the cost model's)
"""
from __future__ import annotations

__all__ = ["StashCounter"]


class StashCounter:
    """Microbatches whose activations this rank holds (a chunk counts 1/v), from the executor's
    announcements (:mod:`runtime.observe`).

    ``held``: the count as each action began (one entry per F, B or W span, in order); ``peak``: the
    most held at once; ``units``: held now. A chunk's 1/v is exact for v a power of two (the
    schedules here use v = 1 and 2), so ``peak`` compares with ``==``.
    """

    ACTIONS = ("F", "B", "W")

    def __init__(self):
        self.units, self.peak, self.held = 0.0, 0.0, []

    def on_count(self, name: str, delta: float, meta: dict) -> None:
        if name == "stash":
            self.units += delta
            self.peak = max(self.peak, self.units)

    def on_begin(self, name: str, category: str | None, meta: dict) -> None:
        if category in self.ACTIONS:
            self.held.append(self.units)
