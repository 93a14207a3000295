"""Wrong: reduce-scatters when the first-registered parameter's gradient arrives, taking it to come last.

True of Sequential(Linear, Tanh, Linear); on a model whose first-registered submodule is used last (a
head registered before the body), the buffer is still mostly zeros when it goes out.
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
        if i == 0:  # "backward runs in reverse registration order, so parameter 0 is last"
            comm.reduce_scatter(grad_shard, state["send"].view(-1).div_(n), group=group)
            state["send"] = None

    return grad_shard, [p.register_post_accumulate_grad_hook(hook) for p in params]
