"""Wrong: update() moves the scale but does not forget the iteration's inf/NaN verdict.

The next iteration then believes it has already checked its gradients: it skips unscaling (or reuses
the old verdict), so after the first overflow the scaler keeps skipping, or steps on scaled gradients.
"""


class LossScaler(LossScaler):

    def update(self) -> None:
        if self._found_inf is None:
            raise RuntimeError("update() before any inf/NaN check; call step() (or unscale_()) first")
        self._scale, self.growth_tracker = scaler_update(self._scale, self.growth_tracker, self._found_inf,
                                                         self.growth_factor, self.backoff_factor,
                                                         self.growth_interval)
        self._stepped = False
