"""Chapter 07 — activation offloading: keep what backward needs in host memory, not on the accelerator.

Rhu et al. 2016, "vDNN: Virtualized Deep Neural Networks for Scalable, Memory-Efficient Neural
Network Design", §3: during the forward pass each layer's activations that backward will need
are copied from GPU memory to host memory ("offload") and their GPU copies released; during the
backward pass they are copied back ("prefetch") just before the layer that needs them. GPU memory
then holds only the layers in flight, at the price of moving every saved byte across PCIe twice:

    bytes to host  = bytes to device = S    (S = bytes saved for backward, per step)
    time           ≈ 2 S / PCIe bandwidth,  hidden if it overlaps compute (vDNN §3.2)

``torch.autograd.graph.saved_tensors_hooks`` is exactly the place to do this: its *pack* hook sees
every tensor autograd saves for backward and may return anything in its place; its *unpack* hook
turns that back into a tensor when backward needs it. ``offload_activations`` packs a tensor into
a host copy and unpacks it into a fresh copy on the tensor's original device, counting the bytes
each way. It is ``torch.autograd.graph.save_on_cpu`` with meters, plus two choices it leaves out:

* **Parameters (and views of them, e.g. the ``weight.t()`` a Linear saves) stay where they are.**
  The model and the optimizer keep them on the device anyway, so a host copy frees nothing; it
  would only cost two PCIe transfers per step.
* **Tensors smaller than ``min_bytes`` stay on the device.** Each copy pays a fixed launch /
  synchronisation cost; tiny tensors (LayerNorm statistics, scalars) are not worth it. vDNN made
  the same choice per layer type (it offloads only the inputs of convolutions, §3.2).

Unlike vDNN, the copies here run on the current stream and the fetch happens on demand when
backward reaches a node, not one layer ahead on a separate stream: it is the readable version of
the idea. With ``pin_memory`` the host buffer is page-locked, so the device-to-host copy is
``non_blocking`` (asynchronous with respect to the host); the host-to-device copy back is ordered
after it on the same stream.

On a CPU-only machine the "device" *is* host memory: the copy is an ordinary memory copy, frees
nothing, and only demonstrates the mechanism and its byte counts (which are what a GPU would move
over PCIe). ``save_on_cpu`` does not copy at all in that case; this module copies anyway, so the
counts and the code path are the same on every machine.

Interaction with ``MemoryMeter`` (and any other saved-tensor hooks): hooks do not nest -- only the
*innermost* ``saved_tensors_hooks`` context sees a saved tensor. Inside ``offload_activations`` an
outer ``MemoryMeter.track()`` therefore sees no activations at all (peak["activations"] stays 0
for everything saved in the block). That is why this object keeps its own accounts:
``host_bytes`` / ``peak_host_bytes`` (the host pool: offloaded tensors alive now / at most) and
``device_bytes`` / ``peak_device_bytes`` (saved activations that stayed on the device because
they were under ``min_bytes``; parameters are not activations and are not counted). On a GPU,
``peak_device_bytes`` is what offloading leaves in device memory, and the CUDA allocator's peak
(``MemoryMeter.peak["cuda_peak_allocated"]``, which does not depend on hooks) shows the saving.
"""
from __future__ import annotations

import threading

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["offload_activations"]


def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)


class _Held:
    """What autograd keeps instead of a saved tensor: the tensor (a host copy, or a detached alias
    left on the device) and the pool it is counted in. When autograd frees it (after backward, or
    when the graph is dropped) ``__del__`` returns its bytes to the pool.

    Holding a *detached* alias, not the saved tensor itself, matters: the saved tensor may be the
    output of the very node that saves it, and holding it would close a reference cycle through
    C++ (tensor -> grad_fn -> saved variable -> this object -> tensor) that Python cannot collect.
    """

    __slots__ = ("tensor", "device", "nbytes", "pool", "owner")

    def __init__(self, tensor, device, nbytes, pool, owner):
        self.tensor, self.device, self.nbytes, self.pool, self.owner = tensor, device, nbytes, pool, owner

    def __del__(self):
        self.owner._release(self.pool, self.nbytes)


class offload_activations(saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it are kept in host memory.

    >>> off = offload_activations()                  # device="cpu": the host
    >>> with off:
    ...     loss = model(x, y)[1]
    >>> loss.backward()                              # saved tensors come back as they are needed
    >>> off.bytes_to_host == off.bytes_to_device, off.tensors_to_host

    Args:
        device: where offloaded tensors live (the host, ``"cpu"``).
        pin_memory: page-lock the host copies so device-to-host copies run asynchronously. ``None``
            (default) pins exactly when the saved tensor is on a CUDA device and CUDA is available;
            pinning a copy of a CPU tensor buys nothing and is never done.
        min_bytes: tensors of fewer bytes (``numel * element_size``) stay on the device.

    Counters (cumulative over every use of this object; ``reset()`` zeroes them):
        ``bytes_to_host``, ``tensors_to_host``: packed copies made (one per *save*: a tensor saved
        by two nodes is copied twice, as in ``save_on_cpu``). ``bytes_to_device``,
        ``tensors_to_device``: copies back, one per unpack (once per saved tensor per backward;
        again for a second backward with ``retain_graph=True``). ``bytes_kept``, ``tensors_kept``:
        activations left on the device by ``min_bytes``. ``parameters_skipped``: saves of
        parameters, never moved and never counted as bytes.
    Pools (alive now, and peak): ``host_bytes``/``peak_host_bytes``, ``device_bytes``/``peak_device_bytes``.
    """

    def __init__(self, device: torch.device | str = "cpu", pin_memory: bool | None = None,
                 min_bytes: int = 0):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int) or min_bytes < 0:
            raise ValueError(f"min_bytes must be an int >= 0 (bytes), got {min_bytes!r}")
        if pin_memory not in (None, True, False):
            raise ValueError(f"pin_memory must be True, False or None (automatic), got {pin_memory!r}")
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.min_bytes = min_bytes
        self._lock = threading.Lock()  # unpack may run in autograd's device threads, __del__ anywhere
        self.reset()
        super().__init__(self._pack, self._unpack)

    def reset(self) -> None:
        """Zero every counter and peak (the pools' live bytes are left as they are)."""
        self.bytes_to_host = self.tensors_to_host = 0
        self.bytes_to_device = self.tensors_to_device = 0
        self.bytes_kept = self.tensors_kept = self.parameters_skipped = 0
        if not hasattr(self, "host_bytes"):
            self.host_bytes = self.device_bytes = 0
        self.peak_host_bytes, self.peak_device_bytes = self.host_bytes, self.device_bytes

    # --- the two hooks ------------------------------------------------------------------------
    def _pin(self, t: torch.Tensor) -> bool:
        if self.pin_memory is False or self.device.type != "cpu":
            return False
        return t.is_cuda and torch.cuda.is_available() and not t.is_sparse

    def _pack(self, t: torch.Tensor):
        # Autograd calls this with grad mode off, so the copy below is not recorded in the graph.
        if _is_parameter(t):
            with self._lock:
                self.parameters_skipped += 1
            return t  # a leaf: no grad_fn, no cycle; autograd keeps it as it would without hooks
        nbytes = t.numel() * t.element_size()
        if nbytes < self.min_bytes or t.layout != torch.strided:
            with self._lock:
                self.bytes_kept += nbytes
                self.tensors_kept += 1
                self.device_bytes += nbytes
                self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
            return _Held(t.detach(), None, nbytes, "device", self)
        pin = self._pin(t)
        # A fresh buffer, even when t is already in host memory: the copy is what a GPU would send
        # over PCIe, and afterwards autograd no longer references t's storage, so it can be freed.
        host = torch.empty_like(t, device=self.device, pin_memory=pin)  # same strides where dense
        host.copy_(t, non_blocking=pin)
        with self._lock:
            self.bytes_to_host += nbytes
            self.tensors_to_host += 1
            self.host_bytes += nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        return _Held(host, t.device, nbytes, "host", self)

    def _unpack(self, packed):
        if not isinstance(packed, _Held):
            return packed  # a parameter, saved as itself
        if packed.device is None:
            return packed.tensor  # never left the device
        host = packed.tensor
        back = torch.empty_like(host, device=packed.device)
        back.copy_(host, non_blocking=host.is_pinned())
        with self._lock:
            self.bytes_to_device += packed.nbytes
            self.tensors_to_device += 1
        return back

    def _release(self, pool: str, nbytes: int) -> None:
        with self._lock:
            if pool == "host":
                self.host_bytes -= nbytes
            else:
                self.device_bytes -= nbytes

    def __repr__(self) -> str:
        return (f"offload_activations(device={str(self.device)!r}, to_host={self.bytes_to_host} B "
                f"in {self.tensors_to_host} tensors, to_device={self.bytes_to_device} B, "
                f"kept on device={self.bytes_kept} B, parameters skipped={self.parameters_skipped})")
