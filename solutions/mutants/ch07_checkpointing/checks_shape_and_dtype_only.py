"""Wrong: checks only the recomputed output's shape and dtype, as torch's determinism_check does.

Cheap and plausible, and it never raises by mistake. But a recomputation that computes other values
(the module switched to eval, a weight changed in place, a flag flipped) passes the check, and the
gradients come from a function the forward never ran.
"""
import torch


class RNGCheckpoint(RNGCheckpoint):

    @staticmethod
    def forward(ctx, fn, x):
        ctx.fn = fn
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state(x.device) if x.is_cuda else None
        ctx.save_for_backward(x)
        y = fn(x)
        ctx.fingerprint = (tuple(y.shape), y.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        (x,) = ctx.saved_tensors
        with torch.random.fork_rng(devices=[x.device] if x.is_cuda else []):
            torch.set_rng_state(ctx.cpu_state)
            if ctx.cuda_state is not None:
                torch.cuda.set_rng_state(ctx.cuda_state, x.device)
            x_again = x.detach().requires_grad_()
            with torch.enable_grad():
                y = ctx.fn(x_again)
        if (tuple(y.shape), y.dtype) != ctx.fingerprint:
            raise RuntimeError("the recomputation differs from the forward in shape or dtype")
        torch.autograd.backward(y, grad_y)
        return None, x_again.grad
