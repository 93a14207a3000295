# generated from solutions/ch07_checkpointing.py by `make exercises`: fill in each NotImplementedError
# fingerprint 0d55e3ba9f7701d7 of the text below (once you change it, `make exercises` leaves it alone)
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
   draws the same mask twice (Chen et al. 2016, §4; ``torch.utils.checkpoint``'s
   ``preserve_rng_state``).
3. :class:`SelectiveAttention`: the attention core ``softmax(Q Kᵀ/√d) V`` whose s x s scores are
   never stored — backward recomputes them from Q and K (Korthikanti et al. 2022, "Reducing
   Activation Recomputation in Large Transformer Models", §5, selective activation recomputation:
   the ``5as/h`` term of the ``sbh(34 + 5as/h)`` bytes per layer).
4. :class:`SegmentedRecompute`: a recompute policy for a GPT — its blocks in k segments (√n by
   default), each but the last checkpointed (Chen et al. 2016, §4.3).
5. :func:`meter_recompute`: predict the peak of saved activations and the recomputed forwards of
   such a policy with the cost model, then meter them.
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
    """Kind: derive

    The number of segments k to cut a chain of ``n_layers`` equal layers into (Chen et al. §4).

    Cut the chain into k segments of at most ``ceil(n/k)`` consecutive layers. Forward keeps only
    each segment's input (its *boundary*, ``boundary_bytes``) and frees everything inside. Backward
    walks the segments from last to first, re-running one segment's forward at a time to rebuild
    its activations (``layer_bytes`` per layer), backpropagates through it, and frees them again.
    The most ever held at once is all the boundaries plus one (the largest) segment's activations:

        peak(k) = k * boundary_bytes + ceil(n / k) * layer_bytes          for k = 1, 2, ..., n

    k = 1 is no checkpointing at all (the input and every layer's activations); k = n
    checkpoints every layer. For equal sizes ``peak(k) ≈ b (k + n/k)``, least at ``k = √n``:
    O(√n) memory for the price of one extra forward, whatever k > 1 (each layer's forward runs twice).

    **Your task:** return the k in ``1..n_layers`` that

    - without a budget (``budget_bytes is None``): makes ``peak(k)`` least (the smallest such k
      on a tie);
    - with a budget: is the *smallest* k with ``peak(k) <= budget_bytes`` — the plan that fits
      with the fewest checkpoints (k = 1 when everything fits: no checkpointing). Each segment is
      one more checkpoint call and one more boundary tensor kept for the whole step, so among the
      plans that fit, fewer is simpler. If no k fits, raise ``ValueError`` saying so and naming
      the least peak and its k (e.g. "no number of segments fits the budget of 100 bytes: the
      least peak is 120 bytes, at k = 4").
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
    """Kind: build

    ``y = fn(x)``, keeping only ``x`` (and the RNG state) for backward; ``fn`` runs again there.

    A plain forward keeps every activation inside ``fn`` until backward reaches it. A
    checkpointed one runs ``fn`` without recording a graph (``Function.forward`` already runs
    under ``torch.no_grad``), keeps ``x``, and lets backward rebuild the graph by running ``fn``
    once more with gradients on. For the gradients to be *the same*, the second run must compute
    the same function: if ``fn`` draws random numbers (dropout), it must draw the same ones. So
    forward records the generator's state before running ``fn`` and backward restores it before
    running ``fn`` again. Backward must not disturb anyone else's random numbers, though: the
    caller's stream continues from wherever it was, as if no checkpoint had rewound it —
    ``torch.random.fork_rng`` saves the states on entry and puts them back on exit.

    This is the *reentrant* design (``torch.utils.checkpoint(..., use_reentrant=True)``):
    backward calls ``torch.autograd.backward`` on the rebuilt graph, which accumulates into the
    ``.grad`` of any parameter inside ``fn`` and of the detached copy of ``x`` whose gradient is
    returned. ``fn`` takes and returns one tensor.

    **Your task:** write

    - ``forward(ctx, fn, x)``: record ``torch.get_rng_state()`` (and, when ``x`` is on a CUDA
      device, ``torch.cuda.get_rng_state(x.device)``), keep ``x`` with ``ctx.save_for_backward``
      and ``fn`` on ctx, return ``fn(x)``;
    - ``backward(ctx, grad_y)``: inside ``torch.random.fork_rng(devices=...)`` (``[x.device]`` on
      CUDA, ``[]`` on CPU), restore the recorded state(s), rebuild ``y = fn(x')`` with gradients
      on (``torch.enable_grad()``) from ``x' = x.detach().requires_grad_()``, backpropagate
      ``grad_y`` through it, and return ``(None, x'.grad)`` — one gradient per input of forward,
      None for ``fn``.

    Call it through :func:`rng_checkpoint` (``Function.apply`` takes no keyword arguments).
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


def _attention_probs(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """``softmax(Q Kᵀ/√d)``, with the future masked when ``causal``: an s x s tensor per head."""
    s = q.shape[-2]
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        future = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(diagonal=1)
        scores = scores.masked_fill(future, float("-inf"))  # every row keeps its diagonal: no NaN
    return scores.softmax(dim=-1)


class SelectiveAttention(torch.autograd.Function):
    """Kind: build

    ``O = softmax(Q Kᵀ / √d) V`` (causal or not) that keeps Q, K, V for backward, not the scores.

    A transformer layer's attention core holds, per layer, the scores ``S = Q Kᵀ/√d``, the
    probabilities ``P = softmax(S)`` (and dropout's mask of P): ``a s²`` numbers per sequence for
    ``a`` heads — Korthikanti et al.'s ``5as/h`` term, which grows with s² and dwarfs the
    ``34 sbh`` of the rest of the layer at long sequences (§4.1). It is also cheap to rebuild:
    two matrix products and a softmax, a few percent of the layer's FLOPs. So *selective*
    recomputation (§5) keeps only Q, K, V (already needed by the layer) and recomputes P in
    backward. With ``q, k`` of shape ``(..., s, d)`` and ``v`` of shape ``(..., s, d_v)``:

        forward:    S = Q Kᵀ / √d           (causal: S[i, j] = -inf for j > i)
                    P = softmax(S)           row-wise, over j
                    O = P V
        backward:   recompute P from Q and K, then, with dO the gradient of O,
                    dV = Pᵀ dO
                    dP = dO Vᵀ
                    dS = P ∘ (dP - rowsum(dP ∘ P))      the softmax's Jacobian, row by row
                    dQ = dS K / √d
                    dK = dSᵀ Q / √d

    Masked entries have P = 0, so their dS is 0 with no extra masking. (``rowsum(dP ∘ P)`` equals
    ``rowsum(dO ∘ O)``, FlashAttention's shortcut when O is kept.)

    ``_attention_probs(q, k, causal)`` (given) builds P, mask included.

    **Your task:** write ``forward(ctx, q, k, v, causal)`` (save only q, k, v with
    ``ctx.save_for_backward`` — no s x s tensor; the output may be saved too) and
    ``backward(ctx, grad_out)`` returning ``(dq, dk, dv, None)``. Call it through
    :func:`selective_attention`.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal):
        raise NotImplementedError("exercise: SelectiveAttention.forward — see chapters/07_checkpointing.md")

    @staticmethod
    def backward(ctx, grad_out):
        raise NotImplementedError("exercise: SelectiveAttention.backward — see chapters/07_checkpointing.md")


def selective_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        causal: bool = True) -> torch.Tensor:
    """``softmax(Q Kᵀ/√d) V`` recomputed in backward (see :class:`SelectiveAttention`)."""
    _check_qkv(q, k, v)
    return SelectiveAttention.apply(q, k, v, bool(causal))


# --- 4. a recompute policy: checkpointed segments of a GPT's blocks --------------------------------------


def _run_blocks(blocks, h: torch.Tensor) -> torch.Tensor:
    """The blocks one after the other (what a segment computes)."""
    for block in blocks:
        h = block(h)
    return h


class SegmentedRecompute(nn.Module):
    """Kind: build

    A recompute policy for a GPT (``minitorch_dist.models.GPT``: ``embed``, ``blocks``, ``head``,
    ``loss_fn``): its n blocks run as k contiguous segments, and every segment but the last is
    checkpointed — in the forward it keeps only its input; in the backward it runs again, with
    the random-number generator put back so that dropout draws the same masks, and is
    back-propagated (Chen et al. 2016, §4.3). The peak of saved activations falls from
    ``n·L`` to about ``k·b + (n/k)·L`` (L: what a block saves, b: its input), least near
    ``k = √(n·L/b)``; with L ≈ b, k = √n: O(√n) memory for one more forward of the checkpointed
    blocks. The last segment runs normally: its backward starts right after its forward, so
    dropping and recomputing it would buy nothing (``checkpoint_last=True`` checkpoints it too;
    with k = n that is "every block").

    ``SegmentedRecompute(model, segments)`` is called like the model: ``logits, loss = wrapped(idx,
    targets)``; the parameters stay the model's. The scaffolding (keep it) checks ``segments``
    (``None``: Chen's rule, ``round(√n)``) and stores ``self.model``, ``self.n``, ``self.k`` and
    ``self.checkpoint_last``; ``_run_blocks(blocks, h)`` runs blocks in a row.

    **Your task:**

    - :meth:`bounds`: the boundaries ``[0, b_1, ..., n]`` of k segments as equal as possible, the
      longer ones first (n = q·k + r: r segments of q + 1 blocks, then k − r of q);
    - :meth:`forward`: ``h = model.embed(idx)``; each segment ``[lo, hi)`` through the chapter's
      ``checkpoint(fn, h)`` (imported above: it keeps ``h`` and the RNG state, and runs ``fn`` again
      in the backward; ``torch.utils.checkpoint.checkpoint(fn, h, use_reentrant=True)`` would do the
      same) with ``fn`` running ``model.blocks[lo:hi]`` (e.g. ``functools.partial(_run_blocks, ...)``)
      — except the last segment unless ``checkpoint_last``, and except under ``torch.no_grad()``,
      where no backward will come and the blocks just run; then ``logits = model.head(h)`` and
      ``(logits, model.loss_fn(logits, targets) if targets is not None else None)``.
    """

    def __init__(self, model: nn.Module, segments: int | None = None, checkpoint_last: bool = False):
        super().__init__()
        if not all(hasattr(model, a) for a in ("embed", "blocks", "head", "loss_fn")):
            raise TypeError(f"SegmentedRecompute wraps a minitorch_dist GPT (embed, blocks, head, loss_fn), "
                            f"got {type(model).__name__}")
        n = len(model.blocks)
        k = max(1, round(math.sqrt(n))) if segments is None else segments
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
            raise ValueError(f"segments must be an int between 1 and the number of blocks {n} (or None for "
                             f"round(√n) = {max(1, round(math.sqrt(n)))}), got {segments!r}")
        self.model, self.n, self.k, self.checkpoint_last = model, n, k, checkpoint_last

    def bounds(self) -> list[int]:
        """``[0, b_1, ..., n]``: k segments, the longer ones first."""
        raise NotImplementedError("exercise: SegmentedRecompute.bounds — see chapters/07_checkpointing.md")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        raise NotImplementedError("exercise: SegmentedRecompute.forward — see chapters/07_checkpointing.md")


# --- 5. predict, then meter, what a recompute policy keeps ---------------------------------------------


def _peak_activations(model: nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> int:
    """The peak of saved activations ``MemoryMeter`` sees over one forward and backward."""
    meter = MemoryMeter(model)
    with meter.track():
        model(idx, targets)[1].backward()
    return meter.peak["activations"]


def meter_recompute(make_model: Callable[[int], nn.Module], n_layers: int, segments: int,
                    idx: torch.Tensor, targets: torch.Tensor) -> dict:
    """Kind: measure

    Predict the peak of saved activations and the recomputed block forwards of a GPT of
    ``n_layers`` blocks trained with ``segments`` equal segments, each but the last checkpointed,
    then measure both. (With equal segments the peak comes at the end of the forward, while the part
    outside the blocks is still held; with unequal ones it can come later, in a longer earlier
    segment, after the head and the loss have freed theirs — try it.)

    ``make_model(n)`` builds the same GPT with n blocks (same seed, dropout on); ``idx``, ``targets``
    are one batch. ``_peak_activations(model, idx, targets)`` (given) meters one forward and
    backward with ``MemoryMeter``. The policy under test is the library's: ``apply_recompute(model,
    "sqrt", segments)``.

    **Your task:** return ``{"L", "b", "rest", "predicted": {"peak", "recomputed"}, "measured":
    {"peak", "recomputed"}}`` (bytes and block forwards):

    - *calibrate* Chen's chain model on plain models: ``L`` = what one more block saves (the peak
      of ``make_model(2)`` minus that of ``make_model(1)``), ``rest`` = what lies outside the blocks
      (the peak of ``make_model(1)`` minus L), and ``b`` = the bytes of one block's input, the
      hidden state ``(B, T, n_embd)`` in fp32 (``model.cfg.n_embd``);
    - *predict*: ``peak = rest + costmodel.checkpoint_saved_bytes(n_layers, L, b, segments,
      checkpoint_last=False)``, and ``recomputed`` = the blocks of every segment but the last, each
      run once more in the backward (``costmodel.segment_sizes`` gives the lengths, the longer first);
    - *measure* on ``apply_recompute(make_model(n_layers), "sqrt", segments)``: the metered peak, and
      the block forwards beyond the n of the forward, counted with ``count_forwards(model.blocks)``
      over one forward and backward.

    The tests hold you to: L, b and rest to the byte and the prediction to 1e-9 (relative), against
    their own calibration; the measured peak to the byte against their own meter; the prediction
    within 1% of the measured peak (a block's first LayerNorm saves the block's input, which is
    the boundary itself: the meter counts that storage once, the formula up to b twice); the
    recomputed forwards exactly.
    """
    if isinstance(segments, bool) or not isinstance(segments, int) or not 1 <= segments <= n_layers:
        raise ValueError(f"segments must be an int in [1, n_layers={n_layers}], got {segments!r}")
    if n_layers % segments:
        raise ValueError(f"segments={segments} does not divide n_layers={n_layers}: use equal segments here "
                         "(with unequal ones the peak can fall in an earlier segment, after the head has "
                         "freed its part)")
    raise NotImplementedError("exercise: meter_recompute — see chapters/07_checkpointing.md")
