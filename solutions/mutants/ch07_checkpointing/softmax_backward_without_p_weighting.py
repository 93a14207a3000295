"""Wrong: back-propagates through the softmax with dS = P ∘ (dP − rowsum(dP)), not rowsum(dP ∘ P).

The softmax's Jacobian is diag(p) − p pᵀ; dropping the p inside the row sum is an easy slip when
writing it from memory. The forward is exact, so only the gradients of q and k are wrong (dv is right).
"""
import math


class SelectiveAttention(SelectiveAttention):

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors
        p = SelectiveAttention.probs(q, k, ctx.causal, ctx.window)
        scale = 1.0 / math.sqrt(q.shape[-1])
        dv = p.transpose(-2, -1) @ grad_out
        dp = grad_out @ v.transpose(-2, -1)
        ds = p * (dp - dp.sum(dim=-1, keepdim=True))
        return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv, None, None
