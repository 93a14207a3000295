"""Wrong: sends the padded gradients one after the other (parameter-major), not rank by rank.

Every gradient is padded and chunked correctly, but the reduce-scatter cuts its input into n
consecutive blocks of S: rank r must find *its* chunk of every parameter in block r. Laid out
parameter after parameter, block r holds pieces of whichever parameters happen to fall there.
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
    starts = [sum(n * c for c in chunks[:i]) for i in range(len(params))]
    index = {id(p): i for i, p in enumerate(params)}
    state = {"send": None, "arrived": 0}

    def hook(p):
        if state["send"] is None:
            state["send"] = torch.zeros(n * s, dtype=grad_shard.dtype, device=grad_shard.device)
        i = index[id(p)]
        state["send"][starts[i]:starts[i] + p.numel()].copy_(p.grad.reshape(-1))  # padded to n * c_i
        p.grad = None
        state["arrived"] += 1
        if state["arrived"] == len(params):
            comm.reduce_scatter(grad_shard, state["send"].div_(n), group=group)
            state["send"], state["arrived"] = None, 0

    return grad_shard, [p.register_post_accumulate_grad_hook(hook) for p in params]
