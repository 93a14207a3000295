"""Wrong: reduce-scatters the unit's gradient without dividing by n.

Every rank's loss is the mean over its own rows; summed over n ranks the shard's gradient is n times
the global batch's. One rank is right; n ranks take n-fold steps.
"""
import torch

from minitorch_dist.runtime import comm


class Zero3Unit(Zero3Unit):
    def unit_backward(self, saved, grad_out):
        leaves, inp, out = saved
        self.gather()
        torch.autograd.backward(out, grad_out)
        send = torch.zeros(self.n, self.S, dtype=self.shard.dtype, device=self.shard.device)
        for leaf, k, c, st in zip(leaves, self.numels, self.chunks, self.starts):
            if leaf.grad is not None:
                padded = torch.zeros(self.n * c, dtype=send.dtype, device=send.device)
                padded[:k].copy_(leaf.grad.reshape(-1))
                send[:, st:st + c].copy_(padded.view(self.n, c))
        grad_shard = torch.empty_like(self.shard)
        comm.reduce_scatter(grad_shard, send.view(-1), group=self.group)  # no 1/n
        self.free()
        return grad_shard, inp.grad
