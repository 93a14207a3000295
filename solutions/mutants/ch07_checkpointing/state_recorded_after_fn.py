"""Wrong: records the RNG state after running fn in the forward, not before.

It reads naturally ("run fn, then remember what is needed for backward"), and it is right for an fn
without randomness. With dropout the recomputation starts from the state after the forward's draws, so
it draws other masks: the recomputation differs and the gradients would be wrong.
"""
import torch


class RNGCheckpoint(RNGCheckpoint):

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.save_for_backward(x)
        y = fn(x)
        ctx.cpu_state = torch.get_rng_state()  # after fn has drawn its masks
        ctx.cuda_state = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.fingerprint = (tuple(y.shape), y.dtype, y.double().sum().item())
        return y
