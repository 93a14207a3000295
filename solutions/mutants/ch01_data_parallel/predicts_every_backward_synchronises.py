"""Wrong: predicts k rounds of all-reduces whatever no_sync says.

Right for no_sync=False; with no_sync=True only the last backward communicates, k times less.
"""
import contextlib

import torch.distributed as dist
from torch import nn

from minitorch_dist.runtime import comm


def predict_and_meter_ddp_traffic(model: nn.Module, micro_batches, bucket_cap_mb: float,
                                  first_bucket_mb: float, no_sync: bool = True) -> dict:

    if not dist.is_initialized():
        raise RuntimeError("predict_and_meter_ddp_traffic runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    if len(micro_batches) == 0:
        raise ValueError("need at least one micro-batch")
    from minitorch_dist.parallelism.data_parallel import DistributedDataParallel

    n, k = dist.get_world_size(), len(micro_batches)
    params = [p for p in model.parameters() if p.requires_grad]
    sizes = [p.numel() * p.element_size() for p in params]
    plan = assign_buckets(sizes, int(bucket_cap_mb * 2**20), int(first_bucket_mb * 2**20))
    per_backward = [sum(sizes[i] for i in b) for b in plan]
    synced = k
    predicted = per_backward * synced
    out = {"predicted": {"all_reduce_bytes": predicted,
                         "wire_bytes": sum(2 * (n - 1) / n * S for S in predicted)}}

    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb, first_bucket_mb=first_bucket_mb)
    with comm.meter() as m:
        for i, (x, y) in enumerate(micro_batches):
            with ddp.no_sync() if no_sync and i < k - 1 else contextlib.nullcontext():
                _, loss = ddp(x, y)
                (loss / k).backward()
    reduces = [e for e in m.events if e.op == "all_reduce"]
    out["measured"] = {"all_reduce_bytes": [e.nbytes for e in reduces],
                       "wire_bytes": sum(e.wire_bytes for e in reduces)}
    return out
