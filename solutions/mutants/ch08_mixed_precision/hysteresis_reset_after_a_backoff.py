"""Wrong: refills the hysteresis counter after each backoff, so only every h-th overflow backs off.

"Back off once h overflows have been seen, then start counting again" sounds symmetric; but a spent
counter means the scale is too high *now*: every further overflow must back off until the scale has
grown again, or a run at a scale that always overflows skips h - 1 steps for each halving.
"""


class LossScaler(LossScaler):

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() before any inf/NaN check; call step() (or unscale_()) first")
        rule = (self.growth_factor, self.backoff_factor, self.growth_interval, self.min_scale)
        if self._found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker == 0:
                self._scale, _ = scaler_update(self._scale, 0, True, *rule)
                self.hysteresis_tracker = self.hysteresis
        else:
            self._scale, self.growth_tracker = scaler_update(self._scale, self.growth_tracker, False, *rule)
            if self.growth_tracker == 0:
                self.hysteresis_tracker = self.hysteresis
        self._found_inf, self._stepped = None, False
