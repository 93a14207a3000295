"""Wrong: all-reduces ``x`` itself rather than a clone.

The all-reduces sum in place. Running them on ``x`` gives the right byte counts — bytes do not
depend on values — but it leaves the caller's tensor summed twice over (once by each algorithm):
a measurement that changes what it measures.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import collectives, comm


def predict_and_meter_allreduce_bytes(x: torch.Tensor) -> dict:
    n = dist.get_world_size()
    S = x.numel() * x.element_size()
    predicted = {"ring": 2 * (n - 1) / n * S, "recursive_doubling": (n.bit_length() - 1) * S}
    out = {}
    for name, algorithm in (("ring", collectives.ring_all_reduce),
                            ("recursive_doubling", collectives.recursive_doubling_all_reduce)):
        with comm.meter() as m:
            algorithm(x)
        out[name] = {"predicted": predicted[name], "measured": m.wire_bytes["send"]}
    return out
