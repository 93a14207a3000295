"""Wrong: weights each block by exp(lse_i) / sum_j exp(lse_j) as written, without subtracting the max.

Exact on paper and on the small scores of most tests; with scores in the hundreds exp(lse) is inf in
float32 and the result inf / inf = NaN.
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
    w = torch.stack([torch.exp(x) for x in lses])
    total = w.sum(0)
    out = sum(w_i[..., None] * torch.nan_to_num(o, nan=0.0) for w_i, o in zip(w, outs)) / total[..., None]
    return out.to(outs[0].dtype), torch.log(total)
