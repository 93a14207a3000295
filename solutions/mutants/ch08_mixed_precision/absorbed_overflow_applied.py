"""Wrong: skips a step only when the scale backs off; an overflow hysteresis absorbs is applied.

Hysteresis tolerates an overflow in the *scale*, not in the weights: the gradients of that step still
hold an inf or a NaN, and stepping with them writes it into every weight it touches.
"""
import torch


class LossScaler(LossScaler):

    def step(self, optimizer: torch.optim.Optimizer):
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update(); call update() "
                               "between steps")
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        if self._found_inf and self.hysteresis_tracker <= 1:  # this overflow will back off
            self.skipped_steps += 1
            return None
        return optimizer.step()
