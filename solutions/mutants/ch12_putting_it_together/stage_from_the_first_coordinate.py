"""Wrong: reads the rank's stage from the first grid coordinate, which is its data-parallel rank.

``coords`` is (dp_rank, tp_rank, pp_rank); taking ``coords[0]`` predicts the first stage's bytes
for a last-stage rank whose DP coordinate is 0, and the stages hold different parameters.
"""
def measure_rank_traffic(cfg, dp: int, tp: int, pp: int, batch: int, seq: int, microbatches: int,
                         zero: int = 0) -> dict:
    res = train_3d(cfg, dp, tp, pp, 1, batch, seq, microbatches, zero_stage=zero)
    stage = res.coords[0] if res.coords[0] < pp else 0
    measured = {"dp": sum(e.wire_bytes for e in res.events["dp"]),
                "pp": sum(e.nbytes for e in res.events["pipeline"] if e.op == "send")}
    predicted = predict_rank_traffic(cfg, dp, tp, pp, batch, seq, microbatches, zero=zero, stage=stage)
    return {"stage": stage, "measured": measured, "predicted": predicted}
