"""Communication compression (chapter 09): send fewer bytes per step.

:mod:`.compression` — the compressor interface, error feedback, top-k / random-k, sign (1-bit),
QSGD, fp16, and the compressed data-parallel reduction. :mod:`.powersgd` — PowerSGD's rank-r
approximation with warm start. :mod:`.activation_compression` — Gist-style encodings of the
activations saved for backward (bit-packed ReLU masks, fp16, int8).
"""
from __future__ import annotations

from .activation_compression import GistReLU, compress_activations, encoded_nbytes, gist_relu
from .compression import (
    FP16, QSGD, Compressor, ErrorFeedback, Payload, RandomK, Sign, TopK, compressed_allreduce, train_compressed,
)
from .powersgd import PowerSGD

__all__ = ["GistReLU", "compress_activations", "encoded_nbytes", "gist_relu", "FP16", "QSGD", "Compressor",
           "ErrorFeedback", "Payload", "RandomK", "Sign", "TopK", "compressed_allreduce", "train_compressed",
           "PowerSGD", "headline"]


def _wire_per_step(rank_result) -> float:
    return sum(s["wire_bytes"] for step in rank_result["comm"] for s in step.values()) / len(rank_result["comm"])


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 09's rows: error feedback rescues sign-SGD; the meter sees each method's predicted payload."""
    steps = 120  # a few seconds; top-k needs them to reach the loss target
    runs = {name: train_compressed(c, n=2, steps=steps)[0] for name, c in (
        ("exact", None), ("sign", Sign()), ("sign+EF", ErrorFeedback(Sign())), ("topk+EF", ErrorFeedback(TopK(0.05))))}
    from .compression import regression_task

    model, _ = regression_task(0)
    predicted = sum(TopK(0.05).payload_nbytes(p.shape) for p in model.parameters())  # all-gathered by 2 ranks
    measured = sum(s["bytes"] for s in runs["topk+EF"]["comm"][0].values())
    ratio = runs["sign"]["final_loss"] / runs["sign+EF"]["final_loss"]
    return [
        {"chapter": "ch09", "experiment": f"sign-SGD, {steps} steps on 2 ranks: final loss without / with error feedback",
         "theory": "> 1", "measured": round(ratio, 2), "ok": ratio > 1.5},
        {"chapter": "ch09", "experiment": "top-k 5% + EF: bytes per step (meter) = payload (values + int32 indices)",
         "theory": predicted * 2, "measured": measured, "ok": measured == predicted * 2},
        {"chapter": "ch09", "experiment": "top-k 5% + EF: wire bytes per step vs exact all-reduce",
         "theory": round(_wire_per_step(runs["exact"])), "measured": round(_wire_per_step(runs["topk+EF"])),
         "ok": _wire_per_step(runs["topk+EF"]) < _wire_per_step(runs["exact"]) / 4
               and runs["topk+EF"]["final_loss"] < 0.05},
    ]
