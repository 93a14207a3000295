"""Wrong: shifts by the largest lse even when it is -inf.

Right whenever a row saw a key somewhere; a row empty in every block computes -inf - (-inf) = NaN,
and so does every later merge of that result.
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
    w = torch.exp(lse_k - m)
    total = w.sum(dim=0)
    out = 0
    for w_i, o in zip(w, outs):
        out = out + w_i[..., None] * torch.where((w_i > 0)[..., None], o, torch.zeros_like(o))
    return (out / total[..., None]).to(outs[0].dtype), m + torch.log(total)
