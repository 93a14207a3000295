"""Wrong: reduce-scatters the gradients without dividing by the number of ranks: a shard of their sum.

Right on one rank only; on n ranks every element of the shard is n times too large.
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
    starts = [sum(chunks[:i]) for i in range(len(params))]
    index = {id(p): i for i, p in enumerate(params)}
    state = {"send": None, "arrived": 0}

    def hook(p):
        if state["send"] is None:
            state["send"] = torch.zeros(n, s, dtype=grad_shard.dtype, device=grad_shard.device)
        i = index[id(p)]
        c = chunks[i]
        padded = torch.zeros(n * c, dtype=p.grad.dtype)
        padded[:p.numel()].copy_(p.grad.reshape(-1))
        state["send"][:, starts[i]:starts[i] + c].copy_(padded.view(n, c))
        p.grad = None
        state["arrived"] += 1
        if state["arrived"] == len(params):
            comm.reduce_scatter(grad_shard, state["send"].view(-1), group=group)  # no 1/n
            state["send"], state["arrived"] = None, 0

    return grad_shard, [p.register_post_accumulate_grad_hook(hook) for p in params]
