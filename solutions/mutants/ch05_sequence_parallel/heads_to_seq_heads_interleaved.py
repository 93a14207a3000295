"""Wrong: lays the received heads out head-major, rank-minor: head i of rank j lands at i*t + j.

With one head per rank it is the same thing; with two or more, rank j's heads must stay together at
j*H/t .. (j+1)*H/t - 1.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def ulysses_heads_to_seq(y_r: torch.Tensor, group=None) -> torch.Tensor:
    t = dist.get_world_size(group)
    b, s, h_r, d = y_r.shape
    if s % t:
        raise ValueError(f"sequence length {s} is not divisible by t={t}")
    inp = y_r.reshape(b, t, s // t, h_r, d).transpose(0, 1).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    return out.permute(1, 2, 3, 0, 4).reshape(b, s // t, t * h_r, d)
