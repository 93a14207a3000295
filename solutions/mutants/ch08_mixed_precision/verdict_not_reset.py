"""Wrong: update() moves the scale but does not forget the iteration's inf/NaN verdict.

The next iteration then believes it has already checked its gradients: it skips unscaling (or reuses
the old verdict), so after the first overflow the scaler keeps skipping, or steps on scaled gradients.
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
            if self.growth_tracker == 0:
                self.hysteresis_tracker = self.hysteresis
        self._stepped = False
