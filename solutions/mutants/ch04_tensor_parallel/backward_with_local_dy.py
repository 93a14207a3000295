"""Wrong: backpropagates only the dY of its own positions, without gathering the rest.

The backward of the row-parallel matmul needs no communication, so it looks like this one does not
either; but x_r and w_r contributed to every position of Y, and their gradients need every position's dY.
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
        out = y.new_empty((y.shape[0] // t, *y.shape[1:]))
        comm.reduce_scatter(out, y, group=group)  # summed, and only this rank's positions kept
        if bias is not None:
            out = out + bias  # once, after the sum
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x_r, w_r = ctx.saved_tensors
        t, n = dist.get_world_size(ctx.group), grad_out.shape[-1]
        grad_y = grad_out.repeat(t, *([1] * (grad_out.dim() - 1)))  # this rank's dY, for every run
        grad_x = grad_y @ w_r.t()
        grad_w = x_r.reshape(-1, x_r.shape[-1]).t() @ grad_y.reshape(-1, n)
        grad_b = grad_out.reshape(-1, n).sum(0) if ctx.has_bias else None  # this rank's positions
        return grad_x, grad_w, grad_b, None
