"""Wrong: predicts one pull per clock, forgetting the last pull of the final parameters.

clocks pushes, but clocks + 1 pulls: the answer to the last one is sent too.
"""

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def predict_and_meter_ps_traffic(problem, bounds, clocks: int, lr: float) -> dict:

    n_servers = _check_ps_arguments(problem, bounds, 0, clocks, lr)
    bounds = [tuple(b) for b in bounds]
    rank, n_workers = dist.get_rank(), problem.n_workers
    pulls = clocks
    if rank < n_servers:
        lo, hi = bounds[rank]
        slice_bytes = (hi - lo) * 4
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
