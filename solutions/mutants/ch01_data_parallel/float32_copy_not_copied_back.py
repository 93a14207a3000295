"""Wrong: all-reduces a float32 copy of a 16-bit gradient and forgets to write it back.

The float64 and float32 models are right, since their gradients are reduced in place; a bfloat16
gradient stays the rank's own.
"""
# ruff: noqa: B007 - a worked solution with one thing wrong, read top to bottom

import torch
import torch.distributed as dist
from torch import nn

from minitorch_dist.runtime import comm


def install_gradient_averaging_hooks(model: nn.Module, group=None) -> list:

    if not dist.is_initialized():
        raise RuntimeError("install_gradient_averaging_hooks runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    n = dist.get_world_size(group)
    pending = []  # (param, reduced buffer, work) launched in this backward and not yet waited for

    def wait_all():  # runs once the autograd engine has finished this backward
        for param, buf, work in pending:
            work.wait()
            pass
        pending.clear()

    def average(param):
        if not pending:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(wait_all)
        if param.grad.element_size() < 4:
            buf = param.grad.float().div_(n)  # a float32 copy: dividing by n there loses nothing more
        else:
            buf = param.grad.div_(n)
        pending.append((param, buf, comm.all_reduce(buf, group=group, async_op=True)))

    return [p.register_post_accumulate_grad_hook(average) for p in model.parameters() if p.requires_grad]
