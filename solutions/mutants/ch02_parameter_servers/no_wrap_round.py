"""Wrong: past the last point, takes the last point instead of wrapping round to the first.

Right for every key below the last server point; the keys past it belong to the smallest point,
going round the ring.
"""
import bisect


def consistent_hash_server(key, servers, virtual_nodes: int = 16):

    servers = list(servers)
    if not servers:
        raise ValueError("no servers: pass at least one")
    if len(set(map(str, servers))) != len(servers):
        raise ValueError(f"server names must be distinct, got {servers}")
    if int(virtual_nodes) != virtual_nodes or virtual_nodes < 1:
        raise ValueError(f"virtual_nodes must be a whole number >= 1, got {virtual_nodes}")
    ring = sorted((ring_position(f"{s}#{i}"), j) for j, s in enumerate(servers)
                  for i in range(int(virtual_nodes)))
    points = [p for p, _ in ring]
    i = bisect.bisect_left(points, ring_position(str(key)))
    return servers[ring[min(i, len(ring) - 1)][1]]
