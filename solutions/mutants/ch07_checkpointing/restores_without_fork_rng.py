"""Wrong: restores the RNG state for the recomputation without forking, so the caller's stream is rewound.

The gradients are right: the recomputation draws the forward's masks. But after backward the global
generator sits where the forward's dropout left it, so every random number the caller draws next (the
next step's dropout, data shuffling) repeats numbers already used.
"""
import torch


class RNGCheckpoint(RNGCheckpoint):

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        torch.set_rng_state(ctx.cpu_state)  # no fork_rng: the caller's stream is rewound
        x_again = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x_again)
        again = (tuple(y.shape), y.dtype, y.detach().double().sum().item())
        if again != ctx.fingerprint:
            raise RuntimeError(f"the recomputation differs from the forward: {again} vs {ctx.fingerprint}")
        torch.autograd.backward(y, grad_y)
        return None, x_again.grad
