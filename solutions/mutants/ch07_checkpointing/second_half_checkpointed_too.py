"""Wrong: checkpoints both halves at every level, the second half too.

Symmetric and tidy; the gradients are right. But the second half's backward starts as soon as its
forward ends, so dropping and recomputing it buys no memory and costs a forward of it at every level:
the blocks run more often than Chen's recursion runs them.
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
        return checkpoint(functools.partial(self.run, blocks[half:]), h)
