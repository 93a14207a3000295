"""Wrong: counts every pipeline event, the receives as well as the sends.

The pipeline's event list holds both directions of each message; summing it counts every message
twice on the stages that both send and receive, and counts received bytes as sent.
"""
def measure_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0) -> dict:
    res = train_3d(cfg, dp, tp, pp, 1, batch, seq, microbatches, zero_stage=zero)
    stage = res.coords[2]
    measured = {"dp": sum(e.wire_bytes for e in res.events["dp"]),
                "pp": sum(e.nbytes for e in res.events["pipeline"])}
    predicted = predict_rank_traffic(cfg, dp, tp, pp, batch, seq, microbatches, zero=zero, stage=stage)
    return {"stage": stage, "measured": measured, "predicted": predicted}
