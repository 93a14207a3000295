"""Wrong: checkpoints the first ⌊n/2⌋ blocks and recurses on the last ⌈n/2⌉.

For a power of two the halves are equal and nothing changes. For an odd run the longer half is the
recursed one: the peak becomes b + M(⌈n/2⌉) instead of max(b + M(⌊n/2⌋), M(⌈n/2⌉)), and every block's
number of runs moves (n = 3: [2, 2, 1] instead of [3, 2, 1]).
"""
import functools

import torch


class RecursiveRecompute(RecursiveRecompute):

    def run(self, blocks, h):
        n = len(blocks)
        if n <= 1 or not torch.is_grad_enabled():
            return _run_blocks(blocks, h)
        half = n // 2
        h = checkpoint(functools.partial(self.run, blocks[:half]), h)
        return self.run(blocks[half:], h)
