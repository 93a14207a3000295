"""Wrong: keeps each residual but never adds it back into the next gradient.

The residual is computed as in Algorithm 2, so the bookkeeping looks complete; but the gradient that is
compressed is the raw one, and what earlier steps did not send is lost.
"""
import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


class PowerSGDReducer(PowerSGDReducer):

    @torch.no_grad()
    def reduce(self, grads, group=None) -> list[torch.Tensor]:
        """Replace each gradient by the PowerSGD estimate of its mean over the ranks; return them."""
        if not dist.is_initialized():
            raise RuntimeError("PowerSGDReducer.reduce runs inside ranks: call it from a function started "
                               "with minitorch_dist.launch(fn, n)")
        grads = list(grads)
        if any(g is None for g in grads):
            raise ValueError("a gradient is None: pass only parameters that received one")
        n_ranks = dist.get_world_size(group)
        if self.iter < self.start_iter:  # warm-up: the exact mean, one buffer
            self.iter += 1
            buf = torch.cat([g.reshape(-1) for g in grads]).div_(n_ranks)
            comm.all_reduce(buf, group=group)
            _unflatten(buf, grads)
            return grads
        big = [i for i, g in enumerate(grads) if self.compresses(g.shape)]
        small = [i for i, g in enumerate(grads) if not self.compresses(g.shape)]
        ms = []
        for i in big:
            mat = grads[i].view(grads[i].shape[0], -1)
            self.error[i] = mat.clone()  # becomes (M + e) - M^ below
            ms.append(mat)
        if self.qs is None:
            self.qs = self._fresh_qs(ms)
        else:
            for q in self.qs:
                _orthogonalise(q)  # warm start: last step's Q
        if small:  # 1-D and incompressible tensors: all-reduced as they are
            buf = torch.cat([grads[i].reshape(-1) for i in small])
            comm.all_reduce(buf, group=group)
            _unflatten(buf.div_(n_ranks), [grads[i] for i in small])
        if ms:
            ps = [m @ q for m, q in zip(ms, self.qs)]
            p_buf = torch.cat([p.reshape(-1) for p in ps])
            comm.all_reduce(p_buf, group=group)  # sum_k M_k Q = (sum_k M_k) Q
            _unflatten(p_buf, ps)
            for p in ps:
                _orthogonalise(p)
            qs = [m.t() @ p for m, p in zip(ms, ps)]
            q_buf = torch.cat([q.reshape(-1) for q in qs])
            comm.all_reduce(q_buf, group=group)
            _unflatten(q_buf.div_(n_ranks), qs)
            for i, m, p, q in zip(big, ms, ps, qs):
                m.copy_(p @ q.t())  # the rank-r estimate of the mean, written into the gradient
                self.error[i] -= m
            self.qs = qs
        self.iter += 1
        return grads
