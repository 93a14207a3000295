"""Chapter 06 — offload the optimizer off the compute device: to host memory (ZeRO-Offload) or to files
(ZeRO-Infinity).

ZeRO-Offload (Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training", §4)
keeps on the accelerator only what forward and backward need -- the parameters and, while they are
produced, the gradients. The fp32 *master* weights, the optimizer states (Adam: momentum and
variance) and the optimizer step itself live on the CPU. Per step, each rank's gradient shard
goes *down* (device -> host), the CPU runs the update, and the updated parameter shard goes
*up* (host -> device). With fp16 training that is 2Ψ bytes each way (the paper's "2x/4x" count);
here training is fp32 (chapter 08 does mixed precision), so it is 4 bytes per element each way::

    device_to_host per step = 4·S        host_to_device per step = 4·S        (S = shard elements)

The states never cross the bus: this is why the offload strategy sends the step to the data, not
the data to the step (§4.1: the edge between the fp32 states and the update is the heaviest,
so both sit on the CPU).

ZeRO-Infinity (Rajbhandari et al. 2021, "ZeRO-Infinity: Breaking the GPU Memory Wall for Extreme
Scale Deep Learning", §5-§6) adds a third tier, NVMe, for states too large for host memory. Here
``where="disk"`` keeps the master shard and every optimizer state tensor in files, used as
memory-mapped tensors (``torch.from_file(..., shared=True)``): the optimizer updates them in
place *on the mapping*, and the operating system's page cache moves the pages to and from the
file -- the role ZeRO-Infinity's own asynchronous NVMe engine plays. The disk traffic is counted
as the *logical* bytes the step touches: it reads the master and every state tensor once and
writes each back once (what an out-of-core step must do when nothing is cached)::

    disk_read  per step = 4·S + B_state        disk_write per step = 4·S + B_state

where ``B_state`` is the optimizer state's size (AdamW: 8·S + 4 for exp_avg, exp_avg_sq and the
step counter; SGD with momentum: 4·S). The page cache may serve some reads from memory; the
count is the model, not a measurement of the device.

Lazy state. torch optimizers create their state on the first ``step()`` (AdamW's exp_avg and
exp_avg_sq, SGD's momentum_buffer). We let them: the first step runs on host memory, and right
after it every state tensor is copied into its own file and replaced in ``optimizer.state`` by
the file-backed tensor; from then on updates happen on the mapping. Pre-building the state
instead (a zero-lr step, or zeros written by hand) is optimizer-specific and easy to get wrong:
AdamW's step counter would advance (changing its bias correction) and SGD's first momentum
buffer is ``clone(grad)``, not zeros (different under ``dampening``). The price is one transient
copy of the state in host memory during step 1, and the first step's disk traffic is
``read 4·S, write 4·S + B_state`` (there was no state to read yet).

On a machine without a GPU, host == device: the copies still happen between two distinct
buffers and are still counted, so the mechanism (and its byte counts) is the one that runs on a
GPU, only the bus is memory.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from collections.abc import Callable

import torch

WHERE = ("cpu", "disk")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def _remove_dir(path: str) -> None:
    """Finalizer: it must not reference the optimizer object, or the object would never be collected."""
    shutil.rmtree(path, ignore_errors=True)


class OffloadedOptimizer:
    """The fp32 master shard and its optimizer state kept off the compute device.

    >>> off = OffloadedOptimizer(shard, lambda ps: torch.optim.AdamW(ps, lr=1e-3), where="cpu")
    >>> off.step(grad_shard)        # grad down, AdamW on the host, updated shard up into ``shard``
    >>> off.bytes_moved             # cumulative bytes: device_to_host, host_to_device, disk_read, disk_write
    >>> off.close()                 # with where="disk": removes the files (also on garbage collection)

    ``shard`` is this rank's 1-D parameter shard on the compute device; ``step`` updates it in place.
    ``optimizer_factory(params)`` builds any ``torch.optim.Optimizer`` (it receives ``[master]``).
    ``where="disk"`` keeps the master and the state in files in a private folder inside
    ``directory`` (a fresh temporary folder when None); ``flush=True`` fsyncs them after each step.

    Attributes: ``master`` (the fp32 host/file copy, an ``nn.Parameter``), ``optimizer`` (the host
    optimizer over it), ``directory`` (the files' folder, disk only), ``files`` (state name -> path).
    """

    def __init__(self, shard: torch.Tensor, optimizer_factory: Callable, where: str = "cpu",
                 directory: str | os.PathLike | None = None, flush: bool = False):
        if where not in WHERE:
            raise ValueError(f"where must be one of {WHERE}, got {where!r}")
        if not isinstance(shard, torch.Tensor) or shard.dim() != 1:
            shape = tuple(shard.shape) if isinstance(shard, torch.Tensor) else type(shard).__name__
            raise ValueError(f"shard must be a 1-D tensor (a flat shard, e.g. FlatParams.shard), got {shape}")
        if not shard.is_floating_point():
            raise TypeError(f"shard must be floating point, got {shard.dtype}")
        if directory is not None and where != "disk":
            raise ValueError(f"directory is only used with where='disk' (got where={where!r}); drop it")
        self.shard, self.where, self.flush = shard, where, flush
        self.bytes_moved = dict.fromkeys(("device_to_host", "host_to_device", "disk_read", "disk_write"), 0)
        self.files: dict[str, str] = {}
        self.directory: str | None = None
        self._closed = False
        # Pinned (page-locked) host memory lets the DMA engine copy without a staging buffer.
        pin = shard.is_cuda
        n = shard.numel()
        # fp32 master weights for 16-bit shards (mixed precision), the shard's own dtype if wider
        dtype = torch.promote_types(shard.dtype, torch.float32)
        if where == "disk":
            parent = os.fspath(directory) if directory is not None else None
            if parent is not None and not os.path.isdir(parent):
                raise FileNotFoundError(f"offload directory {parent!r} does not exist; create it first")
            # A private sub-folder: close() may delete it whole without touching the caller's files.
            self.directory = tempfile.mkdtemp(prefix="mtd-offload-", dir=parent)
            self._finalizer = weakref.finalize(self, _remove_dir, self.directory)
            master = self._mapped("master", n, dtype)
        else:
            self._finalizer = None
            master = torch.empty(n, dtype=dtype, pin_memory=pin)
        master.copy_(shard.detach())
        self.master = torch.nn.Parameter(master)  # shares master's storage (the file, for disk)
        self._grad = torch.empty(n, dtype=dtype, pin_memory=pin)  # host landing buffer
        self.optimizer = optimizer_factory([self.master])
        if not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer_factory must return a torch.optim.Optimizer, "
                            f"got {type(self.optimizer).__name__}")

    # --- files ----------------------------------------------------------------------------------
    def _mapped(self, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new zeroed tensor whose storage *is* the file ``<directory>/<name>.bin`` (MAP_SHARED)."""
        path = os.path.join(self.directory, f"{name}.bin")
        self.files[name] = path
        return torch.from_file(path, shared=True, size=max(numel, 1), dtype=dtype)[:numel]

    def _spill_state(self) -> None:
        """Move the state the optimizer just created in host memory into files (see module docstring)."""
        for state in self.optimizer.state.values():
            for key, t in list(state.items()):
                if isinstance(t, torch.Tensor) and t.untyped_storage().filename is None:
                    name = key if key not in self.files else f"{key}.{len(self.files)}"  # one file per tensor
                    mapped = self._mapped(name, t.numel(), t.dtype).view(t.shape)
                    mapped.copy_(t)
                    state[key] = mapped  # the host copy is dropped here

    def _fsync(self) -> None:
        for path in self.files.values():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)  # on Linux this also writes back pages dirtied through the mapping
            finally:
                os.close(fd)

    # --- the step -------------------------------------------------------------------------------
    def step(self, grad_shard: torch.Tensor) -> None:
        """Gradient down, optimizer step on the host (or on the files), updated shard up."""
        if self._closed:
            raise RuntimeError("this OffloadedOptimizer is closed; build a new one to keep training")
        if grad_shard.shape != self.shard.shape:
            raise ValueError(f"grad_shard has shape {tuple(grad_shard.shape)}, "
                             f"the shard has {tuple(self.shard.shape)}")
        # Blocking copies: the host must see the whole gradient before stepping, and must not
        # rewrite the master while a non-blocking upload of it is still in flight.
        self._grad.copy_(grad_shard.detach())
        self.bytes_moved["device_to_host"] += _nbytes(grad_shard)
        self.master.grad = self._grad
        state_before = sum(map(_nbytes, _state_tensors(self.optimizer)))
        self.optimizer.step()
        if self.where == "disk":
            self._spill_state()  # no-op after the first step
            state_after = sum(map(_nbytes, _state_tensors(self.optimizer)))
            self.bytes_moved["disk_read"] += _nbytes(self.master) + state_before
            self.bytes_moved["disk_write"] += _nbytes(self.master) + state_after
            if self.flush:
                self._fsync()
        self.master.grad = None
        with torch.no_grad():
            self.shard.copy_(self.master)
        self.bytes_moved["host_to_device"] += _nbytes(self.shard)

    # --- state and lifetime -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``optimizer.state_dict()`` with every tensor copied into ordinary memory (safe after close)."""
        if self._closed:
            raise RuntimeError("this OffloadedOptimizer is closed; take state_dict() before close()")
        sd = self.optimizer.state_dict()
        sd["state"] = {k: {n: v.clone() if isinstance(v, torch.Tensor) else v for n, v in s.items()}
                       for k, s in sd["state"].items()}
        return sd

    def close(self) -> None:
        """Drop the master and the state; with ``where="disk"`` remove their files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.optimizer.state.clear()
        self.master = self._grad = None
        if self._finalizer is not None:
            self._finalizer()  # removes the folder now; never runs twice

    def __enter__(self) -> OffloadedOptimizer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        where = self.where if self.directory is None else f"disk:{self.directory}"
        return (f"OffloadedOptimizer({type(self.optimizer).__name__}, {self.shard.numel()} elements, "
                f"{where}{', closed' if self._closed else ''})")
