"""Wrong: picks the holder free soonest (load / bandwidth), not the one that finishes this piece first.

"Least loaded in time" sounds like the rule; but the piece's own write time differs by rank: two
idle ranks tie at 0, and the tie goes to the lowest rank even when it is the slower one.
"""
def plan_writers_by_bandwidth(plans, bandwidth) -> dict:
    plans = [list(plan) for plan in plans]
    bandwidth = list(bandwidth)
    sizes = {(name, key): int(nbytes) for plan in plans for name, key, nbytes in plan}
    holders: dict = {}
    for r, plan in enumerate(plans):
        for name, key, _ in plan:
            holders.setdefault((name, key), []).append(r)
    load, out = [0] * len(plans), {}
    for piece in sorted(holders):
        writer = min(holders[piece], key=lambda q: (load[q] / bandwidth[q], q))
        out[piece] = writer
        load[writer] += sizes[piece]
    return out
