"""Wrong: all-reduces the gradients without dividing by the number of ranks.

"All-reduce the gradients" read literally: the sum, n times the average, on every rank alike.
"""

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
            if buf is not param.grad:
                param.grad.copy_(buf)  # the one rounding to the gradient's dtype
        pending.clear()

    def average(param):
        if not pending:  # the first gradient of this backward
            torch.autograd.Variable._execution_engine.queue_callback(wait_all)
        if param.grad.element_size() < 4:
            buf = param.grad.float()
        else:
            buf = param.grad
        pending.append((param, buf, comm.all_reduce(buf, group=group, async_op=True)))

    return [p.register_post_accumulate_grad_hook(average) for p in model.parameters() if p.requires_grad]
