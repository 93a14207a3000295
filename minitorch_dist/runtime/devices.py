"""Chapter 00 — devices: the few places where a tensor on the ``meta`` device must be told apart.

A dry run builds the model on the ``meta`` device (shapes, no values) under torch's fake process
group, so one machine can stand in for thousands of GPUs. Nearly all technique code runs there
unchanged: shapes propagate, collectives are counted. Only *reading values* differs — a meta
tensor has none. These helpers hold that special case once, so technique code says what it means
("the agreed flags", "the loss as a number") and never branches on the device itself.
"""
from __future__ import annotations

import torch

__all__ = ["has_values", "values_or", "item_or_nan", "same_memory"]


def has_values(t: torch.Tensor) -> bool:
    """False for a tensor on the ``meta`` device (a dry run): it has a shape but no values."""
    return not t.is_meta


def values_or(t: torch.Tensor, stand_in: list) -> list:
    """``t.tolist()``; in a dry run (meta), ``stand_in`` — what this rank knows locally stands in
    for values that a collective would have agreed on."""
    return stand_in if t.is_meta else t.tolist()


def item_or_nan(t: torch.Tensor) -> float:
    """``t.item()`` as a float; NaN in a dry run (a meta loss has no value)."""
    return float("nan") if t.is_meta else float(t.item())


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` start at the same address (e.g. a gradient already written into its flat
    buffer)? Meta tensors have no addresses: only the same object counts."""
    return a is b or (not a.is_meta and not b.is_meta and a.data_ptr() == b.data_ptr())
