"""Wrong: measures the data-parallel traffic as the collectives' buffer sizes, not the bytes on the wire.

Each event carries both; the buffer is the number a call is made with, so it is the first one to
sum. A ring reduce-scatter or all-gather of S bytes on n ranks puts S·(n-1)/n on the wire, which is
what the prediction predicts.
"""
def measure_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0) -> dict:
    res = train_3d(cfg, dp, tp, pp, 1, batch, seq, microbatches, zero_stage=zero)
    stage = res.coords[2]
    measured = {"dp": sum(e.nbytes for e in res.events["dp"]),
                "pp": sum(e.nbytes for e in res.events["pipeline"] if e.op == "send")}
    predicted = predict_rank_traffic(cfg, dp, tp, pp, batch, seq, microbatches, zero=zero, stage=stage)
    return {"stage": stage, "measured": measured, "predicted": predicted}
