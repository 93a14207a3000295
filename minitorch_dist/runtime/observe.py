"""Chapter 00 — observation: a technique says what it does; whoever wants to know listens.

Measurement belongs *beside* a technique, not inside it. A technique's code announces what it
does through this module, and never learns who (if anyone) listens::

    with observe.span("F0", "F", mb=0):        # a block of work on this rank, in this thread
        ...
    key = observe.begin("all_reduce b3", "all_reduce", bucket=3)   # work that ends elsewhere,
    work.get_future().add_done_callback(lambda _: observe.end(key))  # e.g. in the backend's thread
    observe.mark("launch", "ddp", bucket=3)    # an instant: something happened
    observe.count("stash", +1, chunk=0)        # a quantity changed by ``delta``

An *observer* is any object with some of the methods

    on_begin(name, category, meta) -> token     on_end(token)
    on_mark(name, category, meta)               on_count(name, delta, meta)

(a method it lacks is simply not called). It listens inside ``with observe.watching(obs):``, on
this rank, to everything announced from any thread while the block runs. The Gantt timeline
(:class:`runtime.timeline.Timeline`), the workload recorder, the pipeline's stash counter
(:class:`analysis.pipeline_observers.StashCounter`) and the tests' :class:`analysis.observers.Recorder`
are observers. Nesting is allowed: every active observer hears every announcement.

Cost. With nobody watching, an announcement is one truth test of an empty list; code that would
do real work only to announce something (register a hook, read a clock) asks :func:`watched`
first. ``comm.meter()`` is the same design for collectives: one registry of active listeners per
process, entered and left with ``with``.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Protocol, TypeVar

__all__ = ["Observer", "watching", "watched", "span", "begin", "end", "mark", "count"]


class Observer(Protocol):
    """What an observer may implement; every method is optional."""

    def on_begin(self, name: str, category: str | None, meta: dict[str, Any]) -> Any: ...
    def on_end(self, token: Any) -> None: ...
    def on_mark(self, name: str, category: str | None, meta: dict[str, Any]) -> None: ...
    def on_count(self, name: str, delta: float, meta: dict[str, Any]) -> None: ...


# The observers listening on this rank (innermost last), and a lock: announcements may come from
# the backend's callback threads (a future's done-callback) while a block is entered or left.
_watchers: list = []
_lock = threading.Lock()
_O = TypeVar("_O")


@contextlib.contextmanager
def watching(observer: _O) -> Iterator[_O]:
    """Let ``observer`` hear every announcement made on this rank while the block runs."""
    with _lock:
        _watchers.append(observer)
    try:
        yield observer
    finally:
        with _lock:  # by identity: two equal observers are still two listeners
            del _watchers[next(i for i, w in enumerate(_watchers) if w is observer)]


def watched() -> bool:
    """Is anyone listening? Ask before doing work whose only purpose is an announcement."""
    return bool(_watchers)


def _listeners(method: str) -> list:
    with _lock:
        return [(w, getattr(w, method)) for w in _watchers if hasattr(w, method)]


def begin(name: str, category: str | None = None, **meta: Any) -> tuple | None:
    """Announce the start of a piece of work that may end anywhere — later, in another thread, after
    other spans began (a collective in flight). Returns the key :func:`end` takes (None: no observer).
    Observers see ``meta["detached"] = True``: its end need not nest inside the blocks around it."""
    if not _watchers:
        return None
    return _begin(name, category, {**meta, "detached": True})


def _begin(name: str, category: str | None, meta: dict[str, Any]) -> tuple:
    return tuple((w, fn(name, category, meta)) for w, fn in _listeners("on_begin"))


def end(key: tuple | None) -> None:
    """Announce the end of the work :func:`begin` returned ``key`` for (any thread may call it)."""
    if not key:
        return
    for w, token in key:
        fn = getattr(w, "on_end", None)
        if fn is not None:
            fn(token)


@contextlib.contextmanager
def span(name: str, category: str | None = None, **meta: Any) -> Iterator[None]:
    """Announce the block as one piece of work, begun on entry and ended on exit: spans nest."""
    if not _watchers:
        yield
        return
    key = _begin(name, category, meta)
    try:
        yield
    finally:
        end(key)


def mark(name: str, category: str | None = None, **meta: Any) -> None:
    """Announce an instant (a bucket launched, a gradient arrived)."""
    if not _watchers:
        return
    for _, fn in _listeners("on_mark"):
        fn(name, category, meta)


def count(name: str, delta: float, **meta: Any) -> None:
    """Announce that the quantity ``name`` changed by ``delta`` (a stash grew, a counter ticked)."""
    if not _watchers:
        return
    for _, fn in _listeners("on_count"):
        fn(name, delta, meta)
