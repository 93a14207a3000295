"""Chapter 00 — minitorch_dist: large-scale deep-learning training, one readable file per technique.

The names a notebook needs::

    import minitorch_dist as mtd
    mtd.launch(fn, 4)                 # run fn on 4 ranks, get their results
    with mtd.comm.meter() as m: ...   # count collectives and bytes on the wire
"""
from .runtime import (
                      LaunchTimeout,
                      RankError,
                      comm,
                      default_backend,
                      device,
                      hardware_summary,
                      launch,
                      rank,
                      smoke,
                      world_size,
)

__version__ = "0.1.0"

__all__ = ["launch", "comm", "rank", "world_size", "device", "default_backend", "RankError",
           "LaunchTimeout", "hardware_summary", "smoke", "__version__"]
