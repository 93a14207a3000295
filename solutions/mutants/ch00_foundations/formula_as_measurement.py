"""Wrong: reports the prediction as the measurement.

A "measurement" computed from the same formula as the prediction always agrees with it, and on a
tensor whose size n divides it is even the right number. But nothing ran: with 1001 elements on 4
ranks the ring's chunks are 251, 250, 250, 250 elements, and what each rank really sends differs
from 2(n-1)/n * S by up to two elements — a different amount on each rank.
"""
import torch
import torch.distributed as dist


def predict_and_meter_allreduce_bytes(x: torch.Tensor) -> dict:
    n = dist.get_world_size()
    S = x.numel() * x.element_size()
    ring = 2 * (n - 1) / n * S
    rd = (n.bit_length() - 1) * S
    return {"ring": {"predicted": ring, "measured": ring},
            "recursive_doubling": {"predicted": rd, "measured": rd}}
