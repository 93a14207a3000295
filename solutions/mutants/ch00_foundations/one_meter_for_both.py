"""Wrong: meters both all-reduces under one meter and reads it after each.

One ``comm.meter()`` around the two runs looks tidier, and the ring's count, read first, is right.
But the meter keeps counting: the count read after recursive doubling includes the ring's bytes
too, so recursive doubling seems to send 2S + 2(n-1)/n * S.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import collectives, comm


def predict_and_meter_allreduce_bytes(x: torch.Tensor) -> dict:
    n = dist.get_world_size()
    S = x.numel() * x.element_size()
    predicted = {"ring": 2 * (n - 1) / n * S, "recursive_doubling": (n.bit_length() - 1) * S}
    out = {}
    with comm.meter() as m:
        for name, algorithm in (("ring", collectives.ring_all_reduce),
                                ("recursive_doubling", collectives.recursive_doubling_all_reduce)):
            algorithm(x.clone())
            out[name] = {"predicted": predicted[name], "measured": m.wire_bytes["send"]}
    return out
