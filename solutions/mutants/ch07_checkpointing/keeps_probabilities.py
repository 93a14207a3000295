"""Wrong: saves the probabilities P for backward instead of recomputing them.

The gradients are exactly right and backward is cheaper, which is why it is tempting; but P is the
s x s tensor per head that selective recomputation exists to drop (Korthikanti's 5as/h term).
"""
import math


class SelectiveAttention(SelectiveAttention):

    @staticmethod
    def forward(ctx, q, k, v, causal, window):
        p = SelectiveAttention.probs(q, k, causal, window)
        ctx.save_for_backward(q, k, v, p)
        return p @ v

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, p = ctx.saved_tensors
        scale = 1.0 / math.sqrt(q.shape[-1])
        dv = p.transpose(-2, -1) @ grad_out
        dp = grad_out @ v.transpose(-2, -1)
        ds = p * (dp - (dp * p).sum(dim=-1, keepdim=True))
        return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, dv, None, None
