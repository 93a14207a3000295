"""Chapter 10 — dropless MoE: every token processed, all experts in one grouped GEMM.

Gale, Narayanan, Young & Zaharia 2023, "MegaBlocks: Efficient Sparse Training with Mixture-of-Experts"
(MLSys), "No-Token-Left-Behind with Block Sparsity": capacity exists because a batched matmul wants
every expert's input to be the same [C, h] block; drop that wish and the experts' work is one
matmul whose row blocks have variable sizes. No token is dropped, no slot is padded.

For A assignments sorted by expert (expert e owns the contiguous rows ``[o_e, o_e + n_e)``, n_e its
load, o_e = Σ_{j<e} n_j) and expert weights stacked along a leading expert dim, W [E, h, d_ff]:

    grouped GEMM    Y[o_e : o_e + n_e] = X[o_e : o_e + n_e] @ W[e]        for every e, in one call

MegaBlocks writes it as a block-sparse matrix product; later systems (Megatron-Core's GroupedMLP,
PyTorch's ``torch._grouped_mm``) call it a grouped GEMM. Here an expert (c_fc, GELU, c_proj) is two
grouped GEMMs with the GELU between, over the rows :func:`.moe.dispatch` already sorted by expert;
:func:`.moe.combine` scatters the results back to their tokens. Two implementations of one formula:

    "grouped_mm"    torch._grouped_mm (PyTorch >= 2.8: CPU fp32 / bf16; CUDA bf16 on sm90+), rows of
                    16-byte-aligned width; offsets = the cumulative loads
    "loop"          one matmul per expert over its contiguous slice (any dtype and device)

``impl="auto"`` picks the first that applies. FLOPs are ``4·h·d_ff·Σ_e n_e`` forward, exactly the
routed work (``costmodel.dropless_expert_flops``); a capacity-based layer computes ``E·C`` rows
whatever the load (``costmodel.capacity_expert_flops``) and drops ``Σ max(0, n_e − C)``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .moe import MoELayer, Router, combine, dispatch, make_router

__all__ = ["IMPLS", "grouped_mm_supported", "grouped_linear", "grouped_experts", "DroplessMoELayer"]

IMPLS = ("auto", "grouped_mm", "loop")


def grouped_mm_supported(x: torch.Tensor, *widths: int) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``x``'s dtype and device with rows of these ``widths``:
    this torch has it; CPU fp32 / bf16, or CUDA bf16 on compute capability >= 9.0; every width a
    multiple of 16 bytes (the kernel's stride rule)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        ok_dtype = x.dtype in (torch.float32, torch.bfloat16)
    elif x.device.type == "cuda":
        ok_dtype = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        ok_dtype = False
    return ok_dtype and all((w * x.element_size()) % 16 == 0 for w in widths)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: ``torch._grouped_mm``'s backward
    refuses a broadcast (stride-0) gradient, which e.g. ``y.sum().backward()`` produces."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def _offsets(counts: list[int], device) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, counts: list[int],
                   impl: str = "loop") -> torch.Tensor:
    """Rows of expert e (the e-th block of ``counts[e]`` rows of x [A, k]) times ``weight[e]`` [k, m],
    plus ``bias[e]`` [m]: [A, m]. ``impl``: "grouped_mm" (one call) or "loop" (one matmul per expert)."""
    if impl == "grouped_mm":
        y = _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), weight, offs=_offsets(counts, x.device)))
    elif impl == "loop":
        y = torch.cat([xe @ we for xe, we in zip(x.split(counts), weight.unbind(0))])
    else:
        raise ValueError(f"impl must be 'grouped_mm' or 'loop' here, got {impl!r}")
    if bias is not None:
        y = y + bias.repeat_interleave(torch.tensor(counts, device=x.device), dim=0,
                                       output_size=x.size(0))
    return y


def _stacked(linears, attr):
    """[E, in, out] weights (nn.Linear keeps [out, in]) or [E, out] biases of one layer of every expert."""
    if attr == "weight":
        return torch.stack([lin.weight.t() for lin in linears])
    return None if linears[0].bias is None else torch.stack([lin.bias for lin in linears])


def _pick_impl(impl: str, packed: torch.Tensor, h: int, d_ff: int) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    supported = packed.size(0) > 0 and grouped_mm_supported(packed, h, d_ff)
    if impl == "grouped_mm" and not supported:
        raise ValueError(f"torch._grouped_mm cannot run {packed.dtype} rows of width {h} / {d_ff} on "
                         f"{packed.device.type} (it needs CPU fp32/bf16 or CUDA bf16 on sm90+, widths whose "
                         f"bytes are multiples of 16, and at least one row); use impl='loop' or 'auto'")
    return "grouped_mm" if impl == "grouped_mm" or (impl == "auto" and supported) else "loop"


def grouped_experts(experts, packed: torch.Tensor, counts: list[int], impl: str = "auto") -> torch.Tensor:
    """Every :class:`~.moe.Expert` MLP on its block of ``counts[e]`` rows of ``packed`` [A, h], as two
    grouped GEMMs: ``c_proj(GELU(c_fc(X)))`` with each expert's weights on its own rows. The same
    numbers as :func:`~.moe.run_experts`; experts with no rows get zero gradients."""
    if len(counts) != len(experts) or sum(counts) != packed.size(0):
        raise ValueError(f"counts {counts} must give one block per expert ({len(experts)}) "
                         f"and add up to the {packed.size(0)} packed rows")
    fc, proj = [e.c_fc for e in experts], [e.c_proj for e in experts]
    impl = _pick_impl(impl, packed, fc[0].in_features, fc[0].out_features)
    hidden = grouped_linear(packed, _stacked(fc, "weight"), _stacked(fc, "bias"), counts, impl)
    hidden = F.gelu(hidden, approximate="tanh")
    return grouped_linear(hidden, _stacked(proj, "weight"), _stacked(proj, "bias"), counts, impl)


class DroplessMoELayer(MoELayer):
    """An :class:`~.moe.MoELayer` that drops nothing: its router has no capacity, and the experts run as
    grouped GEMMs (:func:`grouped_experts`) over the tokens sorted by expert. ``impl``: "auto",
    "grouped_mm" or "loop". ``forward(x, path="dropless" | "dispatch" | "dense")``: the last two are
    :class:`MoELayer`'s (a per-expert loop, and every expert on every token), kept as references.
    Every token-choice router works when built with ``capacity_factor=None``; expert choice fixes each
    expert's load and leaves tokens unpicked, so it is refused.
    """

    def __init__(self, h: int, d_ff: int, n_experts: int, router: Router | str = "switch", bias: bool = True,
                 impl: str = "auto"):
        if router == "expert_choice" or getattr(router, "capacity_factor", None) is not None:
            name = router if isinstance(router, str) else type(router).__name__
            raise ValueError("a dropless MoE has no expert capacity: build its router with "
                             f"capacity_factor=None (got {name} with capacity_factor="
                             f"{getattr(router, 'capacity_factor', 'fixed')}); expert choice, which fixes "
                             "every expert's load, cannot be dropless")
        if isinstance(router, str):
            router = make_router(router, h, n_experts, capacity_factor=None)
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        super().__init__(h, d_ff, n_experts, router, bias)
        self.impl = impl

    def forward(self, x: torch.Tensor, path: str = "dropless") -> torch.Tensor:
        if path != "dropless":
            return super().forward(x, path)
        if x.size(-1) != self.h:
            raise ValueError(f"DroplessMoELayer expects [..., h={self.h}] inputs, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.h)
        routing = self.last_routing = self.router(tokens)
        if routing.capacity is not None or routing.dropped:
            raise RuntimeError(f"the router dropped {routing.dropped} assignments (capacity "
                               f"{routing.capacity}): a dropless MoE needs a router without capacity")
        packed, counts = dispatch(tokens, routing)
        y = combine(grouped_experts(self.experts, packed, counts, self.impl), routing, tokens.size(0))
        return y.reshape(x.shape)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, dropless, impl={self.impl}"
