"""Wrong: all-reduces the bias gradient so that every rank holds the full one.

The bias is replicated, so its gradient must be the full one somewhere; but that sum belongs to the
optimizer's all-reduce of replicated parameters, and here it adds a collective to every backward and
counts the bias's gradient t times once that all-reduce runs too.
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
        grad_y = grad_out.new_empty((grad_out.shape[0] * t, *grad_out.shape[1:]))
        comm.all_gather(grad_y, grad_out.contiguous(), group=ctx.group)  # every position's dY
        grad_x = grad_y @ w_r.t()
        grad_w = x_r.reshape(-1, x_r.shape[-1]).t() @ grad_y.reshape(-1, n)
        grad_b = None
        if ctx.has_bias:
            grad_b = grad_out.reshape(-1, n).sum(0).contiguous()
            comm.all_reduce(grad_b, group=ctx.group)
        return grad_x, grad_w, grad_b, None
