"""Wrong: reshapes the input straight to (t, B, S/t, H/t, d) instead of moving the head groups first.

The shapes line up and one all-to-all runs; but a reshape keeps the memory order, so piece j is a
slab of batch rows and positions, not this rank's positions of j's heads.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def ulysses_seq_to_heads(x_r: torch.Tensor, group=None) -> torch.Tensor:
    t = dist.get_world_size(group)
    b, s_r, h, d = x_r.shape
    if h % t:
        raise ValueError(f"n_head {h} is not divisible by t={t}")
    inp = x_r.reshape(t, b, s_r, h // t, d).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    return out.permute(1, 0, 2, 3, 4).reshape(b, t * s_r, h // t, d)
