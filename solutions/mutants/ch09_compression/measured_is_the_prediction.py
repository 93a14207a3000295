"""Wrong: reports the prediction as the measurement and never runs the reduction.

The prediction is exact, so the numbers match; but nothing was measured, and the gradients were never
averaged over the ranks.
"""
import torch.distributed as dist

from minitorch_dist import costmodel


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
            predicted = {"all_gather": n * payload}
    measured = dict(predicted)
    return {"predicted": {op: int(b) for op, b in predicted.items()}, "measured": measured}
