"""Wrong: returns only the ranges the greedy fill used, not one per server.

The loads are optimal, but a caller indexing server i's range gets fewer ranges than servers
whenever the optimum needs fewer, e.g. more servers than keys.
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

    lo, hi = max(sizes, default=0), sum(sizes)  # the optimum lies in [largest key, everything]
    while lo < hi:  # the smallest cap the greedy fill meets
        mid = (lo + hi) // 2
        if cuts_for(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    ranges = cuts_for(lo)
    return ranges
