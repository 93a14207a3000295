"""Wrong: splits the key count evenly, ignoring the keys' sizes.

torch.tensor_split's cut, what the library's key_ranges does: optimal when every key has one size,
far from it with an embedding-sized key among small ones.
"""




def balanced_key_ranges(key_bytes, n_servers: int) -> list[range]:

    sizes = [int(b) for b in key_bytes]
    if any(b < 0 for b in sizes):
        raise ValueError(f"key sizes must be >= 0 bytes, got {[b for b in sizes if b < 0][:5]}")
    if int(n_servers) != n_servers or n_servers < 1:
        raise ValueError(f"n_servers must be a whole number >= 1, got {n_servers}")
    n_servers = int(n_servers)
    base, extra = divmod(len(sizes), n_servers)
    out, start = [], 0
    for i in range(n_servers):
        stop = start + base + (1 if i < extra else 0)
        out.append(range(start, stop))
        start = stop
    return out

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
    return ranges + [range(len(sizes), len(sizes))] * (n_servers - len(ranges))
