# generated from solutions/ch07_checkpointing.py by `make exercises`: fill in each NotImplementedError
# fingerprint 0972e05bfa5e7a17 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 07 exercises: activation checkpointing — the number of segments, an RNG-preserving
checkpoint, selective attention, a recompute policy for a GPT, predicting and metering what it keeps.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch07``.

Nothing here needs ranks: checkpointing trades compute for memory inside one process.

1. :func:`choose_segments`: how many segments to cut a chain of n layers into, so that the
   activations held at the peak of backward are fewest — or, under a memory budget, the fewest
   segments that fit (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost", §4: the
   cost ``O(n/k) + O(k)``, least at ``k = √n``).
2. :class:`RNGCheckpoint`: ``y = fn(x)`` that keeps only ``x`` for backward and runs ``fn`` again
   there, with the random number generator put back where the forward found it, so that dropout
   draws the same mask twice, and that checks the recomputation matches the forward (Chen et al.
   2016, §4; ``torch.utils.checkpoint``'s ``preserve_rng_state`` and ``determinism_check``).
3. :class:`SelectiveAttention`: a sliding-window attention core ``softmax(Q Kᵀ/√d + M) V`` whose
   s x s scores are never stored — backward recomputes them from Q and K (Korthikanti et al. 2022,
   "Reducing Activation Recomputation in Large Transformer Models", §5, selective activation
   recomputation: the ``5as/h`` term of the ``sbh(34 + 5as/h)`` bytes per layer).
4. :class:`RecursiveRecompute`: a recompute policy for a GPT — Chen's recursive checkpointing,
   O(log n) saved activations for O(n log n) forwards (Chen et al. 2016, §4.4).
5. :func:`meter_recompute`: predict the peak of saved activations and the recomputed forwards of
   √n-style segments with the cost model, then meter them on a real step.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.checkpointing import apply_recompute, checkpoint, count_forwards

# --- 1. the number of segments ---------------------------------------------------------------------


def choose_segments(n_layers: int, layer_bytes: int, boundary_bytes: int,
                    budget_bytes: int | None = None) -> int:
    """Kind: derive · about 25 minutes

    The number of segments k to cut a chain of ``n_layers`` equal layers into (Chen et al. 2016,
    "Training Deep Nets with Sublinear Memory Cost", §4.3).

    The assumptions are Chen's chain model (``minitorch_dist.costmodel.checkpointing``):

    - running a layer normally keeps ``layer_bytes`` (L) for backward until backward reaches it;
    - the chain is cut into k segments of consecutive layers, as equal as possible, the longer ones
      first (n = q·k + r: r segments of q + 1 layers, then k − r of q);
    - *every* segment is checkpointed: the forward keeps only each segment's input,
      ``boundary_bytes`` (b), and frees everything inside;
    - the backward walks the segments from the last to the first; for each it re-runs the segment's
      forward (its layers then hold their L each), back-propagates through it, and frees both the
      segment's activations and its input before moving to the one before.

    The quantity is ``peak(k)``: the most bytes this keeps at any one moment, for k = 1, ..., n.
    Work it out yourself — which inputs are still alive while segment j is back-propagated? — and
    notice that with uneven segments the peak need not come at the last one.

    **Your task:** return the k in ``1..n_layers`` that

    - without a budget (``budget_bytes is None``): makes ``peak(k)`` least (the smallest such k on a
      tie);
    - with a budget: is the *smallest* k with ``peak(k) <= budget_bytes``, the plan that fits with
      the fewest checkpoints. If no k fits, raise ``ValueError`` naming the least peak and its k
      (e.g. "no number of segments fits the budget of 100 bytes: the least peak is 120 bytes, at
      k = 4").

    The tests compare your k with a search over ``costmodel.checkpoint_saved_bytes`` for random chains
    and budgets (seeded), and with hand-worked chains.
    """
    if int(n_layers) != n_layers or n_layers < 1:
        raise ValueError(f"n_layers must be a whole number >= 1, got {n_layers}")
    if layer_bytes <= 0 or boundary_bytes <= 0:
        raise ValueError(f"layer_bytes ({layer_bytes}) and boundary_bytes ({boundary_bytes}) must be > 0")
    if budget_bytes is not None and budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be > 0 (or None for the least peak), got {budget_bytes}")
    n_layers = int(n_layers)
    raise NotImplementedError("exercise: choose_segments — see chapters/07_checkpointing.md")


# --- 2. an RNG-preserving checkpoint ---------------------------------------------------------------


class RNGCheckpoint(torch.autograd.Function):
    """Kind: build · about 45 minutes

    ``y = fn(x)`` that keeps only ``x`` for backward, runs ``fn`` again there — drawing the same
    random numbers — and *checks* that the recomputation is the forward it replaces.

    A checkpoint is only correct if the second run of ``fn`` computes the same function as the first
    (Chen et al. 2016, §4; ``torch.utils.checkpoint``'s ``preserve_rng_state``). Dropout breaks that
    unless the random-number generator is put back; so does anything else that changes between
    forward and backward (a module switched to ``eval()``, a flag, a buffer updated in place), and
    then the gradients are silently wrong. PyTorch's ``determinism_check`` compares only shapes and
    dtypes. Yours compares values too, without keeping the output: remember a fingerprint of ``y``
    that is not a tensor (its shape, dtype and a float64 checksum of its values), and compare the
    recomputed output's fingerprint with it, exactly.

    Interface: ``forward(ctx, fn, x)`` returns ``fn(x)``; ``backward(ctx, grad_y)`` returns one
    gradient per input of forward, ``(None, dx)``. ``fn`` takes and returns one tensor and may hold
    parameters: they get their ``.grad`` during ``loss.backward()`` (the *reentrant* design: backward
    back-propagates through the rebuilt graph itself). Call it through :func:`rng_checkpoint`.

    The tests check:

    - with dropout p = 0.5, the output, ``x.grad`` and every parameter's gradient equal those of the
      plain ``fn`` run under the same seed, alone and for three checkpoints in a row;
    - ``fn`` runs exactly twice (once in forward, once in backward);
    - the only tensor kept with ``ctx.save_for_backward`` (or autograd) is ``x``: not ``y``, not
      ``fn``'s activations;
    - the caller's random stream is left alone: the numbers drawn after backward are those drawn
      after a plain backward, and numbers drawn between forward and backward change nothing;
    - when ``fn`` computes something else in backward (its module put in ``eval()``, a parameter
      changed in place, a scale changed, the RNG not restored), backward raises ``RuntimeError``
      with "recomputation" in its message, naming what differs.

    Reference: ``minitorch_dist/memory/checkpointing.py`` (``_Checkpoint``: the reentrant checkpoint with
    the RNG restore; it does not check that the recomputation matches the forward).
    """

    @staticmethod
    def forward(ctx, fn, x):
        raise NotImplementedError("exercise: RNGCheckpoint.forward — see chapters/07_checkpointing.md")

    @staticmethod
    def backward(ctx, grad_y):
        raise NotImplementedError("exercise: RNGCheckpoint.backward — see chapters/07_checkpointing.md")


def rng_checkpoint(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)``, checkpointed (see :class:`RNGCheckpoint`): only ``x`` is kept for backward."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (a function or an nn.Module), got {type(fn).__name__}")
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if not torch.is_grad_enabled():
        return fn(x)  # no backward will come: nothing to keep, nothing to recompute
    if not x.requires_grad:
        raise ValueError("x does not require grad, so the checkpoint's backward would never run and the "
                         "parameters inside fn would get no gradient; call x.requires_grad_() "
                         "(torch.utils.checkpoint's reentrant variant has the same limitation)")
    return RNGCheckpoint.apply(fn, x)


# --- 3. selective recomputation of the attention core --------------------------------------------


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() < 2:
        raise ValueError(f"q must be (..., s, d), at least 2-D, got shape {tuple(q.shape)}")
    if q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape (..., s, d)")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v {tuple(v.shape)} must match k {tuple(k.shape)} in every dimension but the last: "
                         "one value per key")


class SelectiveAttention(torch.autograd.Function):
    """Kind: build · about 50 minutes

    ``O = softmax(Q Kᵀ / √d + M) V`` for a *sliding window* of keys, keeping Q, K, V for backward and
    recomputing the probabilities there, with a backward you write by hand.

    The attention core of a transformer layer keeps its s x s probabilities (and dropout's mask):
    Korthikanti et al. 2022's ``5as/h`` term, which grows with s² and dwarfs the ``34 sbh`` of the
    rest of the layer at long sequences (§4.1). Rebuilding them is cheap, so *selective*
    recomputation (§5) keeps Q, K, V and recomputes the probabilities in backward. Here the core is a
    local one (Longformer, Mistral): query i sees key j when

    - ``causal`` and ``window=w``: ``j <= i`` and ``i - j < w`` (itself and the w − 1 keys before);
    - not causal and ``window=w``: ``|i - j| < w``;
    - ``window=None``: every key (causal: every ``j <= i``).

    M is 0 where a key is seen and −inf elsewhere; every row sees at least its own key. ``q, k`` are
    ``(..., s, d)``, ``v`` is ``(..., s, d_v)``; the output is ``(..., s, d_v)``.

    Interface: ``forward(ctx, q, k, v, causal, window)`` and ``backward(ctx, grad_out)`` returning
    ``(dq, dk, dv, None, None)``; :func:`selective_attention` (given) checks the shapes and the window
    and applies it. Derive the softmax's backward yourself: that, and the mask, are the exercise.

    The tests check: output and gradients equal ``F.scaled_dot_product_attention`` with the same mask
    (float64, within the derived bound) for windows 1, 3, s − 1 and None, causal and not, ``d_v != d``;
    ``torch.autograd.gradcheck``; float32 inputs within a componentwise float32 bound; that nothing of
    size s x s is kept (only q, k, v, maybe the output); that window 1 returns v exactly; that a
    query's output has a gradient for exactly the keys and values in its window; and errors on bad
    shapes and windows.

    Reference: ``minitorch_dist/memory/checkpointing.py`` (``attention_core`` and ``ExplicitAttention``: the
    full causal core, recomputed through the generic ``checkpoint`` and autograd; here the mask is a
    window and the backward is yours).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, window):
        raise NotImplementedError("exercise: SelectiveAttention.forward — see chapters/07_checkpointing.md")

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("exercise: SelectiveAttention.backward — see chapters/07_checkpointing.md")

    @staticmethod
    def probs(q, k, causal, window):
        """``softmax(Q Kᵀ/√d + M)``: the s x s probabilities, with the mask of ``causal`` and ``window``."""
        raise NotImplementedError("exercise: SelectiveAttention.probs — see chapters/07_checkpointing.md")


def selective_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool = True, window: int | None = None) -> torch.Tensor:
    """``softmax(Q Kᵀ/√d + M) V`` over a sliding window, recomputed in backward (see
    :class:`SelectiveAttention`)."""
    _check_qkv(q, k, v)
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be an int >= 1 (the keys a query sees, itself included) or None "
                         f"(every key), got {window!r}")
    return SelectiveAttention.apply(q, k, v, bool(causal), window)


# --- 4. a recompute policy: checkpointed segments of a GPT's blocks --------------------------------------


def _run_blocks(blocks, h: torch.Tensor) -> torch.Tensor:
    """The blocks one after the other (what a segment computes)."""
    for block in blocks:
        h = block(h)
    return h


class RecursiveRecompute(nn.Module):
    """Kind: build · about 75 minutes

    A recompute policy for a GPT (``minitorch_dist.models.GPT``: ``embed``, ``blocks``, ``head``,
    ``loss_fn``) that keeps O(log n) activations for n blocks: Chen et al. 2016's recursive
    checkpointing (§4.4, one checkpoint per level), where √n segments (§4.3) keep O(√n).

    The policy, for a run of n blocks whose input is kept: if n = 1, run the block normally.
    Otherwise checkpoint the first ⌈n/2⌉ blocks (keep their input, the run's input; drop what is
    inside), then apply the policy to the last ⌊n/2⌋ blocks. When backward comes back to the
    checkpointed first half, its recomputation applies the same policy to those ⌈n/2⌉ blocks. The
    peak of saved activations obeys M(1) = L, M(n) = max(b + M(⌊n/2⌋), M(⌈n/2⌉)), that is
    ``⌊log2 n⌋·b + L`` beyond the input (``costmodel.log_checkpoint_saved_bytes``); the price is
    ``costmodel.log_checkpoint_forwards(n)`` block forwards per step instead of n.

    Interface: ``RecursiveRecompute(model)`` is called like the model, ``logits, loss =
    wrapped(idx, targets)`` (``loss`` None without targets), and its parameters are the model's. Its
    method ``run(blocks, h)`` applies the policy to ``blocks`` (a slice of ``model.blocks``, or any
    sequence of modules mapping a tensor to a tensor of the same shape) on ``h`` and returns their
    output. Under ``torch.no_grad()`` (no backward will come) the blocks just run, once each. Use the
    chapter's ``checkpoint(fn, h)`` (imported above: it keeps ``h`` and the RNG state and runs ``fn``
    again in the backward) or ``torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=True)``;
    ``_run_blocks(blocks, h)`` (given) runs blocks in a row.

    The tests check, for n = 1..7 blocks with dropout: the loss, every parameter's gradient and the
    input's gradient equal the plain model's (float64, same seed); each block's number of forward runs
    is exactly the recursion's (the first block runs most, the last once), their sum
    ``log_checkpoint_forwards(n)``; the metered peak of saved activations of the GPT is the recursion's
    to the byte (⌊log2 n⌋ boundaries and one block beyond the plain one-block model) and below √n
    segments' for n = 8; nothing is saved under ``no_grad``.

    Reference: ``minitorch_dist/memory/checkpointing.py`` (``checkpoint_sequential`` and ``apply_recompute``:
    one level of √n segments; the recursion of §4.4 is only costed there, in costmodel, never run).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        if not all(hasattr(model, a) for a in ("embed", "blocks", "head", "loss_fn")):
            raise TypeError(f"RecursiveRecompute wraps a minitorch_dist GPT (embed, blocks, head, loss_fn), "
                            f"got {type(model).__name__}")
        self.model, self.n = model, len(model.blocks)

    def run(self, blocks, h: torch.Tensor) -> torch.Tensor:
        """``blocks`` applied to ``h`` under the recursive policy."""
        raise NotImplementedError("exercise: RecursiveRecompute.run — see chapters/07_checkpointing.md")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        raise NotImplementedError("exercise: RecursiveRecompute.forward — see chapters/07_checkpointing.md")


# --- 5. predict, then meter, what a recompute policy keeps ---------------------------------------------


def _peak_activations(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """The peak of saved activations ``MemoryMeter`` sees over one forward and backward."""
    meter = MemoryMeter(model)
    with meter.track():
        model(idx, targets)[1].backward()
    return meter.peak["activations"]


def meter_recompute(make_model: Callable[[int], nn.Module], n_layers: int, segments: int,
                    idx: torch.Tensor, targets: torch.Tensor) -> dict:
    """Kind: measure · about 40 minutes

    Predict, then measure, the peak of saved activations and the recomputed block forwards of one
    training step of a GPT of ``n_layers`` blocks in ``segments`` equal segments, each but the last
    checkpointed (Chen et al. 2016, §4.3; the library's ``apply_recompute(model, "sqrt", segments)``).

    ``make_model(n)`` builds the same GPT with n blocks (same seed, dropout on); ``idx``, ``targets`` are
    one batch. ``_peak_activations(model, idx, targets)`` (given) meters one forward and backward with
    ``MemoryMeter``.

    Return ``{"L", "b", "rest", "predicted": {"peak", "recomputed"}, "measured": {"peak",
    "recomputed"}}`` (bytes and block forwards):

    - ``L``, ``b``, ``rest``: Chen's chain model calibrated on *plain* models by measurement: what one
      more block keeps, the bytes of one block's input (the fp32 hidden state, ``model.cfg.n_embd``
      wide), and what lies outside the blocks;
    - ``predicted``: the peak from ``minitorch_dist.costmodel`` and your calibration, and the block
      forwards run again in the backward;
    - ``measured``: the same two quantities from a real forward and backward of the checkpointed model
      (the peak by ``MemoryMeter``, the forwards by counting each block's runs), not from a formula.

    The tests hold you to: L, b and rest to the byte and the prediction to 1e-9 (relative), against
    their own calibration; the measured peak to the byte against their own meter of the same step; the
    prediction within 1% of the measured peak (a block's first LayerNorm saves the block's input,
    which is the boundary itself: the meter counts that storage once, the formula up to b twice); the
    recomputed forwards exactly; and a ``ValueError`` when the segments are not equal.

    Reference: ``minitorch_dist/costmodel/checkpointing.py`` (``checkpoint_saved_bytes`` and
    ``segment_sizes``: the prediction; the exercise adds the calibration and a real metered run).
    """
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n_layers:
        raise ValueError(f"segments must be an int in [1, n_layers={n_layers}], got {segments!r}")
    if n_layers % segments:
        raise ValueError(f"segments={segments} does not divide n_layers={n_layers}: use equal segments here "
                         "(with unequal ones the peak can fall in an earlier segment, after the head has "
                         "freed its part)")
    raise NotImplementedError("exercise: meter_recompute — see chapters/07_checkpointing.md")
