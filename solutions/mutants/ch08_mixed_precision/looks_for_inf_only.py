"""Wrong: looks for infinities only (torch.isinf), not for NaNs.

"Overflow" suggests inf; but 0 * inf, inf - inf and a NaN loss all give NaN gradients, and a step
taken with them writes NaN into every weight it touches.
"""
import torch


class LossScaler(LossScaler):

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called since the last update(); "
                               "call it at most once per iteration")
        grads = _grads_of(optimizer)
        inv_scale = _fp32(1.0 / self._scale)
        found = False
        with torch.no_grad():
            for g in grads:
                found = found or bool(torch.isinf(g).any())
                g.mul_(inv_scale)
        self._found_inf = found
        return found
