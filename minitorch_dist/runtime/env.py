"""Chapter 00 — where the numbers come from: the hardware line every notebook prints first, and the
smoke switch.

Every measurement in the course is only as meaningful as the machine it ran on, so each notebook
opens with `print(hardware_summary())`. `smoke()` is the switch that shrinks sizes so the whole
test suite (and a notebook under nbval) runs in seconds on a 2-core laptop.
"""
from __future__ import annotations

import contextlib
import os
import platform

import torch


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


def hardware_summary() -> str:
    """One line naming the CPU, core count, GPUs (if any), and the torch version / default backend."""
    from .launch import default_backend  # late import: launch imports this module

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
def single_thread():
    """Run the enclosed code on one intra-op thread, as every CPU rank does under ``launch``:
    a single-process reference computed this way sums in the same order as the ranks."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
