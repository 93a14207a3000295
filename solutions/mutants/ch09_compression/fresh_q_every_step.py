"""Wrong: draws a fresh random Q at every compressed step instead of warm-starting from the last one.

One round from a random start is still a rank-r approximation; but the paper's warm start (§3) is what
turns successive steps into subspace iteration, and torch's batched hook reuses its Q.
"""
import math

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


class PowerSGDReducer(PowerSGDReducer):

    @torch.no_grad()
    def reduce(self, grads, group=None) -> list[torch.Tensor]:
        if not dist.is_initialized():
            raise RuntimeError("PowerSGDReducer.reduce runs inside ranks: call it from a function started "
                               "with minitorch_dist.launch(fn, n)")
        grads = list(grads)
        if not grads or any(g is None for g in grads):
            raise ValueError("pass a non-empty list of gradients, none of them None")
        if len({g.dtype for g in grads}) > 1:
            raise ValueError(f"the gradients have dtypes {sorted({str(g.dtype) for g in grads})}: one bucket "
                             "holds one dtype, so reduce each dtype's gradients with a reducer of its own")
        shapes = [tuple(g.shape) for g in grads]
        if self._shapes is not None and shapes != self._shapes:
            raise ValueError(f"reduce got gradients of shapes {shapes}, but the residual and the warm-start "
                             f"Q belong to {self._shapes}: pass the same list, in the same order, every step")
        if self.iter >= self.start_iter:
            self._shapes = shapes  # this call compresses: the memory belongs to this list from now on
        n_ranks = dist.get_world_size(group)
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.iter < self.start_iter:  # warm-up: the exact mean of the N entries
            self.iter += 1
            comm.all_reduce(flat.div_(n_ranks), group=group)
            _unflatten(flat, grads)
            return grads
        n = flat.numel()
        side = math.isqrt(n - 1) + 1  # ⌈√N⌉, exactly
        if self.rank > side:
            raise ValueError(f"rank {self.rank} exceeds the side {side} of the {n} gradient entries padded "
                             "to a square: use a smaller rank")
        buf = flat.new_zeros(side * side)
        buf[:n] = flat
        if self.error is not None:
            buf += self.error  # error feedback, padding included
        given = buf.clone()
        M = buf.view(side, side)
        self.q = self._fresh_q(side, buf.dtype).to(buf.device)
        _orthogonalise(self.q)  # warm start: the last call's Q, orthogonalised
        p = M @ self.q
        comm.all_reduce(p, group=group)  # sum_k M_k Q = (sum_k M_k) Q
        _orthogonalise(p)
        q = M.t() @ p
        comm.all_reduce(q, group=group)
        q.div_(n_ranks)
        M.copy_(p @ q.t())  # the rank-r estimate of the mean
        self.error = given - buf  # what this rank had and did not send
        self.q = q
        self.iter += 1
        _unflatten(buf, grads)
        return grads
