# generated from solutions/ch07_checkpointing.py by `make exercises`: fill in each NotImplementedError
# fingerprint 2d27bdc345c462ab of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 07 exercises: activation checkpointing — √n segments, an RNG-preserving checkpoint,
selective attention.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch07``.

Nothing here needs ranks: checkpointing trades compute for memory inside one process.

1. :func:`optimal_segments`: how many segments to cut a chain of n layers into, so that the
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
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

# --- 1. the number of segments ---------------------------------------------------------------------


def optimal_segments(n_layers: int, layer_bytes: int, boundary_bytes: int,
                     budget_bytes: int | None = None) -> int:
    """The number of segments k to cut a chain of ``n_layers`` equal layers into (Chen et al. §4).

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
    raise NotImplementedError("exercise: optimal_segments — see chapters/07_checkpointing.md")


# --- 2. an RNG-preserving checkpoint ---------------------------------------------------------------


class RNGCheckpoint(torch.autograd.Function):
    """``y = fn(x)``, keeping only ``x`` (and the RNG state) for backward; ``fn`` runs again there.

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
    """``O = softmax(Q Kᵀ / √d) V`` (causal or not) that keeps Q, K, V for backward, not the scores.

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
