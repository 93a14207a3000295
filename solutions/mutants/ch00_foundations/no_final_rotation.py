"""Wrong: returns the blocks in the order it received them, own block first.

Bruck's rounds leave rank r holding blocks r, r+1, ..., r-1 (mod n): rank r's own block first.
Copying that buffer straight into the output looks right on rank 0, whose rotation is the
identity, and on every rank the sizes and the message counts are right; but on every other rank
the blocks sit r places off, so the result differs from ``all_gather_into_tensor``.
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
    return buf.reshape(n * chunk.shape[0], *chunk.shape[1:])
