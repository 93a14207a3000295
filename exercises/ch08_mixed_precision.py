# generated from solutions/ch08_mixed_precision.py by `make exercises`: fill in each NotImplementedError
# fingerprint da95af19e78b46fe of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 08 exercises: mixed precision — the loss scaler and a training loop built on it, the
updates bf16 loses, stochastic rounding, a Kahan-compensated bf16 update, fp8 tiles, delayed scaling.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch08``.

Nothing here needs ranks: number formats are a single-process matter.

1. :func:`scaler_update`: the dynamic loss-scale rule (Micikevicius et al. 2018, "Mixed Precision
   Training", §3.2; the rule ``torch.amp.GradScaler.update`` applies): halve the scale and skip the
   step when a gradient overflowed, double it after ``growth_interval`` clean steps in a row.
2. :class:`LossScaler`: the whole dynamic loss scaler, ``scale`` / ``unscale_`` / ``step`` /
   ``update`` with ``torch.amp.GradScaler``'s semantics, its rule being exercise 1.
3. :func:`train_with_loss_scaling`: mixed-precision training (Micikevicius et al. 2018, §3.1-3.3): a
   half model for forward and backward, fp32 master weights owned by the optimizer, a loss scaler
   deciding which steps are applied.
4. :func:`count_lost_bf16_updates`: predict from bf16's bit layout how many elements of one SGD step
   round away in a pure-bf16 model, then take the step and count them.
5. :func:`stochastic_round_to_bf16`: fp32 -> bf16 rounding that goes up or down at random, with the
   probability that makes it unbiased, ``E[round(x)] = x`` (Gupta et al. 2015, "Deep Learning with
   Limited Numerical Precision", §3): tiny updates to a bf16 weight then survive *on average*,
   where round-to-nearest drops every one of them.
6. :func:`kahan_bf16_update`: ``w += u`` for a bf16 weight that keeps a second bf16 tensor, the
   *compensation*, holding what rounding took away (Kahan 1965, "Further Remarks on Reducing
   Truncation Errors"; used for bf16 optimizers by Zamirai et al. 2020, "Revisiting BFloat16
   Training", §4): the weight tracks the exact sum to within a rounding, deterministically, for
   4 bytes per parameter instead of an fp32 master copy's 6.
7. :func:`quantize_tiles_1x128`: DeepSeek-V3's fine-grained fp8 quantisation of activations
   (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2): one scale per 1×128 tile, so that an
   outlier spoils only the 128 values that share its tile.
8. :func:`delayed_scaling_update`: Transformer Engine's delayed-scaling step for one fp8 tensor: the
   next scale from a window of past amaxes, then the window rolled (Micikevicius et al. 2022, "FP8
   Formats for Deep Learning", §4, per-tensor scaling; TE's ``DelayedScaling`` recipe).
"""
from __future__ import annotations

import math
import struct

import torch
from torch import nn

from minitorch_dist.costmodel.precision import update_lost
from minitorch_dist.memory.mixed_precision import fp32_cross_entropy, half_precision_copy

# --- 1. the loss scaler's update rule --------------------------------------------------------------


def _fp32(x: float) -> float:
    """``x`` rounded to the nearest fp32 number (``inf`` beyond fp32's range), as a Python float.

    GradScaler keeps its scale in a one-element fp32 tensor, so every new scale is an fp32 number.
    """
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:  # struct refuses what rounds past fp32's largest finite number
        return math.copysign(math.inf, x)


def _check_factors(growth_factor: float, backoff_factor: float, growth_interval: int) -> None:
    """The scaler's constants, checked (shared by exercises 1 and 2)."""
    if not growth_factor > 1.0:
        raise ValueError("growth_factor must be > 1 "
                         f"(the scale grows after clean steps), got {growth_factor}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError("backoff_factor must be in (0, 1) (the scale shrinks on overflow), got "
                         f"{backoff_factor}")
    if int(growth_interval) != growth_interval or growth_interval < 1:
        raise ValueError(f"growth_interval must be a whole number >= 1, got {growth_interval}")


def scaler_update(scale: float, growth_tracker: int, found_inf: bool, growth_factor: float = 2.0,
                  backoff_factor: float = 0.5, growth_interval: int = 2000) -> tuple[float, int]:
    """Kind: build

    The loss scale and growth tracker after one step: ``(new_scale, new_growth_tracker)``.

    fp16 flushes gradients below 2^-24 to zero. Multiplying the loss by a scale ``S`` multiplies
    every gradient by ``S`` (backward is linear), lifting small gradients into fp16's range; the
    optimizer divides by ``S`` again in fp32 before the update (Micikevicius et al. §3.2). Too large
    an ``S`` overflows some gradient to ``inf`` (or makes a ``NaN``) instead. Nobody knows the right
    ``S`` in advance, and it drifts as gradients shrink through training, so it is found online:

    - if this step's gradients held an inf or a NaN (``found_inf``): the step is skipped (the
      optimizer does not run, the weights stay), the scale shrinks, ``S <- S * backoff_factor``,
      and the count of clean steps starts again: ``growth_tracker <- 0``;
    - otherwise one more clean step: ``growth_tracker + 1``. When that reaches ``growth_interval``
      the scale grows, ``S <- S * growth_factor``, and the count restarts at 0; else the scale
      stays and the tracker keeps the new count.

    The scale lives in fp32 (GradScaler's ``_scale`` is a one-element fp32 tensor): round every
    new scale to fp32 with ``_fp32`` (given). A scale that would grow past fp32's largest number
    (``_fp32`` gives ``inf``) is not grown: it stays as it was, though the tracker still restarts
    at 0 — GradScaler's kernel does the same, so the scale can never become ``inf``.

    **Your task:** return ``(new_scale, new_growth_tracker)`` (a float and an int) by the rule
    above. The arguments are already checked.
    """
    if isinstance(found_inf, torch.Tensor):
        found_inf = bool(found_inf.item())  # GradScaler's found_inf is a one-element tensor
    scale, growth_factor, backoff_factor = float(scale), float(growth_factor), float(backoff_factor)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite number > 0, got {scale}")
    _check_factors(growth_factor, backoff_factor, growth_interval)
    if int(growth_tracker) != growth_tracker or not 0 <= growth_tracker < growth_interval:
        raise ValueError("growth_tracker must be a whole number in [0, growth_interval = "
                         f"{growth_interval}), got {growth_tracker}: it counts the clean steps since the "
                         "scale last changed")
    growth_tracker, growth_interval = int(growth_tracker), int(growth_interval)
    raise NotImplementedError("exercise: scaler_update — see chapters/08_mixed_precision.md")


# --- 2. the loss scaler ----------------------------------------------------------------------------


class LossScaler:
    """Kind: build

    A dynamic loss scaler with ``torch.amp.GradScaler``'s four calls (Micikevicius et al. 2018,
    §3.2), for one optimizer whose parameters hold fp32 (or bf16) gradients::

        scaler.scale(loss).backward()   # every gradient comes out multiplied by S
        scaler.unscale_(optimizer)      # optional: g <- g / S now (before clipping, say), inf/NaN found?
        scaler.step(optimizer)          # unscale_ unless done; optimizer.step() unless inf/NaN was found
        scaler.update()                 # S and the growth tracker by the rule of exercise 1

    - ``scale(loss)``: ``loss * S``, with S as an fp32 tensor on the loss's device.
    - ``unscale_(optimizer)``: multiply every ``.grad`` of the optimizer's parameters in place by
      ``1 / S`` — computed as GradScaler does, in float64 and rounded once to fp32 (``_fp32(1.0 /
      S)``) — and record (and return) whether any gradient held an inf or a NaN *before* the
      multiplication. ``_grads_of(optimizer)`` (given) lists the gradients and refuses fp16 ones.
    - ``step(optimizer)``: call ``unscale_`` unless it was called this iteration; then, if a
      gradient was not finite, skip the step — the weights keep their values, ``skipped_steps``
      grows by one — and return None; otherwise return ``optimizer.step()``.
    - ``update()``: ``scale, growth_tracker <- scaler_update(...)`` with this iteration's
      ``found_inf`` and the scaler's factors, then forget the iteration (the next one starts clean).

    The state: ``self._scale`` (a Python float, always an fp32 number), ``self.growth_tracker``,
    ``self.skipped_steps``, and two per-iteration flags, ``self._found_inf`` (None until
    ``unscale_`` ran this iteration, then a bool) and ``self._stepped``. The misuse checks (a second
    ``unscale_``, a second ``step`` without ``update``, ``update`` before any check) are given.

    **Your task:** the bodies of ``scale``, ``unscale_``, ``step`` and ``update``.
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        if not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        _check_factors(float(growth_factor), float(backoff_factor), growth_interval)
        self._scale = _fp32(float(init_scale))
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.growth_tracker = 0
        self.skipped_steps = 0
        self._found_inf: bool | None = None
        self._stepped = False

    def get_scale(self) -> float:
        """The current loss scale S."""
        return self._scale

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"loss must be a tensor, got {type(loss).__name__}")
        raise NotImplementedError("exercise: LossScaler.scale — see chapters/08_mixed_precision.md")

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by S in place; return whether any was inf or NaN."""
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called since the last update(); "
                               "call it at most once per iteration")
        grads = _grads_of(optimizer)
        raise NotImplementedError("exercise: LossScaler.unscale_ — see chapters/08_mixed_precision.md")

    def step(self, optimizer: torch.optim.Optimizer):
        """``unscale_`` unless done, then ``optimizer.step()`` unless a gradient was not finite."""
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update(); call update() "
                               "between steps")
        raise NotImplementedError("exercise: LossScaler.step — see chapters/08_mixed_precision.md")

    def update(self) -> None:
        """The new S and growth tracker; the iteration's flags reset."""
        if self._found_inf is None:
            raise RuntimeError("update() before any inf/NaN check; call step() (or unscale_()) first")
        raise NotImplementedError("exercise: LossScaler.update — see chapters/08_mixed_precision.md")


def _grads_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The ``.grad`` tensors of ``optimizer``'s parameters (those that have one); fp16 ones refused, as
    GradScaler refuses them: in fp16 1/S rounds to 0 once S > 2^24 and every gradient would become 0."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if any(g.dtype == torch.float16 for g in grads):
        raise ValueError("Attempting to unscale FP16 gradients: keep fp32 master weights and unscale their "
                         "fp32 gradients")
    return grads


# --- 3. mixed-precision training driven by a loss scaler -------------------------------------------


def train_with_loss_scaling(model: nn.Module, batches, make_optimizer, scaler=None,
                            dtype: torch.dtype = torch.float16, loss_fn=None) -> dict:
    """Kind: build

    Train ``model`` in mixed precision (Micikevicius et al. 2018, §3) on ``batches``, one optimizer
    step per ``(x, y)`` batch, and return what happened.

    The arrangement (set up for you below): ``half`` is a copy of the model in ``dtype`` (fp16 or
    bf16) whose LayerNorms compute in fp32; ``masters`` are fp32 copies of the *original* weights,
    in the order of ``half.parameters()``, and ``optimizer = make_optimizer(masters)`` owns them.
    Each step:

    1. forward and backward run on ``half``: ``loss = loss_fn(half, x, y)`` (an fp32 scalar), and the
       backward starts from ``scaler.scale(loss)`` — or from ``loss`` itself when ``scaler`` is None
       (bf16, or fp16 shown without loss scaling);
    2. each half gradient becomes its master's fp32 gradient (``m.grad = h.grad.float()``), and the
       half gradient is dropped (``h.grad = None``) — sums and the update happen in fp32;
    3. ``scaler.step(optimizer)`` then ``scaler.update()`` (or ``optimizer.step()`` without a
       scaler): the scaler unscales the fp32 gradients, and skips the step if one is inf or NaN;
    4. every master is rounded into its half weight (``h.copy_(m)`` under ``torch.no_grad()``), which
       the next forward uses.

    ``scaler`` is anything with GradScaler's calls: your :class:`LossScaler`, or
    ``torch.amp.GradScaler("cpu")`` itself. A step was applied unless the scaler backed off: a skip
    is the only thing that lowers the scale, so ``applied = scaler.get_scale() >= scale_before``.

    **Your task:** the loop. Return ``{"losses": [...], "applied": [...], "masters": masters,
    "half_model": half}``: the unscaled loss of each step (``loss.item()``) and whether its update
    was applied (always True without a scaler).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "step", "update", "get_scale")):
        raise TypeError("scaler must have GradScaler's scale/step/update/get_scale, got "
                        f"{type(scaler).__name__}")
    loss_fn = loss_fn or fp32_cross_entropy
    half = half_precision_copy(model, dtype)
    half_params = list(half.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    optimizer = make_optimizer(masters)
    losses, applied = [], []
    raise NotImplementedError("exercise: train_with_loss_scaling — see chapters/08_mixed_precision.md")
    return {"losses": losses, "applied": applied, "masters": masters, "half_model": half}


# --- 4. the updates bf16 loses: predicted, then counted ---------------------------------------------


def count_lost_bf16_updates(model: nn.Module, x, y, lr: float, loss_fn=None) -> dict:
    """Kind: measure

    A model kept entirely in bf16 — no fp32 master — takes one SGD step, ``w <- w - lr * g``. How
    many of its elements does the step fail to move? Predict it from the number format, then take
    the step and count.

    - **Predict.** Forward and backward once (``loss_fn(model, x, y)``, default
      ``fp32_cross_entropy``) to get every gradient ``g`` (bf16). The update of an element is ``u =
      -lr * g.float()``. Among the elements with ``u != 0`` (a zero update moves nothing, lost or
      not), count those whose update :func:`costmodel.precision.update_lost` says rounds away in
      ``"bf16"`` (``update_lost(w, u, "bf16")`` takes tensors; give it the weights and updates as
      float64). That needs nothing but bf16's bit layout: |u| below half the gap to w's neighbour.
    - **Measure.** Take the step in place, as SGD does on bf16 weights: ``p.add_(p.grad, alpha=-lr)``
      under ``torch.no_grad()``, and count, among the same elements, those whose weight is exactly
      what it was.

    Tolerance: the two counts agree to within 0.5 % of the updated elements. They can differ by a
    few: the real step rounds w + u twice, to fp32 and then to bf16, where the prediction rounds once.

    **Your task:** return ``{"predicted": int, "measured": int, "updated": int}`` (``updated``: the
    elements with ``u != 0``), leaving ``model`` stepped and its gradients in place.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        raise TypeError("model must be entirely bf16 (model.to(torch.bfloat16)): no fp32 master here")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    loss_fn = loss_fn or fp32_cross_entropy
    model.zero_grad(set_to_none=True)
    raise NotImplementedError("exercise: count_lost_bf16_updates — see chapters/08_mixed_precision.md")


# --- 5. stochastic rounding to bf16 ----------------------------------------------------------------

_LOW_BITS = 16  # bf16 is fp32 with the low 16 bits of the mantissa cut off


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Kind: build

    ``x`` (fp32) rounded to bf16, up or down at random so that the result is right on average.

    bf16 is the top half of an fp32: the same sign bit and 8 exponent bits, 7 of the 23 mantissa
    bits. Every fp32 ``x`` lies between two neighbouring bf16 numbers ``lo <= x < hi`` (towards
    zero and away from it). Round-to-nearest always picks the closer one; *stochastic rounding*
    picks ``hi`` with probability ``(x - lo) / (hi - lo)`` and ``lo`` otherwise, so that

        E[round(x)] = lo + (x - lo) / (hi - lo) * (hi - lo) = x.

    Why it matters (Gupta et al. §3): a weight ``w`` that receives updates smaller than half its
    ulp (the gap between neighbouring bf16 numbers, ``2^-7`` at 1.0) never moves under
    round-to-nearest — each ``w + u`` rounds back to ``w`` — but moves by ``u`` *in expectation*
    under stochastic rounding, so the updates add up over many steps with no fp32 copy.

    On the bits it is one integer addition. Read the fp32's 32 bits as an integer (``x.view(
    torch.int32)``): the 16 low bits are exactly the position of ``x`` between ``lo`` and ``hi``,
    in units of ``(hi - lo) / 2^16`` (within one binade fp32 numbers are evenly spaced). Add a
    uniform random integer ``r`` in ``[0, 2^16)``: it carries into bit 16 — rounding the magnitude up
    to ``hi`` — exactly when ``r >= 2^16 - low bits``, with probability ``low bits / 2^16``. Then
    clear the 16 low bits (``& ~0xFFFF``, i.e. ``& -65536``) and read the result back as fp32: it
    is a bf16 number, and ``.to(torch.bfloat16)`` is exact. The sign bit sits apart from the
    magnitude, so negative numbers round just as well, and a carry out of the largest mantissa
    moves into the next binade (or to ``inf`` past bf16's largest number), which is right. ``±inf``
    come through unchanged (the 16 low bits of inf are 0, so no carry), but a NaN could become
    inf: keep NaNs as they are.

    **Your task:** return the bf16 tensor of ``x``'s shape. Draw the random bits from
    ``generator`` only (``torch.randint(..., generator=generator, device=x.device)``), so a seeded
    generator makes the rounding reproducible and the global random stream is untouched.
    """
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        got = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x must be a float32 tensor, got {got}; call x.float() first")
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator (e.g. torch.Generator().manual_seed(0)), "
                        f"got {type(generator).__name__}")
    if generator.device.type != x.device.type:
        raise ValueError(f"generator is on {generator.device} but x is on {x.device}; "
                         f"make the generator with torch.Generator(device=x.device)")
    raise NotImplementedError("exercise: stochastic_round_to_bf16 — see chapters/08_mixed_precision.md")


# --- 6. a Kahan-compensated bf16 update ------------------------------------------------------------


def kahan_bf16_update(weight: torch.Tensor, compensation: torch.Tensor,
                      update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build

    ``weight + update`` for a bf16 weight, keeping what rounding lost in ``compensation``.

    ``bf16(w + u)`` loses everything of ``u`` below half of ``w``'s ulp: at ``w = 1`` an update of
    ``10^-3`` vanishes outright (the ulp is ``2^-7 ≈ 7.8e-3``), so a pure-bf16 optimizer with a
    small learning rate stops learning. Kahan summation (Kahan 1965) keeps a second number ``c``
    beside each weight: the part of the sum the weight could not hold, so that ``w + c`` is the
    true running sum. Each step adds ``c`` back before adding to the weight and measures what was
    lost this time:

        y     = u + c                 the update, plus what earlier steps lost     (in fp32)
        w'    = bf16(w + y)           the new weight                               (w + y in fp32)
        c'    = bf16(y - (w' - w))    what this step lost: asked for y, got w' - w (in fp32)

    ``w' - w`` is exact in fp32 (both are bf16, close together), so ``c'`` misses only its own
    bf16 rounding — a relative ``2^-9`` of a number below half an ulp of ``w``. Once the lost
    pieces add up to half an ulp, ``w + y`` rounds up and the weight moves; the weight stays
    within about half an ulp of the exact sum however many tiny updates it receives, where the
    plain bf16 weight does not move at all (Zamirai et al. 2020, §4, use this for bf16 training
    with no fp32 master weights: 2 + 2 bytes per weight instead of 2 + 4).

    **Your task:** return ``(new_weight, new_compensation)``, new tensors in the dtypes of
    ``weight`` and ``compensation`` (bf16), leaving the inputs unchanged. ``update`` is already
    fp32 and the shapes are checked.
    """
    for name, t in (("weight", weight), ("compensation", compensation), ("update", update)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
    if weight.dtype != torch.bfloat16 or compensation.dtype != torch.bfloat16:
        raise TypeError(f"weight ({weight.dtype}) and compensation ({compensation.dtype}) must be bfloat16; "
                        "start the compensation as torch.zeros_like(weight)")
    if not update.is_floating_point():
        raise TypeError(f"update must be a floating-point tensor, got {update.dtype}")
    if compensation.shape != weight.shape:
        raise ValueError(f"compensation shape {tuple(compensation.shape)} does not match weight shape "
                         f"{tuple(weight.shape)}: one compensation per weight")
    if update.shape != weight.shape:
        raise ValueError(f"update shape {tuple(update.shape)} does not match weight shape "
                         f"{tuple(weight.shape)}")
    update = update.float()
    raise NotImplementedError("exercise: kahan_bf16_update — see chapters/08_mixed_precision.md")


# --- 7. fine-grained fp8 quantisation: a scale per 1x128 tile --------------------------------------

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn: 1.75 * 2^8 (its top exponent is not inf)


def quantize_tiles_1x128(x: torch.Tensor, tile: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build

    ``x`` (tokens × channels) in fp8 E4M3 with one scale per ``1 × tile`` tile: ``(q, scales)``.

    E4M3 holds 448 at most and has 3 mantissa bits; below 2^-6 its numbers thin out into subnormals
    and below 2^-10 everything is 0. A tensor therefore has to be *scaled* into that range before the
    cast: multiply by ``s = 448 / amax`` so that its largest magnitude lands on 448, cast, and divide
    by ``s`` to read it back. With one ``s`` for the whole tensor, a single outlier 10^5 times the
    typical value pushes every other value down into the subnormals or to zero. DeepSeek-V3 (§3.3.2)
    gives each token's channels a scale per tile of 128 (a weight gets one per 128×128 block): the
    outlier then spoils only its own tile::

        tile (i, j) = x[i, j*tile : (j+1)*tile]          the last tile of a row may be shorter
        scales[i, j] = 448 / amax(tile (i, j))           fp32; 1.0 for an all-zero tile (no 0 / 0)
        q[i, k]      = e4m3(clamp(x[i, k] * scales[i, k // tile], -448, 448))

    so that ``x ≈ q.float() / scales`` repeated over each tile. The clamp saturates instead of
    overflowing (it matters only if rounding ``x * s`` in fp32 lands a hair above 448).

    **Your task:** return ``q`` (``torch.float8_e4m3fn``, the shape of ``x``) and ``scales``
    (``torch.float32``, shape ``(M, ceil(K / tile))``) for a 2-D float ``x`` of shape (M, K), on
    ``x``'s device, without changing ``x``. Hint: pad each row with zeros to a multiple of ``tile``
    (zeros never raise an amax), view it as ``(M, K_pad // tile, tile)`` and take the amax of the last
    dimension; ``repeat_interleave`` spreads the scales back over the columns. Divide tensors
    (``torch.full_like(amax, 448.0) / amax``): ``448.0 / amax`` computes ``448 * (1 / amax)``, two
    roundings, and can differ in the last bit.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens x channels), got shape {tuple(x.shape)}; "
                         f"reshape it with x.reshape(-1, x.shape[-1])")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int (DeepSeek-V3 uses 128), got {tile!r}")
    raise NotImplementedError("exercise: quantize_tiles_1x128 — see chapters/08_mixed_precision.md")


# --- 8. delayed scaling: the scale of the next step from a window of amaxes -------------------------


def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int = 0,
                           algo: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build

    One step of Transformer Engine's delayed scaling for one tensor: ``(new_history, new_scale)``.

    Finding ``amax`` before every cast costs a pass over the tensor. *Delayed* scaling casts this
    step's tensor with a scale computed from *past* steps' amaxes instead, and records this step's
    amax while casting. ``amax_history`` is a 1-D window of length L: slot 0 holds this step's amax
    (just recorded), the other slots the amaxes of earlier steps (0 where none yet). After the step::

        amax      = max(amax_history)           (algo="max"; algo="most_recent": amax_history[0])
        new_scale = (fp8_max / amax) / 2^margin      -- but the old ``scale`` where amax is 0 or
                                                        not finite (nothing to learn from it)
        new_history = amax_history rolled by one to the left (slot 0 moves to the end, slot i to
                      slot i-1: torch.roll(h, -1)), then slot 0 set to 0 for the next step

    so the window slides: an amax is counted for L steps and then dropped (it reaches slot 0 again
    and is cleared). ``margin`` leaves 2^margin of headroom for growth before the next update.

    **Your task:** return new tensors (fp32, on the inputs' device), leaving ``amax_history`` and
    ``scale`` (a 0-dim fp32 tensor) unchanged. The arguments are already checked. (As in exercise 7,
    divide tensors, ``torch.full_like(amax, fp8_max) / amax``, for a correctly rounded scale.)
    """
    if not isinstance(amax_history, torch.Tensor) or amax_history.dim() != 1 or amax_history.numel() < 1:
        raise ValueError("amax_history must be a 1-D tensor with at least one slot, got "
                         f"{getattr(amax_history, 'shape', type(amax_history).__name__)}")
    if not isinstance(scale, torch.Tensor) or scale.dim() != 0:
        raise ValueError(f"scale must be a 0-dim tensor (torch.tensor(1.0)), got {scale!r}")
    if not (isinstance(fp8_max, (int, float)) and fp8_max > 0):
        raise ValueError(f"fp8_max must be a positive number (448 for E4M3, 57344 for E5M2), got {fp8_max!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    history, scale = amax_history.float(), scale.float()
    raise NotImplementedError("exercise: delayed_scaling_update — see chapters/08_mixed_precision.md")
