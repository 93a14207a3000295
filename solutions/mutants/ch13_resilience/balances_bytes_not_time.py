"""Wrong: gives each piece to the holder with the fewest bytes so far, ignoring the write bandwidths.

That is DCP's rule and the library's, right when every rank writes equally fast; a rank four times
faster should take about four times the bytes, or the slow rank finishes last.
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
        writer = min(holders[piece], key=lambda q: (load[q], q))
        out[piece] = writer
        load[writer] += sizes[piece]
    return out
