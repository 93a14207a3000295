"""Wrong: unscales with g.div_(S) rather than multiplying by 1/S rounded once to fp32.

Mathematically the same; in floating point g / S and g * fp32(1/S) differ in the last bit whenever S is
not a power of two, so the gradients and weights drift from GradScaler's bit for bit.
"""
import torch


class LossScaler(LossScaler):

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called since the last update(); "
                               "call it at most once per iteration")
        grads = _grads_of(optimizer)
        found = False
        with torch.no_grad():
            for g in grads:
                found = found or not bool(torch.isfinite(g).all())
                g.div_(self._scale)
        self._found_inf = found
        return found
