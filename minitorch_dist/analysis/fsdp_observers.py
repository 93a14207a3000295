"""Chapter 06 — what ``fully_shard`` announces, turned into the numbers the chapter checks.

A unit of :mod:`memory.zero.fsdp` announces through :mod:`runtime.observe`, category ``"fsdp"``, an
instant per event — ``all_gather`` (issued), ``forward`` / ``backward`` (the unit starts),
``forward_end`` / ``backward_end``, ``reduce_scatter``, ``free`` — each with ``unit=<its name>``, and
counts ``gathered_bytes`` up by its full buffer when it is gathered and down when it is freed. It
keeps no statistics itself; :class:`GatheredUnits` listens and keeps them::

    gathered = GatheredUnits()
    with observe.watching(gathered):
        loss = model(x, y)[1]
    gathered.peak_units, gathered.peak_bytes    # with prefetch: the root and two blocks at most
    gathered.schedule                           # [("forward", "root"), ("all_gather", "blocks.0"), ...]
"""
from __future__ import annotations

import threading

__all__ = ["GatheredUnits"]


class GatheredUnits:
    """The units gathered at once and the order of events, from ``fully_shard``'s announcements.

    ``now``: the names of the units gathered right now (since the observer started listening);
    ``bytes_now``: their full buffers' bytes; ``peak_units`` / ``peak_bytes``: the most of each at
    once; ``schedule``: ``(event, unit name)`` in the order announced.
    """

    def __init__(self):
        self.now: set[str] = set()
        self.bytes_now = self.peak_units = self.peak_bytes = 0
        self.schedule: list[tuple[str, str]] = []
        self._lock = threading.Lock()  # an all-gather's completion may be announced from another thread

    def on_mark(self, name: str, category: str | None, meta: dict) -> None:
        if category == "fsdp":
            with self._lock:
                self.schedule.append((name, meta.get("unit")))

    def on_count(self, name: str, delta: float, meta: dict) -> None:
        if name != "gathered_bytes":
            return
        with self._lock:
            (self.now.add if delta > 0 else self.now.discard)(meta.get("unit"))
            self.bytes_now += delta
            self.peak_units = max(self.peak_units, len(self.now))
            self.peak_bytes = max(self.peak_bytes, self.bytes_now)
