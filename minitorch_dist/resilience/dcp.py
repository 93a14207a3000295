"""Chapter 13 — PyTorch's Distributed Checkpoint (DCP) read through this chapter's loader.

DCP (``torch.distributed.checkpoint``) is the production version of this chapter: ``dcp.save`` writes
each rank's shards of a state dict of DTensors (``get_model_state_dict`` / ``get_optimizer_state_dict``
give them, under the single-process names) plus a ``.metadata`` file of chunks (offsets and lengths
per dimension); ``dcp.load`` reads them back into any other sharding. Our names follow DCP's: a
nested dict flattened with dots, so ``{"model": ..., "optim": {"state": {fqn: {"exp_avg": ...}}}}``
is ``model.<fqn>`` and ``optim.state.<fqn>.exp_avg`` in both. So a DCP checkpoint of a model is a
checkpoint of this chapter's format in all but its files: :class:`DCPCheckpoint` reads the dense
tensors with DCP's own reader (``format_utils.dcp_to_torch_save``, one process, no process group)
and hands them to :func:`.loading.load` like a checkpoint of ours with one whole piece per tensor.
One difference: torch's state dicts list a tied weight under each of its names, ours once, so the
reader keeps the first name (:func:`_drop_tied_copies`).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from .placement import Placement

__all__ = ["DCPCheckpoint"]


def _flatten(tree, prefix: str = "") -> tuple[dict, dict]:
    """(tensors, other values) of a nested dict, keys joined with dots as DCP joins them."""
    tensors, other = {}, {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if torch.is_tensor(v):
            tensors[key] = v
        elif isinstance(v, dict):
            t, o = _flatten(v, key + ".")
            tensors.update(t), other.update(o)
        else:
            other[key] = v
    return tensors, other


def _drop_tied_copies(tensors: dict) -> dict:
    """``nn.Module.state_dict`` lists a tied weight under each of its names (``lm_head.weight`` and
    ``wte.weight``); our states list it once, under its first name. Drop the later copies of a model
    tensor (same shape, same values as an earlier one) and its optimizer state; return {copy: kept}."""
    aliases, firsts = {}, {}
    for key in list(tensors):
        if not key.startswith("model."):
            continue
        t = tensors[key]
        twin = next((k for k in firsts.get((t.shape, t.dtype), []) if torch.equal(tensors[k], t)), None)
        if twin is None:
            firsts.setdefault((t.shape, t.dtype), []).append(key)
            continue
        aliases[key] = twin
        del tensors[key]
        fqn = key.removeprefix("model.")
        for k in [k for k in tensors if k.startswith(f"optim.state.{fqn}.")]:
            del tensors[k]
    return aliases


class DCPCheckpoint:
    """A DCP checkpoint folder, read whole into memory once (dense tensors), served by name."""

    world_size = None  # DCP does not record it here: per-rank values are not restored from it
    save_id = None

    def __init__(self, path):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        self.path = Path(path)
        fd, tmp = tempfile.mkstemp(suffix=".pt")
        os.close(fd)
        try:
            dcp_to_torch_save(self.path, tmp)
            tree = torch.load(tmp, map_location="cpu", weights_only=True)
        finally:
            os.unlink(tmp)
        self.tensors, other = _flatten(tree)
        self.aliases = _drop_tied_copies(self.tensors)
        self.plain = other
        self.objects = {k: {"per_rank": False, "value": v} for k, v in other.items()}

    def names(self) -> set:
        return set(self.tensors)

    def shape(self, key: str) -> tuple:
        return tuple(self.tensors[key].shape)

    def fill(self, key: str, placement: Placement) -> tuple[torch.Tensor, bool]:
        dense = self.tensors[key].reshape(-1)
        if placement.whole:
            return dense, False
        return dense[placement.positions()], True

    def per_rank(self, key: str, rank: int):
        raise KeyError(key)

    def close(self) -> None:
        """Nothing stays open: the tensors were read whole when the checkpoint was opened."""
