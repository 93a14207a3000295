"""Chapter 08 — FSDP all-gathers in fp8: a unit's weights cross the wire in 1 byte each, plus a scale.

FSDP (chapter 06) all-gathers every unit's parameters twice per step, in ``param_dtype``. With
``fully_shard(module, fp8_all_gather=True)`` each rank instead casts its shard to E4M3 with one
scale of its own, ``s_r = 448 / amax(shard_r)``, and all-gathers ``[fp8 bytes | s_r as 4 bytes]``;
every rank then dequantises each rank's piece, ``w = q / s_r``, into the full buffer the unit computes
with (``param_dtype``, or the parameters' own dtype). The master shard stays fp32 and receives the
gradient of the dequantised weights (a straight-through estimator: the cast is treated as the identity
in backward), reduce-scattered as before. Bytes on the wire per rank per all-gather of Ψ_u elements
(S = ceil(Ψ_u / n) per shard, ``costmodel.precision.all_gather_buffer_bytes``)::

    fp32: n·4S      bf16: n·2S      fp8: n·(S + 4)      -> half of bf16, a quarter of fp32

PyTorch's FSDP2 does the same with torchao's ``Float8Linear`` weights
(``Float8LinearConfig(enable_fsdp_float8_all_gather=True)``): a tensor subclass whose
``fsdp_pre_all_gather`` casts the shard to fp8 and ``fsdp_post_all_gather`` wraps the gathered bytes,
so the fp8 GEMM uses them directly. torchao scales per tensor from an all-reduced amax; here the
scale is per shard, which needs no extra collective. One difference to know: here the scale covers
every tensor in the shard (the flat buffer mixes a block's Linear weights, biases and LayerNorm
weights), where torchao casts only the Linear weights; make each Linear its own unit to keep the
rest in ``param_dtype``.
"""
from __future__ import annotations

import functools

import torch

from ...runtime import comm
from ..fp8 import FP8_FORMATS, cast_to_fp8, fp8_format, scale_from_amax

_SCALE_BYTES = 4  # one fp32 scale per shard


def fp8_all_gather_format(value) -> str | None:
    """The fp8 format of ``fully_shard``'s ``fp8_all_gather`` option: False/None -> None (off),
    True -> ``'e4m3'``, or ``'e4m3'`` / ``'e5m2'``."""
    if value is None or value is False:
        return None
    if value is True:
        return "e4m3"
    if isinstance(value, str):
        return fp8_format(value)
    raise ValueError(f"fp8_all_gather must be True, False, 'e4m3' or 'e5m2', got {value!r}")


class _Fp8Gather:
    """An all-gather of fp8 shards in flight: ``wait()`` finishes it and dequantises into ``full``.

    The unit calls ``wait()`` under the version-counter guard of ``full``, so writing the
    dequantised weights there is as invisible to autograd as the plain all-gather's write."""

    def __init__(self, work, part, recv, fmt):
        self.work, self.part, self.recv, self.fmt = work, part, recv, fmt

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        n, S = self.part.unit.n, self.part.flat.shard_numel
        q = self.recv[:, :S].view(FP8_FORMATS[self.fmt])  # (n, S) fp8, one row per rank
        scales = self.recv[:, S:].contiguous().view(torch.float32)  # (n, 1)
        with torch.no_grad():
            self.part.full.view(n, S).copy_(q.float() / scales)
        self.recv = None


def quantize_shard(shard: torch.Tensor, fmt: str = "e4m3") -> torch.Tensor:
    """``[fp8 bytes of shard * s | s as 4 bytes]`` (uint8), ``s = fp8_max / amax(shard)`` (1 if all 0)."""
    scale = scale_from_amax(shard.detach().abs().amax() if shard.numel() else shard.new_zeros(()), fmt)
    data = cast_to_fp8(shard.detach(), scale, fmt).view(torch.uint8)
    return torch.cat([data, scale.float().reshape(1).view(torch.uint8)])


def _fp8_all_gather(part, fmt: str, async_op: bool) -> None:
    """A :class:`.fsdp_unit.FlatPart`'s ``all_gather`` with fp8 on the wire (same protocol: the unit's
    ``wait`` finds ``(work, guard, send)`` in ``part.pending``)."""
    part.full.untyped_storage().resize_(part.full_bytes)
    guard = torch.autograd._unsafe_preserve_version_counter(part.full)
    send = quantize_shard(part.shard, fmt)
    recv = send.new_empty(part.unit.n, send.numel())
    work = comm.all_gather(recv.view(-1), send, group=part.unit.group, async_op=async_op)
    part.pending = (_Fp8Gather(work, part, recv, fmt), guard, send)


def enable_fp8_all_gather(unit, fmt: str = "e4m3") -> None:
    """Make every part of ``unit`` (a :class:`.fsdp_unit.FlatUnit`) all-gather in fp8 ``fmt``."""
    fmt = fp8_format(fmt)
    for part in unit.parts:
        part.all_gather = functools.partial(_fp8_all_gather, part, fmt)
    unit.fp8_all_gather = fmt
