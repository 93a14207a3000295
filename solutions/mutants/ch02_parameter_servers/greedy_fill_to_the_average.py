"""Wrong: fills each server greedily up to the average load, total / n_servers.

The average is a lower bound, rarely reachable with contiguous ranges: the greedy fill then runs out
of servers and the last one takes everything left.
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

    target, ranges, start, load = sum(sizes) / n_servers, [], 0, 0
    for k, b in enumerate(sizes):
        if load and load + b > target and len(ranges) < n_servers - 1:
            ranges.append(range(start, k))
            start, load = k, 0
        load += b
    ranges.append(range(start, len(sizes)))
    return ranges + [range(len(sizes), len(sizes))] * (n_servers - len(ranges))
