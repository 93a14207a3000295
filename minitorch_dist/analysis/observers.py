"""Chapter 00 — observers: what listens to a technique's announcements (:mod:`runtime.observe`).

A technique announces spans, instants and counter changes; it never keeps a log of them. The
observers here turn those announcements into the facts the notebooks and tests check — the order
in which DDP's gradients arrived and its buckets launched, how many microbatches a pipeline rank
held at its peak, how many blocks ring attention computed. The Gantt chart's observer is
:class:`runtime.timeline.Timeline` itself; the step replay's is :class:`analysis.workload.WorkloadRecorder`.

    rec = Recorder()
    with observe.watching(rec):
        loss = model(x).sum(); loss.backward()
    rec.marks("ddp")        # [("grad", {...}), ("launch", {"bucket": 0}), ...]
"""
from __future__ import annotations

import threading
from collections import Counter

__all__ = ["Recorder", "launches_during_backward"]


class Recorder:
    """Keeps every announcement, in the order it was made, as plain data.

    ``log``: ``("begin", name, category, meta)``, ``("end", index of its begin)``, ``("mark", name,
    category, meta)``, ``("count", name, delta, meta)``. ``totals[name]``: the running sum of a
    counter; ``peaks[name]``: the largest it reached. Announcements may come from other threads (a
    communication future's callback): the lock keeps the log whole.
    """

    def __init__(self):
        self.log: list[tuple] = []
        self.totals: Counter = Counter()
        self.peaks: dict[str, float] = {}
        self._lock = threading.Lock()

    def on_begin(self, name, category, meta) -> int:
        with self._lock:
            self.log.append(("begin", name, category, dict(meta)))
            return len(self.log) - 1

    def on_end(self, token: int) -> None:
        with self._lock:
            self.log.append(("end", token))

    def on_mark(self, name, category, meta) -> None:
        with self._lock:
            self.log.append(("mark", name, category, dict(meta)))

    def on_count(self, name, delta, meta) -> None:
        with self._lock:
            self.log.append(("count", name, delta, dict(meta)))
            self.totals[name] += delta
            self.peaks[name] = max(self.peaks.get(name, self.totals[name]), self.totals[name])

    def marks(self, category: str | None = None) -> list[tuple[str, dict]]:
        """``(name, meta)`` of every instant announced (of ``category`` only, when given), in order."""
        return [(e[1], e[3]) for e in self.log if e[0] == "mark" and (category is None or e[2] == category)]

    def spans(self, category: str | None = None) -> list[tuple[str, dict]]:
        """``(name, meta)`` of every span begun (of ``category`` only, when given), in order."""
        return [(e[1], e[3]) for e in self.log if e[0] == "begin" and (category is None or e[2] == category)]

    def counts(self, name: str) -> list[float]:
        """Every ``delta`` announced for the counter ``name``, in order (``totals[name]`` is their sum)."""
        return [e[2] for e in self.log if e[0] == "count" and e[1] == name]


def launches_during_backward(ddp_marks) -> int:
    """How many bucket all-reduces DDP launched before backward produced its last gradient.

    ``ddp_marks``: a :class:`Recorder` that listened to one synchronised backward, or its
    ``marks("ddp")`` — ``("grad", {"param": name})``, ``("launch", {"bucket": i})``, ``("wait", ...)``
    in the order they were announced. Zero means no communication overlapped the backward.
    """
    marks = ddp_marks.marks("ddp") if isinstance(ddp_marks, Recorder) else list(ddp_marks)
    grads = [k for k, (name, _) in enumerate(marks) if name == "grad"]
    if not grads:
        return 0
    return sum(1 for name, _ in marks[:grads[-1]] if name == "launch")
