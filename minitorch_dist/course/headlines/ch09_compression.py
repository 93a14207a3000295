"""Chapter 09 — the tour's rows: error feedback rescues sign-SGD; the meter sees top-k's predicted payload."""
from __future__ import annotations

from ...communication import ErrorFeedback, Sign, TopK, train_compressed
from ...communication.compression import regression_task


def _wire_per_step(rank_result) -> float:
    steps = rank_result["comm"]
    return sum(s["wire_bytes"] for step in steps for s in step.values()) / len(steps)


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 09's rows: error feedback rescues sign-SGD; the meter sees each method's predicted payload."""
    steps = 120  # a few seconds; top-k needs them to reach the loss target
    runs = {name: train_compressed(c, n=2, steps=steps)[0] for name, c in (
        ("exact", None), ("sign", Sign()), ("sign+EF", ErrorFeedback(Sign())),
        ("topk+EF", ErrorFeedback(TopK(0.05))))}
    model, _ = regression_task(0)
    predicted = sum(TopK(0.05).payload_nbytes(p.shape) for p in model.parameters())  # all-gathered by 2 ranks
    measured = sum(s["bytes"] for s in runs["topk+EF"]["comm"][0].values())
    ratio = runs["sign"]["final_loss"] / runs["sign+EF"]["final_loss"]
    return [
        {"chapter": "ch09",
         "experiment": f"sign-SGD, {steps} steps on 2 ranks: final loss without / with error feedback",
         "theory": "> 1", "measured": round(ratio, 2), "ok": ratio > 1.5},
        {"chapter": "ch09",
         "experiment": "top-k 5% + EF: bytes per step (meter) = payload (values + int32 indices)",
         "theory": predicted * 2, "measured": measured, "ok": measured == predicted * 2},
        {"chapter": "ch09", "experiment": "top-k 5% + EF: wire bytes per step vs exact all-reduce",
         "theory": round(_wire_per_step(runs["exact"])), "measured": round(_wire_per_step(runs["topk+EF"])),
         "ok": _wire_per_step(runs["topk+EF"]) < _wire_per_step(runs["exact"]) / 4
               and runs["topk+EF"]["final_loss"] < 0.05},
    ]
