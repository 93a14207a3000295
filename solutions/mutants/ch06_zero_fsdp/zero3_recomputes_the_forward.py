"""Wrong: saves only the input and runs the module again in the backward.

Activation checkpointing inside the unit: the gradients are right and less is saved, but every
step runs each module's forward twice — the unit was asked to reuse its saved graph.
"""
import torch

from minitorch_dist.runtime import comm


class Zero3Unit(Zero3Unit):
    def unit_forward(self, x):
        self.gather()
        self._bind([self.full[o:o + k].view(shape)
                    for o, k, shape in zip(self.offsets, self.numels, self.shapes)])
        try:
            out = self.module(x.detach())
        finally:
            self._bind(None)
        self.free()
        return out.detach(), (x.detach(), x.requires_grad)

    def unit_backward(self, saved, grad_out):
        x, needs_grad = saved
        self.gather()
        leaves = [self.full[o:o + k].view(shape).detach().requires_grad_()
                  for o, k, shape in zip(self.offsets, self.numels, self.shapes)]
        inp = x.requires_grad_(needs_grad)
        with torch.enable_grad():
            self._bind(leaves)
            try:
                out = self.module(inp)
            finally:
                self._bind(None)
        torch.autograd.backward(out, grad_out)
        send = torch.zeros(self.n, self.S, dtype=self.shard.dtype, device=self.shard.device)
        for leaf, k, c, st in zip(leaves, self.numels, self.chunks, self.starts):
            if leaf.grad is not None:
                padded = torch.zeros(self.n * c, dtype=send.dtype, device=send.device)
                padded[:k].copy_(leaf.grad.reshape(-1))
                send[:, st:st + c].copy_(padded.view(self.n, c))
        grad_shard = torch.empty_like(self.shard)
        comm.reduce_scatter(grad_shard, send.view(-1).div_(self.n), group=self.group)
        self.free()
        return grad_shard, inp.grad
