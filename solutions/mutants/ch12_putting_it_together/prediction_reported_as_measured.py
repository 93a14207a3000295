"""Wrong: reports the prediction as the measurement: a formula dressed as a measurement.

The forecast is within 1% of the meter, so copying it looks harmless; but nothing was measured, and
the one-byte flags and padding the real step sends are missing from the "measurement".
"""
def measure_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0) -> dict:
    res = train_3d(cfg, dp, tp, pp, 1, batch, seq, microbatches, zero_stage=zero)
    stage = res.coords[2]

    predicted = predict_rank_traffic(cfg, dp, tp, pp, batch, seq, microbatches, zero=zero, stage=stage)
    return {"stage": stage, "measured": dict(predicted), "predicted": predicted}
