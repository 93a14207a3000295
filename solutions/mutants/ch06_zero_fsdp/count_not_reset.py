"""Wrong: counts the arrivals across backwards instead of per backward.

The first backward is right; in the second the count passes len(params) and no reduce-scatter runs:
the shard keeps the first step's gradient.
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
    if any(not p.requires_grad for p in params):
        raise ValueError("every parameter must require grad: a frozen one never fires its hook, and the "
                         "reduce-scatter would never run; leave frozen parameters out")
    if len({(p.dtype, p.device) for p in params}) != 1:
        raise ValueError("one flat gradient buffer holds one dtype on one device, got "
                         f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
    n = dist.get_world_size(group)
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(params))]
    s = math.ceil(sum(numels) / n)
    padded = n * s
    grad_shard = torch.zeros(s, dtype=params[0].dtype, device=params[0].device)
    index = {id(p): i for i, p in enumerate(params)}
    state = {"flat": None, "arrived": 0}

    def hook(p: torch.nn.Parameter) -> None:
        if state["flat"] is None:  # the first gradient of this backward
            state["flat"] = torch.zeros(padded, dtype=grad_shard.dtype, device=grad_shard.device)
        i = index[id(p)]
        state["flat"][offsets[i]:offsets[i] + numels[i]].copy_(p.grad.reshape(-1))
        p.grad = None  # ZeRO-2: the full gradient is not kept
        state["arrived"] += 1
        if state["arrived"] == len(params):  # the flat buffer is complete: one reduce-scatter
            comm.reduce_scatter(grad_shard, state["flat"].div_(n), group=group)
            state["flat"] = None

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    return grad_shard, handles
