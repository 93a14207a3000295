"""Wrong: predicts a server's bytes from an even share of the keys, n_params / S.

Right when the ranges are equal, as ps_bytes_per_step assumes; with 30 and 71 keys each server
moves its own range's bytes.
"""

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def predict_and_meter_ps_traffic(problem, bounds, clocks: int, lr: float) -> dict:

    n_servers = _check_ps_arguments(problem, bounds, 0, clocks, lr)
    bounds = [tuple(b) for b in bounds]
    rank, n_workers = dist.get_rank(), problem.n_workers
    pulls = clocks + 1  # the last pull reads the final parameters
    if rank < n_servers:
        lo, hi = bounds[rank]
        slice_bytes = problem.n_params / n_servers * 4
        predicted = {"sent": n_workers * pulls * slice_bytes, "received": n_workers * clocks * slice_bytes}
    else:
        psi = problem.n_params * 4
        predicted = {"sent": clocks * psi, "received": pulls * psi}
    with comm.meter() as m:
        ssp_parameter_server(problem, bounds, 0, clocks, lr)
    values = [e for e in m.events if e.dtype == str(torch.float32)]
    measured = {"sent": sum(e.nbytes for e in values if e.op == "send"),
                "received": sum(e.nbytes for e in values if e.op == "recv")}
    return {"predicted": predicted, "measured": measured}
