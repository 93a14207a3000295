"""Chapter 04 — the vocabulary-parallel ends of a tensor-parallel language model: embedding and
loss, split over the vocabulary so that neither the V x h table nor the b·s·V logits is ever whole.

Shoeybi et al. 2019, "Megatron-LM", §3 (last paragraphs: the input embedding E = [E_1, E_2]
split along the vocabulary with an all-reduce (g) after it; the output layer's parallel GEMM
fused with the cross-entropy so that only b·s numbers are communicated instead of b·s·V).
Built on the g operator and the all-reduce of :mod:`.mappings`; ``TensorParallelGPT`` of
:mod:`.tensor_parallel` uses both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..models.init import record_cut
from .mappings import all_reduce_copy, divide, reduce_from_tp, size_and_rank
from .replicas import broadcast_from_first_rank

if TYPE_CHECKING:
    from typing import Self  # typing's since 3.11; annotations are never evaluated here

IGNORE_INDEX = -100  # F.cross_entropy's default: positions with this target add nothing to the loss


class VocabParallelEmbedding(nn.Module):
    """Rank r holds rows [r·V/t, (r+1)·V/t) of the table. A token outside them looks up zeros, so
    E[idx] = g(sum_r E_r[idx]): one all-reduce of b·s·h forward, nothing backward."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group: dist.ProcessGroup | None = None, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        t, r = size_and_rank(group)
        n = divide(num_embeddings, t, "vocab_size")
        self.num_embeddings, self.embedding_dim, self.group = num_embeddings, embedding_dim, group
        self.vocab_start, self.vocab_end = r * n, (r + 1) * n
        self.weight = nn.Parameter(torch.empty(n, embedding_dim, device=device, dtype=dtype))
        nn.init.normal_(self.weight, 0.0, 0.02)

    @classmethod
    def from_dense(cls, emb: nn.Embedding, group: dist.ProcessGroup | None = None, *,
                   broadcast_weights: bool = True) -> Self:
        """This rank's rows of ``emb`` (first made the group's first rank's, unless
        ``broadcast_weights=False``)."""
        w = emb.weight
        m = cls(emb.num_embeddings, emb.embedding_dim, group, device=w.device, dtype=w.dtype)
        if broadcast_weights:
            broadcast_from_first_rank(emb, group)
        record_cut(m.weight, w.shape, 0, range(m.vocab_start, m.vocab_end))  # deferred init (ch12)
        with torch.no_grad():
            m.weight.copy_(emb.weight[m.vocab_start:m.vocab_end])
        return m

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits sharded over the vocabulary (§3: the output layer's
    parallel GEMM is fused with the loss, so b·s numbers travel instead of b·s·V logits). With
    z = logits - max_v logits,

        loss = log sum_v exp(z_v) - z_target

    needs only three all-reduces of one number per token: the max (MAX), sum_v exp(z_v) and
    z_target (SUM, only the rank owning the target contributes it). The gradient is local:
    dloss/dz_v = softmax_v - [v == target].

    A position whose target is ``ignore_index`` (padding) is not a token of the loss: its loss and
    its whole gradient row are 0 (it still rides along in the all-reduces: same shapes everywhere).
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group: dist.ProcessGroup | None, ignore_index):
        n_local = logits.size(-1)
        zmax = all_reduce_copy(logits.max(dim=-1).values, group, op=dist.ReduceOp.MAX)
        z = logits - zmax.unsqueeze(-1)
        kept = target != ignore_index
        mine = (target >= vocab_start) & (target < vocab_start + n_local) & kept
        local_t = (target - vocab_start).masked_fill(~mine, 0)
        z_target = all_reduce_copy(z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1) * mine, group)
        exp = z.exp()
        sum_exp = all_reduce_copy(exp.sum(dim=-1), group)
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), mine, local_t, kept)
        return (sum_exp.log() - z_target).masked_fill(~kept, 0.0)

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, local_t, kept = ctx.saved_tensors
        g = softmax.clone()
        g.scatter_add_(-1, local_t.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        # masked after the product: an ignored row gets 0 even when grad is inf (all targets ignored)
        return (g * grad.unsqueeze(-1)).masked_fill(~kept.unsqueeze(-1), 0.0), None, None, None, None


def vocab_parallel_cross_entropy(logits_local: torch.Tensor, target: torch.Tensor,
                                 group: dist.ProcessGroup | None = None,
                                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is not ``ignore_index``, from this rank's
    vocabulary shard of the logits (..., V/t) and the full targets (...). Equals F.cross_entropy
    (mean reduction, the same ``ignore_index``) on the gathered logits, value and gradient: NaN
    when every target is ignored, as torch."""
    if target.numel() != logits_local[..., 0].numel():
        raise ValueError(f"targets of shape {tuple(target.shape)} do not match the logits "
                         f"{tuple(logits_local.shape)}: pass one target per position, shape "
                         f"{tuple(logits_local.shape[:-1])}")
    start = size_and_rank(group)[1] * logits_local.size(-1)
    target = target.reshape(-1)
    loss = _VocabParallelCrossEntropy.apply(logits_local.reshape(-1, logits_local.size(-1)), target, start,
                                            group, ignore_index)
    return loss.sum() / (target != ignore_index).sum()
