"""Wrong: launches every bucket from the end-of-backward callback: the right gradients, no overlap.

Each all-reduce waits for the whole backward, which is what buckets were meant to avoid.
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
        state["works"] = [comm.all_reduce(flat, group=group, async_op=True) for flat in flats]
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
        state["ready"][bucket_of[id(p)]] += 1

    return [p.register_post_accumulate_grad_hook(on_grad) for p in params]
