"""Wrong: reports the prediction as the measurement, without running the server.

The "measured" bytes always agree with the prediction, but nothing ran.
"""

import torch.distributed as dist


def predict_and_meter_ps_traffic(problem, bounds, clocks: int, lr: float) -> dict:

    n_servers = _check_ps_arguments(problem, bounds, 0, clocks, lr)
    bounds = [tuple(b) for b in bounds]
    rank, n_workers = dist.get_rank(), problem.n_workers
    pulls = clocks + 1  # the last pull reads the final parameters
    if rank < n_servers:
        lo, hi = bounds[rank]
        slice_bytes = (hi - lo) * 4
        predicted = {"sent": n_workers * pulls * slice_bytes, "received": n_workers * clocks * slice_bytes}
    else:
        psi = problem.n_params * 4
        predicted = {"sent": clocks * psi, "received": pulls * psi}
    measured = dict(predicted)
    return {"predicted": predicted, "measured": measured}
