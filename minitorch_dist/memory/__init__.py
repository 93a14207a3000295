"""Chapter 06 — saving memory: ZeRO/FSDP and Adafactor (06), checkpointing and activation
offload (07), mixed precision and fp8 training (08)."""
from .fp8 import (
    FP8_FORMATS,
    DelayedScaler,
    FP8Tensor,
    cast_to_fp8,
    fp8_gemm,
    fp8_max,
    quantize_blockwise,
    quantize_per_tensor,
)
from .fp8_linear import BlockwiseScaling, DelayedScaling, FP8Linear, swap_to_fp8, train_in_precision

__all__ = ["FP8_FORMATS", "DelayedScaler", "FP8Tensor", "cast_to_fp8", "fp8_gemm", "fp8_max",
           "quantize_blockwise", "quantize_per_tensor", "BlockwiseScaling", "DelayedScaling", "FP8Linear",
           "swap_to_fp8", "train_in_precision"]
