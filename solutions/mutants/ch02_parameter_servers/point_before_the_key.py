"""Wrong: gives a key to the server point *before* it on the ring.

Still a consistent hash (adding a server moves only keys to it), but not the rule: the owner is the
first point at or after the key.
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
    return servers[ring[i - 1][1]]
