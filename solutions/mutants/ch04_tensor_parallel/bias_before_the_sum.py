"""Wrong: adds the bias to the partial product, before the reduce-scatter.

Y = X W + b reads as one expression; but every rank then adds b to its partial sum, and the sum
counts the bias t times.
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
        y = (x_r @ w_r + (bias if bias is not None else 0)).contiguous()
        out = y.new_empty((y.shape[0] // t, *y.shape[1:]))
        comm.reduce_scatter(out, y, group=group)  # summed, and only this rank's positions kept
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
