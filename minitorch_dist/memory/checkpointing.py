"""Chapter 07 — activation checkpointing: keep a few activations, recompute the rest during backward.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", §3-4. Split n layers into k
segments and keep only each segment's *input* (its boundary) in forward; in backward, re-run one
segment at a time with gradients on and back-propagate through it. With per-layer activations L
and boundary tensors B the saved bytes become

    peak(k) ≈ k·B + (n/k)·L        (the k boundaries + one segment's activations while recomputed)

which is smallest at k = √(n·L/B), i.e. k = √n for B ≈ L: O(√n) memory for one extra forward
(≈ 1/3 more compute, a step being forward + backward ≈ 1 + 2). Recursing on the segments gives
O(log n) memory for O(n log n) compute (Chen §4; Griewank & Walther 2000, "Algorithm 799: revolve").

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §5:
recompute only what is cheap to recompute and expensive to keep. In attention, the a·s² scores,
their softmax and its dropout cost 5·a·s²·b bytes per layer (16-bit) against 34·s·b·h for the rest,
yet only the two batched matmuls QKᵀ and (softmax)·V produce them. *Selective* recomputation
keeps q, k, v and recomputes softmax(QKᵀ/√d + mask)·V in backward: a few percent more FLOPs.

Dropout makes recomputation subtle: the recomputed forward must draw the same random masks, so
``checkpoint`` saves the RNG state (CPU and the inputs' CUDA devices) and restores it in backward.

Contents: ``checkpoint`` · ``checkpoint_sequential`` (the √n rule) · ``count_forwards`` (forward
hooks that count how often each block ran) · ``attention_core`` / ``ExplicitAttention``
(selective recomputation) · ``apply_recompute(model, policy)`` for the GPT · ``plan_segments``
(segment boundaries for a memory budget) and ``segment_peak_bytes`` (its memory model).
"""
from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..costmodel.checkpointing import segment_peak_bytes

__all__ = [
    "checkpoint", "checkpoint_sequential", "sqrt_segments", "segment_bounds", "count_forwards",
    "attention_core", "ExplicitAttention", "apply_recompute", "RECOMPUTE_POLICIES",
    "plan_segments", "segment_peak_bytes",
]


# --- checkpoint -----------------------------------------------------------------------------------
class _Checkpoint(torch.autograd.Function):
    """forward: run fn without a graph, keep its inputs (+ RNG state). backward: re-run, backprop.

    Why an ``autograd.Function`` (PyTorch's ``use_reentrant=True`` design) rather than
    saved-tensor hooks (``use_reentrant=False``): it is the algorithm of Chen et al. in ten lines,
    and it composes with ``MemoryMeter``, which counts activations through saved-tensor hooks.
    ``save_for_backward`` passes the kept inputs through the meter's hooks, and the recomputation
    runs under them too, so the meter sees both what is kept and the bump of recomputing one
    segment. A hooks-based checkpoint would install its own innermost hooks and hide both.
    The price: it supports ``loss.backward()`` only, not ``torch.autograd.grad``, because the
    recomputed graph accumulates into ``.grad`` of the parameters inside ``fn`` directly.
    """

    @staticmethod
    def forward(ctx, fn, preserve_rng_state, _anchor, *args):
        ctx.fn, ctx.preserve_rng_state = fn, preserve_rng_state
        # Tensors go through save_for_backward (which checks nobody modified them in place before
        # backward); other arguments are kept as they are.
        ctx.is_tensor = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_tensor)]
        tensors = [a for a, t in zip(args, ctx.is_tensor) if t]
        ctx.save_for_backward(*tensors)
        if preserve_rng_state:
            ctx.cpu_rng = torch.get_rng_state()
            ctx.cuda_devices = sorted({t.device.index for t in tensors if t.is_cuda})
            ctx.cuda_rng = [torch.cuda.get_rng_state(d) for d in ctx.cuda_devices]
        # Recompute under the same autocast as now (mixed precision, ch08), or the activations differ.
        ctx.autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                        for d in ("cpu", "cuda")}
        with torch.no_grad():  # no graph: nothing inside fn is kept
            return fn(*args)

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint() supports loss.backward() only, not torch.autograd.grad(); "
                               "use torch.utils.checkpoint.checkpoint(..., use_reentrant=False) for that")
        # Detached copies are the leaves of the recomputed graph: it stops there, and their .grad
        # is what this node hands on to the graph before the checkpoint.
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        it = iter(leaves)
        args = [next(it) if t else a for a, t in zip(ctx.others, ctx.is_tensor)]
        devices = ctx.cuda_devices if ctx.preserve_rng_state else []
        # fork_rng: the restored state serves the recomputation only; afterwards the caller's RNG
        # stream continues as if backward had drawn nothing.
        with torch.random.fork_rng(devices=devices, enabled=ctx.preserve_rng_state):
            if ctx.preserve_rng_state:
                torch.set_rng_state(ctx.cpu_rng)
                for d, state in zip(ctx.cuda_devices, ctx.cuda_rng):
                    torch.cuda.set_rng_state(state, d)
            with torch.enable_grad(), _autocast(ctx.autocast):
                outputs = ctx.fn(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                 if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
        if pairs:  # parameters inside fn accumulate their .grad here
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        it = iter(leaves)
        grads = [next(it).grad if t else None for t in ctx.is_tensor]
        return (None, None, None, *grads)


@contextlib.contextmanager
def _autocast(state: dict):
    with contextlib.ExitStack() as stack:
        for device, (enabled, dtype) in state.items():
            if enabled:
                stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


def checkpoint(fn: Callable, *args, preserve_rng_state: bool = True):
    """``fn(*args)`` computed without keeping its activations; they are recomputed in backward.

    Keeps only the tensor arguments (and the RNG state, so dropout draws the same masks when
    re-run). ``args`` may mix tensors and other values; ``fn`` may return a tensor or a tuple.
    Parameters used inside ``fn`` get their gradients during ``loss.backward()``, even when no
    input requires grad. ``preserve_rng_state=False`` skips the RNG bookkeeping: correct only
    for an ``fn`` that draws no random numbers (the tests show dropout gradients go wrong without it).
    """
    if not torch.is_grad_enabled():  # no backward will come: nothing to save or recompute
        return fn(*args)
    # A leaf that requires grad makes the output require grad, so backward reaches this node and
    # the parameters inside fn get gradients even if no input needs one.
    anchor = torch.empty(0, requires_grad=True)
    return _Checkpoint.apply(fn, preserve_rng_state, anchor, *args)


# --- checkpoint_sequential: the √n rule -----------------------------------------------------------
def sqrt_segments(n: int) -> int:
    """Chen et al.'s rule: k = round(√n) segments minimise k·B + (n/k)·L when B ≈ L."""
    return max(1, round(math.sqrt(n)))


def segment_bounds(n: int, segments: int | Sequence[int] | None) -> list[int]:
    """Boundaries [0, b1, ..., n] of ``segments`` contiguous segments of n layers.

    ``None`` -> the √n rule; an int k -> k segments as equal as possible (the first n % k one layer
    longer); a list -> taken as boundaries (e.g. from ``plan_segments``) after checking it.
    """
    if segments is None:
        segments = sqrt_segments(n)
    if isinstance(segments, int):
        if not 1 <= segments <= n:
            raise ValueError(f"segments must be between 1 and the number of layers {n}, got {segments}; "
                             f"use segments=None for the sqrt(n) rule ({sqrt_segments(n)} here)")
        size, extra = divmod(n, segments)
        bounds = [0]
        for j in range(segments):
            bounds.append(bounds[-1] + size + (j < extra))
        return bounds
    bounds = list(segments)
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != n or any(a >= b
                                                                   for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"segment boundaries must rise strictly from 0 to {n} (e.g. [0, 3, {n}]), got "
                         f"{bounds}")
    return bounds


def _run_blocks(blocks: Sequence[Callable], x):
    for block in blocks:
        x = block(x)
    return x


def checkpoint_sequential(blocks: Sequence[Callable], segments: int | Sequence[int] | None, x: torch.Tensor,
                          checkpoint_last: bool = False, preserve_rng_state: bool = True) -> torch.Tensor:
    """Run ``blocks`` in order on ``x``, checkpointing ``segments`` contiguous segments of them.

    ``segments``: an int k, ``None`` for round(√n), or boundaries [0, ..., n] (``plan_segments``).
    As in ``torch.utils.checkpoint.checkpoint_sequential`` the last segment runs normally by
    default: its activations would be recomputed right after being dropped, a wasted forward.
    Unlike torch, an uneven split puts the extra layers in the first segments, not all in the last.
    """
    blocks = list(blocks)
    bounds = segment_bounds(len(blocks), segments)
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        last = j == len(bounds) - 2
        if last and not checkpoint_last:
            x = _run_blocks(blocks[a:b], x)
        else:
            x = checkpoint(_run_blocks, blocks[a:b], x, preserve_rng_state=preserve_rng_state)
    return x


# --- counting forwards --------------------------------------------------------------------------
@contextlib.contextmanager
def count_forwards(modules: Iterable[nn.Module] | Mapping[Any, nn.Module]):
    """Count how many times each module's forward runs inside the block.

    >>> with count_forwards(model.blocks) as runs:   # keys: 0..n-1 (or the mapping's keys)
    ...     model(x, y)[1].backward()
    >>> runs   # {0: 2, 1: 2, 2: 1}: a checkpointed block runs twice per step, once re-run in backward
    """
    items = modules.items() if isinstance(modules, Mapping) else enumerate(modules)
    counts: dict[Any, int] = {}
    handles = []
    for key, module in items:
        counts[key] = 0
        handles.append(module.register_forward_hook(
            lambda *_, key=key: counts.__setitem__(key, counts[key] + 1)))
    try:
        yield counts
    finally:
        for h in handles:
            h.remove()


# --- selective recomputation of the attention core (Korthikanti §5) -------------------------------
def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0) -> torch.Tensor:
    """softmax(q·kᵀ/√d + M)·v with the causal mask M, written out so its activations are visible.

    q, k, v: (b, a, s, d). Autograd keeps the softmax output (b·a·s² floats), the dropout mask
    (b·a·s² elements) and the dropout output (b·a·s² floats): Korthikanti's 5·a·s²·b in 16-bit
    (2 + 1 + 2 bytes per score); in fp32 4 + m + 4, m = 4 on CPU, where dropout keeps a float
    mask, 1 on CUDA (a bool mask). ``F.scaled_dot_product_attention`` is not a fair baseline: on
    CPU without dropout its fused kernel keeps only the log-sum-exp (b·a·s floats) and recomputes
    the scores in its own backward -- selective recomputation built in (FlashAttention, Dao et al.
    2022) -- while with dropout it falls back to the math path and keeps all of them.
    """
    s = q.size(-2)
    mask = torch.full((s, s), float("-inf"), device=q.device, dtype=q.dtype).triu(1)  # an add keeps nothing
    att = torch.softmax(q @ k.transpose(-2, -1) * (1.0 / math.sqrt(q.size(-1))) + mask, dim=-1)
    if dropout_p > 0:
        att = F.dropout(att, dropout_p, training=True)
    return att @ v


class ExplicitAttention(nn.Module):
    """Drop-in for the GPT's ``CausalSelfAttention`` that computes the core with ``attention_core``.

    Built *from* an existing attention module: it shares its ``c_attn``, ``c_proj`` and
    ``resid_dropout`` (same parameters, same state-dict names). ``selective=True`` wraps the core
    in ``checkpoint``: q, k, v (views of the c_attn output, kept anyway) are saved, the a·s²
    tensors are recomputed in backward. The module it replaced is kept in ``.original`` (not
    registered as a child, so parameters are not listed twice).
    """

    def __init__(self, attn: nn.Module, selective: bool = False):
        super().__init__()
        self.c_attn, self.c_proj, self.resid_dropout = attn.c_attn, attn.c_proj, attn.resid_dropout
        self.head_dim, self.dropout, self.selective = attn.head_dim, attn.dropout, selective
        self.__dict__["original"] = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = checkpoint(attention_core, q, k, v, p) if self.selective else attention_core(q, k, v, p)
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


RECOMPUTE_POLICIES = ("none", "explicit", "selective", "full", "sqrt")


def _recomputed_forward(model, idx, targets=None):
    """GPT.forward with the blocks checkpointed ("full": each block; "sqrt": √n segments)."""
    h = model.embed(idx)
    if model.recompute_policy == "full":
        for block in model.blocks:
            h = checkpoint(block, h)
    else:
        h = checkpoint_sequential(model.blocks, model.recompute_segments, h)
    logits = model.head(h)
    return logits, (None if targets is None else model.loss_fn(logits, targets))


def apply_recompute(model: nn.Module, policy: str, segments: int | Sequence[int] | None = None) -> nn.Module:
    """Switch a ``models.gpt.GPT`` among recomputation policies, in place; returns the model.

    =============  ==================================================================================
    "none"         the model as built: SDPA attention (keeps the a·s² tensors on CPU only with dropout)
    "explicit"     attention core written out (``attention_core``): keeps the a·s² tensors, what
                   Korthikanti's recompute="none" formula counts -- the baseline for "selective"
    "selective"    that core checkpointed: scores recomputed (Korthikanti recompute="selective")
    "full"         every block checkpointed: only block inputs kept (Korthikanti recompute="full")
    "sqrt"         ``checkpoint_sequential`` over the blocks; ``segments`` as there (None: √n)
    =============  ==================================================================================

    Parameters and their names are untouched (state dicts load either way); switching back and forth
    is allowed. "full" and "sqrt" replace ``model.forward`` on this instance by one that checkpoints
    the loop over ``model.blocks``; the blocks themselves are unchanged, so hooks on them still fire.
    """
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"unknown recompute policy {policy!r}; expected one of {RECOMPUTE_POLICIES}")
    if not hasattr(model, "blocks") or not hasattr(model, "embed"):
        raise TypeError(f"apply_recompute expects a minitorch_dist GPT (with .embed and .blocks), "
                        f"got {type(model).__name__}")
    if policy == "sqrt":
        segment_bounds(len(model.blocks), segments)  # validate now, not at the first forward
    for block in model.blocks:
        attn = block.attn.original if isinstance(block.attn, ExplicitAttention) else block.attn
        attn.train(block.training)  # it missed .train()/.eval() calls while swapped out
        explicit = policy in ("explicit", "selective")
        block.attn = ExplicitAttention(attn, selective=policy == "selective") if explicit else attn
    model.recompute_policy, model.recompute_segments = policy, segments
    if policy in ("full", "sqrt"):
        model.forward = types.MethodType(_recomputed_forward, model)
    else:
        model.__dict__.pop("forward", None)  # back to GPT.forward
    return model


# --- the planner: segment boundaries for a memory budget --------------------------------------------
# (its memory model, ``segment_peak_bytes``, is a formula: it lives in costmodel)
def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n:.0f} B"


def plan_segments(layer_bytes: Sequence[int], boundary_bytes: Sequence[int], budget_bytes: float,
                  layer_flops: Sequence[float] | None = None) -> list[int]:
    """Boundaries [0, ..., n] for ``checkpoint_sequential`` that recompute least within ``budget_bytes``.

    Recompute cost = Σ layer_flops over the checkpointed segments (all but the last; default
    one unit per layer); ties go to the lower ``segment_peak_bytes``. A generous budget gives
    [0, n] (no checkpointing); a tight one pushes more layers into checkpointed segments.

    Exact search, O(n⁴) for n layers (tens in practice): for every cap M on a segment's
    activations (a sum of consecutive layer_bytes), a dynamic program finds the cheapest set of
    boundaries covering layers [0, t) with segments of at most M; the tail [t, n) runs normally.
    """
    n = len(layer_bytes)
    if n == 0 or len(boundary_bytes) != n:
        raise ValueError(f"need one boundary size per layer: {n} layer_bytes, "
                         f"{len(boundary_bytes)} boundary_bytes")
    cost = [1.0] * n if layer_flops is None else list(layer_flops)
    if len(cost) != n or min(cost) < 0 or min(layer_bytes) < 0 or min(boundary_bytes) < 0:
        raise ValueError("layer_bytes, boundary_bytes and layer_flops must be n non-negative numbers")
    P = [0]  # prefix sums: a segment [i, j) holds P[j] - P[i] bytes of activations
    for b in layer_bytes:
        P.append(P[-1] + b)
    plans = []  # (recompute, peak, tail start t, back-pointers)
    for M in sorted({P[j] - P[i] for i in range(n) for j in range(i + 1, n + 1)}):
        # f[j]: least boundary bytes splitting layers [0, j) into segments of <= M bytes; prev[j]: last cut.
        f, prev = [0.0] + [math.inf] * n, [0] * (n + 1)
        for j in range(1, n + 1):
            for i in range(j):
                if P[j] - P[i] <= M and f[i] + boundary_bytes[i] < f[j]:
                    f[j], prev[j] = f[i] + boundary_bytes[i], i
        for t in range(n):  # the tail [t, n) is the last segment, run without checkpoint
            if P[n] - P[t] <= M and f[t] < math.inf:
                plans.append((sum(cost[:t]), f[t] + M, t, prev))
    lowest = min(p[1] for p in plans)  # t = 0, M = everything: no checkpointing, always a plan
    if lowest > budget_bytes:
        raise ValueError(f"budget {_fmt_bytes(budget_bytes)} is below the smallest possible peak "
                         f"{_fmt_bytes(lowest)}: no split of these {n} layers fits; raise the budget or "
                         "shrink the layers (smaller micro-batch, sequence/tensor parallelism, "
                         "selective recomputation)")
    _, _, t, prev = min((p for p in plans if p[1] <= budget_bytes), key=lambda p: p[:2])
    bounds, j = [n], t
    while j > 0:
        bounds.append(j)
        j = prev[j]
    return [0] + bounds[::-1]
