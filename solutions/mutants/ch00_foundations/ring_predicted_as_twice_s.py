"""Wrong: predicts that the ring sends 2S per rank, forgetting that each step moves S/n.

"A reduce-scatter and an all-gather, each moving the buffer once" gives 2S. But each of the
2(n-1) steps sends one chunk of S/n bytes, so a rank sends 2(n-1)/n * S: 1.5 S on 4 ranks. The
measurement is right; the prediction is a third too high.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import collectives, comm


def predict_and_meter_allreduce_bytes(x: torch.Tensor) -> dict:
    n = dist.get_world_size()
    S = x.numel() * x.element_size()
    predicted = {"ring": 2 * S, "recursive_doubling": (n.bit_length() - 1) * S}
    out = {}
    for name, algorithm in (("ring", collectives.ring_all_reduce),
                            ("recursive_doubling", collectives.recursive_doubling_all_reduce)):
        with comm.meter() as m:
            algorithm(x.clone())
        out[name] = {"predicted": predicted[name], "measured": m.wire_bytes["send"]}
    return out
