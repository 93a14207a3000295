"""Wrong: all-reduces the partial product and keeps its own positions.

The values are right, and it is what the row-parallel layer already does plus a slice; but it moves
twice a reduce-scatter's bytes and computes every position's sum on every rank, the waste sequence
parallelism removes.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


class RowScatterMatmul(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x_r, w_r, bias, group):
        ctx.save_for_backward(x_r, w_r)
        ctx.has_bias, ctx.group = bias is not None, group
        t = dist.get_world_size(group)
        y = (x_r @ w_r).contiguous()  # a partial sum of all of Y, on every rank
        comm.all_reduce(y, group=group)
        r, n = dist.get_rank(group), y.shape[0] // t
        out = y[r * n:(r + 1) * n].clone()
        if bias is not None:
            out = out + bias  # once, after the sum
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_r, w_r = ctx.saved_tensors
        t, n = dist.get_world_size(ctx.group), grad_out.shape[-1]
        grad_y = grad_out.new_empty((grad_out.shape[0] * t, *grad_out.shape[1:]))
        comm.all_gather(grad_y, grad_out.contiguous(), group=ctx.group)  # every position's dY
        grad_x = grad_y @ w_r.t()
        grad_w = x_r.reshape(-1, x_r.shape[-1]).t() @ grad_y.reshape(-1, n)
        grad_b = grad_out.reshape(-1, n).sum(0) if ctx.has_bias else None  # this rank's positions
        return grad_x, grad_w, grad_b, None
