"""Wrong: gives every piece to its fastest holder.

Writing on the fastest disk sounds like the quickest save; but it piles every replicated piece on
one rank, whose queue then outlasts what the slower ranks could have written in parallel.
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
        writer = min(holders[piece], key=lambda q: (-bandwidth[q], q))
        out[piece] = writer
        load[writer] += sizes[piece]
    return out
