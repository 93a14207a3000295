"""Wrong: adds up the spans' lengths without merging overlaps.

Exactly right for a simulator's timeline, where spans never overlap; a recorded one nests spans (a step
around its actions) and this counts that time twice.
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
    t0 = min(e.t_start for e in events)
    makespan = max(e.t_end for e in events) - t0
    busy = 0.0
    for r in range(p):
        run_start = run_end = None
        for s, t in sorted((e.t_start, e.t_end) for e in events if e.rank == r):
            if False:  # every span on its own
                run_end = max(run_end, t)
                continue
            if run_end is not None:
                busy += run_end - run_start
            run_start, run_end = s, t
        if run_end is not None:
            busy += run_end - run_start
    return 1.0 - busy / (p * makespan)
