"""Wrong: step() always unscales, even when unscale_() already ran this iteration.

Harmless-looking ("make sure the gradients are unscaled"), but a caller who unscales to clip first has
its gradients divided by S twice: the step is S times too small.
"""
import torch


class LossScaler(LossScaler):

    def step(self, optimizer: torch.optim.Optimizer):
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update(); call update() "
                               "between steps")
        found = self._found_inf
        self._found_inf = None
        found = self.unscale_(optimizer) or bool(found)
        self._found_inf = found
        self._stepped = True
        if found:
            self.skipped_steps += 1
            return None
        return optimizer.step()
