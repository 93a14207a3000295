"""Wrong: meters the forward and runs the backward outside the meter.

The layers really run; but the meter sees K and V go round (or the four forward all-to-alls) and
none of the backward's traffic, half of Ulysses' bytes and a third of the ring's.
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
    predicted = {"ulysses": costmodel.ulysses_bytes_per_layer(b, seq, hidden, t, e),
                 "ring": costmodel.ring_attention_bytes_per_layer(b, seq, hidden, t, e)["total"]}
    out = {}
    for name, fn in (("ulysses", ulysses_attention), ("ring", ring_attention)):
        q_, k_, v_ = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
        with comm.meter() as m:
            y = fn(q_, k_, v_, group=group)
        y.sum().backward()
        out[name] = {"predicted": predicted[name], "measured": m.total_wire_bytes}
    return out
