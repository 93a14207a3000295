"""Chapter 10 — expert parallelism: experts sharded over ranks, tokens sent to their expert by all-to-all.

Lepikhin et al. 2021, "GShard", §2.2 and §3.2 (experts partitioned over devices, the rest of the
model replicated; dispatch and combine become ``AllToAll`` across devices). Fedus et al. 2021,
"Switch Transformers", §5.4 (expert and data parallelism, Fig. 9). Rajbhandari et al. 2022,
"DeepSpeed-MoE", §5 (the all-to-all is the cost to beat).

n ranks, E experts: rank r owns experts ``[r·E/n, (r+1)·E/n)``; the router is replicated. Each rank
routes *its own* tokens (so capacity is per rank, as in GShard's per-group capacity) and:

    1. all_to_all of counts       each rank learns how many rows every rank sends to each of its
                                  experts (E int64 counts in, E out), to size its receive buffer
    2. all_to_all of tokens       dispatch: the kept rows, sorted by expert, go to their expert's
                                  owner; uneven splits, rank j gets Σ_{e of j} counts[e] rows
    3. local experts              rows regrouped by expert (they arrive grouped by source rank)
    4. all_to_all back            the same splits swapped: every row returns to where it came from
    5. combine                    weights applied locally, as in the single-process layer

With ``chunks=m > 1``, steps 2-4 run in m pipelined pieces, each chunk's experts computing while the
next chunk's all-to-all travels (:mod:`.ep_overlap`); the result is the same. Each forward announces
(:mod:`runtime.observe`) the spans a rank spends routing ("routing"), exchanging counts ("counts"),
launching all-to-alls ("a2a launch"), waiting on them ("a2a wait") and computing experts ("experts").

The all-to-alls are differentiable (:class:`AllToAll`, from :mod:`..parallelism.mappings`, the home
of every region-crossing operator, and re-exported here): the backward of an all-to-all is the
all-to-all of the gradients with the splits swapped, so the backward pass costs the same two
all-to-alls again. Bytes per layer per rank: dispatch sends A·h·e and combine R·h·e (A rows kept
here, R rows received), see ``costmodel.all_to_all_bytes_moe``.

Gradients. The experts' gradients already hold every rank's tokens (step 4's backward brings them
home). The replicated parameters (the router here; attention and the rest in a model) only saw
this rank's tokens: :func:`sync_replicated_grads` all-reduces them, as data parallelism would.
It sums: the result is the gradient of Σ_r loss_r; to train on the mean, scale each rank's loss
by 1/n before backward (then experts and router are both the mean's gradient).

Initial weights. The sharded layer is the dense layer only if every rank holds the same dense
layer before keeping its experts: the wrappers broadcast it from the group's first rank first
(:func:`..parallelism.replicas.broadcast_from_first_rank`, as DDP does), router and experts, so
ranks that built the model under different seeds still train one model.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..parallelism.mappings import AllToAll, all_to_all, size_and_rank
from ..parallelism.replicas import broadcast_from_first_rank
from ..runtime import comm, observe
from ..runtime.devices import has_values
from .ep_overlap import chunked_expert_exchange
from .moe import MoELayer, Routing, combine, dispatch, run_experts

__all__ = ["AllToAll", "all_to_all", "check_divisible", "ExpertParallelMoE", "expert_parallel",
           "replicated_parameters", "sync_replicated_grads"]


def check_divisible(n_experts: int, n: int) -> None:
    if n_experts % n:
        raise ValueError(f"n_experts {n_experts} is not divisible by {n} ranks (expert parallel degree); "
                         f"use a multiple of {n} experts or a degree that divides {n_experts}")


class ExpertParallelMoE(nn.Module):
    """An :class:`~.moe.MoELayer` with its experts sharded over the ranks of ``group``.

    Shares the router and the local experts (``layer.experts[r·E/n:(r+1)·E/n]``) with ``layer``,
    after making ``layer`` the group's first rank's (a broadcast of the whole layer, once;
    ``broadcast_weights=False`` when it already is): every rank keeps its shard of one layer.
    ``forward(x)`` on this rank's tokens [..., h] returns their outputs, as ``layer(x)`` would on
    this rank alone.
    After a forward: ``last_routing`` (this rank's routing), ``aux_loss``, and ``send_counts`` /
    ``recv_counts``: the rows sent to / received from each rank by the dispatch all-to-all.
    ``chunks``: pipeline the dispatch, experts and combine in that many pieces (1: the plain layer).
    The forward announces its spans through :mod:`runtime.observe` (module docstring).
    """

    def __init__(self, layer: MoELayer, group: dist.ProcessGroup | None = None, *,
                 broadcast_weights: bool = True, chunks: int = 1) -> None:
        super().__init__()
        if not isinstance(layer, MoELayer):
            raise ValueError(f"ExpertParallelMoE wraps an MoELayer, got {type(layer).__name__}")
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive int (1 = no pipelining), got {chunks!r}")
        n, r = size_and_rank(group, "expert parallelism")
        check_divisible(layer.n_experts, n)
        if broadcast_weights:
            broadcast_from_first_rank(layer, group)
        self.group, self.n, self.rank = group, n, r
        self.h, self.n_experts, self.local = layer.h, layer.n_experts, layer.n_experts // n
        self.first_expert = r * self.local
        self.router = layer.router
        self.experts = nn.ModuleList(layer.experts[self.first_expert:self.first_expert + self.local])
        self.last_routing: Routing | None = None
        self.send_counts: list[int] = []
        self.recv_counts: list[int] = []
        self.chunks = chunks

    @classmethod
    def from_dense(cls, layer: MoELayer, group: dist.ProcessGroup | None = None, *,
                   broadcast_weights: bool = True, chunks: int = 1) -> ExpertParallelMoE:
        """The same as ``ExpertParallelMoE(layer, group)``: this rank's shard of a dense layer."""
        return cls(layer, group, broadcast_weights=broadcast_weights, chunks=chunks)

    @property
    def aux_loss(self) -> torch.Tensor:
        return self.router.w_gate.new_zeros(()) if self.last_routing is None else self.last_routing.aux_loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(-1) != self.h:
            raise ValueError(f"ExpertParallelMoE expects [..., h={self.h}] inputs, got shape "
                             f"{tuple(x.shape)}")
        if not (has_values(x) and has_values(self.router.w_gate)):
            raise RuntimeError("expert parallelism routes by values: run it on real tensors (the all-to-all "
                               "splits are the token counts per expert, which meta tensors do not hold)")
        n, El = self.n, self.local
        tokens = x.reshape(-1, self.h)
        with observe.span("route", "routing"):
            routing = self.last_routing = self.router(tokens)
            packed, counts = dispatch(tokens, routing)  # rows sorted by expert = grouped by owner rank
        # 1. counts: recv[i·El + e] = rows rank i sends to my local expert e.
        recv = torch.empty_like(routing.counts)
        with observe.span("counts", "counts"):
            comm.all_to_all(recv, routing.counts.contiguous(), [El] * n, [El] * n, group=self.group)
        per_src_expert = recv.view(n, El)
        self.send_counts = routing.counts.view(n, El).sum(1).tolist()
        self.recv_counts = per_src_expert.sum(1).tolist()
        if self.chunks > 1:  # 2-4 pipelined in chunks
            back = chunked_expert_exchange(lambda rows, c: run_experts(self.experts, rows, c), packed,
                                           self.send_counts, self.recv_counts, per_src_expert, self.group,
                                           self.chunks)
            return combine(back, routing, tokens.size(0)).reshape(x.shape)
        # 2. dispatch.
        with observe.span("wait dispatch", "a2a wait"):
            received = all_to_all(packed, self.recv_counts, self.send_counts, self.group)
        # 3. regroup source-major rows to expert-major, run, and restore the source-major order.
        with observe.span("experts", "experts"):
            expert_of_row = (torch.arange(El, device=x.device).repeat(n)
                             .repeat_interleave(per_src_expert.reshape(-1)))
            by_expert = torch.sort(expert_of_row, stable=True).indices
            out = run_experts(self.experts, received[by_expert], per_src_expert.sum(0).tolist())
            out = out[torch.argsort(by_expert)]
        # 4. combine all-to-all: every row back to the rank that sent it; 5. weights, locally.
        with observe.span("wait combine", "a2a wait"):
            back = all_to_all(out, self.send_counts, self.recv_counts, self.group)
        return combine(back, routing, tokens.size(0)).reshape(x.shape)

    def extra_repr(self) -> str:
        return (f"experts [{self.first_expert}, {self.first_expert + self.local}) of {self.n_experts} "
                f"on rank {self.rank} of {self.n}" + (f", {self.chunks} chunks" if self.chunks > 1 else ""))


def expert_parallel(model: nn.Module, group: dist.ProcessGroup | None = None, *,
                    broadcast_weights: bool = True, chunks: int = 1) -> nn.Module:
    """Replace every :class:`~.moe.MoELayer` inside ``model`` by its :class:`ExpertParallelMoE`, in place.
    The whole ``model`` (the replicated parameters too) is first made the group's first rank's, once
    (``broadcast_weights=False`` when it already is). A model without MoE layers is left alone.
    ``chunks``: each layer's all-to-alls pipelined with its experts in that many pieces.
    ``model`` itself an MoELayer cannot be replaced in place: its :class:`ExpertParallelMoE` is returned
    (use the result: ``layer = expert_parallel(layer)``)."""
    if isinstance(model, MoELayer):  # checks that the experts divide over the ranks
        return ExpertParallelMoE(model, group, broadcast_weights=broadcast_weights, chunks=chunks)
    if not any(isinstance(m, MoELayer) for m in model.modules()):
        return model
    if broadcast_weights:
        size_and_rank(group, "expert parallelism")
        broadcast_from_first_rank(model, group)
    for name, child in list(model.named_children()):
        if isinstance(child, MoELayer):
            setattr(model, name, ExpertParallelMoE(child, group, broadcast_weights=False, chunks=chunks))
        else:
            expert_parallel(child, group, broadcast_weights=False, chunks=chunks)
    return model


def replicated_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters every rank holds a copy of: all but the experts of the ExpertParallelMoE layers."""
    sharded = {id(p) for m in module.modules() if isinstance(m, ExpertParallelMoE)
               for p in m.experts.parameters()}
    return [p for p in module.parameters() if id(p) not in sharded]


def sync_replicated_grads(module: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Sum the replicated parameters' gradients over the ranks: one all-reduce of one flat buffer
    (a missing gradient counts as zero, so every rank sends the same shapes)."""
    params = replicated_parameters(module)
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group=group)
    for p, g in zip(params, flat.split([q.numel() for q in params])):
        p.grad = g.view_as(p).clone()
