"""Wrong: keeps the gathered weights from the forward until the backward has used them.

It saves the second all-gather's latency, and the numbers are all right; but every unit's whole
weights now sit in memory between its forward and its backward, which is ZeRO-2's memory, not
ZeRO-3's (FSDP's reshard_after_forward=False, without saying so).
"""
import torch


class Zero3Unit(Zero3Unit):
    def unit_forward(self, x):
        self.gather()
        leaves = [self.full[o:o + k].view(shape).detach().requires_grad_()
                  for o, k, shape in zip(self.offsets, self.numels, self.shapes)]
        inp = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            self._bind(leaves)
            try:
                out = self.module(inp)
            finally:
                self._bind(None)
        return out.detach(), (leaves, inp, out)  # not freed: the backward frees
