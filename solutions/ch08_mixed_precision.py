"""Chapter 08 exercises: mixed precision — the loss scaler and a training loop built on it, the
updates bf16 loses, stochastic rounding, a Kahan-compensated bf16 update, fp8 tiles, delayed scaling.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch08_mixed_precision.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch08 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Nothing here needs ranks: number formats are a single-process matter.

1. :func:`scaler_update`: the dynamic loss-scale rule (Micikevicius et al. 2018, "Mixed Precision
   Training", §3.2; the rule ``torch.amp.GradScaler.update`` applies) with a floor: halve the scale
   (never below ``min_scale``) and skip the step when a gradient overflowed, double it after
   ``growth_interval`` clean steps in a row.
2. :class:`LossScaler`: the whole dynamic loss scaler, ``scale`` / ``unscale_`` / ``step`` /
   ``update`` with ``torch.amp.GradScaler``'s semantics, its rule being exercise 1, plus Megatron-LM's
   *hysteresis*: the scale backs off only once ``hysteresis`` overflows have been seen since it last
   grew (every overflowing step is still skipped).
3. :func:`train_with_loss_scaling`: mixed-precision training (Micikevicius et al. 2018, §3.1-3.3): a
   half model for forward and backward, fp32 master weights owned by the optimizer, several
   micro-batches per step summed in fp32, the true gradients clipped to a global norm between
   ``unscale_`` and ``step``, a loss scaler deciding which steps are applied.
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
   outlier spoils only the 128 values that share its tile; optionally power-of-two scales (MX).
8. :func:`delayed_scaling_update`: Transformer Engine's delayed-scaling step for one or many fp8
   tensors: the next scales from windows of past amaxes, then the windows rolled (Micikevicius et
   al. 2022, "FP8 Formats for Deep Learning", §4, per-tensor scaling; TE's ``DelayedScaling``).
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
                  backoff_factor: float = 0.5, growth_interval: int = 2000,
                  min_scale: float = 0.0) -> tuple[float, int]:
    """Kind: build · about 25 minutes

    The dynamic loss-scale rule: the scale and growth tracker after one step,
    ``(new_scale, new_growth_tracker)`` (Micikevicius et al. 2018, "Mixed Precision Training", §3.2).

    Multiplying the loss by a scale S lifts small fp16 gradients into range; too large an S
    overflows some gradient to inf or NaN instead. The right S is unknown and drifts, so it is found
    online: a step whose gradients held an inf or a NaN (``found_inf``) shrinks S by
    ``backoff_factor`` and restarts the count of clean steps; ``growth_interval`` clean steps in a row
    grow S by ``growth_factor`` and restart the count; otherwise the count goes on and S stays.

    Unlike GradScaler, yours has a floor, ``min_scale`` (DeepSpeed's ``min_loss_scale``, Megatron's
    ``min_scale``): a backoff never takes S below it (a scale already below it, say the initial one,
    is not raised; it just does not shrink). A run whose loss is NaN for a reason no scale can fix
    (bad data, a diverged model) then keeps a usable S instead of halving it towards 0 step after
    step. ``min_scale = 0`` is GradScaler's rule.

    Interface: ``scale`` (a float), ``growth_tracker`` (clean steps since S last changed, in
    ``[0, growth_interval)``), ``found_inf`` (a bool or a one-element tensor), the factors and the
    floor; returns a float and an int. The arguments are already checked.

    Properties the tests check: the same sequence of scales and trackers as
    ``torch.amp.GradScaler`` (and its update kernel) on scripted and random runs, for several
    factors and intervals with ``min_scale = 0``; random runs with a floor against GradScaler's kernel
    clamped by hand; every scale is an fp32 number (GradScaler keeps S in an fp32 tensor: round with
    ``_fp32``, given; the floor is rounded too); S never grows into inf (the tracker still restarts);
    an interval of 1 grows on every clean step; a backoff stops at the floor and never crosses it.

    Reference: ``minitorch_dist/memory/mixed_precision.py`` (``DynamicLossScaler.update``: the same rule
    on a tensor scale; here it is a pure function of the state).
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
    if not (math.isfinite(float(min_scale)) and min_scale >= 0):
        raise ValueError(f"min_scale must be a finite number >= 0 (0: no floor), got {min_scale}")
    growth_tracker, growth_interval, min_scale = int(growth_tracker), int(growth_interval), float(min_scale)
    # BEGIN SOLUTION
    if found_inf:  # overflow: shrink, but not below the floor (nor raise a scale already below it)
        return min(scale, max(_fp32(scale * backoff_factor), _fp32(min_scale))), 0
    clean = growth_tracker + 1
    if clean < growth_interval:
        return scale, clean
    grown = _fp32(scale * growth_factor)
    return (grown if math.isfinite(grown) else scale), 0  # never grow into inf
    # END SOLUTION


# --- 2. the loss scaler ----------------------------------------------------------------------------


class LossScaler:
    """Kind: build · about 50 minutes

    A dynamic loss scaler with ``torch.amp.GradScaler``'s four calls (Micikevicius et al. 2018,
    §3.2) and Megatron-LM's *hysteresis*, for one optimizer whose parameters hold fp32 (or bf16)
    gradients::

        scaler.scale(loss).backward()   # every gradient comes out multiplied by S
        scaler.unscale_(optimizer)      # optional: gradients divided by S now (before clipping, say)
        scaler.step(optimizer)          # the optimizer's step, unless a gradient was inf or NaN
        scaler.update()                 # the next S

    GradScaler halves S at every overflow. In a long fp16 run an occasional lone overflow (a spike
    in one batch) then costs a factor 2 of range that takes ``growth_interval`` clean steps to win
    back. Megatron-LM's ``DynamicGradScaler`` tolerates a few: it keeps a *hysteresis counter*
    ``h``, set to ``hysteresis`` at the start, and the rule of an iteration is

    * an overflow (an inf or a NaN among the gradients): the step is skipped, the growth tracker
      restarts at 0, and ``h`` drops by one, never below 0; if ``h`` is then 0, S backs off by
      exercise 1's rule (``backoff_factor``, not below ``min_scale``);
    * a clean iteration: the growth tracker counts it by exercise 1's rule; when it completes
      ``growth_interval`` clean iterations (the tracker restarts at 0, S grows unless that would be
      inf), ``h`` is restored to ``hysteresis``. A clean iteration does nothing else to ``h``.

    So S backs off at the ``hysteresis``-th overflow since S last grew (clean iterations between the
    overflows do not restore ``h``), and at *every* further overflow until S grows again.
    ``hysteresis = 1`` is GradScaler exactly.

    Interface: ``LossScaler(init_scale, growth_factor, backoff_factor, growth_interval, min_scale,
    hysteresis)``. ``scale(loss)`` returns ``loss * S`` (S an fp32 tensor on the loss's device);
    ``unscale_(optimizer)`` divides every ``.grad`` in place and returns whether any held an inf or a
    NaN *before* it; ``step(optimizer)`` returns ``optimizer.step()``'s value, or None for a skipped
    step (the weights keep their values, ``skipped_steps`` grows by one); ``update()`` moves S, the
    growth tracker and ``h`` by the rule above and starts a fresh iteration. The state is
    ``self._scale`` (a Python float, an fp32 number), ``self.growth_tracker``,
    ``self.hysteresis_tracker`` (``h``), ``self.skipped_steps`` and the per-iteration flags
    ``self._found_inf`` (None until checked) and ``self._stepped``; the argument and misuse checks are
    given, and ``_grads_of(optimizer)`` (given) lists the gradients.

    Properties the tests check: with ``hysteresis = 1``, bit for bit the scales, growth trackers,
    gradients, weights and skipped steps of ``torch.amp.GradScaler`` on a scripted run with
    overflows, NaNs and clipping between ``unscale_`` and ``step`` (1/S is computed as GradScaler
    does, in float64 and rounded once to fp32); with ``hysteresis = 2`` and ``3``, the scale, growth
    tracker, ``h`` and skip of every iteration equal a hand-written schedule of clean and overflowing
    iterations (overflows separated by clean ones, overflows in a row, a floor), and every
    overflowing step leaves the weights alone; a gradient is divided once however the calls are
    mixed; an iteration's verdict does not leak into the next; misuse raises.

    Reference: ``minitorch_dist/memory/mixed_precision.py`` (``DynamicLossScaler``: GradScaler's
    rule, keyed by optimizer with a tensor scale; yours keeps a float scale for one optimizer and adds
    the hysteresis of Megatron-LM's ``megatron/core/optimizer/grad_scaler.py``, which is not in the
    library).
    """

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, min_scale: float = 0.0, hysteresis: int = 1):
        if not (isinstance(init_scale, (int, float)) and 0 < init_scale < math.inf):
            raise ValueError(f"init_scale must be a finite number > 0, got {init_scale!r}")
        _check_factors(float(growth_factor), float(backoff_factor), growth_interval)
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1 (overflows tolerated before a backoff; 1 is "
                             f"GradScaler), got {hysteresis!r}")
        self._scale = _fp32(float(init_scale))
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.hysteresis = hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis
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
        # BEGIN SOLUTION
        return loss * torch.tensor(self._scale, dtype=torch.float32, device=loss.device)
        # END SOLUTION

    def unscale_(self, optimizer: torch.optim.Optimizer) -> bool:
        """Divide the gradients by S in place; return whether any was inf or NaN."""
        if self._found_inf is not None:
            raise RuntimeError("unscale_() has already been called since the last update(); "
                               "call it at most once per iteration")
        grads = _grads_of(optimizer)
        # BEGIN SOLUTION
        inv_scale = _fp32(1.0 / self._scale)  # 1/S in float64, rounded once to fp32, as GradScaler
        found = False
        with torch.no_grad():
            for g in grads:
                found = found or not bool(torch.isfinite(g).all())
                g.mul_(inv_scale)
        self._found_inf = found
        return found
        # END SOLUTION

    def step(self, optimizer: torch.optim.Optimizer):
        """``unscale_`` unless done, then ``optimizer.step()`` unless a gradient was not finite."""
        if self._stepped:
            raise RuntimeError("step() has already been called since the last update(); call update() "
                               "between steps")
        # BEGIN SOLUTION
        if self._found_inf is None:
            self.unscale_(optimizer)
        self._stepped = True
        if self._found_inf:
            self.skipped_steps += 1  # skipped whatever h says: the weights stay, the step is lost
            return None
        return optimizer.step()
        # END SOLUTION

    def update(self) -> None:
        """The new S, growth tracker and hysteresis counter; the iteration's flags reset."""
        if self._found_inf is None:
            raise RuntimeError("update() before any inf/NaN check; call step() (or unscale_()) first")
        # BEGIN SOLUTION
        rule = (self.growth_factor, self.backoff_factor, self.growth_interval, self.min_scale)
        if self._found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
            if self.hysteresis_tracker == 0:  # out of tolerance: back off, at every overflow until S grows
                self._scale, _ = scaler_update(self._scale, 0, True, *rule)
        else:
            self._scale, self.growth_tracker = scaler_update(self._scale, self.growth_tracker, False, *rule)
            if self.growth_tracker == 0:  # an interval of clean iterations completed: tolerance restored
                self.hysteresis_tracker = self.hysteresis
        self._found_inf, self._stepped = None, False
        # END SOLUTION


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


def _checked_steps(steps) -> list:
    """``steps`` as a list, each entry checked to be a non-empty list of ``(x, y)`` micro-batches."""
    steps = list(steps)
    for i, step in enumerate(steps):
        if not isinstance(step, list) or not step or not all(isinstance(mb, (tuple, list)) and len(mb) == 2
                                                             for mb in step):
            raise ValueError(f"steps[{i}] must be a non-empty list of (x, y) micro-batches, got "
                             f"{type(step).__name__}; wrap a single batch as [(x, y)]")
    return steps


def train_with_loss_scaling(model: nn.Module, steps, make_optimizer, scaler=None,
                            dtype: torch.dtype = torch.float16, loss_fn=None,
                            max_norm: float | None = None) -> dict:
    """Kind: build · about 50 minutes

    Train ``model`` in mixed precision (Micikevicius et al. 2018, §3.1-3.3) with gradient
    accumulation and gradient clipping: one optimizer step per entry of ``steps``, each a list of
    ``(x, y)`` micro-batches, and return what happened.

    The arrangement is set up for you below: ``half``, a copy of the model in ``dtype`` (fp16 or bf16,
    its LayerNorms computing in fp32); ``masters``, fp32 copies of the *original* weights in the order
    of ``half.parameters()``; ``optimizer = make_optimizer(masters)``, which owns them. Forward and
    backward run on ``half``; sums and updates happen in fp32 on the masters; the next forward sees
    the updated masters rounded into ``half``. ``loss = loss_fn(half, x, y)`` is an fp32 scalar.
    ``scaler`` is anything with GradScaler's calls (your :class:`LossScaler`, or
    ``torch.amp.GradScaler("cpu")``), or None (bf16, or fp16 without loss scaling).

    A step of k micro-batches minimises their mean loss: each micro-batch's backward starts from
    ``loss / k`` (scaled by the scaler when there is one, ``scaler.scale(loss / k)``), and its half
    gradients are added into the masters' fp32 gradients, in micro-batch order, before the next
    micro-batch runs; they are never summed in half. With ``max_norm``, the step's true (unscaled)
    gradient is clipped to that global 2-norm by ``torch.nn.utils.clip_grad_norm_(masters, max_norm)``
    after ``scaler.unscale_(optimizer)`` and before ``scaler.step(optimizer)``. A step in which any
    micro-batch overflowed is skipped as a whole (the scaler sees the sum, and inf or NaN survives
    every later addition), however many micro-batches were clean.

    Return ``{"losses": [...], "applied": [...], "grad_norms": [...], "masters": masters,
    "half_model": half}``, one entry per step: its loss, the mean of its micro-batches' ``loss.item()``
    (``sum(...) / k`` in Python, in micro-batch order); whether its update was applied, the scaler's
    verdict (always True without a scaler; with one, *not* whether the scale fell: with hysteresis an
    overflowing step may leave it where it was); the total norm ``clip_grad_norm_`` returned, before
    clipping, as a float (not finite for an overflowing step; None for every step without
    ``max_norm``).

    Properties the tests check: the losses, applied flags, norms, masters and half weights equal, bit
    for bit, a reference loop driven by ``torch.amp.GradScaler`` (``unscale_``, ``clip_grad_norm_``,
    ``step``, ``update``), driven by GradScaler and by your scaler, with steps that overflow and a clip
    that binds; an overflow in the middle micro-batch only skips the step; a clip that does not bind
    changes no bit, one that binds does; your scaler with hysteresis skips an overflowing step it
    does not back off for; with gradients too small for fp16, the loss-scaled run learns what fp32
    learns while the unscaled one does not (and bf16 needs no scaler); the fp32 model is left as it
    was; bad input is refused.

    Reference: ``minitorch_dist/memory/mixed_precision.py`` (``MixedPrecisionTrainer``: the same
    arrangement as a class, with micro-batches, reporting a step as skipped from the scaler's own
    counter; it does not clip and reports no norm. Yours clips between ``unscale_`` and ``step`` and
    is driven by any scaler with GradScaler's calls).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if scaler is not None and not all(hasattr(scaler, m) for m in ("scale", "unscale_", "step", "update")):
        raise TypeError("scaler must have GradScaler's scale/unscale_/step/update, got "
                        f"{type(scaler).__name__}")
    if max_norm is not None and not (isinstance(max_norm, (int, float)) and 0 < max_norm < math.inf):
        raise ValueError(f"max_norm must be None (no clipping) or a finite number > 0, got {max_norm!r}")
    steps = _checked_steps(steps)
    loss_fn = loss_fn or fp32_cross_entropy
    half = half_precision_copy(model, dtype)
    half_params = list(half.parameters())
    masters = [p.detach().clone().float().requires_grad_(True) for p in model.parameters()]
    optimizer = make_optimizer(masters)
    losses, applied, grad_norms = [], [], []
    # BEGIN SOLUTION
    for step in steps:
        k, step_losses = len(step), []
        for x, y in step:
            loss = loss_fn(half, x, y)
            part = loss / k
            (scaler.scale(part) if scaler is not None else part).backward()
            for m, h in zip(masters, half_params):  # fold into fp32 now: never summed in half
                if h.grad is not None:
                    g = h.grad.float()
                    m.grad = g if m.grad is None else m.grad.add_(g)
                    h.grad = None
            step_losses.append(loss.item())
        # the scaler's verdict: it looks at these (scaled, fp32) gradients for inf and NaN
        finite = all(bool(torch.isfinite(m.grad).all()) for m in masters if m.grad is not None)
        if scaler is not None:
            scaler.unscale_(optimizer)  # the true gradients, before the clip reads them
        norm = None if max_norm is None else float(torch.nn.utils.clip_grad_norm_(masters, max_norm))
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        with torch.no_grad():
            for m, h in zip(masters, half_params):
                h.copy_(m)  # the rounded master is what the next forward sees
                m.grad = None
        losses.append(sum(step_losses) / k)
        applied.append(finite or scaler is None)
        grad_norms.append(norm)
    # END SOLUTION
    return {"losses": losses, "applied": applied, "grad_norms": grad_norms, "masters": masters,
            "half_model": half}


# --- 4. the updates bf16 loses: predicted, then counted ---------------------------------------------


def count_lost_bf16_updates(model: nn.Module, x, y, lr: float, loss_fn=None) -> dict:
    """Kind: measure · about 30 minutes

    A model kept entirely in bf16 — no fp32 master — takes one SGD step, ``w <- w - lr * g``. How many
    of its elements does the step fail to move? Predict it from the number format, then take the step
    and count.

    - **Predict** from bf16's bit layout alone, with ``costmodel.precision.update_lost`` (given the
      weights and the updates ``u = -lr * g``), which elements the step cannot move.
    - **Measure**: take the step in place, as SGD does on bf16 weights (``p.add_(p.grad, alpha=-lr)``
      under ``torch.no_grad()``), and count the elements whose weight is exactly what it was.

    Count only the elements whose update is not zero (a zero update moves nothing, lost or not).
    ``loss_fn(model, x, y)`` (default ``fp32_cross_entropy``) gives the loss to back-propagate.

    Return ``{"predicted": int, "measured": int, "updated": int}`` (``updated``: the elements with
    ``u != 0``), leaving ``model`` stepped and its gradients in place.

    Properties the tests check: ``updated`` and ``measured`` exactly against the test's own SGD step of
    an identical model; ``predicted`` within 0.5 % of the updated elements of the test's own bit-level
    count; your model's weights after the call equal the test's stepped weights (the measurement came
    from a real step); the two counts agree to within 0.5 % of the updated elements (the real step
    rounds w + u twice, to fp32 then bf16, the prediction once).

    Reference: ``minitorch_dist/costmodel/precision.py`` (``update_lost``: the prediction; the exercise
    adds the real step and the count).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        raise TypeError("model must be entirely bf16 (model.to(torch.bfloat16)): no fp32 master here")
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a number > 0, got {lr!r}")
    loss_fn = loss_fn or fp32_cross_entropy
    model.zero_grad(set_to_none=True)
    # BEGIN SOLUTION
    loss_fn(model, x, y).backward()
    predicted = measured = updated = 0
    for p in model.parameters():
        if p.grad is None:
            continue
        u = -lr * p.grad.float()
        moved = u != 0
        before = p.detach().clone()
        predicted += (update_lost(before.double(), u.double(), "bf16") & moved).sum().item()
        with torch.no_grad():
            p.add_(p.grad, alpha=-lr)
        measured += ((p.detach() == before) & moved).sum().item()
        updated += moved.sum().item()
    return {"predicted": int(predicted), "measured": int(measured), "updated": int(updated)}
    # END SOLUTION


# --- 5. stochastic rounding to bf16 ----------------------------------------------------------------

_LOW_BITS = 16  # bf16 is fp32 with the low 16 bits of the mantissa cut off


def stochastic_round_to_bf16(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Kind: build · about 40 minutes

    ``x`` (fp32) rounded to bf16, up or down at random so that the result is right on average
    (Gupta et al. 2015, "Deep Learning with Limited Numerical Precision", §3).

    Every fp32 ``x`` lies between two neighbouring bf16 numbers ``lo <= x < hi`` (towards zero and
    away from it). *Stochastic rounding* picks ``hi`` with probability ``(x - lo) / (hi - lo)`` and
    ``lo`` otherwise, so ``E[round(x)] = x``: a weight whose updates are each below half its ulp
    never moves under round-to-nearest, but moves by the updates *on average* under stochastic
    rounding, with no fp32 copy.

    Interface: ``x`` a float32 tensor (any shape, on any device), ``generator`` a ``torch.Generator``
    on x's device; returns a bf16 tensor of x's shape. Draw random numbers from ``generator`` only.

    Properties the tests check: every result is one of x's two bf16 neighbours (x itself when it is
    a bf16 number); the mean over many draws is within a few standard errors of x, for positive and
    negative values across binades, where round-to-nearest is biased; inf, -inf, NaN, zeros and
    values near bf16's largest come through as they should (a carry past the largest is inf); the
    global random stream is untouched and a seeded generator reproduces the result; tiny updates to
    a bf16 weight add up over many steps.

    Reference: ``minitorch_dist/memory/mixed_precision.py`` (bf16 training there keeps an fp32 master
    and rounds to nearest; stochastic rounding is not in the library).
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
    # BEGIN SOLUTION
    bits = x.contiguous().view(torch.int32)
    r = torch.randint(0, 1 << _LOW_BITS, x.shape, generator=generator, dtype=torch.int32, device=x.device)
    rounded = ((bits + r) & -(1 << _LOW_BITS)).view(torch.float32)  # carry into bit 16, then truncate
    rounded = torch.where(torch.isnan(x), x, rounded)  # a NaN's carry could make it inf
    return rounded.to(torch.bfloat16)  # exact: the low 16 bits are zero
    # END SOLUTION


# --- 6. a Kahan-compensated bf16 update ------------------------------------------------------------


def kahan_bf16_update(weight: torch.Tensor, compensation: torch.Tensor,
                      update: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build · about 35 minutes

    ``weight + update`` for a bf16 weight, keeping what rounding lost in a bf16 ``compensation``
    (Kahan 1965, "Further Remarks on Reducing Truncation Errors"; Zamirai et al. 2020, "Revisiting
    BFloat16 Training", §4).

    ``bf16(w + u)`` loses everything of ``u`` below half of ``w``'s ulp: at ``w = 1`` an update of
    ``10^-3`` vanishes outright, so a pure-bf16 optimizer with a small learning rate stops learning.
    Kahan summation keeps beside each weight a second number ``c``, the part of the running sum the
    weight could not hold, so that ``w + c`` tracks the true sum: 2 + 2 bytes per weight instead of
    an fp32 master's 2 + 4.

    Interface: returns ``(new_weight, new_compensation)``, new bf16 tensors, leaving the inputs
    unchanged; ``update`` is fp32 and the shapes are checked. Start a weight's compensation at zero.

    Properties the tests check: single steps worked by hand (an update that fits, one that is lost
    and remembered, one that tips the weight over); a long run of tiny updates tracks the exact sum
    within the derived bound of a few ulps while plain bf16 does not move; random updates against a
    float64 sum; inputs unchanged; bad input refused.

    Reference: ``minitorch_dist/memory/mixed_precision.py`` (the library keeps fp32 masters instead;
    compensated bf16 updates are not in it).
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
    # BEGIN SOLUTION
    w = weight.float()
    y = update + compensation.float()  # add back what earlier steps lost
    new_w = (w + y).to(weight.dtype)
    new_c = (y - (new_w.float() - w)).to(compensation.dtype)  # what this step lost
    return new_w, new_c
    # END SOLUTION


# --- 7. fine-grained fp8 quantisation: a scale per 1x128 tile --------------------------------------

E4M3_MAX = 448.0  # the largest finite float8_e4m3fn: 1.75 * 2^8 (its top exponent is not inf)


def quantize_tiles_1x128(x: torch.Tensor, tile: int = 128,
                         power_of_two: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build · about 35 minutes

    ``x`` (tokens × channels) in fp8 E4M3 with one scale per ``1 × tile`` tile: ``(q, scales)``
    (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2).

    E4M3 holds 448 at most and has 3 mantissa bits; below 2^-6 it thins into subnormals and below
    2^-10 everything is 0. A tensor is therefore scaled into range before the cast, by
    ``s = 448 / amax``. With one ``s`` for the whole tensor a single outlier pushes everything else
    towards zero; with one per tile of ``tile`` consecutive channels of a row the outlier spoils only
    its own tile. The last tile of a row may be shorter; an all-zero tile has scale 1.0.

    ``power_of_two=True`` is the other design point, the one MX formats (OCP Microscaling, E8M0
    scales) and DeepSeek-V3's later recipe use: each scale is the largest power of two not above
    ``448 / amax`` (the correctly rounded fp32 quotient). Scaling by a power of two only moves
    exponents, so it adds no rounding of its own and a scale fits in 8 bits; the price is up to one
    binade of E4M3's range: a tile's amax lands in (224, 448] instead of on 448.

    Interface: ``x`` a 2-D float tensor (M, K); returns ``q`` (``torch.float8_e4m3fn``, x's shape) and
    ``scales`` (``torch.float32``, ``(M, ceil(K / tile))``) with ``x ≈ q.float() / scales`` over each
    tile, on x's device, x unchanged. Values are clamped to ±448 before the cast (saturating).

    Properties the tests check: ``q`` and ``scales`` bit for bit against a tile-by-tile computation
    (scales as ``torch.full_like(amax, 448.0) / amax``: correctly rounded, one division), with and
    without ``power_of_two``, for ragged and exact shapes and all-zero tiles; power-of-two scales that
    are powers of two with every tile's amax in (224, 448]; the round trip within E4M3's half-ulp per
    tile; an outlier confined to its tile; bad input refused.

    Reference: ``minitorch_dist/memory/fp8.py`` (``quantize_blockwise``: any block shape, wrapped in an
    ``FP8Tensor``; yours is the 1 x tile case with the scales returned).
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (tokens x channels), got shape {tuple(x.shape)}; "
                         f"reshape it with x.reshape(-1, x.shape[-1])")
    if isinstance(tile, bool) or not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be a positive int (DeepSeek-V3 uses 128), got {tile!r}")
    if not isinstance(power_of_two, bool):
        raise TypeError(f"power_of_two must be True or False, got {power_of_two!r}")
    # BEGIN SOLUTION
    M, K = x.shape
    n_tiles = -(-K // tile)
    padded = x.new_zeros(M, n_tiles * tile, dtype=torch.float32)
    padded[:, :K] = x.float().abs()
    amax = padded.view(M, n_tiles, tile).amax(dim=-1)
    scales = torch.where(amax > 0, torch.full_like(amax, E4M3_MAX) / amax, torch.ones_like(amax))
    if power_of_two:  # s = m * 2^e with m in [0.5, 1): the largest power of two <= s is 2^(e - 1)
        _, exponent = torch.frexp(scales)
        scales = torch.ldexp(torch.ones_like(scales), exponent - 1)
    per_element = scales.repeat_interleave(tile, dim=1)[:, :K]
    q = (x.float() * per_element).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales
    # END SOLUTION


# --- 8. delayed scaling: the scale of the next step from a window of amaxes -------------------------


def delayed_scaling_update(amax_history: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int = 0,
                           algo: str = "max") -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: build · about 35 minutes

    One step of Transformer Engine's delayed scaling for one fp8 tensor, or for T tensors at once:
    ``(new_history, new_scale)`` (Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §4; TE's
    ``DelayedScaling`` recipe).

    Finding a tensor's amax before every cast costs a pass over it. *Delayed* scaling casts with a
    scale computed from *past* amaxes, recording this step's amax while casting. A tensor's window
    holds its last L amaxes: slot 0 this step's (just recorded), the others earlier steps' (0 where
    none yet). The next scale is ``fp8_max / amax / 2^margin``, amax being the window's largest
    (``algo="max"``) or this step's (``"most_recent"``); where that amax is 0 or not finite the old
    scale stays. Then the window slides by one step, so an amax counts for L steps and is dropped,
    and slot 0 is cleared for the next step's amax.

    TE keeps the windows of all the fp8 tensors of a model in one ``(L, T)`` tensor — slot along
    dim 0, one column per tensor — and the scales in one ``(T,)`` tensor, and updates them all in one
    call; the library's ``DelayedScaler`` updates one tensor's window. Yours takes both layouts:
    ``amax_history`` of shape ``(L,)`` with a 0-dim ``scale``, or ``(L, T)`` with a ``(T,)`` ``scale``.
    Each column is independent of the others.

    Interface: returns new fp32 tensors of the inputs' shapes on their device, leaving
    ``amax_history`` and ``scale`` unchanged. The arguments are already checked.

    Properties the tests check: over a driven sequence of amaxes, each scale and window equal a
    reference that slides a Python list (within one fp32 rounding of ``fp8_max / amax``, computed as
    ``torch.full_like(amax, fp8_max) / amax``); the window moves as ``torch.roll(h, -1)`` along the
    slots with slot 0 cleared; margin, most_recent, zero, inf and NaN amaxes; for T = 3 tensors each
    column equal to driving that tensor alone, and a hand-worked (3, 2) window; inputs unchanged.

    Reference: ``minitorch_dist/memory/fp8.py`` (``DelayedScaler.update``: the same step on one
    tensor's window; yours is a pure function over the windows of many tensors).
    """
    if not isinstance(amax_history, torch.Tensor) or amax_history.dim() not in (1, 2) \
            or amax_history.shape[0] < 1:
        raise ValueError("amax_history must be a 1-D (L,) or 2-D (L, T) tensor with at least one slot, got "
                         f"{getattr(amax_history, 'shape', type(amax_history).__name__)}")
    if not isinstance(scale, torch.Tensor) or scale.shape != amax_history.shape[1:]:
        raise ValueError(f"scale must have shape {tuple(amax_history.shape[1:])}, one per column of "
                         f"amax_history (a 0-dim tensor for a 1-D history), got {scale!r}")
    if not (isinstance(fp8_max, (int, float)) and fp8_max > 0):
        raise ValueError(f"fp8_max must be a positive number (448 for E4M3, 57344 for E5M2), got {fp8_max!r}")
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise ValueError(f"margin must be an int >= 0, got {margin!r}")
    if algo not in ("max", "most_recent"):
        raise ValueError(f"algo must be 'max' or 'most_recent', got {algo!r}")
    history, scale = amax_history.float(), scale.float()
    # BEGIN SOLUTION
    amax = history.max(dim=0).values if algo == "max" else history[0]  # per column (NaN propagates)
    fresh = torch.full_like(amax, fp8_max) / amax / 2.0 ** margin
    new_scale = torch.where((amax > 0) & torch.isfinite(amax), fresh, scale)
    new_history = torch.roll(history, -1, dims=0)  # along the slots; a new tensor: the input is untouched
    new_history[0] = 0.0
    return new_history, new_scale
    # END SOLUTION
