"""Chapter 09 — communication compression: send fewer bytes per step.

:mod:`.compression` — the compressor interface, error feedback, top-k / random-k, sign (1-bit),
QSGD, fp16, and the compressed data-parallel reduction. :mod:`.powersgd` — PowerSGD's rank-r
approximation with warm start. :mod:`.activation_compression` — Gist-style encodings of the
activations saved for backward (bit-packed ReLU masks, fp16, int8).
"""
from __future__ import annotations

from .activation_compression import GistReLU, compress_activations, encoded_nbytes, gist_relu
from .compression import (
    FP16,
    QSGD,
    Compressor,
    ErrorFeedback,
    Payload,
    RandomK,
    Sign,
    TopK,
    compressed_allreduce,
    train_compressed,
)
from .powersgd import PowerSGD

__all__ = ["GistReLU", "compress_activations", "encoded_nbytes", "gist_relu", "FP16", "QSGD", "Compressor",
           "ErrorFeedback", "Payload", "RandomK", "Sign", "TopK", "compressed_allreduce", "train_compressed",
           "PowerSGD"]
