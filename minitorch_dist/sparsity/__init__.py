"""Chapter 10 — sparsity: mixture of experts and expert parallelism.

:mod:`.routers` — the :class:`Routing` a router returns; noisy top-k (Shazeer et al. 2017), Switch
top-1 with capacity (Fedus et al. 2021), GShard top-2 (Lepikhin et al. 2021), expert choice (Zhou et
al. 2022); expert capacity and the load-balancing loss. :mod:`.moe` — the :class:`MoELayer`, with a
dense reference path and the dispatch / combine path. :mod:`.expert_parallel` — experts sharded over
ranks, tokens moved by all-to-all with uneven splits; :mod:`.ep_overlap` — those all-to-alls
pipelined in chunks behind the experts' compute (Tutel). :mod:`.aux_free` — auxiliary-loss-free load
balancing by a per-expert selection bias (Wang et al. 2024; DeepSeek-V3). :mod:`.dropless` — the
dropless MoE, experts as grouped GEMMs (MegaBlocks). :mod:`.moe_gpt` — the tiny GPT with MoE
feed-forwards.
"""
from __future__ import annotations

from .aux_free import (
    AuxFreeRouter,
    aux_free_routers,
    bias_update,
    biased_choice,
    biased_top_k_routing,
    update_expert_biases,
)
from .dropless import DroplessMoELayer, grouped_experts, grouped_linear, grouped_mm_supported
from .ep_overlap import all_to_all_start, all_to_all_wait, chunked_expert_exchange
from .expert_parallel import (
    AllToAll,
    ExpertParallelMoE,
    all_to_all,
    expert_parallel,
    replicated_parameters,
    sync_replicated_grads,
)
from .moe import Expert, MoELayer, combine, dispatch, run_experts
from .moe_gpt import MoEGPT, MoEGPTConfig
from .routers import (
    ROUTERS,
    ExpertChoiceRouter,
    NoisyTopKRouter,
    Router,
    Routing,
    SwitchRouter,
    Top2Router,
    assign_by_priority,
    capacity,
    expert_choice_routing,
    load_balancing_loss,
    make_router,
    register_router,
    top_k_routing,
)

__all__ = ["AllToAll", "ExpertParallelMoE", "all_to_all", "expert_parallel", "replicated_parameters",
           "sync_replicated_grads", "Expert", "MoELayer", "combine", "dispatch", "run_experts", "MoEGPT",
           "MoEGPTConfig", "ROUTERS", "ExpertChoiceRouter", "NoisyTopKRouter", "Router", "Routing",
           "SwitchRouter", "Top2Router", "capacity", "expert_choice_routing", "load_balancing_loss",
           "make_router", "top_k_routing", "assign_by_priority", "register_router", "AuxFreeRouter",
           "aux_free_routers", "bias_update", "biased_choice", "biased_top_k_routing", "update_expert_biases",
           "DroplessMoELayer", "grouped_experts", "grouped_linear", "grouped_mm_supported",
           "all_to_all_start", "all_to_all_wait", "chunked_expert_exchange"]
