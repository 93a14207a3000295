"""Wrong: multiplies its own blocks and all-reduces the products along its grid row.

It reads like Megatron's row-parallel sum of partial products; but C_ij needs A_ik B_kj, blocks held by
other ranks, not A_ij B_ij summed over j.
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
    c_ij = a_ij @ b_ij
    comm.all_reduce(c_ij, group=rows[i])
    del cols
    return c_ij
