"""Wrong: under SSP moves x by lr / W for every push, however stale (the library's rule).

Plain asynchronous SGD's step, and what the library's server does: it converges here too. But a
gradient computed from parameters two clocks old counts as much as a fresh one.
"""
import time

import torch
import torch.distributed as dist


def ssp_parameter_server(  # noqa: C901 - a server and a worker, one worked solution read top to bottom
        problem, bounds, staleness, clocks: int, lr: float, straggler=None) -> dict:

    n_servers = _check_ps_arguments(problem, bounds, staleness, clocks, lr)
    straggler = dict(straggler or {})
    rank, n_workers = dist.get_rank(), problem.n_workers
    if rank < n_servers:  # --- a server
        lo, hi = bounds[rank]
        x, grad = torch.zeros(hi - lo), torch.empty(hi - lo)
        pushed, pending, in_flight = [0] * n_workers, [], []
        total, arrived, finished = torch.zeros(hi - lo), 0, 0
        staleness_log, events = [], []
        while finished < n_workers:
            src, op, w, c, read_clock = recv_request(grad)
            if op == PUSH:
                pushed[w] += 1
                staleness_log.append(c - read_clock)
                events.append(("push", w, c))
                if staleness == 0:  # BSP: the mean of the clock's W gradients, all at once
                    total += grad
                    arrived += 1
                    if arrived == n_workers:
                        x -= lr * (total / n_workers)
                        total.zero_()
                        arrived = 0
                else:
                    x -= (lr / n_workers) * grad
            elif op == PULL:
                pending.append((src, w, c))
            else:
                finished += 1
            server_clock, waiting = min(pushed), []
            for src_, w_, c_ in pending:
                if c_ - server_clock <= staleness:
                    events.append(("reply", w_, c_))
                    in_flight += reply(src_, server_clock, x)
                else:
                    waiting.append((src_, w_, c_))
            pending = waiting
        for h in in_flight:
            h.wait()
        return {"params": x, "staleness": staleness_log, "events": events}
    w, losses = rank - n_servers, []  # --- a worker
    for c in range(clocks + 1):
        x, reads = pull(bounds, w, c)
        losses.append(problem.loss(x))
        if c == clocks:
            break
        g = problem.grad(x, problem.batch_rows(w, c))
        time.sleep(straggler.get(w, 0))
        for k, (lo, hi) in enumerate(bounds):
            send_request(k, PUSH, w, c, reads[k])
            send_gradient(k, g[lo:hi])
    for k in range(n_servers):
        send_request(k, DONE, w, clocks)
    return {"loss": losses}
