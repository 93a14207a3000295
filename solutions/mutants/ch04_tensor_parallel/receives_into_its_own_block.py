"""Wrong: receives each broadcast block into its own A and B blocks.

Broadcast overwrites the tensor on the receivers, and the block has the right shape; but the rank needs
its own block later, when its turn comes to send it, and by then it holds someone else's.
"""


def summa_matmul(a_ij: torch.Tensor, b_ij: torch.Tensor) -> torch.Tensor:
    _require_dist("summa_matmul")
    world = dist.get_world_size()
    q = math.isqrt(world)
    if q * q != world:
        raise ValueError(f"SUMMA needs a square grid of ranks: world size {world} is not q*q; "
                         "launch 1, 4, 9... ranks")
    if a_ij.dim() != 2 or b_ij.dim() != 2 or a_ij.shape[1] != b_ij.shape[0]:
        raise ValueError("blocks must be 2-D with A_ij's columns equal to B_ij's rows, got "
                         f"{tuple(a_ij.shape)} and {tuple(b_ij.shape)}")
    i, j = divmod(dist.get_rank(), q)
    rows = [dist.new_group([q * r + c for c in range(q)]) for r in range(q)]  # same order on every rank
    cols = [dist.new_group([q * r + c for r in range(q)]) for c in range(q)]
    c_ij = torch.zeros(a_ij.shape[0], b_ij.shape[1], dtype=torch.result_type(a_ij, b_ij), device=a_ij.device)
    for k in range(q):
        a_ik = a_ij
        comm.broadcast(a_ik, src=q * i + k, group=rows[i])
        b_kj = b_ij
        comm.broadcast(b_kj, src=q * k + j, group=cols[j])
        c_ij += a_ik @ b_kj
    return c_ij
