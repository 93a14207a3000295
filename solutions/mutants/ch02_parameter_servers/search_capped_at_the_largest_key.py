"""Wrong: searches the load between the average and the largest key.

Both look like the natural bounds, and when one key dominates the optimum is the largest key. But
when the keys are alike the optimum lies above the largest key (four keys of 4 bytes on two
servers: 8), outside the search: no cap in it fits the keys into n_servers ranges.
"""
def balanced_key_ranges(key_bytes, n_servers: int) -> list[range]:

    sizes = [int(b) for b in key_bytes]
    if any(b < 0 for b in sizes):
        raise ValueError(f"key sizes must be >= 0 bytes, got {[b for b in sizes if b < 0][:5]}")
    if int(n_servers) != n_servers or n_servers < 1:
        raise ValueError(f"n_servers must be a whole number >= 1, got {n_servers}")
    n_servers = int(n_servers)

    def cuts_for(cap):  # greedy: fill each server up to cap; None if n_servers do not suffice
        out, start, load = [], 0, 0
        for k, b in enumerate(sizes):
            if b > cap:
                return None
            if load + b > cap:
                out.append(range(start, k))
                start, load = k, 0
            load += b
        out.append(range(start, len(sizes)))
        return out if len(out) <= n_servers else None

    lo, hi = sum(sizes) // n_servers, max(sizes, default=0)  # from the average to the largest key
    while lo < hi:  # the smallest cap the greedy fill meets
        mid = (lo + hi) // 2
        if cuts_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    ranges = cuts_for(lo) or cuts_for(max(lo, hi)) or [range(0, len(sizes))]
    return ranges + [range(len(sizes), len(sizes))] * (n_servers - len(ranges))
