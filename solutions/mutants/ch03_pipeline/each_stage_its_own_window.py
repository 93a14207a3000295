"""Wrong: measures each stage's idle inside that stage's own first-to-last span.

It reads as "the stage's utilisation", and it misses exactly the fill and the drain, the time a stage
waits before its first action and after its last: the bubble itself.
"""


def bubble_from_timeline(events, p: int) -> float:
    events = list(events)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int (the number of stages), got {p!r}")
    if not events:
        raise ValueError("no events: nothing to measure")
    for e in events:
        if not 0 <= e.rank < p:
            raise ValueError(f"event on rank {e.rank} is outside stages 0..{p - 1}; pass the right p")
        if e.t_end < e.t_start:
            raise ValueError(f"event on rank {e.rank} ends ({e.t_end}) before it starts ({e.t_start})")
    if not max(e.t_end for e in events) > min(e.t_start for e in events):
        raise ValueError("the events span no time (every one is an instant at the same time)")
    idle = 0.0
    for r in range(p):
        spans = sorted((e.t_start, e.t_end) for e in events if e.rank == r)
        if not spans:
            idle += 1.0
            continue
        lo, hi = spans[0][0], max(t for _, t in spans)
        busy, run_start, run_end = 0.0, None, None
        for s, t in spans:
            if run_end is not None and s <= run_end:
                run_end = max(run_end, t)
                continue
            if run_end is not None:
                busy += run_end - run_start
            run_start, run_end = s, t
        busy += run_end - run_start
        idle += 1.0 - busy / (hi - lo) if hi > lo else 0.0
    return idle / p
