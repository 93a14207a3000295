"""Wrong: places each server at one point, ignoring virtual_nodes.

Right with one virtual node; with more, the arcs stay as uneven as a single point makes them, and
the owners differ from the ring the rule describes.
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
    ring = sorted((ring_position(f"{s}#0"), j) for j, s in enumerate(servers))
    points = [p for p, _ in ring]
    i = bisect.bisect_left(points, ring_position(str(key)))
    return servers[ring[i % len(ring)][1]]  # past the last point: wrap round to the first
