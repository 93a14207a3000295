"""Chapter 00 — process groups: the one check every distributed wrapper makes before it starts.

Every technique in the course (DDP, ZeRO, FSDP, tensor/sequence/pipeline/expert parallelism) is
built on ``torch.distributed``: it asks its group for its size and this rank's place in it. Outside
a process group those calls fail with torch's own message, which does not say what to do. So each
wrapper calls :func:`require_process_group` first, naming itself, and the learner reads the fix.
"""
from __future__ import annotations

import torch.distributed as dist

__all__ = ["require_process_group"]


def require_process_group(what: str) -> None:
    """Raise a ``RuntimeError`` naming ``what`` and the fix unless ``torch.distributed`` is initialised.

    >>> require_process_group("fully_shard")   # inside launch(fn, n) or under torchrun: passes
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what} needs an initialised process group: call it inside a function run by "
                           f"launch(fn, world_size) (or under torchrun)")
