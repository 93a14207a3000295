"""Wrong: undoes the rotation in the wrong direction.

After the rounds, slot j of the buffer holds rank (r + j) mod n's block. Placing slot j at block
(r - j) mod n instead is the other reading of "rotate by r": right on rank 0 and, on 2 ranks, on
both ranks (r + j and r - j agree mod 2), so a test on 2 ranks alone passes it; from 3 ranks on the
blocks of every rank but 0 land in mirrored places.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def bruck_all_gather(chunk: torch.Tensor) -> torch.Tensor:
    n, r = dist.get_world_size(), dist.get_rank()
    buf = chunk.new_empty((n, *chunk.shape))
    buf[0] = chunk
    held = 1
    while held < n:
        count = min(held, n - held)
        ops = [dist.P2POp(dist.isend, buf[:count], (r - held) % n),
               dist.P2POp(dist.irecv, buf[held:held + count], (r + held) % n)]
        for work in comm.batch_isend_irecv(ops):
            work.wait()
        held += count
    out = chunk.new_empty((n * chunk.shape[0], *chunk.shape[1:]))
    out.view(n, *chunk.shape)[(r - torch.arange(n)) % n] = buf
    return out
