"""Chapter 00 — where the numbers come from: the hardware line every notebook prints first, the
smoke switch, and the ``MTD_*`` settings a launch reads.

Every measurement in the course is only as meaningful as the machine it ran on, so each notebook
opens with `print(hardware_summary())`. `smoke()` is the switch that shrinks sizes so the whole
test suite (and a notebook under nbval) runs in seconds on a 2-core laptop.

The settings ``launch`` reads from the environment are checked here, so that a bad value is an
error naming the variable and what it accepts, not a failure in every rank:
``MTD_THREADS`` (intra-op threads per CPU rank), ``MTD_START_METHOD`` (``fork`` or ``spawn``) and
``MTD_OVERSUBSCRIBE`` (allow more than :data:`RANKS_PER_CORE` ranks per core).
"""
from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator

import torch

START_METHODS = ("fork", "spawn")
#: A local launch starts at most this many ranks per CPU core unless told otherwise: the course
#: uses at most 8 ranks, so 8 per core leaves room on a 1-core machine, while a typo such as
#: ``launch(fn, 1000)`` (each rank a whole Python process with torch, plus a gloo group with every
#: other rank) is refused at once instead of exhausting the machine's memory.
RANKS_PER_CORE = 8
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def smoke() -> bool:
    """True when ``MTD_SMOKE`` is set to a true value: notebooks and the tour use small sizes."""
    return os.environ.get("MTD_SMOKE", "0").strip().lower() not in ("", "0", "false", "no")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def default_backend(world_size: int) -> str:
    """``MTD_BACKEND`` if set; NCCL when there is one GPU per rank; else gloo."""
    forced = os.environ.get("MTD_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= world_size:
        return "nccl"
    return "gloo"


def hardware_summary() -> str:
    """One line naming the CPU, core count, GPUs (if any), and the torch version / default backend."""
    cores = os.cpu_count() or 1
    parts = [f"CPU: {_cpu_name()} ({cores} cores)"]
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = sorted({torch.cuda.get_device_name(i) for i in range(n)})
        parts.append(f"GPU: {n} x {', '.join(names)}")
    else:
        parts.append("GPU: none")
    parts.append(f"torch {torch.__version__}, python {platform.python_version()}")
    parts.append(f"default backend: {default_backend(2)}")
    return " | ".join(parts)


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run the enclosed code on one intra-op thread, as every CPU rank does under ``launch``:
    a single-process reference computed this way sums in the same order as the ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def oversubscribe() -> bool:
    """``MTD_OVERSUBSCRIBE`` as a switch (unset: False)."""
    raw = os.environ.get("MTD_OVERSUBSCRIBE", "")
    if raw.strip().lower() in _TRUE + _FALSE:
        return raw.strip().lower() in _TRUE
    raise ValueError(f"MTD_OVERSUBSCRIBE={raw!r}: use 1 (allow more than {RANKS_PER_CORE} ranks per "
                     f"core) or 0 (the default)")


def check_world_size(world_size: int, allow: bool | None) -> None:
    """Refuse more than :data:`RANKS_PER_CORE` local ranks per core unless ``allow`` (or, when it is
    None, ``MTD_OVERSUBSCRIBE``) says so."""
    cores = usable_cores()
    limit = RANKS_PER_CORE * cores
    if world_size <= limit or (oversubscribe() if allow is None else allow):
        return
    raise ValueError(
        f"launch(world_size={world_size}) would start {world_size} processes on {cores} CPU core(s): "
        f"the limit is {RANKS_PER_CORE} ranks per core ({limit} here), since each rank is a whole "
        f"Python process with torch. Use fewer ranks (to study thousands of ranks, run on meta "
        f"tensors under the fake process group, as analysis.dryrun does), or pass "
        f"launch(..., oversubscribe=True) or set MTD_OVERSUBSCRIBE=1 if you mean it.")


def threads_per_rank(threads: int | None = None) -> int:
    """Intra-op threads per CPU rank: ``threads`` if given, else ``MTD_THREADS``, else 1."""
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int (intra-op threads per rank), got {threads!r}")
        return threads
    raw = os.environ.get("MTD_THREADS", "1")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"MTD_THREADS={raw!r}: it sets the intra-op threads of each CPU rank and must be "
                         f"a positive integer such as 1 (the default) or 2; unset it for the default")
    return value


def requested_start_method(forced: str | None = None) -> str | None:
    """The start method asked for (``forced``, else ``MTD_START_METHOD``), checked; None: choose."""
    name, source = (forced, "start_method") if forced else (os.environ.get("MTD_START_METHOD"), None)
    if not name:
        return None
    if name not in START_METHODS:
        where = f"start_method={name!r}" if source else f"MTD_START_METHOD={name!r}"
        raise ValueError(f"{where}: launch supports {' or '.join(START_METHODS)} "
                         f"(a rank started another way cannot watch its caller and would end at once)")
    return name
