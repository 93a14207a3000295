"""Wrong: reports the prediction as the measurement, without running the step.

The "measured" numbers always agree with the prediction, but no all-reduce ran.
"""

import torch.distributed as dist
from torch import nn


def predict_and_meter_ddp_traffic(model: nn.Module, micro_batches, bucket_cap_mb: float,
                                  first_bucket_mb: float, no_sync: bool = True) -> dict:

    if not dist.is_initialized():
        raise RuntimeError("predict_and_meter_ddp_traffic runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")

    n, k = dist.get_world_size(), len(micro_batches)
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    plan = assign_buckets(sizes, int(bucket_cap_mb * 2**20), int(first_bucket_mb * 2**20))
    per_backward = [sum(sizes[i] for i in b) for b in plan]
    synced = 1 if no_sync else k  # backward passes that all-reduce
    predicted = per_backward * synced
    out = {"predicted": {"all_reduce_bytes": predicted,
                         "wire_bytes": sum(2 * (n - 1) / n * S for S in predicted)}}

    out["measured"] = dict(out["predicted"])
    return out
