"""Wrong: returns the dK, dV accumulators in hand after the last step, without the hop home.

After t - 1 hops each rank holds the accumulators of its successor's block, complete, but not its
own: every rank returns another rank's gradient (and sends 2 fewer messages).
"""
import torch
import torch.distributed as dist


def _visible(n, j, r, device):
    return torch.ones(n, n, dtype=torch.bool, device=device).tril(0 if j <= r else -1)


class StripedRingAttn(StripedRingAttn):
    @staticmethod
    def forward(ctx, q, k, v, causal, group):
        t, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        n = q.shape[-2]
        out = lse = None
        k_j, v_j = k, v
        for i in range(t):
            if i > 0:
                k_j, v_j = _pass_to_next([k_j, v_j], group)
            j = (r - i) % t
            scores = q @ k_j.transpose(-1, -2) * scale
            if causal:
                scores = scores.masked_fill(~_visible(n, j, r, q.device), float("-inf"))
            lse_j = torch.logsumexp(scores, dim=-1)
            seen = torch.isfinite(lse_j)[..., None]
            out_j = torch.where(seen, torch.exp(scores - lse_j[..., None]).nan_to_num(0.0) @ v_j, 0.0)
            if out is None:
                out, lse = out_j, lse_j
            else:
                new = torch.logaddexp(lse, lse_j)
                out = torch.exp(lse - new)[..., None] * out + torch.exp(lse_j - new)[..., None] * out_j
                lse = new
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.group = causal, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, group = ctx.causal, ctx.group
        t, r = dist.get_world_size(group), dist.get_rank(group)
        scale = q.shape[-1] ** -0.5
        n = q.shape[-2]
        delta = (dout * out).sum(-1, keepdim=True)
        dq = torch.zeros_like(q)
        k_j, v_j = k, v
        dk_j, dv_j = torch.zeros_like(k), torch.zeros_like(v)
        for i in range(t):
            if i > 0:
                k_j, v_j = _pass_to_next([k_j, v_j], group)
                dk_j, dv_j = _pass_to_next([dk_j, dv_j], group)
            j = (r - i) % t
            scores = q @ k_j.transpose(-1, -2) * scale
            if causal:
                scores = scores.masked_fill(~_visible(n, j, r, q.device), float("-inf"))
            p = torch.exp(scores - lse[..., None])
            dv_j = dv_j + p.transpose(-1, -2) @ dout
            ds = p * (dout @ v_j.transpose(-1, -2) - delta)
            dq = dq + ds @ k_j * scale
            dk_j = dk_j + ds.transpose(-1, -2) @ q * scale
        dk, dv = dk_j, dv_j  # the block in hand after t - 1 hops
        return dq, dk, dv, None, None
