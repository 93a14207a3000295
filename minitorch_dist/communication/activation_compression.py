"""Chapter 09 — activation compression: store what backward needs in a compact encoding, decode it in
backward.

Jain et al. 2018, "Gist: Efficient Data Encoding for Deep Neural Network Training", §3. Between a
layer's forward and its backward, its *stashed* feature maps sit idle in memory; Gist encodes them
right after their last forward use and decodes them just before backward needs them:

* **Binarize** (lossless, §3.1): ReLU's backward needs only *where* its input was positive,
  ``dx = dy * [x > 0]``, so one bit per element suffices instead of 32 -- a 32x saving, and exact.
* **Delayed precision reduction** (lossy, §3.3): other stashed maps are kept in fewer bits (Gist
  uses fp16 / 8 / 10 bits) while the forward pass still uses full precision; only backward sees
  the rounding. Here: ``"fp16"`` (a cast) or ``"int8"`` (per-tensor absmax scale, Jacob et al. 2018
  style linear quantisation: ``q = round(x * 127 / max|x|)``).

Per saved tensor of ``n`` elements (the formulas :func:`encoded_nbytes` returns):

    bool / ReLU mask   ceil(n / 8) bytes   (8 flags per uint8; lossless)
    "fp16"             2 n bytes           (lossy: ~11 significant bits, fp16's range)
    "int8"             n + 4 bytes         (lossy: 255 levels over [-max|x|, max|x|]; + an fp32 scale)
    "none"             n * element_size    (floating tensors kept as they are)

``torch.autograd.graph.saved_tensors_hooks`` is the place for it: the *pack* hook sees every tensor
autograd saves and may return anything instead; the *unpack* hook turns that back into a tensor.
``compress_activations`` packs floating tensors with the chosen encoding and bool tensors with the
bit-packed mask, always (lossless, so there is no reason not to). ``torch.relu`` saves its float
*output*; :func:`gist_relu` / :class:`GistReLU` is a ReLU that saves the bool mask instead, so the
1-bit encoding applies. Combined with a lossy encoding this also keeps ReLU's gradient gate exact:
only the values the *next* layer saved are rounded, never the decision of which units were on.

Parameters (and views of them, e.g. the ``weight.t()`` a Linear saves) are left alone: the model
keeps them anyway, so encoding them would save nothing and perturb the gradient.

Accounting: hooks do not nest -- only the *innermost* ``saved_tensors_hooks`` sees a saved tensor,
so a ``MemoryMeter`` outside this context sees no activations. This object therefore counts for
itself: ``raw_bytes`` (what autograd would have kept, ``numel * element_size`` per save) and
``encoded_bytes`` (the bytes of the payload tensors actually kept), per encoding in ``by_encoding``.
A tensor saved by two nodes is packed, and counted, twice (without hooks they would share storage).
"""
from __future__ import annotations

import math
import threading
from collections import defaultdict

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["ENCODINGS", "encoded_nbytes", "pack_bits", "unpack_bits", "quantize_int8", "dequantize_int8",
           "GistReLU", "gist_relu", "compress_activations"]

ENCODINGS = ("none", "fp16", "int8")  # for floating tensors; bool tensors are always bit-packed


def encoded_nbytes(numel: int, encoding: str, element_size: int = 4) -> int:
    """Bytes one saved tensor of ``numel`` elements takes in ``encoding`` ("mask" for bool tensors)."""
    if encoding == "mask":
        return math.ceil(numel / 8)
    if encoding == "fp16":
        return 2 * numel
    if encoding == "int8":
        return numel + 4  # one byte per element + the fp32 scale
    if encoding == "none":
        return numel * element_size
    raise ValueError(f"encoding {encoding!r} is not one of {('mask', *ENCODINGS)}")


# --- the encodings ----------------------------------------------------------------------------------

_BIT_WEIGHTS = [1 << i for i in range(8)]


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A bool tensor of ``n`` elements as ``ceil(n / 8)`` bytes: flag ``i`` is bit ``i % 8`` of byte
    ``i // 8``."""
    if mask.dtype != torch.bool:
        raise TypeError(f"pack_bits takes a bool tensor, got {mask.dtype}; pass e.g. `x > 0`")
    flat = mask.reshape(-1)
    pad = (-flat.numel()) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    weights = torch.tensor(_BIT_WEIGHTS, dtype=torch.uint8, device=mask.device)
    # each row of 8 flags times 1, 2, 4, ..., 128 summed is one byte (at most 255: no overflow)
    return (flat.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The bool tensor of ``shape`` that :func:`pack_bits` turned into ``packed``."""
    n = math.prod(shape)
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:n].to(torch.bool).view(shape)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: int8 ``q = round(x / scale)`` in [-127, 127], fp32 ``scale = max|x| / 127``."""
    absmax = x.detach().abs().max().float() if x.numel() else torch.zeros((), device=x.device)
    scale = torch.where(absmax > 0, absmax / 127, torch.ones_like(absmax))  # all-zero x: any scale works
    q = torch.round(x.float() / scale).clamp_(-127, 127).to(torch.int8)
    return q, scale.reshape(())


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


class _BinarizedReLU(torch.autograd.Function):
    """ReLU that saves a bool mask ``x > 0`` for backward instead of its float output (Gist's Binarize)."""

    @staticmethod
    def forward(ctx, x):
        mask = x > 0
        ctx.save_for_backward(mask)  # 1 byte per element as bool, 1 bit once compress_activations packs it
        return x * mask  # not torch.relu: that would save the float output as well

    @staticmethod
    def backward(ctx, grad_out):
        (mask,) = ctx.saved_tensors
        return grad_out * mask


def gist_relu(x: torch.Tensor) -> torch.Tensor:
    """``relu(x)``, saving a 1-bit-encodable mask for backward; values and gradients equal
    ``torch.relu``'s."""
    return _BinarizedReLU.apply(x)


class GistReLU(torch.nn.Module):
    """``nn.ReLU`` that saves a bool mask for backward (see :func:`gist_relu`)."""

    def forward(self, x):
        return gist_relu(x)


# --- the hooks ----------------------------------------------------------------------------------------

def _is_parameter(t: torch.Tensor) -> bool:
    base = t._base if t._base is not None else t
    return isinstance(t, torch.nn.Parameter) or isinstance(base, torch.nn.Parameter)


class _Packed:
    """What autograd keeps instead of a saved tensor: the payload and how to decode it."""

    __slots__ = ("encoding", "payload", "shape", "dtype")

    def __init__(self, encoding, payload, shape, dtype):
        self.encoding, self.payload, self.shape, self.dtype = encoding, payload, shape, dtype


class compress_activations(saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it are kept encoded (Gist, Jain et al. 2018).

    >>> gist = compress_activations("fp16")
    >>> with gist:
    ...     loss = model(x, y)[1]
    >>> loss.backward()                       # each saved tensor is decoded when backward needs it
    >>> gist.raw_bytes, gist.encoded_bytes    # what autograd would have kept vs what it kept

    Args:
        encoding: for floating-point tensors: "none" (kept as they are), "fp16" or "int8".
            Bool tensors (e.g. :func:`gist_relu`'s mask) are always bit-packed, losslessly.
    Counters (cumulative; ``reset()`` zeroes them): ``raw_bytes``, ``encoded_bytes``, ``tensors``,
    ``by_encoding[name] = [tensors, raw_bytes, encoded_bytes]`` with names "mask", "fp16", "int8",
    "none" (floats kept, or integer tensors, which are never encoded); ``parameters_skipped``.
    """

    def __init__(self, encoding: str = "fp16"):
        if encoding not in ENCODINGS:
            raise ValueError(f"encoding {encoding!r} is not one of {ENCODINGS} "
                             "(bool tensors / ReLU masks are bit-packed under every encoding)")
        self.encoding = encoding
        self._lock = threading.Lock()
        self.reset()
        super().__init__(self._pack, self._unpack)

    def reset(self) -> None:
        self.raw_bytes = self.encoded_bytes = self.tensors = self.parameters_skipped = 0
        self.by_encoding = defaultdict(lambda: [0, 0, 0])

    @property
    def ratio(self) -> float:
        """raw / encoded bytes over everything counted so far (1.0 before anything was saved)."""
        return self.raw_bytes / self.encoded_bytes if self.encoded_bytes else 1.0

    def _pack(self, t: torch.Tensor):
        # Autograd calls this with grad mode off: the encoding is not recorded in the graph.
        if _is_parameter(t):
            with self._lock:
                self.parameters_skipped += 1
            return t
        if t.layout != torch.strided:
            name, payload = "none", (t.detach(),)
        elif t.dtype == torch.bool:
            name, payload = "mask", (pack_bits(t),)
        elif not t.is_floating_point() or self.encoding == "none":
            name, payload = "none", (t.detach(),)
        elif self.encoding == "fp16":
            name, payload = "fp16", (t.detach().to(torch.float16),)
        else:
            name, payload = "int8", quantize_int8(t.detach())
        raw = t.numel() * t.element_size()
        enc = sum(p.numel() * p.element_size() for p in payload)
        with self._lock:
            self.raw_bytes += raw
            self.encoded_bytes += enc
            self.tensors += 1
            row = self.by_encoding[name]
            row[0] += 1
            row[1] += raw
            row[2] += enc
        return _Packed(name, payload, t.shape, t.dtype)

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, _Packed):
            return packed  # a parameter, saved as itself
        if packed.encoding == "mask":
            return unpack_bits(packed.payload[0], packed.shape)
        if packed.encoding == "int8":
            return dequantize_int8(*packed.payload, dtype=packed.dtype)
        if packed.encoding == "fp16":
            return packed.payload[0].to(packed.dtype)
        return packed.payload[0]

    def __repr__(self) -> str:
        rows = ", ".join(f"{k}: {v[0]} tensors {v[1]}->{v[2]} B" for k, v in sorted(self.by_encoding.items()))
        return (f"compress_activations({self.encoding!r}, raw={self.raw_bytes} B, "
                f"encoded={self.encoded_bytes} B, x{self.ratio:.2f}; {rows or 'nothing saved'})")
