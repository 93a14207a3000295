"""Chapter 00 — how ranks run and talk: launch, metered collectives, and collectives built on
send/recv."""
from . import comm
from .env import hardware_summary, smoke
from .groups import require_process_group
from .launch import LaunchTimeout, RankError, default_backend, device, launch, rank, world_size

__all__ = ["comm", "launch", "rank", "world_size", "device", "default_backend", "RankError",
           "LaunchTimeout", "hardware_summary", "smoke", "require_process_group"]
