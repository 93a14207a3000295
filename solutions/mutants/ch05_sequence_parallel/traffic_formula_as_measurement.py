"""Wrong: reports the cost model's numbers as the measurement, without running either layer.

Prediction and "measurement" agree to the byte, and both agree with the meter's count of a real run
— because the formulas are right; nothing was measured.
"""
import torch
import torch.distributed as dist

from minitorch_dist import costmodel


def context_parallel_traffic(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None) -> dict:

    b, heads, s_r, d = q.shape
    t = dist.get_world_size(group)
    seq, hidden, e = s_r * t, heads * d, q.element_size()
    predicted = {"ulysses": costmodel.ulysses_bytes_per_layer(b, seq, hidden, t, e),
                 "ring": costmodel.ring_attention_bytes_per_layer(b, seq, hidden, t, e)["total"]}
    return {name: {"predicted": predicted[name], "measured": predicted[name]} for name in predicted}
