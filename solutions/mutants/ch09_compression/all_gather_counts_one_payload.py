"""Wrong: predicts one payload for an all-gather, not n of them.

What a rank sends is one payload; what the meter counts for an all-gather is its output, every rank's
payload: the prediction is n times too small.
"""
import torch.distributed as dist

from minitorch_dist import costmodel
from minitorch_dist.communication import compressed_allreduce
from minitorch_dist.runtime import comm


def meter_compressed_step(grads, compressor) -> dict:
    if not dist.is_initialized():
        raise RuntimeError("meter_compressed_step runs inside ranks: call it from a function started "
                           "with minitorch_dist.launch(fn, n)")
    grads = list(grads)
    method, params = _method_of(compressor)
    n = dist.get_world_size()
    if method == "powersgd" and compressor.iter < compressor.start_iter:
        predicted = {"all_reduce": sum(4 * g.numel() for g in grads)}
    else:
        payload = sum(costmodel.compressed_payload_bytes(method, tuple(g.shape), **params) for g in grads)
        if method in costmodel.SUMMABLE:
            predicted = {"all_reduce": payload}
        else:
            predicted = {"all_gather": payload}
    with comm.meter() as m:
        compressed_allreduce(grads, compressor)
    measured = {op: int(s["bytes"]) for op, s in m.summary().items()}
    return {"predicted": {op: int(b) for op, b in predicted.items()}, "measured": measured}
