"""Wrong: never resets the per-backward counts, so the second backward launches nothing.

The first backward is right; from the second on, each bucket counts gradients it saw in an earlier
backward and never looks complete: every rank steps on its own gradient.
"""
# ruff: noqa: C901 - a worked solution with one thing wrong, read top to bottom

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
    sizes = [p.numel() * p.element_size() for p in params]
    index = {id(p): i for i, p in enumerate(params)}
    state = {}

    def build(order):  # order: parameter indices in the order their gradients are expected
        plan = assign_buckets([sizes[i] for i in reversed(order)], cap_bytes, first_cap_bytes)
        buckets = [[params[order[len(order) - 1 - j]] for j in b] for b in plan]
        flats = [torch.zeros(sum(p.numel() for p in b), dtype=b[0].dtype, device=b[0].device)
                 for b in buckets]
        views, bucket_of = {}, {}
        for j, (b, flat) in enumerate(zip(buckets, flats)):
            offset = 0
            for p in b:
                views[id(p)], bucket_of[id(p)] = flat[offset:offset + p.numel()].view_as(p), j
                offset += p.numel()
        state.update(buckets=buckets, flats=flats, views=views, bucket_of=bucket_of)

    build(list(reversed(range(len(params)))))  # first guess: reverse registration order
    state.update(ready=[0] * len(state["buckets"]), works=[], started=False, arrived=[], rebuilt=False)

    def finish():  # the autograd engine calls it once backward has produced every gradient
        for work in state["works"]:
            work.wait()
        for p in params:
            p.grad.copy_(state["views"][id(p)])
        if not state["rebuilt"]:  # once: rank 0's arrival order, the same on every rank
            order = torch.tensor(state["arrived"], dtype=torch.int64, device=params[0].device)
            src = 0 if group is None else dist.get_global_rank(group, 0)
            comm.broadcast(order, src, group=group)
            build(order.tolist())
            state["rebuilt"] = True
        state.update(works=[], started=False, arrived=[])
        if len(state["ready"]) != len(state["buckets"]):  # only when the rebuild changed their number
            state["ready"] = [0] * len(state["buckets"])

    def on_grad(p):
        if not state["started"]:  # the first gradient of this backward
            state["started"] = True
            torch.autograd.Variable._execution_engine.queue_callback(finish)
        state["arrived"].append(index[id(p)])
        torch.div(p.grad, n, out=state["views"][id(p)])
        j = state["bucket_of"][id(p)]
        state["ready"][j] += 1
        launched = len(state["works"])  # buckets 0 .. launched-1 are on their way
        buckets = state["buckets"]
        while launched < len(buckets) and state["ready"][launched] == len(buckets[launched]):
            state["works"].append(comm.all_reduce(state["flats"][launched], group=group, async_op=True))
            launched += 1

    return [p.register_post_accumulate_grad_hook(on_grad) for p in params]
