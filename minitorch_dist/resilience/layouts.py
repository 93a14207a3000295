"""Chapter 13 — the training state of any layout, named as the single-process model names it.

:func:`state_dict` looks at a model (and its optimizer) in any of the course's layouts and returns
the nested dict that :func:`.checkpoint.save` writes and :func:`.checkpoint.load` fills in place::

    {"model": {"wte.weight": Shard(local, placement), ...},                    # dense names
     "optim": {"state": {"wte.weight": {"exp_avg": Shard, "exp_avg_sq": Shard, "step": Shard}, ...},
               "param_groups": ParamGroups(optimizer)},                        # lr, betas, ... by group
     ...anything else: "step": 1200, "data": {...}, "rng": RNGState()}

A :class:`Shard` is this rank's tensor (the live one: loading copies into it) and its
:class:`.placement.Placement` in the dense tensor. The layouts, and how each rank's placement is found:

=================  ===========================================================================
DDP, one process   whole tensors (every replica holds the same; the save writes one copy)
TP, TP + SP        the cut each TP layer recorded when it sliced the dense weight (``record_cut``)
PP                 whole tensors of the rank's stages; a tied ``lm_head.weight`` is ``wte.weight``
``fully_shard``    the unit's ``[u, v)`` of each flattened tensor (``FlatPart.element_ranges``)
ZeRO-1/2           parameters whole; optimizer state every n-th element (``piece_slice``)
3D (``Model3D``)   TP cuts of the stages' tensors, then ZeRO-1's strided slice of the state
torch FSDP2 / TP   a ``DTensor`` on a 1-D mesh: ``Shard(dim)`` as ``torch.chunk``, ``Replicate``
=================  ===========================================================================

Optimizer state shaped like its parameter has the parameter's placement; a 0-d state (Adam's
``step``) is a whole tensor of shape ``()``. State that does not exist yet (before the first step)
is created first, with zeros, by a step of learning rate 0 (as DCP's ``_init_optim_state``), so
that there are tensors to load into. That step also counts (Adam's ``step`` becomes 1), so such
state is marked ``fresh``: a save skips it and removes it again, and a load that finds none in the
checkpoint removes it too, leaving the optimizer exactly as fresh as before.
"""
from __future__ import annotations

import math
import random

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..memory.zero import ShardedOptimizer, ZeroDataParallel, sharded_units
from ..models.init import cut_of
from ..parallelism.data_parallel import DistributedDataParallel, NaiveDataParallel
from ..parallelism.three_d import Model3D
from .placement import Placement

__all__ = ["Shard", "ParamGroups", "RNGState", "state_dict", "named_placements", "init_optimizer_state"]

_WRAPPERS = (DistributedDataParallel, NaiveDataParallel, ZeroDataParallel,
             nn.parallel.DistributedDataParallel)


class Shard:
    """``local``: this rank's tensor (loading copies into it, in place); ``placement``: where its
    elements sit in the dense tensor. ``if_missing()`` runs when a checkpoint lacks the tensor
    (None: that is an error). ``fresh``: optimizer state that :func:`state_dict` only created so that
    a load has somewhere to write; a save skips it and removes it again (``if_missing``)."""

    def __init__(self, local: torch.Tensor, placement: Placement, if_missing=None, fresh: bool = False):
        if local.numel() != placement.numel:
            raise ValueError(f"a local tensor of {local.numel()} elements cannot hold placement "
                             f"{placement.key()} ({placement.numel} elements)")
        self.local, self.placement, self.if_missing, self.fresh = local, placement, if_missing, fresh

    def __repr__(self) -> str:
        return f"Shard({tuple(self.local.shape)} of {self.placement.shape}, {self.placement.key()})"


class ParamGroups:
    """An optimizer's hyperparameters by group (``lr``, ``betas``, ``weight_decay``... and the dense
    names of each group's parameters): saved as plain values, put back on load."""

    per_rank = False

    def __init__(self, optimizer, names: dict):
        self.optimizer, self.names = optimizer, names

    def to_saved(self) -> list:
        out = []
        for g in self.optimizer.param_groups:
            opts = {k: _plain(v) for k, v in g.items() if k != "params"}
            out.append(opts | {"params": [self.names.get(id(p), "?") for p in g["params"]]})
        return out

    def restore(self, saved: list) -> None:
        groups = self.optimizer.param_groups
        if len(saved) != len(groups):
            raise ValueError(f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
                             f"{len(groups)}: build the optimizer with the same groups as the one saved")
        for g, s in zip(groups, saved):
            for k, v in s.items():
                if k != "params" and k in g and not torch.is_tensor(g[k]):
                    g[k] = tuple(v) if isinstance(g[k], tuple) else v


class RNGState:
    """This rank's random number generators (torch's CPU and CUDA, Python's, NumPy's): one value per
    rank. Restored only at the world size that saved it; the course's loops draw their data from
    ``(seed, step)`` and need none of it to resume exactly on another number of ranks."""

    per_rank = True

    def to_saved(self) -> dict:
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        numpy_state = [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)]
        out = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": numpy_state}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.get_rng_state_all()
        return out

    def restore(self, saved: dict) -> None:
        torch.set_rng_state(saved["torch"])
        version, state, gauss = saved["python"]
        random.setstate((version, tuple(state), gauss))
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(saved["cuda"])


def _plain(v):
    """A hyperparameter as JSON can hold it (tuples as lists, 0-d tensors as numbers)."""
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    return list(v) if isinstance(v, tuple) else v


# --- parameters: dense names and placements -------------------------------------------------------


def _modules(model) -> list[nn.Module]:
    """The modules whose parameters this rank trains: the pipeline stages of a rank, or one model."""
    if isinstance(model, Model3D):
        return list(model.stages.values())
    if isinstance(model, dict):
        return list(model.values())
    while isinstance(model, _WRAPPERS):
        model = model.module
    if not isinstance(model, nn.Module):
        raise TypeError(f"state_dict takes a model (nn.Module), a dict of pipeline stages or a Model3D, "
                        f"got {type(model).__name__}")
    return [model]


def _dense_name(module: nn.Module, name: str) -> str:
    """A pipeline stage's tied ``lm_head.weight`` is the dense model's ``wte.weight``."""
    tied = getattr(getattr(module, "cfg", None), "tie_embeddings", False)
    return "wte.weight" if tied and name == "lm_head.weight" else name


def _fsdp_ranges(module: nn.Module) -> dict:
    """id(sharded parameter) -> (shape of its tensor, its cut, ``[u, v)``) for every FSDP unit."""
    out = {}
    for unit in sharded_units(module):
        for part in unit.parts:
            for p, shape, cut, uv in zip(part.sharded, part.flat.shapes, part.cuts, part.element_ranges()):
                out[id(p)] = (tuple(shape), cut, uv)
    return out


def _dtensor_placement(p) -> tuple[torch.Tensor, Placement]:
    """A DTensor on a 1-D mesh: ``Shard(d)`` is ``torch.chunk``'s piece of dim d, ``Replicate`` all."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor import Shard as TorchShard

    if p.device_mesh.ndim != 1 or len(p.placements) != 1:
        raise ValueError(f"a DTensor on a {p.device_mesh.ndim}-D mesh: only 1-D meshes are read here")
    kind, local = p.placements[0], p.to_local()
    if isinstance(kind, Replicate):
        return local, Placement(tuple(p.shape))
    if not isinstance(kind, TorchShard):
        raise ValueError(f"DTensor placement {kind} (partial sums) is not a saved state")
    n, r, size = p.device_mesh.size(), p.device_mesh.get_local_rank(), p.shape[kind.dim]
    chunk = math.ceil(size / n)
    lo, hi = min(r * chunk, size), min((r + 1) * chunk, size)
    return local, Placement(tuple(p.shape), (kind.dim, ((lo, hi),)))


def _placement(p: torch.Tensor, fsdp: dict) -> tuple[torch.Tensor, Placement]:
    if _is_dtensor(p):
        return _dtensor_placement(p)
    if id(p) in fsdp:
        shape, cut, (u, v) = fsdp[id(p)]
        base = Placement(shape) if cut is None else Placement.of_cut(cut.dense_shape, cut.dim, cut.index)
        return p, base.then_flat(u, 1, v - u)
    cut = cut_of(p)
    if cut is not None:
        return p, Placement.of_cut(cut.dense_shape, cut.dim, cut.index)
    return p, Placement(tuple(p.shape))


def named_placements(model) -> dict[str, tuple[torch.Tensor, torch.Tensor, Placement]]:
    """``{dense name: (parameter, local tensor, placement)}`` of what this rank trains, a tied tensor
    once. The local tensor is the parameter's own data (a DTensor's local shard)."""
    out, seen = {}, set()
    for module in _modules(model):
        fsdp = _fsdp_ranges(module)
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            local, placement = _placement(p, fsdp)
            out[_dense_name(module, name)] = (p, local.detach(), placement)
    return out


def _buffers(model) -> dict[str, Shard]:
    """Persistent buffers (a BatchNorm's running statistics), whole: every replica holds them."""
    out = {}
    for module in _modules(model):
        persistent = set(module.state_dict(keep_vars=True))
        for name, b in module.named_buffers():
            if name in persistent:
                out[name] = Shard(b.detach(), Placement(tuple(b.shape)))
    return out


# --- the optimizer ---------------------------------------------------------------------------------


def init_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state (zeros) without moving a parameter: one step with zero
    gradients and learning rate 0 (DCP's ``_init_optim_state``). Nothing happens if it has state."""
    if isinstance(optimizer, ShardedOptimizer):
        optimizer.init_state()
        return
    if optimizer.state:
        return
    given = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
                given.append(p)
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = 0.0
    try:
        with torch.no_grad():
            optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p in given:
            p.grad = None


def _is_dtensor(t) -> bool:
    return torch.is_tensor(t) and hasattr(t, "device_mesh") and hasattr(t, "placements")


def _state_entry(key: str, value, placement: Placement, forget, fresh: bool):
    if _is_dtensor(value):  # torch FSDP2 / DTensor TP: the state is sharded as its parameter
        return Shard(*_dtensor_placement(value), forget, fresh)
    if torch.is_tensor(value) and value.dim() == 0:
        return Shard(value, Placement(()), forget, fresh)
    if torch.is_tensor(value) and value.numel() == placement.numel:
        return Shard(value, placement, forget, fresh)
    if torch.is_tensor(value):
        raise ValueError(f"optimizer state {key!r} of shape {tuple(value.shape)} is neither per element "
                         f"nor a number: only elementwise optimizers (SGD, Adam, AdamW, ...) are saved here")
    return value


def _optimizer_state(optimizer, placements: dict) -> dict:
    """``{"state": {name: {key: Shard}}, "param_groups": ParamGroups}`` of a torch optimizer over the
    local parameters, or of a :class:`ShardedOptimizer` (its pieces, each a strided slice)."""
    inner = optimizer.optim if isinstance(optimizer, ShardedOptimizer) else optimizer
    fresh = not inner.state  # created below only to be loaded into: a save skips it
    init_optimizer_state(optimizer)
    by_id = {id(p): (name, pl) for name, (p, _, pl) in placements.items()}
    if isinstance(optimizer, ShardedOptimizer):
        if optimizer.offloaded is not None:
            raise ValueError("an offloaded ShardedOptimizer keeps its state off the device: save it before "
                             "offloading, or train without offload to checkpoint it here")
        part, inner = optimizer.partition, optimizer.optim
        keyed = [(piece, p, by_id[id(p)][1].then_flat(*part.piece_slice(i)))
                 for i, (piece, p) in enumerate(zip(optimizer.pieces, part.flat.params))]
    else:
        inner = optimizer
        keyed = [(p, p, by_id[id(p)][1]) for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for holder, p, pl in keyed:
        if holder not in inner.state:
            continue
        forget = (lambda h=holder: inner.state.pop(h, None))  # saved before it had state: fresh again
        state[by_id[id(p)][0]] = {k: _state_entry(k, v, pl, forget, fresh)
                                  for k, v in inner.state[holder].items()}
    names = {id(p): name for name, (p, _, _) in placements.items()}
    return {"state": state, "param_groups": ParamGroups(optimizer, names)}


def _optimizer_of(model, optimizer):
    if optimizer is not None:
        return optimizer
    if isinstance(model, Model3D):
        return model.zero.sharded
    if isinstance(model, ZeroDataParallel):
        return model.sharded
    return None


def state_dict(model, optimizer=None, **extra) -> dict:
    """The training state of ``model`` (and ``optimizer``) in the layout it is in, as dense-named
    :class:`Shard` s: ``{"model": ..., "optim": ..., **extra}`` (see the module docstring). A
    ``ZeroDataParallel`` or ``Model3D`` brings its own optimizer. ``extra``: plain values (the step,
    the data position), :class:`RNGState` (), anything with ``to_saved`` / ``restore``."""
    placements = named_placements(model)
    out = {"model": {name: Shard(local, pl) for name, (_, local, pl) in placements.items()} | _buffers(model)}
    opt = _optimizer_of(model, optimizer)
    if opt is not None:
        out["optim"] = _optimizer_state(opt, placements)
    for k in extra:
        if k in out:
            raise ValueError(f"extra state {k!r} would replace the {k!r} entry: choose another name")
    return out | extra


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
