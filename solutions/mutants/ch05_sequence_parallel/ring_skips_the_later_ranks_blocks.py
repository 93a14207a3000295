"""Wrong: treats striped shards like contiguous ones: skips the blocks of later ranks, masks its own.

The contiguous ring's rule (earlier ranks' blocks whole, the own block lower-triangular, later
ranks' blocks wholly in the future) — but under striping every block holds keys before and after
every query, so the skipped blocks carry attention that is lost and the earlier ones are over-seen.
"""
import torch
import torch.distributed as dist


def _visible(n, j, r, device):
    full = torch.ones(n, n, dtype=torch.bool, device=device)
    return full if j < r else full.tril()


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
            if causal and j > r:
                continue
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
            if causal and j > r:
                continue
            scores = q @ k_j.transpose(-1, -2) * scale
            if causal:
                scores = scores.masked_fill(~_visible(n, j, r, q.device), float("-inf"))
            p = torch.exp(scores - lse[..., None])
            dv_j = dv_j + p.transpose(-1, -2) @ dout
            ds = p * (dout @ v_j.transpose(-1, -2) - delta)
            dq = dq + ds @ k_j * scale
            dk_j = dk_j + ds.transpose(-1, -2) @ q * scale
        dk, dv = _pass_to_next([dk_j, dv_j], group)
        return dq, dk, dv, None, None
