"""Wrong: launches a bucket the moment it is complete, not in bucket order.

Where the gradients arrive in another order on another rank (branches run in a rank-dependent
order), the ranks all-reduce different buckets together: each rank ends with a wrong gradient, and
no error.
"""
import torch
import torch.distributed as dist
from torch import nn

from minitorch_dist.runtime import comm


def install_bucketed_gradient_hooks(model: nn.Module, cap_bytes: int, first_cap_bytes: int | None = None,
                                    group=None) -> list:
    if not dist.is_initialized():
        raise RuntimeError("install_bucketed_gradient_hooks runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"{type(model).__name__} has no parameters with requires_grad=True: no gradients "
                         "to average")
    if len({(p.dtype, p.device) for p in params}) > 1:
        raise ValueError("all parameters must share one dtype and device (one flat buffer per bucket)")
    n = dist.get_world_size(group)
    plan = assign_buckets([p.numel() * p.element_size() for p in params], cap_bytes, first_cap_bytes)
    buckets = [[params[i] for i in b] for b in plan]
    flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device) for b in buckets]
    views, bucket_of = {}, {}
    for j, (b, flat) in enumerate(zip(buckets, flats)):
        offset = 0
        for p in b:
            views[id(p)], bucket_of[id(p)] = flat[offset:offset + p.numel()].view_as(p), j
            offset += p.numel()
    state = {"ready": [0] * len(buckets), "works": [], "started": False}

    def finish():  # the autograd engine calls it once backward has produced every gradient
        for work in state["works"]:
            work.wait()
        for p in params:
            p.grad.copy_(views[id(p)])
        state.update(ready=[0] * len(buckets), works=[], started=False)

    def on_grad(p):
        if not state["started"]:  # the first gradient of this backward
            state["started"] = True
            torch.autograd.Variable._execution_engine.queue_callback(finish)
        torch.div(p.grad, n, out=views[id(p)])
        j = bucket_of[id(p)]
        state["ready"][j] += 1
        if state["ready"][j] == len(buckets[j]):  # complete: on its way at once
            state["works"].append(comm.all_reduce(flats[j], group=group, async_op=True))

    return [p.register_post_accumulate_grad_hook(on_grad) for p in params]
