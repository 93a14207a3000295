"""Chapter 13 — saving, resharding and surviving failures.

:mod:`.placement` — where a rank's elements sit in the dense tensor (a cut, then a flat run).
:mod:`.layouts` — :func:`state_dict`: the training state of any layout (DDP, ZeRO-1/2, ``fully_shard``,
TP, PP, 3D, torch's DTensors) as dense-named shards. :mod:`.checkpoint` — :func:`save` and
:func:`async_save` (plan, dedupe, stage to host memory, write). :mod:`.storage` — the files: one per
rank plus ``metadata.json`` with SHA-256s, written into a staging folder and renamed when complete, one
save of a path at a time (a lock). :mod:`.reading` — one save read whole while newer ones commit, every
file checked. :mod:`.loading` — :func:`load` into any other layout (resharding). :mod:`.dcp` — PyTorch DCP
checkpoints read by the same loader. :mod:`.elastic` — a failure injected mid-step, detected by
``launch`` and survived by restarting from the last checkpoint on fewer ranks. :mod:`.failures_sim` —
how much work failures cost for a checkpoint interval (Young/Daly, simulated).
"""
from __future__ import annotations

from .checkpoint import SaveHandle, async_save, flatten, save
from .layouts import ParamGroups, RNGState, Shard, init_optimizer_state, named_placements, state_dict
from .loading import LoadReport, load, open_checkpoint, read_dense
from .placement import Placement
from .storage import CheckpointError

__all__ = ["save", "async_save", "load", "state_dict", "Shard", "Placement", "ParamGroups", "RNGState",
           "SaveHandle", "LoadReport", "CheckpointError", "flatten", "named_placements",
           "init_optimizer_state", "open_checkpoint", "read_dense"]
