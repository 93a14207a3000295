"""Chapter 04 — one dense model for every rank of a group: its weights broadcast from the group's first rank.

Tensor, sequence and expert parallelism are built *from a dense module*: each rank keeps its slice
of the dense weights (column / row blocks, heads, vocabulary rows, experts) and whole copies of the
rest (LayerNorms, position embeddings, routers). Together the slices are the dense model only if
every rank sliced the *same* dense weights. Build the model under a different seed on each rank
(``torch.manual_seed(rank)``; a data loader's per-rank seed set too early does it) and rank r holds
a slice of model r: the parallel model then matches no dense model at all, and nothing fails.

Data parallelism meets the same problem and solves it by broadcasting rank 0's parameters when the
wrapper is built (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", §3.2.1; chapter 01's ``DistributedDataParallel``). Every wrapper that splits a dense
module does the same through :func:`broadcast_from_first_rank`, once, before it splits: one
broadcast per tensor at construction, nothing in training.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import comm, require_process_group
from ..runtime.launch import device

__all__ = ["broadcast_from_first_rank", "first_rank"]


def first_rank(group: dist.ProcessGroup | None = None) -> int:
    """Global rank of ``group``'s rank 0 (0 for the default group)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _staged(t: torch.Tensor, backend: str) -> torch.Tensor:
    """``t`` as a buffer the backend can broadcast: contiguous, bool as uint8, on the GPU under NCCL."""
    buf = t.detach().contiguous()
    if buf.dtype == torch.bool:
        buf = buf.to(torch.uint8)
    if backend == "nccl" and buf.device.type == "cpu":
        buf = buf.to(device())
    return buf


@torch.no_grad()
def broadcast_from_first_rank(module: nn.Module, group: dist.ProcessGroup | None = None) -> nn.Module:
    """Overwrite, in place, every parameter (a tied one once) and buffer of ``module`` with the values
    on the first rank of ``group``, and return ``module``. Every rank of the group must call it on a
    module of the same structure; on a group of one rank it does nothing."""
    require_process_group("broadcasting a module's weights to the ranks of a group")
    if dist.get_world_size(group) == 1:
        return module
    src, backend = first_rank(group), dist.get_backend(group)
    for t in itertools.chain(module.parameters(), module.buffers()):
        buf = _staged(t, backend)
        comm.broadcast(buf, src, group=group)
        if buf.data_ptr() != t.data_ptr():
            t.copy_(buf)
    return module
