"""Wrong: backpropagates each microbatch's loss as it is, not loss / m.

The m microbatches' gradients then add up to m times the gradient of the batch's mean loss.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def run_stage_budgeted(stage, inputs, targets, boundary_shape, budget: int) -> list[float]:
    inputs, targets = list(inputs), list(targets)
    if not inputs or len(inputs) != len(targets):
        raise ValueError(f"need one target per input microbatch, got {len(inputs)} inputs and "
                         f"{len(targets)} targets")
    _check_positive("budget", budget, "the most microbatches a rank may hold; 1 runs one at a time")
    if not dist.is_initialized():
        raise RuntimeError("run_stage_budgeted runs on ranks: call it inside launch(fn, p)")
    m = len(inputs)
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    limit = min(p - rank, budget)
    kept, sends, losses = {}, [], []
    next_f = next_b = 0
    while next_b < m:
        if next_f < m and len(kept) < limit:
            i, next_f = next_f, next_f + 1
            if first:
                x = inputs[i]
            else:
                x = torch.empty(boundary_shape)
                comm.recv(x, rank - 1)
                x.requires_grad_(True)
            if last:
                loss = stage(x, targets[i])
                losses.append(loss.item())
                y = loss
            else:
                y = stage(x)
                out = y.detach().contiguous()
                sends.append((comm.isend(out, rank + 1), out))
            kept[i] = (x, y)
        else:
            i, next_b = next_b, next_b + 1
            x, y = kept.pop(i)
            if last:
                y.backward()
            else:
                g = torch.empty(boundary_shape)
                comm.recv(g, rank + 1)
                torch.autograd.backward(y, g)
            if not first:
                dx = x.grad.contiguous()
                sends.append((comm.isend(dx, rank - 1), dx))
            del x, y
    for work, _ in sends:
        work.wait()
    return losses
