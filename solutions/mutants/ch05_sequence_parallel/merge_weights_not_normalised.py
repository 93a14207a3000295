"""Wrong: adds the blocks weighted by exp(lse_i - max) without dividing by their sum.

Right when one block dominates (its weight is 1, the others near 0) and for a single block; otherwise
the output is too large by the sum of the weights.
"""
import torch


def merge_partial_attention(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = list(outs), list(lses)
    if not outs or len(outs) != len(lses):
        raise ValueError(f"need one lse per partial output and at least one of each, got {len(outs)} outs "
                         f"and {len(lses)} lses")
    for i, lse in enumerate(lses):
        if lse.shape != outs[0].shape[:-1]:
            raise ValueError(f"lses[{i}] has shape {tuple(lse.shape)}; expected {tuple(outs[0].shape[:-1])}")
    lse_k = torch.stack(lses)
    m = lse_k.max(dim=0).values
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lse_k - m)
    out = 0
    for w_i, o in zip(w, outs):
        out = out + w_i[..., None] * torch.where((w_i > 0)[..., None], o, torch.zeros_like(o))
    return out.to(outs[0].dtype), m + torch.log(w.sum(dim=0))
