"""Wrong: predicts with the cost model's default element size (2 bytes) instead of the tensors' own.

The formulas are the right ones, and for bf16 activations the numbers would be too; these tensors
are float32, so both predictions are half the bytes that go on the wire.
"""
import torch
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.runtime import comm


def context_parallel_traffic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> dict:
    from minitorch_dist.parallelism.sequence_parallel.ring_attention import ring_attention
    from minitorch_dist.parallelism.sequence_parallel.ulysses import ulysses_attention

    b, heads, s_r, d = q.shape
    t = dist.get_world_size(group)
    seq, hidden, e = s_r * t, heads * d, q.element_size()
    predicted = {"ulysses": costmodel.ulysses_bytes_per_layer(b, seq, hidden, t),
                 "ring": costmodel.ring_attention_bytes_per_layer(b, seq, hidden, t)["total"]}
    out = {}
    for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
        q_, k_, v_ = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        with comm.meter() as m:
            fn(q_, k_, v_, group=group).sum().backward()
        out[name] = {"predicted": predicted[name], "measured": m.total_wire_bytes}
    return out
