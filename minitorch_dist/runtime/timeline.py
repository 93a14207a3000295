"""Chapter 00 — per-rank event timelines, Gantt charts, and the idle ("bubble") fraction they show.

A schedule is easiest to understand as a picture: one row per rank, one bar per piece of work.
Pipeline parallelism is where this matters most -- GPipe's bubble (Huang et al. 2019) and
1F1B's (Narayanan et al. 2021, §2.2) are the white space in that picture -- but the same picture
shows DDP overlapping all-reduce with backward, or ZeRO-3 prefetching parameters.

Each rank records into its own ``Timeline``; ``launch`` returns them (or their ``events``) to the
caller, who merges and plots them::

    def work():
        tl = Timeline()                 # rank from torch.distributed
        tl.align()                      # barrier, then a common time zero
        with tl.span("F0", category="forward", microbatch=0):
            ...
        return tl.events                # plain, picklable data
    events = Timeline.merge(launch(work, 4))
    plot_gantt(events); bubble_fraction(events)

Clock. Times come from ``time.monotonic``: on Linux that is ``CLOCK_MONOTONIC``, one system-wide
clock that every process on the machine reads alike and that never jumps (``time.time`` can jump
when NTP corrects it; ``time.perf_counter`` happens to be the same clock on Linux, but Python
promises nothing about its reference point across processes). So ranks on one machine agree
already if they share an ``origin`` (take ``time.monotonic()`` in the parent and pass it in).
Across machines no clock is shared; ``align()`` makes one by leaving a barrier together and
calling that instant zero -- good to the barrier's exit skew (tens of microseconds to a
millisecond), far below the length of a forward pass.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch.distributed as dist


@dataclass
class Event:
    """One piece of work (or, when ``t_start == t_end``, an instant) on one rank.

    Times are seconds since the timeline's origin. ``depth`` is the nesting level of the span
    (0 = outermost). ``meta`` should hold plain values so events pickle between processes.
    """

    rank: int
    name: str
    category: str | None
    t_start: float
    t_end: float
    meta: dict[str, Any] = field(default_factory=dict)
    depth: int = 0

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


def _default_rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:
        pass
    return 0


class Timeline:
    """Records spans and marks for one rank, relative to ``origin`` on ``clock``.

    ``cuda_sync=True`` synchronises the GPU at span boundaries so a span covers the kernels it
    launched, not just their launch (GPU work is asynchronous). It serialises work, so leave it off
    when the point is to see communication overlap computation.
    """

    def __init__(self, rank: int | None = None, origin: float | None = None,
                 clock: Callable[[], float] = time.monotonic, cuda_sync: bool = False):
        self.rank = _default_rank() if rank is None else rank
        self.clock = clock
        self.origin = clock() if origin is None else origin
        self.cuda_sync = cuda_sync
        self.events: list[Event] = []
        self._depth = 0

    def now(self) -> float:
        """Seconds since the origin."""
        if self.cuda_sync:
            from .timing import sync  # imported here: this module does not need torch otherwise
            sync()  # the current CUDA device, if this process has used CUDA
        return self.clock() - self.origin

    @contextlib.contextmanager
    def span(self, name: str, category: str | None = None, **meta: Any) -> Iterator[Event]:
        """Record the block as one event; spans may nest. Yields the ``Event`` (add to its meta)."""
        ev = Event(self.rank, name, category, self.now(), float("nan"), dict(meta), self._depth)
        self.events.append(ev)  # appended at entry, so ``events`` stays in start order
        self._depth += 1
        try:
            yield ev
        finally:
            self._depth -= 1
            ev.t_end = self.now()

    def mark(self, name: str, category: str | None = None, **meta: Any) -> Event:
        """Record an instant (e.g. "all-reduce of bucket 3 launched")."""
        t = self.now()
        ev = Event(self.rank, name, category, t, t, dict(meta), self._depth)
        self.events.append(ev)
        return ev

    def add(self, name: str, t_start: float, t_end: float, category: str | None = None,
            **meta: Any) -> Event:
        """Record a span whose times are known rather than measured (a simulator, a replay)."""
        if t_end < t_start:
            raise ValueError(f"span {name!r} ends ({t_end}) before it starts ({t_start})")
        ev = Event(self.rank, name, category, float(t_start), float(t_end), dict(meta), self._depth)
        self.events.append(ev)
        return ev

    # --- as an observer (runtime.observe): ``with observe.watching(tl):`` records what techniques
    # announce. Spans become events; instants and counters are not drawn (a technique's marks are
    # for the observers that count them).

    def on_begin(self, name: str, category: str | None, meta: dict) -> Event:
        """A technique started ``name``: an event with no end yet (``on_end`` closes it, maybe from
        another thread, e.g. a communication future's callback). Nesting: at the depth of the
        :meth:`span` blocks open around it."""
        ev = Event(self.rank, name, category, self.now(), float("nan"), dict(meta), self._depth)
        self.events.append(ev)
        return ev

    def on_end(self, ev: Event) -> None:
        ev.t_end = self.now()

    def align(self, group: dist.ProcessGroup | None = None) -> float:
        """Make this instant time zero on every rank: a barrier, then a new origin.

        Collective: every rank of ``group`` must call it. Without an initialised process group it
        just resets the origin. Events already recorded are shifted so they keep their place.
        """
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            dist.barrier(group=group)
        new_origin = self.clock()
        shift = self.origin - new_origin
        for ev in self.events:
            ev.t_start += shift
            ev.t_end += shift
        self.origin = new_origin
        return new_origin

    @staticmethod
    def merge(items: Iterable[Timeline | Event | Iterable[Event]]) -> list[Event]:
        """All events of several timelines (or event lists, e.g. ``launch``'s results), sorted by start."""
        return sorted(_as_events(items), key=lambda e: (e.t_start, e.rank, e.depth))


def _as_events(items: Any) -> list[Event]:
    """Flatten a Timeline, an Event, or (nested) lists of them into a list of Events."""
    if isinstance(items, Event):
        return [items]
    if isinstance(items, Timeline):
        return list(items.events)
    out: list[Event] = []
    for it in items:
        out += _as_events(it)
    return out


def _window(events: list[Event], window: tuple[float, float] | None) -> tuple[float, float]:
    if window is None:
        if not events:
            raise ValueError("no events: nothing to measure")
        window = (min(e.t_start for e in events), max(e.t_end for e in events))
    if not window[1] > window[0]:
        raise ValueError(f"the time window {window} is empty; pass window=(start, end) with end > start")
    return window


def busy_fraction(events: Timeline | Iterable[Any], rank: int, window: tuple[float, float] | None = None,
                  categories: Iterable[str] | None = None) -> float:
    """Fraction of ``window`` during which ``rank`` runs at least one span.

    Overlapping and nested spans count once (the union of their intervals). ``window`` defaults to
    the first start to the last end over *all* events -- the makespan. ``categories`` keeps only
    spans of those categories (e.g. leave out an enclosing "step" span that would cover everything).
    """
    events = _as_events(events)
    lo, hi = _window(events, window)
    keep = set(categories) if categories is not None else None
    spans = sorted((max(e.t_start, lo), min(e.t_end, hi)) for e in events
                   if e.rank == rank and e.duration > 0 and (keep is None or e.category in keep))
    busy, cur_s, cur_e = 0.0, 0.0, None  # cur_s is read only once cur_e is set
    for s, e in spans:  # sweep: merge overlapping intervals, add each merged run once
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            busy += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    return busy / (hi - lo)


def bubble_fraction(events: Timeline | Iterable[Any], ranks: Iterable[int] | None = None,
                    window: tuple[float, float] | None = None,
                    categories: Iterable[str] | None = None) -> float:
    """Idle device-time over total device-time: ``1 - mean_r busy_fraction(r)``.

    This is GPipe's measure: with p stages and m micro-batches of equal cost each stage idles
    (p-1) of the (m+p-1) slots, so the bubble is (p-1)/(m+p-1). Megatron-LM (Narayanan et al.
    2021, §2.2.1) quotes bubble time over *ideal* time instead, (p-1)/m = f/(1-f) for our f.
    """
    events = _as_events(events)
    window = _window(events, window)
    ranks = sorted({e.rank for e in events}) if ranks is None else list(ranks)
    busy = [busy_fraction(events, r, window, categories) for r in ranks]
    return 1.0 - sum(busy) / len(busy)


def _rank_of(e: Event) -> Any:
    return e.rank


class _RowOf:
    """``row[event]`` -> the row index of an event (so the drawing code reads ``row[e]``-like)."""

    def __init__(self, index: dict[Any, int], key: Callable[[Event], Any]) -> None:
        self.index, self.key = index, key

    def __getitem__(self, e: Event) -> int:
        return self.index[self.key(e)]


def plot_gantt(events: Timeline | Iterable[Any], ax: Any = None, colors: dict[str, Any] | None = None,
               title: str | None = None, labels: bool = True, min_label_frac: float = 0.03,
               row_of: Callable[[Event], Any] | None = None) -> Any:
    """Draw one row per rank (rank 0 on top) and one bar per span, x in milliseconds.

    ``row_of(event)`` picks a span's row instead of its rank, e.g.
    ``lambda e: (e.rank, e.category == "all_reduce")`` gives each rank a compute lane and a
    communication lane, so overlapping spans of one rank are seen side by side. Rows are sorted
    by that key and labelled with it.

    Bars are coloured by category (by name when an event has none); ``colors`` maps those keys to
    colours, the rest take the tab10 cycle. Nested spans are drawn thinner, on top of their parent.
    Instants (marks) are drawn as ticks. Bars at least ``min_label_frac`` of the whole span wide
    carry their name. Returns the matplotlib Axes; works with any backend, Agg included.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = _as_events(events)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 1 + 0.6 * max(1, len({(row_of or _rank_of)(e) for e in events}))))
    if not events:
        return ax
    row_key = row_of or _rank_of
    ranks = sorted({row_key(e) for e in events})
    index = {r: i for i, r in enumerate(ranks)}
    row = _RowOf(index, row_key)
    key = lambda e: e.category if e.category is not None else e.name
    palette = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]  # tab10 is a ListedColormap
    cmap = dict(colors or {})
    for k in sorted({key(e) for e in events} - set(cmap)):
        cmap[k] = palette[len(cmap) % len(palette)]
    t0 = min(e.t_start for e in events)
    total_ms = max(max(e.t_end for e in events) - t0, 1e-12) * 1e3

    spans = [e for e in events if e.duration > 0]
    if spans:
        ax.barh([row[e] for e in spans], [e.duration * 1e3 for e in spans],
                left=[(e.t_start - t0) * 1e3 for e in spans], height=[0.8 * 0.7 ** e.depth for e in spans],
                color=[cmap[key(e)] for e in spans], edgecolor="black", linewidth=0.4)
    for e in spans:
        if labels and e.duration * 1e3 >= min_label_frac * total_ms:
            ax.text((e.t_start - t0 + e.duration / 2) * 1e3, row[e], e.name,
                    ha="center", va="center", fontsize=7, clip_on=True)
    for e in events:
        if e.duration <= 0:
            ax.plot([(e.t_start - t0) * 1e3], [row[e]], marker="|", markersize=14, color=cmap[key(e)])

    ax.set_yticks(range(len(ranks)), [f"rank {r}" if row_of is None else str(r) for r in ranks])
    ax.set_ylim(len(ranks) - 0.5, -0.5)  # rank 0 on top
    ax.set_xlabel("time (ms)")
    present = {key(e) for e in events}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in cmap.items() if k in present], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    return ax
