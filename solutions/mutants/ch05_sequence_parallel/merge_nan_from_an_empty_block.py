"""Wrong: gives an empty block weight 0 but multiplies its NaN rows anyway.

exp(-inf - m) = 0 is the right weight, and every block with keys is merged exactly; but 0 * NaN is
NaN, so a causal block wholly in the future of a query poisons that query's row.
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
    total = w.sum(dim=0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = sum(w_i[..., None] * o for w_i, o in zip(w, outs))
    return (out / safe[..., None]).to(outs[0].dtype), m + torch.log(total)
