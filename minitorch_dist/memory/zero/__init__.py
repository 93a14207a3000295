"""Chapter 06 — ZeRO and fully sharded data parallelism: shard the optimizer state, the gradients
and the parameters of data parallelism over its n ranks (Rajbhandari et al. 2020; Zhao et al. 2023).

:mod:`.flat` — the flat, padded parameter buffer every stage shards. :mod:`.zero12` — stages 0
(plain data parallelism on the flat buffer), 1 (optimizer state sharded) and 2 (and gradients,
reduce-scattered bucket by bucket during backward). :mod:`.fsdp` — stage 3 / FSDP: parameters
sharded unit by unit on any module (FSDP2's ``fully_shard``), gathered just in time, prefetched,
mixed precision, and hybrid sharding on a 2-D grid (:mod:`.fsdp_unit` is one unit). :mod:`.offload` — the
optimizer step and state on the host or in memory-mapped files (ZeRO-Offload, ZeRO-Infinity's NVMe tier).
"""
from __future__ import annotations

from .flat import FlatParams, shard_range, shard_size
from .fsdp import (
                   FSDPModule,
                   MixedPrecisionPolicy,
                   full_state_dict,
                   fully_shard,
                   hybrid_groups,
                   replicate,
                   sharded_units,
                   sharding_state,
)
from .offload import OffloadedOptimizer
from .sharded_optimizer import ShardedOptimizer
from .zero12 import ZeroDataParallel

__all__ = ["FlatParams", "shard_range", "shard_size", "FSDPModule", "MixedPrecisionPolicy", "fully_shard",
           "full_state_dict", "sharded_units", "sharding_state", "hybrid_groups",
           "replicate", "OffloadedOptimizer", "ShardedOptimizer", "ZeroDataParallel"]
