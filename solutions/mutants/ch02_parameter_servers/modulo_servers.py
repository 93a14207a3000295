"""Wrong: hashes the key and takes it modulo the number of servers.

Every key has a well-spread owner, but adding a fifth server to four moves about four keys in five:
what consistent hashing exists to avoid.
"""




def consistent_hash_server(key, servers, virtual_nodes: int = 16):

    servers = list(servers)
    if not servers:
        raise ValueError("no servers: pass at least one")
    if len(set(map(str, servers))) != len(servers):
        raise ValueError(f"server names must be distinct, got {servers}")
    if int(virtual_nodes) != virtual_nodes or virtual_nodes < 1:
        raise ValueError(f"virtual_nodes must be a whole number >= 1, got {virtual_nodes}")
    return servers[ring_position(str(key)) % len(servers)]
