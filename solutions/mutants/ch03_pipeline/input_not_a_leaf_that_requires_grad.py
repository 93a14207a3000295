"""Wrong: receives the activation into a plain tensor, not a leaf that requires grad.

Backward then stops at the stage's input: there is no x.grad to send back, so the stages before
this one never receive their gradient.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def run_stage_actions(stage, actions, inputs, targets, boundary_shape) -> list[float]:
    parsed = [_parse_action(a) for a in actions]
    inputs, targets = list(inputs), list(targets)
    if not inputs or len(inputs) != len(targets):
        raise ValueError(f"need one target per input microbatch, got {len(inputs)} inputs and "
                         f"{len(targets)} targets")
    m = len(inputs)
    bad = sorted({i for _, i in parsed if not 0 <= i < m})
    if bad:
        raise ValueError(f"actions name microbatches {bad}, outside 0..{m - 1}")
    if not dist.is_initialized():
        raise RuntimeError("run_stage_actions runs on ranks: call it inside launch(fn, p)")
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    kept, sends, losses = {}, [], []
    for kind, i in parsed:
        if kind == "F":
            if first:
                x = inputs[i]
            else:
                x = torch.empty(boundary_shape)
                comm.recv(x, rank - 1)
            if last:
                loss = stage(x, targets[i])
                losses.append(loss.item())
                y = loss / m
            else:
                y = stage(x)
                out = y.detach().contiguous()
                sends.append((comm.isend(out, rank + 1), out))
            kept[i] = (x, y)
        else:
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
    for work, _ in sends:
        work.wait()
    return losses
