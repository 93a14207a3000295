"""Chapter 07 — activation checkpointing: saved bytes, the best number of segments, recompute FLOPs,
offload bytes.

Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost": §4.3 (k segments, O(√n)
memory for one extra forward), §4.4 (recursion: O(log n) memory for O(n log n) forward work).
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §5
(selective recomputation of the attention core). Rhu et al. 2016, vDNN, §3 (offload traffic).
Per-layer activation bytes of a transformer are :func:`.memory.activation_memory_bytes`.

The model of a network used here is Chen's: a chain of ``n`` layers; running layer i normally
saves ``L`` bytes for backward (``layer_bytes``); a checkpoint keeps only a segment's input, ``b``
bytes (``boundary_bytes``), and recomputes the segment in backward. Bytes are saved-for-backward
bytes (what ``MemoryMeter`` calls activations); gradients in flight are not counted.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from functools import cache

from .compute import megatron_flops_per_step
from .memory import RECOMPUTE


def _check_chain(n_layers, layer_bytes, boundary_bytes):
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
        raise ValueError(f"n_layers must be an int >= 1, got {n_layers!r}")
    if layer_bytes < 0 or boundary_bytes < 0:
        raise ValueError(f"layer_bytes and boundary_bytes must be >= 0, got {layer_bytes}, {boundary_bytes}")


def segment_sizes(n_layers: int, segments: int) -> list[int]:
    """Split ``n_layers`` into ``segments`` runs as equal as possible, the longer ones first:
    with n = q·k + r, r segments of q+1 layers then k−r of q (``numpy.array_split``'s order)."""
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n_layers:
        raise ValueError(f"segments must be an int in [1, n_layers={n_layers}], got {segments!r}")
    q, r = divmod(n_layers, segments)
    return [q + 1] * r + [q] * (segments - r)


def checkpoint_saved_bytes(n_layers: int, layer_bytes: float, boundary_bytes: float,
                           segments: int | Sequence[int] | None, checkpoint_last: bool = True) -> float:
    """Peak saved bytes of a chain of ``n_layers`` layers trained with ``segments`` checkpoints
    (Chen et al. 2016, §4.3).

    ``segments``: ``None`` (no checkpointing), an int k (:func:`segment_sizes`), or the list of
    segment lengths s_1..s_k (summing to n; what a planner chooses). Forward keeps each
    checkpointed segment's input (b each). Backward walks the segments last to first; while
    segment j is recomputed and back-propagated, the inputs of segments 1..j are still kept and
    its s_j layers hold their L bytes each, so

        peak = max_j ( c_j · b + s_j · L ),   c_j = j  (every segment checkpointed),

    For an int k, n = q·k + r (r segments of q+1 first), only j = r and j = k can peak:

        peak = max( k·b + q·L,  r·b + (q+1)·L  [if r > 0] )

    With k dividing n this is Chen's  k·b + (n/k)·L; otherwise it is at most k·b + ceil(n/k)·L.
    Special cases: ``segments=None`` → n·L; k = n (every layer) → n·b + L; k = 1 → b + n·L.

    ``checkpoint_last=False`` runs the last segment normally (as ``torch.utils.checkpoint.
    checkpoint_sequential`` and ``memory.checkpointing.checkpoint_sequential`` do: its backward
    starts right after its forward, so recomputing it would buy nothing): c_k = k − 1, i.e. the
    last segment's internals are held at the end of the forward instead of its input, and the
    extra compute is (n − s_k)/n of a forward. Then k = 1 is no checkpointing, n·L.

    The chain model counts a layer's own input inside L separately from the boundary b. In a
    pre-LN transformer block the first LayerNorm saves the block input, which *is* the boundary
    tensor: a meter counting storages then sees each recomputed segment's boundary once, up to b
    less than this formula.
    """
    _check_chain(n_layers, layer_bytes, boundary_bytes)
    if segments is None:
        return n_layers * layer_bytes
    if isinstance(segments, int) and checkpoint_last:
        # n = q·k + r: the candidates are the last long segment (j = r) and the last one (j = k)
        segment_sizes(n_layers, segments)  # checks k
        q, r = divmod(n_layers, segments)
        last = segments * boundary_bytes + q * layer_bytes
        return max(last, r * boundary_bytes + (q + 1) * layer_bytes) if r else last
    sizes = segment_sizes(n_layers, segments) if isinstance(segments, int) else list(segments)
    if sum(sizes) != n_layers or min(sizes, default=0) < 1:
        raise ValueError(f"segment lengths {sizes} must be >= 1 and sum to n_layers={n_layers}")
    k = len(sizes)
    kept = [j + 1 for j in range(k)]  # segment inputs alive while segment j+1 is back-propagated
    if not checkpoint_last:
        kept[-1] = k - 1
    return max(c * boundary_bytes + s * layer_bytes for c, s in zip(kept, sizes))


def optimal_segments(n_layers: int, layer_bytes: float, boundary_bytes: float,
                     checkpoint_last: bool = True) -> int:
    """The number of equal segments k that minimises :func:`checkpoint_saved_bytes` (Chen §4.3).

    Treating k as real, f(k) = k·b + n·L/k has f'(k) = b − n·L/k² = 0 at

        k* = √(n·L / b),   f(k*) = 2·√(n·L·b),

    so with L = b (a layer saves as much as its input) k* = √n and the peak is 2√n·b: Chen's
    O(√n). Segments are whole layers and the exact peak is a step function of k, so the integer
    optimum is found by scanning k = 1..n. Its bottom is flat (n = 961, L = b: every k in 26..37
    gives 62·b), so ties go to the k nearest k*, then to the fewer segments: √n for a square n.
    The optimal peak lies within [2√(n·L·b) − L, 2√(n·L·b) + L + b]: it can dip *below* the
    continuous optimum, because the last segments are the shorter ones (floor(n/k) layers).
    """
    _check_chain(n_layers, layer_bytes, boundary_bytes)
    costs = {k: checkpoint_saved_bytes(n_layers, layer_bytes, boundary_bytes, k, checkpoint_last)
             for k in range(1, n_layers + 1)}
    kstar = math.sqrt(n_layers * layer_bytes / boundary_bytes) if boundary_bytes else n_layers
    return min(costs, key=lambda k: (costs[k], abs(k - kstar), k))


def log_checkpoint_saved_bytes(n_layers: int, layer_bytes: float, boundary_bytes: float) -> float:
    """Peak saved bytes of Chen et al.'s recursive checkpointing with one checkpoint per level (§4.4).

    Back-propagating through n layers with their input kept: run the first ceil(n/2) layers
    without saving, keep the midpoint, recurse on the second half, drop the midpoint, recurse on
    the first half; one layer is run normally (L). The memory obeys M(1) = L,
    M(n) = max(b + M(floor(n/2)), M(ceil(n/2))) = floor(log2 n)·b + L, so with the input:

        peak = (1 + floor(log2 n))·b + L          -- O(log n)

    (Chen's g(n) = k·log_{k+1}(n) with k = 1.) The price is :func:`log_checkpoint_forwards`.
    """
    _check_chain(n_layers, layer_bytes, boundary_bytes)
    return (1 + int(math.floor(math.log2(n_layers)))) * boundary_bytes + layer_bytes


@cache
def log_checkpoint_forwards(n_layers: int) -> int:
    """Layer forwards per step of the recursion in :func:`log_checkpoint_saved_bytes` (Chen §4.4).

    C(1) = 1, C(n) = ceil(n/2) + C(floor(n/2)) + C(ceil(n/2)); for n = 2^p, C(n) = n + (n/2)·log2 n:
    O(n log n) against n without checkpointing (and 2n with √n segments).
    """
    _check_chain(n_layers, 0, 0)
    if n_layers == 1:
        return 1
    first = (n_layers + 1) // 2
    return first + log_checkpoint_forwards(n_layers - first) + log_checkpoint_forwards(first)


def recompute_overhead(policy: str, seq: int | None = None, hidden: int | None = None,
                       layers: int | None = None, vocab: int = 0, relative_to: str = "step") -> float:
    """Extra FLOPs of activation recomputation, as a fraction of a step's (or a forward's) model FLOPs.

    Per layer and sample the forward costs 24·s·h² + 4·s²·h matmul FLOPs (Narayanan et al. 2021
    §5.1, :func:`.compute.megatron_flops_per_step`), backward twice that, and the logit layer
    2·s·h·V forward (never recomputed).

    * ``"none"``: 0.
    * ``"full"`` (every layer checkpointed, one extra forward of the layers): without shapes
      exactly 1/3 -- forward : backward = 1 : 2, so one more forward is 1/3 of a step. With
      ``seq``, ``hidden``, ``layers`` (and ``vocab``) it is
      ``megatron_flops_per_step(recompute=True) / megatron_flops_per_step(recompute=False) − 1``
      = (1/3)·(1 + s/6h) / (1 + s/6h + V/12lh): a bit less, the logits are not recomputed.
    * ``"selective"`` (Korthikanti §5: recompute only the attention core -- QKᵀ, softmax, its
      dropout, attention·V -- whose activations are the 5as²b term): the two s²·h matmuls,
      4·s²·h per layer, over the step's model FLOPs:

          (s/18h) / (1 + s/6h + V/12lh)

    ``relative_to="forward"`` divides by the forward's FLOPs instead (one third of the step):
    selective is then (s/6h)/(1 + s/6h + V/12lh), which for GPT-3 (s = 2048, h = 12288)
    is ≈ 2.7% -- the figure Korthikanti quote; against the whole step it is ≈ 0.9%.
    """
    if policy not in RECOMPUTE:
        raise ValueError(f"unknown recompute policy {policy!r}; expected one of {RECOMPUTE}")
    if relative_to not in ("step", "forward"):
        raise ValueError(f"relative_to must be 'step' or 'forward', got {relative_to!r}")
    scale = 3.0 if relative_to == "forward" else 1.0  # model FLOPs: step = 3 forwards
    if policy == "none":
        return 0.0
    shapes = (seq, hidden, layers)
    if policy == "full" and all(v is None for v in shapes):
        return scale / 3.0
    if any(v is None or v < 1 for v in shapes) or vocab < 0:
        raise ValueError(f"{policy!r} recompute overhead needs seq, hidden and layers >= 1 (and vocab >= 0), "
                         f"got seq={seq}, hidden={hidden}, layers={layers}, vocab={vocab}")
    step = megatron_flops_per_step(1, seq, layers, hidden, vocab, recompute=False)
    if policy == "full":
        extra = megatron_flops_per_step(1, seq, layers, hidden, vocab, recompute=True) - step
    else:
        extra = 4 * seq**2 * hidden * layers  # QK^T and attention·V of every layer, once more
    return scale * extra / step


def activation_offload_bytes(saved_bytes: float) -> dict:
    """Bytes activation offloading moves per step (Rhu et al. 2016, vDNN §3): every saved byte
    goes to the host in the forward pass and comes back in the backward pass, once each,
    ``{"to_host": S, "to_device": S, "total": 2·S}``. Divide by the link bandwidth (PCIe 4.0 x16
    ≈ 32e9 B/s, see ``LINKS``) for the time that overlap with compute must hide."""
    if saved_bytes < 0:
        raise ValueError(f"saved_bytes must be >= 0, got {saved_bytes}")
    return {"to_host": saved_bytes, "to_device": saved_bytes, "total": 2 * saved_bytes}


def segment_peak_bytes(layer_bytes: Sequence[int], boundary_bytes: Sequence[int],
                       bounds: Sequence[int]) -> int:
    """Chen et al. 2016 (§4.3)'s memory model of ``checkpoint_sequential`` with segment boundaries
    ``bounds`` and uneven layers (the planner in ``memory.checkpointing`` minimises over it).

    layer_bytes[i]: what layer i saves for backward when run normally (its input included);
    boundary_bytes[i]: the size of layer i's input, kept when a checkpointed segment starts at i.
    All segments but the last are checkpointed, so

        peak = Σ_{checkpointed segments} boundary_bytes[start]
               + max_{segments} Σ_{i in segment} layer_bytes[i]

    (the kept boundaries + the largest segment while it is recomputed, or the last one as it runs).
    """
    starts = list(bounds[:-2])  # the checkpointed segments' starts; the last segment keeps its own input
    internal = max(sum(layer_bytes[a:b]) for a, b in zip(bounds, bounds[1:]))
    return sum(boundary_bytes[s] for s in starts) + internal
