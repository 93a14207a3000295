"""Wrong: cuts one flat buffer end to end, as ZeRO-1/2 and the library do, not each parameter.

The natural copy of the library's stage 2: gradients end to end, padded to n·S, rank r keeps
elements [r·S, (r+1)·S). The sizes even match at n = 2; but a rank's shard then holds whole
tensors and none of others, not its chunk of every parameter.
"""
import math

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def zero2_reduce_scatter_hook(params: list[torch.nn.Parameter], group=None) -> tuple[torch.Tensor, list]:
    _require_dist("zero2_reduce_scatter_hook")
    params = list(params)
    if not params:
        raise ValueError("zero2_reduce_scatter_hook needs at least one parameter")
    n = dist.get_world_size(group)
    chunks = [math.ceil(p.numel() / n) for p in params]
    s = sum(chunks)
    grad_shard = torch.zeros(s, dtype=params[0].dtype, device=params[0].device)
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    index = {id(p): i for i, p in enumerate(params)}
    state = {"flat": None, "arrived": 0}

    def hook(p):
        if state["flat"] is None:
            state["flat"] = torch.zeros(n * s, dtype=grad_shard.dtype, device=grad_shard.device)
        i = index[id(p)]
        state["flat"][offsets[i]:offsets[i] + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        state["arrived"] += 1
        if state["arrived"] == len(params):
            comm.reduce_scatter(grad_shard, state["flat"].div_(n), group=group)
            state["flat"], state["arrived"] = None, 0

    return grad_shard, [p.register_post_accumulate_grad_hook(hook) for p in params]
