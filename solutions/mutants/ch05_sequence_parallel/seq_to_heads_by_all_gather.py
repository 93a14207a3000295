"""Wrong: all-gathers the whole sequence and keeps this rank's heads.

The values are exactly right; but every rank receives all H heads of every position, t times the
all-to-all's traffic and memory: the point of Ulysses is lost.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def ulysses_seq_to_heads(x_r: torch.Tensor, group=None) -> torch.Tensor:
    t = dist.get_world_size(group)
    b, s_r, h, d = x_r.shape
    if h % t:
        raise ValueError(f"n_head {h} is not divisible by t={t}")
    r = dist.get_rank(group)
    full = torch.empty(t * b, s_r, h, d, dtype=x_r.dtype)
    comm.all_gather(full, x_r.contiguous(), group=group)
    full = full.view(t, b, s_r, h, d)
    heads = slice(r * h // t, (r + 1) * h // t)
    return full.permute(1, 0, 2, 3, 4).reshape(b, t * s_r, h, d)[:, :, heads].contiguous()
