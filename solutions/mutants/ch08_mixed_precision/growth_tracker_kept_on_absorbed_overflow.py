"""Wrong: an overflow that hysteresis absorbs leaves the growth tracker counting.

Nothing changes for the scale, so nothing seems to need resetting; but the growth interval counts clean
iterations *in a row*: an overflow, absorbed or not, restarts it, or the scale grows right after an
overflow said it was already too high.
"""


class LossScaler(LossScaler):

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() before any inf/NaN check; call step() (or unscale_()) first")
        rule = (self.growth_factor, self.backoff_factor, self.growth_interval, self.min_scale)
        if self._found_inf:
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:
                self._scale, self.growth_tracker = scaler_update(self._scale, 0, True, *rule)
        else:
            self._scale, self.growth_tracker = scaler_update(self._scale, self.growth_tracker, False, *rule)
            if self.growth_tracker == 0:
                self.hysteresis_tracker = self.hysteresis
        self._found_inf, self._stepped = None, False
