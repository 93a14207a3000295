"""Chapter 00 — what the two memory meters share: the model states' tensors, the hooks at the moments
memory may peak, the stand-in for a saved tensor, the table of bytes.

:class:`.meters.MemoryMeter` (chapter 00) keys storages by address and reads the model states when
it samples; :class:`.meta_memory.MetaMemoryMeter` (chapter 12) keys them by identity and watches every
op, which also works on ``meta``. Both count the same categories of the same tensors, sample at the
same moments (a tensor saved for backward, a gradient accumulated, an optimizer step) and print the
same table: that common part is :class:`MeterCore`, written once here.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..runtime.tables import format_table

__all__ = ["UNITS", "storage_of", "SavedAlias", "MeterCore", "TextTable"]

UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage behind ``t`` -- for a DTensor (FSDP2, TP) its local shard's, all it owns -- or None
    for a layout without one (sparse)."""
    t = getattr(t, "_local_tensor", t)
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and other storage-less layouts
        return None


class SavedAlias:
    """What autograd keeps instead of a saved tensor while a meter tracks.

    It holds a *detached* alias (same storage, same version counter): holding the saved tensor
    itself would hold its ``grad_fn`` and close a reference cycle through C++ that Python's
    garbage collector cannot break. When autograd frees the saved tensor (after backward, or when
    the graph is dropped) this object dies and calls ``release()``: the meter lets its bytes go.
    """

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]):
        self.tensor, self.release = tensor, release

    def __del__(self):
        self.release()


class MeterCore:
    """What both memory meters do alike: name the model states' tensors, hook the moments memory may
    peak (a gradient accumulated, an optimizer step), stand :class:`SavedAlias` in for what autograd
    saves, and show bytes as a table. They differ in how they see storages (the module docstring)."""

    def __init__(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer | None):
        self.model, self.optimizer = model, optimizer
        self._lock = threading.RLock()  # releases may come from autograd's threads or from __del__

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizer, and a sharded optimizer's local one (it holds the shards and their state)."""
        opts = [self.optimizer] if self.optimizer is not None else []
        inner = getattr(self.optimizer, "optim", None)
        if isinstance(inner, torch.optim.Optimizer):
            opts.append(inner)
        return opts

    def _params(self) -> list[torch.Tensor]:
        """The model's parameters and every optimizer's, each tensor once (both may list it)."""
        ps = list(self.model.parameters()) if self.model is not None else []
        ps += [p for o in self._optimizers() for g in o.param_groups for p in g["params"]]
        return list({id(p): p for p in ps}.values())

    def _hooks(self, params, on_grad: Callable, after_step: Callable,
               before_step: Callable | None = None) -> list:
        """Handles of the hooks that call ``on_grad()`` when a gradient of ``params`` is accumulated,
        and ``before_step()`` / ``after_step()`` around the optimizer's step."""
        handles = [p.register_post_accumulate_grad_hook(lambda _p: on_grad())
                   for p in params if p.requires_grad and p.is_leaf]
        if self.optimizer is not None:
            if before_step is not None:
                handles.append(self.optimizer.register_step_pre_hook(lambda *_: before_step()))
            handles.append(self.optimizer.register_step_post_hook(lambda *_: after_step()))
        return handles

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, SavedAlias) else packed

    @staticmethod
    def _table(keys, columns: dict[str, dict], unit: str) -> TextTable:
        """Bytes in ``unit`` (B, KiB, MiB or GiB): a row per key, a column per ``{title: {key: bytes}}``
        ("-" where a column lacks the key), through the course's one table formatter."""
        if unit not in UNITS:
            raise ValueError(f"unit {unit!r} is not one of {list(UNITS)}")
        rows = [[k, *(f"{c[k] / UNITS[unit]:.3f}" if k in c else "-" for c in columns.values())]
                for k in keys]
        header = ["category", *(f"{title} {unit}" for title in columns)]
        return TextTable(format_table(rows, header, align="l" + "r" * len(columns)))  # decimal points line up


class TextTable(str):
    """A string that a notebook displays as itself (no quotes, real newlines)."""

    def __repr__(self) -> str:
        return str(self)
