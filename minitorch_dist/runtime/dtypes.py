"""Chapter 00 — dtype names: the one table between torch's dtypes and the short names the course writes.

The papers, the cost model's peak tables and the machine profiles say ``fp32``, ``bf16``, ``fp16``;
torch says ``torch.float32``, ``torch.bfloat16``; a command line or a results file says
``float32``. :func:`short_name` maps any of these to the short name, :func:`to_dtype` to the torch
dtype and :func:`torch_name` to torch's own name (what a results file records), all from
:data:`DTYPES` and :data:`ALIASES`. It sits in ``runtime/``, the lowest layer, so that every module
that names a dtype can read it.
"""
from __future__ import annotations

import torch

__all__ = ["DTYPES", "ALIASES", "short_name", "to_dtype", "torch_name"]

#: The floating-point formats the course names, by their short names.
DTYPES: dict[str, torch.dtype] = {
    "fp64": torch.float64,
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
#: Other spellings of them: torch's names, C's, the FP8 paper's (Micikevicius et al. 2022).
ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64", "float32": "fp32", "float": "fp32", "float16": "fp16",
    "half": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8_e4m3", "e4m3": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "e5m2": "fp8_e5m2",
}
_SHORT = {d: k for k, d in DTYPES.items()}


def short_name(dtype: torch.dtype | str, default: str | None = None) -> str:
    """The short name (a key of :data:`DTYPES`) of a torch dtype or of any name of one:
    ``torch.bfloat16``, ``"torch.bfloat16"``, ``"bfloat16"`` and ``"bf16"`` all give ``"bf16"``.
    For a dtype the table lacks: ``default``, or a ValueError naming the known ones when None."""
    if isinstance(dtype, torch.dtype) and dtype in _SHORT:
        return _SHORT[dtype]
    key = str(dtype).removeprefix("torch.").lower()
    key = ALIASES.get(key, key)
    if key in DTYPES:
        return key
    if default is not None:
        return default
    raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} or {sorted(ALIASES)}")


def to_dtype(name: torch.dtype | str) -> torch.dtype:
    """The torch dtype of ``name`` (any spelling :func:`short_name` reads, or a torch dtype)."""
    return name if isinstance(name, torch.dtype) else DTYPES[short_name(name)]


def torch_name(dtype: torch.dtype | str) -> str:
    """Torch's own name of ``dtype`` without its module: ``"bfloat16"`` for ``torch.bfloat16`` (or
    ``"bf16"``); any torch dtype, in the table or not (``torch.int64``: ``"int64"``)."""
    dtype = dtype if isinstance(dtype, torch.dtype) else to_dtype(dtype)
    return str(dtype).removeprefix("torch.")
