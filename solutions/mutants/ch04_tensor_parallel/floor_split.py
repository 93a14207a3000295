"""Wrong: gives every rank f // t units, Megatron's split, and drops the remainder.

Right whenever t divides f, which is all Megatron allows; on an uneven width the last f % t hidden
units belong to nobody and the output misses their part.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from minitorch_dist.runtime import comm


class UnevenMLP(nn.Module):

    class f(torch.autograd.Function):
        """Megatron's f: identity forward, all-reduce of the gradient backward."""

        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return x.view_as(x)  # a view, not x itself: autograd records this Function as its creator

        @staticmethod
        def backward(ctx, grad):
            grad = grad.contiguous().clone()
            comm.all_reduce(grad, group=ctx.group)
            return grad, None

    class g(torch.autograd.Function):
        """Megatron's g: all-reduce forward, identity backward."""

        @staticmethod
        def forward(ctx, y_r, group):
            y = y_r.contiguous().clone()
            comm.all_reduce(y, group=group)
            return y

        @staticmethod
        def backward(ctx, grad):
            return grad, None

    def __init__(self, mlp: nn.Module, group=None):
        super().__init__()
        _require_dist("UnevenMLP")
        for name in ("c_fc", "c_proj"):
            lin = getattr(mlp, name, None)
            if not isinstance(lin, nn.Linear) or lin.bias is None:
                raise ValueError(f"mlp.{name} must be an nn.Linear with a bias (a models.gpt.MLP), "
                                 f"got {lin!r}")
        t, r = dist.get_world_size(group), dist.get_rank(group)
        width = mlp.c_fc.out_features
        if width < t:
            raise ValueError(f"the MLP width {width} is smaller than t={t}: every rank needs at least one "
                             f"hidden unit; use t <= {width}")
        if getattr(getattr(mlp, "dropout", None), "p", 0.0):
            raise ValueError("dropout must be 0: a split region needs per-rank random streams "
                             "(see the chapter)")
        self.group = group
        units = slice(r * (width // t), (r + 1) * (width // t))
        self.w_fc = nn.Parameter(mlp.c_fc.weight.detach()[units].clone())
        self.b_fc = nn.Parameter(mlp.c_fc.bias.detach()[units].clone())
        self.w_proj = nn.Parameter(mlp.c_proj.weight.detach()[:, units].clone())
        self.b_proj = nn.Parameter(mlp.c_proj.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h_r = F.gelu(F.linear(self.f.apply(x, self.group), self.w_fc, self.b_fc), approximate="tanh")
        y = self.g.apply(F.linear(h_r, self.w_proj), self.group)
        return y + self.b_proj  # once, after the sum
