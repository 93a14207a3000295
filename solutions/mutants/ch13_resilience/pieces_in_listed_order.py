"""Wrong: hands out the pieces in the order rank 0 and the others list them, not in sorted order.

Any fixed order seems as good as another for a greedy rule; but the ranks list their pieces in
their own orders, and the answer must not depend on them (nor, with the tests, differ from the
sorted order every rank can agree on).
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
    for piece in list(dict.fromkeys((name, key) for plan in plans for name, key, _ in plan)):
        writer = min(holders[piece], key=lambda q: ((load[q] + sizes[piece]) / bandwidth[q], q))
        out[piece] = writer
        load[writer] += sizes[piece]
    return out
