"""Wrong: copies the all-gathered buffer into the weights as if it held them end to end.

With one flat buffer cut end to end (ZeRO-3, FSDP1, the library) the all-gather's output *is* the
weights; with per-parameter shards it holds rank 0's piece of every parameter, then rank 1's: every
weight is read from the wrong place (and the padding read as weights).
"""
import torch

from minitorch_dist.runtime import comm


class Zero3Unit(Zero3Unit):
    def gather(self):
        self.full.untyped_storage().resize_(self.total * self.full.element_size())
        received = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        comm.all_gather(received, self.shard.detach(), group=self.group)
        self.gather_into.copy_(received[:self.total])
