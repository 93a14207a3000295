"""Wrong: one level of the recursion only: checkpoints the first half, runs the second half plainly.

It is the "two segments" policy, Chen's §4.3 with k = 2, mistaken for §4.4: the second half keeps all
its activations, so the peak is b + ⌊n/2⌋·L, O(n), and only the first half's blocks are recomputed.
"""
import functools

import torch


class RecursiveRecompute(RecursiveRecompute):

    def run(self, blocks, h):
        n = len(blocks)
        if n <= 1 or not torch.is_grad_enabled():
            return _run_blocks(blocks, h)
        half = (n + 1) // 2
        h = checkpoint(functools.partial(self.run, blocks[:half]), h)
        return _run_blocks(blocks[half:], h)
