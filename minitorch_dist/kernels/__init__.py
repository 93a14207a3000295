"""Chapter 11 — fused kernels in Triton: fewer trips to memory for the memory-bound ops.

Each module holds the kernels, the math in its docstring, and the PyTorch reference it is tested
against: :mod:`.softmax` (row softmax in one pass; online softmax for long rows; backward),
:mod:`.layernorm` (forward and backward with dw / db partial sums; an ``nn.LayerNorm`` drop-in),
:mod:`.adamw` (one AdamW step over a flat fp32 buffer of the whole model),
:mod:`.cross_entropy` (loss and gradient per row in one kernel), :mod:`.flash_attention`
(FlashAttention-2 forward and backward) and its tiled PyTorch twin :mod:`.attention_tiled`, which
needs no Triton and computes ring attention's blocks (chapter 05). :mod:`.bench` times them
against eager PyTorch, ``torch.compile`` and a copy on a GPU.

:mod:`._runtime` decides where they run: compiled for CUDA when there is a GPU, else Triton's
interpreter on CPU tensors (``TRITON_INTERPRET=1``, set here before any kernel is defined unless
the user set it), so every kernel is checked on any machine. ``backend()`` says which.

``kernels.softmax``, ``kernels.cross_entropy``, ``kernels.flash_attention`` and ``kernels.tiled_attention``
are the differentiable functions (named as in
``torch.nn.functional``); reach a module's kernels with ``from minitorch_dist.kernels.softmax import ...``.
"""
from __future__ import annotations

# FlashAttention-2 tile by tile in plain PyTorch: needs no Triton (ring attention, chapter 05, uses it)
from .attention_tiled import (
    tiled_attention,
    tiled_attention_backward,
    tiled_attention_delta,
    tiled_attention_forward,
)

__all__ = ["backend", "default_device", "FlatParameters", "FusedAdamW", "adamw_reference", "fused_adamw_step",
           "cross_entropy", "cross_entropy_forward_backward", "cross_entropy_reference", "LayerNorm",
           "layer_norm", "layernorm_backward", "layernorm_forward", "layernorm_reference",
           "replace_layernorms", "softmax", "softmax_backward", "softmax_forward", "softmax_reference",
           "tiled_attention", "tiled_attention_backward", "tiled_attention_delta", "tiled_attention_forward",
           "flash_attention", "flash_attention_backward", "flash_attention_delta", "flash_attention_forward"]

try:
    from ._runtime import backend, default_device  # first: sets TRITON_INTERPRET before any @triton.jit
except ImportError as _no_triton:  # pragma: no cover - Triton ships with the Linux x86-64 install
    _MISSING: ImportError | None = _no_triton
else:
    _MISSING = None
    from .adamw import FlatParameters, FusedAdamW, adamw_reference, fused_adamw_step
    from .cross_entropy import cross_entropy, cross_entropy_forward_backward, cross_entropy_reference
    from .flash_attention import (
        flash_attention,
        flash_attention_backward,
        flash_attention_delta,
        flash_attention_forward,
    )
    from .layernorm import (
        LayerNorm,
        layer_norm,
        layernorm_backward,
        layernorm_forward,
        layernorm_reference,
        replace_layernorms,
    )
    from .softmax import softmax, softmax_backward, softmax_forward, softmax_reference


def __getattr__(name: str):
    """Without Triton only the tiled PyTorch attention is here: say why a Triton kernel is missing."""
    if _MISSING is not None and not name.startswith("__"):
        raise ImportError(f"minitorch_dist.kernels.{name} needs Triton: {_MISSING}") from _MISSING
    raise AttributeError(f"module 'minitorch_dist.kernels' has no attribute {name!r}")
