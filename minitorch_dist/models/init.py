"""Chapter 12 — deferred initialisation: build any wrapper on ``meta``, then draw only this rank's shards.

A model that fits no device cannot be built dense and then split. Real systems build it on the
``meta`` device (shapes, no storage), wrap it (TP, FSDP, PP), and only then allocate each rank's
shards and initialise them (torchtitan: ``to_empty(device)`` then ``init_weights()`` on sharded
DTensors whose random ops are offset-aware; Megatron-LM: ``_initialize_affine_weight_cpu`` draws the
master weight and splits it). Either way a shard's values must not depend on how the model is split,
or the parallel model is no longer the dense model it claims to be.

The scheme here is the simplest exact one. Every dense parameter has its own random stream, keyed by
``(seed, dense name)``::

    dense = init_dense(name, dense_shape, dtype, device, seed, n_layer)   # one tensor at a time
    mine  = dense.index_select(cut.dim, cut.index)                          # this rank's slice

so peak memory is the largest dense tensor, not the model, and rank r's slice is exactly the slice
of the dense model initialised with the same seed. Wrappers say where each shard comes from when
they split it: :func:`record_cut` (a dimension and the indices along it: TP columns, rows, heads,
vocabulary rows); an FSDP unit keeps each piece's cut and fills its flat shard from the pieces
(``FlatUnit.materialize``). The dense name is the parameter's name in the module being materialised
(TP, FSDP and pipeline stages keep the dense model's names); a tied ``lm_head.weight`` is ``wte``'s.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["Cut", "record_cut", "cut_of", "stable_hash", "init_dense", "materialize", "rebind"]

STD = 0.02  # GPT-2's N(0, 0.02²) (models.gpt.init_gpt2_)


@dataclass(frozen=True)
class Cut:
    """Where a shard comes from: ``index`` (int64 positions) along ``dim`` of a ``dense_shape`` tensor."""

    dense_shape: tuple
    dim: int
    index: torch.Tensor

    def apply(self, dense: torch.Tensor) -> torch.Tensor:
        """This shard's values out of the dense tensor."""
        return dense.index_select(self.dim, self.index.to(dense.device))


def record_cut(shard: torch.Tensor, dense_shape, dim: int, index) -> torch.Tensor:
    """Note on ``shard`` (a parameter a wrapper just made) that it holds ``index`` along ``dim`` of a
    dense tensor of ``dense_shape``; ``index`` is a 1-D tensor of positions or a ``range``."""
    index = torch.as_tensor(list(index) if isinstance(index, range) else index, dtype=torch.long)
    shard.dense_cut = Cut(tuple(dense_shape), dim, index)
    return shard


def cut_of(t: torch.Tensor) -> Cut | None:
    """The :class:`Cut` recorded on ``t`` (None: ``t`` is the whole dense tensor)."""
    return getattr(t, "dense_cut", None)


def stable_hash(seed: int, name: str) -> int:
    """A 63-bit seed from ``(seed, name)``, the same in every process (Python's ``hash`` is salted)."""
    digest = hashlib.sha256(f"{int(seed)}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def init_dense(name: str, shape, dtype, device, seed: int, n_layer: int) -> torch.Tensor:
    """The dense parameter ``name`` as the course GPT initialises it (``init_gpt2_``: LayerNorm
    weight 1 / bias 0, biases 0, ``c_proj.weight`` ~ N(0, (0.02/sqrt(2·n_layer))²), the rest
    ~ N(0, 0.02²)), drawn from its own stream ``Generator(device).manual_seed(stable_hash(seed, name))``."""
    out = torch.empty(tuple(shape), dtype=dtype, device=device)
    module, _, leaf = name.rpartition(".")
    with torch.no_grad():
        if module.rpartition(".")[2].startswith("ln_"):
            return out.fill_(1.0 if leaf == "weight" else 0.0)
        if leaf == "bias":
            return out.zero_()
        std = STD / math.sqrt(2 * n_layer) if module.endswith("c_proj") else STD
        gen = torch.Generator(device=out.device).manual_seed(stable_hash(seed, name))
        return out.normal_(0.0, std, generator=gen)


class _Drawer:
    """Draws a (possibly cut) parameter's values by its dense name; a tied tensor once."""

    def __init__(self, module: nn.Module, device, seed: int, n_layer: int):
        self.device, self.seed, self.n_layer = torch.device(device), seed, n_layer
        cfg = getattr(module, "cfg", None)
        self.tied = bool(getattr(cfg, "tie_embeddings", False))
        self.names = {id(p): k for k, p in module.named_parameters()}
        self.names.update({id(b): k for k, b in module.named_buffers()})

    def dense_name(self, t: torch.Tensor) -> str:
        name = self.names[id(t)]
        return "wte.weight" if self.tied and name == "lm_head.weight" else name

    def values(self, t: torch.Tensor, shape, cut: Cut | None) -> torch.Tensor:
        """The values ``t`` (shaped ``shape``, cut from its dense tensor by ``cut``) must hold."""
        dense_shape = cut.dense_shape if cut is not None else tuple(shape)
        dense = init_dense(self.dense_name(t), dense_shape, t.dtype, self.device, self.seed, self.n_layer)
        out = cut.apply(dense) if cut is not None else dense
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{self.names[id(t)]}: the recorded cut gives shape {tuple(out.shape)}, "
                             f"the parameter has {tuple(shape)}")
        return out


def _units(module: nn.Module):
    """The FSDP units under ``module`` still on meta (anything with a ``fsdp_unit`` that can materialise)."""
    for m in module.modules():
        unit = getattr(m, "fsdp_unit", None)
        if unit is not None and hasattr(unit, "materialize") and unit.is_meta:
            yield unit


@torch.no_grad()
def materialize(module: nn.Module, device, seed: int, n_layer: int | None = None,
                memo: dict | None = None) -> nn.Module:
    """Give every ``meta`` parameter of ``module`` real storage on ``device``, holding this rank's
    part of the dense model initialised with ``seed`` (see the module docstring); return ``module``.

    Call it after wrapping and before the first forward and the optimizer (parameters are replaced).
    ``n_layer`` (for the scaled ``c_proj`` init) defaults to ``module.cfg.n_layer``. A buffer on meta
    is filled with zeros (the course GPT has none). ``memo``: a dict shared by several calls on modules
    that share tensors (a rank's pipeline stages: a tied embedding on its first and last), so that a
    shared tensor stays one tensor.
    """
    if n_layer is None:
        cfg = getattr(module, "cfg", None)
        if cfg is None:
            raise ValueError("materialize: pass n_layer (module has no .cfg to read it from)")
        n_layer = cfg.n_layer
    draw = _Drawer(module, device, seed, n_layer)
    for unit in list(_units(module)):  # a flat shard, filled piece by piece
        unit.materialize(draw.device, lambda part, i: draw.values(part.sharded[i], part.flat.shapes[i],
                                                                  part.cuts[i]))
    done = {} if memo is None else memo  # id -> (old, new): the old one kept alive so ids stay unique
    for _, m in module.named_modules(remove_duplicate=False):
        for a, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                new = nn.Parameter(draw.values(p, p.shape, cut_of(p)), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # what wrappers noted on it: its cut, an SP flag
                done[id(p)] = (p, new)
            m._parameters[a] = done[id(p)][1]
        for a, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[a] = torch.zeros(b.shape, dtype=b.dtype, device=draw.device)
    return module


def rebind(module: nn.Module, memo: dict) -> nn.Module:
    """Put the tensors that :func:`materialize` calls sharing ``memo`` made in place of the meta ones
    they replaced, wherever else under ``module`` those still sit (the whole model around a rank's
    pipeline stages: its tied ``wte`` / ``lm_head`` stays one tensor). Others stay on meta."""
    for m in module.modules():
        for a, p in list(m._parameters.items()):
            if p is not None and id(p) in memo and memo[id(p)][0] is p:
                m._parameters[a] = memo[id(p)][1]
    return module
