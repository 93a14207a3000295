"""Wrong: reshapes what arrives to (B, S, H/t, d) without moving the rank dimension next to the positions.

Piece j holds rank j's positions; a plain reshape of (t, B, S/t, ...) puts them in place only when
B = 1.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def ulysses_seq_to_heads(x_r: torch.Tensor, group=None) -> torch.Tensor:
    t = dist.get_world_size(group)
    b, s_r, h, d = x_r.shape
    if h % t:
        raise ValueError(f"n_head {h} is not divisible by t={t}")
    inp = x_r.reshape(b, s_r, t, h // t, d).permute(2, 0, 1, 3, 4).contiguous()
    out = torch.empty_like(inp)
    comm.all_to_all(out, inp, group=group)
    return out.reshape(b, t * s_r, h // t, d)
