"""Wrong: sends every block it holds in every round, also in the last one.

The power-of-two recipe — swap everything gathered so far — carried over to any n: gather into a
buffer of the next power of two of blocks and keep the first n. The result is right and the
round count is ceil(log2 n), but in the last round a rank sends blocks its receiver already
holds: on 3 ranks it sends 1 + 2 = 3 blocks, not n - 1 = 2, above the all-gather's lower bound.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def bruck_all_gather(chunk: torch.Tensor) -> torch.Tensor:
    n, r = dist.get_world_size(), dist.get_rank()
    p = 1 << (n - 1).bit_length()  # the next power of two
    buf = chunk.new_empty((p, *chunk.shape))
    buf[0] = chunk
    held = 1
    while held < n:
        ops = [dist.P2POp(dist.isend, buf[:held], (r - held) % n),
               dist.P2POp(dist.irecv, buf[held:2 * held], (r + held) % n)]
        for work in comm.batch_isend_irecv(ops):
            work.wait()
        held *= 2
    out = chunk.new_empty((n * chunk.shape[0], *chunk.shape[1:]))
    out.view(n, *chunk.shape)[(torch.arange(n) + r) % n] = buf[:n]
    return out
