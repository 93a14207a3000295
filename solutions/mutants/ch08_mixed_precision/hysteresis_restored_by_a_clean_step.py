"""Wrong: a clean iteration restores the hysteresis counter (backs off only after h overflows in a row).

"Tolerate a few overflows in a row" is the natural reading, and Megatron's own docstring says
"consecutive"; but its counter is restored only when the scale grows: overflows separated by clean
iterations still add up, and a scaler that forgets them keeps a scale that overflows every few steps.
"""


class LossScaler(LossScaler):

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() before any inf/NaN check; call step() (or unscale_()) first")
        rule = (self.growth_factor, self.backoff_factor, self.growth_interval, self.min_scale)
        if self._found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:
                self._scale, _ = scaler_update(self._scale, 0, True, *rule)
        else:
            self._scale, self.growth_tracker = scaler_update(self._scale, self.growth_tracker, False, *rule)
            self.hysteresis_tracker = self.hysteresis
        self._found_inf, self._stepped = None, False
