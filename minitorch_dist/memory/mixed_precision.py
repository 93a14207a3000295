"""Chapter 08 — mixed-precision training: a half-precision model, fp32 master weights, dynamic loss
scaling.

Micikevicius et al. 2018, "Mixed Precision Training" (ICLR), three techniques:

* §3.1 fp32 master weights. The model computes forward and backward in fp16 (2 B per weight,
  2 B per gradient), but the optimizer owns an fp32 copy of every weight and applies the update
  there. Why: an fp16 number w has spacing ulp(w) = 2^(floor(log2 |w|) - 10) (10 mantissa
  bits), so an update |u| below half the gap to w's neighbour rounds away (w + u == w). At
  w = 1 the gap is 2^-10 above and 2^-11 below, so any |u| < 2^-12 ~ 2.4e-4 is lost in either
  direction: an update of lr = 1e-4 times a unit gradient, routine late in training. The fp32 master
  (ulp(1) = 2^-23) keeps them, and they add up until the fp16 copy changes.
* §3.2 loss scaling. Backward gradients are small: many lie below fp16's smallest subnormal
  2^-24 ~ 6e-8 and flush to zero. Multiplying the loss by S multiplies every gradient by S
  (the chain rule is linear), lifting them into range; the fp32 master gradients are divided by S
  again before the update, so the update is unchanged. Too large an S overflows to inf. The
  *dynamic* scaler here (the semantics of ``torch.amp.GradScaler``) starts high (2^16); on
  any inf/NaN gradient it skips the step and halves S; after ``growth_interval`` (2000) clean
  steps in a row it doubles S, probing for the largest S that does not overflow.
* §3.3 arithmetic precision. Products may be fp16, but *sums* of many terms must accumulate in
  fp32: a long fp16 sum stops growing once the addends drop below half an ulp of the running
  total. Where accumulation stays fp32 in this file and why:
    - matrix multiplies and attention: the kernels (cuBLAS / CPU gemm, SDPA) accumulate fp16/bf16
      products in fp32 internally and round only the result; nothing to do here.
    - reductions over a row: LayerNorm's mean and variance, softmax's sum of exponentials, and the
      loss (log-sum-exp, mean over B*T tokens). This file computes LayerNorm in fp32 (weights stay
      stored in half, inputs and weights are *cast* to fp32 for the op and the output cast back:
      autocast's policy for ``layer_norm``), and the default loss casts the logits to fp32 before
      ``cross_entropy``. The loss is therefore an fp32 scalar, scaled in fp32.
    - gradient accumulation across microbatches: each microbatch's half gradients are added
      into the fp32 master gradients (``backward`` folds them in before the next backward), never
      summed in fp16.
    - the optimizer: master weights and Adam's m and v are fp32 (v ~ g^2 would underflow in fp16).

Kalamkar et al. 2019, "A Study of BFLOAT16 for Deep Learning Training": bf16 keeps fp32's 8
exponent bits (range ~1e-38 .. 3e38) with only 8 bits of precision, so gradients do not underflow
and no loss scaling is needed: ``dtype=torch.bfloat16`` runs with the scaler disabled. Its ulp
is 8x coarser than fp16's, so master weights matter even more.

**With sharded gradients** (chapter 06). The scaler unscales and checks the gradients the optimizer
will *apply*, found by :func:`grads_to_step`, and decides for all ranks at once:

* ``ShardedOptimizer`` (ZeRO-1/2; with ``ZeroDataParallel`` pass ``zero.sharded``): at stage 2 every
  ``p.grad`` is freed during backward and the reduced gradient lives only in this rank's flat shard;
  the optimizer's ``grads_to_step()`` names it (stage 1: the local gradients in the flat buffer,
  reduced inside ``step``: mean_r(g_r / S) = mean_r(g_r) / S).
* ``fully_shard`` (ZeRO-3 / FSDP): a plain optimizer over the sharded parameters, whose ``.grad`` are
  this rank's pieces of each unit's reduced gradient; ``fsdp.shard_groups`` names their group.

Each rank sees only its own 1/n of the gradient. Left alone, an inf in rank 1's shard makes rank 1
skip while rank 0 steps its half of the weights: the replicas part, and so do their scales. So the
flags are agreed first: f = max_r f_r (f_r = 1 if rank r saw an inf or NaN), one all-reduce of one
byte per step (torch's ``ShardedGradScaler`` all-reduces its flag too, a SUM over the default group);
every rank then skips or steps together and moves S alike. Plain data parallelism needs none: DDP
all-reduced the gradients in backward, so an inf on one rank is an inf (or NaN) on every rank.

Memory (``costmodel.model_state_bytes(P, "mixed", "adamw")``): half weights 2 + half gradients 2
+ fp32 master 4 + Adam m 4 + v 4 = 16 B per parameter -- the same as pure fp32 training.
Mixed precision buys faster math and half-size activations, not smaller model states. The
fp32 gradient copy made inside ``step`` is a transient freed before it returns.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..runtime import comm
from .zero.fsdp import shard_groups


class DynamicLossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, §3.2) with ``torch.amp.GradScaler``'s semantics::

        scaler.scale(loss).backward()   # gradients are S * dL/dw
        scaler.step(optimizer)          # unscale_ (g /= S, look for inf/NaN); optimizer.step() unless found
        scaler.update()                 # found inf/NaN: S *= backoff_factor, counter = 0
                                        # else counter += 1;
                                        #   counter == growth_interval: S *= growth_factor, counter = 0

    S is an fp32 tensor (as in torch) so ``scale`` never synchronises a GPU. Counters: ``steps``
    (calls to ``step``) and ``skipped_steps`` (steps skipped for inf/NaN gradients).
    ``enabled=False`` turns every method into a pass-through (the bf16 path).
    """

    _READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True) -> None:
        if not (init_scale > 0 and init_scale < float("inf")):
            raise ValueError(f"init_scale must be a finite positive number, got {init_scale!r}")
        if not growth_factor > 1.0:
            raise ValueError("growth_factor must be > 1 (the scale grows after clean steps), got "
                             f"{growth_factor!r}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError("backoff_factor must be in (0, 1) (the scale shrinks on overflow), got "
                             f"{backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError("growth_interval must be a positive int (clean steps before growing), got "
                             f"{growth_interval!r}")
        self.enabled = bool(enabled)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = growth_interval
        self._scale = torch.tensor(float(init_scale), dtype=torch.float32)
        self._growth_tracker = 0  # consecutive clean steps since the last change of S
        self._found_inf: dict[int | str, bool] = {}  # id(optimizer) (or "grads") -> bool, this iteration
        self._stage: dict[int | str, str] = {}  # id(optimizer) -> ready / unscaled / stepped
        self.steps = 0
        self.skipped_steps = 0

    # --- the four calls of an iteration ---------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S`` (in the loss's dtype, S moved to its device); ``loss`` itself when disabled."""
        if not self.enabled:
            return loss
        self._scale = self._scale.to(loss.device)
        return loss * self._scale.to(loss.dtype)

    def unscale_(self, optimizer_or_grads: torch.optim.Optimizer | Iterable[torch.Tensor | None]) -> bool:
        """Multiply the gradients by 1/S in place and return whether any was inf or NaN.

        Takes an optimizer (the gradients it will apply: :func:`grads_to_step`) or a list of
        gradient tensors. Call it before anything that reads true gradient values (clipping, norms);
        ``step`` calls it otherwise. Once per optimizer per iteration, as ``GradScaler.unscale_``.
        With sharded gradients (ZeRO, FSDP) the found-inf flag is agreed over the group, MAX of one
        flag per rank, so every rank gets the same answer (a collective: every rank calls it).

        fp16 gradients are refused, as ``GradScaler`` refuses them (a ``ValueError``, nothing
        unscaled): 1/S would be rounded to fp16 (11 significant bits, fewer once S > 2^14, and 0
        once S > 2^24: every gradient would silently become 0). Unscale fp32 master gradients
        (``MixedPrecisionTrainer`` does). bf16 gradients are accepted, as by ``GradScaler``: bf16
        has fp32's exponent range.
        """
        if not self.enabled:
            return False
        if isinstance(optimizer_or_grads, torch.optim.Optimizer):
            key: int | str = id(optimizer_or_grads)
            stage = self._stage.get(key, self._READY)
            if stage == self._UNSCALED:
                raise RuntimeError("unscale_() has already been called on this optimizer since the last "
                                   "update(); call it at most once per iteration")
            if stage == self._STEPPED:
                raise RuntimeError("unscale_() is being called after step(); call update() first")
            grads, groups = grads_to_step(optimizer_or_grads)
            _refuse_fp16(grads)
            self._stage[key] = self._UNSCALED
        else:
            key, grads, groups = "grads", [g for g in optimizer_or_grads if g is not None], []
            _refuse_fp16(grads)
        # 1/S in fp64, rounded once to fp32 (as torch), then one multiply per gradient.
        inv_scale = self._scale.double().reciprocal().float()
        found = torch.zeros(1, dtype=torch.uint8, device=self._scale.device)  # 1: an inf/NaN seen
        with torch.no_grad():
            for g in grads:
                found |= (~torch.isfinite(g).all()).to(found.device, found.dtype)
                g.mul_(inv_scale.to(g.device, g.dtype))
            for group in groups:  # any rank's inf skips the step on every rank: MAX of the flags
                comm.all_reduce(found, op=dist.ReduceOp.MAX, group=group)
        self._found_inf[key] = bool(found) or self._found_inf.get(key, False)
        return self._found_inf[key]

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        """``unscale_`` (unless done), then ``optimizer.step()`` unless a gradient was inf/NaN.

        Returns ``optimizer.step``'s return value, or None for a skipped step.
        """
        if not self.enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("a closure is not supported with loss scaling; call step() without one")
        key = id(optimizer)
        stage = self._stage.get(key, self._READY)
        if stage == self._STEPPED:
            raise RuntimeError("step() has already been called since the last update(); "
                               "call update() between steps")
        if stage == self._READY:
            self.unscale_(optimizer)
        self._stage[key] = self._STEPPED
        self.steps += 1
        if self._found_inf[key]:
            self.skipped_steps += 1  # the weights keep their values: an overflowed step is lost, not harmful
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adjust S for the next iteration (``torch._amp_update_scale_``) and reset per-iteration state."""
        if not self.enabled:
            return
        if not self._found_inf:
            raise RuntimeError("no inf/NaN checks were recorded before update(); call step() "
                               "(or unscale_()) first")
        if any(self._found_inf.values()):
            self._scale = (self._scale.double() * self.backoff_factor).float()  # fp64 product, as torch
            self._growth_tracker = 0
        else:
            self._growth_tracker += 1
            if self._growth_tracker == self.growth_interval:
                grown = (self._scale.double() * self.growth_factor).float()
                if torch.isfinite(grown):  # never grow S into fp32 infinity
                    self._scale = grown
                self._growth_tracker = 0
        self._found_inf.clear()
        self._stage.clear()

    # --- inspection and checkpoints ---------------------------------------------------------
    def get_scale(self) -> float:
        """Current S as a Python float (1.0 when disabled)."""
        return float(self._scale) if self.enabled else 1.0

    @property
    def growth_tracker(self) -> int:
        return self._growth_tracker

    def state_dict(self) -> dict:
        """GradScaler's keys (so either can load the other's) plus the step counters; {} when disabled."""
        if not self.enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": self._growth_tracker, "steps": self.steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        if not self.enabled:
            return  # as GradScaler: a disabled scaler has no state to load
        if not state:
            raise RuntimeError("the state dict is empty: it came from a disabled scaler")
        self._scale = torch.tensor(float(state["scale"]), dtype=torch.float32, device=self._scale.device)
        self.growth_factor, self.backoff_factor = (float(state["growth_factor"]),
                                                   float(state["backoff_factor"]))
        self.growth_interval, self._growth_tracker = (int(state["growth_interval"]),
                                                      int(state["_growth_tracker"]))
        self.steps, self.skipped_steps = int(state.get("steps", 0)), int(state.get("skipped_steps", 0))


def grads_to_step(optimizer: torch.optim.Optimizer) -> tuple[list[torch.Tensor], list]:
    """The gradients ``optimizer.step()`` will apply, where they live, and the process groups over
    which the skip-or-step verdict must be agreed (each is one MAX all-reduce of one flag):

    * an optimizer with a ``grads_to_step() -> (tensors, group)`` method says so itself
      (``ShardedOptimizer``: at stage 2 this rank's reduced gradient shard; ``p.grad`` is None);
    * otherwise its parameters' ``.grad``; where some are shards made by ``fully_shard``, the groups
      they are sharded over (``fsdp.shard_groups``);
    * otherwise no group: one process, or data parallelism whose gradients were all-reduced in
      backward (DDP), where every rank holds the same gradient and reaches the same verdict alone.
    """
    if callable(getattr(optimizer, "grads_to_step", None)):
        grads, group = optimizer.grads_to_step()  # type: ignore[attr-defined]  # a method, checked just above
        return [g for g in grads if g is not None], [group]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return [p.grad for p in params if p.grad is not None], shard_groups(params)


def _refuse_fp16(grads) -> None:
    """``GradScaler``'s check (its message first), with the fix: keep fp32 master gradients."""
    if any(g.dtype == torch.float16 for g in grads):
        raise ValueError("Attempting to unscale FP16 gradients. In fp16, 1/S rounds to 0 for a loss scale "
                         "S > 2^24 and every gradient would become 0: keep fp32 master weights and unscale "
                         "their fp32 gradients (MixedPrecisionTrainer does: it folds the half gradients "
                         "into fp32 before unscaling)")


class Fp32LayerNorm(nn.LayerNorm):
    """LayerNorm whose statistics are computed in fp32 while its weights are stored in half.

    The mean and variance are sums over the hidden dimension (§3.3): input, weight and bias are
    cast to fp32, normalised, and the result cast back to the input's dtype. Autograd carries
    the casts, so the weight's gradient arrives in half like every other gradient.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def half_precision_copy(model: nn.Module, dtype: torch.dtype = torch.float16) -> nn.Module:
    """A deep copy of ``model`` with every parameter and floating buffer in ``dtype`` and every
    ``nn.LayerNorm`` computing in fp32 (``Fp32LayerNorm``: same parameters, only ``forward`` differs).
    Tied parameters stay tied (deepcopy keeps sharing). ``model`` is left untouched."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16 for the model copy, got {dtype}")
    half = copy.deepcopy(model).to(dtype)
    for m in half.modules():
        if type(m) is nn.LayerNorm:
            m.__class__ = Fp32LayerNorm  # swap the behaviour, keep the (half) parameters in place
    return half


def fp32_cross_entropy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Default loss for a ``model(idx) -> (logits, _)`` language model: logits cast to fp32 before
    the log-sum-exp and the mean over B*T tokens, so the loss (and its scaling) is fp32."""
    logits, _ = model(x)
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


class MixedPrecisionTrainer:
    """Mixed-precision training of ``model`` (Micikevicius et al. 2018, §3): a half copy for forward
    and backward, fp32 master weights owned by the optimizer, dynamic loss scaling for fp16.

    ``make_optimizer(params)`` builds the optimizer over the fp32 masters (default AdamW(lr=1e-3)).
    ``dtype=torch.float16`` uses a ``DynamicLossScaler`` (pass ``scaler=`` to configure it, or
    ``loss_scaling=False`` to see fp16 without it); ``torch.bfloat16`` disables scaling.
    ``loss_fn(model, x, y)`` returns the fp32 loss (default ``fp32_cross_entropy``). One iteration::

        loss = trainer.backward(x, y)  # as many microbatches as needed; grads folded into fp32
        trainer.step()                 # half grads -> fp32 master grads, unscale, skip on inf/NaN,
                                       # optimizer step on masters, masters -> half model
    or ``trainer.train_step([(x, y), ...])``. ``model`` itself is not modified.
    """

    def __init__(self, model: nn.Module, make_optimizer=None, dtype: torch.dtype = torch.float16, *,
                 scaler: DynamicLossScaler | None = None, loss_scaling: bool | None = None, loss_fn=None):
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}; "
                             f"for fp32 training use the model and optimizer directly")
        if loss_scaling is None:
            loss_scaling = dtype == torch.float16  # bf16 has fp32's exponent range: nothing underflows
        if scaler is not None and not loss_scaling:
            raise ValueError("scaler= was given with loss_scaling=False; drop one of them")
        self.dtype = dtype
        self.model = half_precision_copy(model, dtype)
        self.half_params = [p for p in self.model.parameters() if p.requires_grad]
        # fp32 masters: fresh leaf tensors, initialised from the *original* fp32 weights (not from the
        # rounded half copy), so fp16 training starts from exactly the fp32 run's weights.
        self.master_params = [p.detach().clone().float().requires_grad_(True)
                              for p in model.parameters() if p.requires_grad]
        make_optimizer = make_optimizer or (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
        self.optimizer = make_optimizer(self.master_params)
        self.scaler = scaler or DynamicLossScaler(enabled=loss_scaling)
        self.loss_fn = loss_fn or fp32_cross_entropy

    def _fold_half_grads_into_master(self) -> None:
        """master.grad += float(half.grad); half.grad = None. The sum is fp32 (§3.3), still scaled by S."""
        for m, p in zip(self.master_params, self.half_params):
            if p.grad is None:
                continue
            g = p.grad.float()
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None

    def backward(self, x, y, loss_weight: float = 1.0) -> float:
        """Forward and backward of one (micro)batch in half precision; returns the unscaled loss.

        ``loss_weight`` multiplies the loss (1/k for k microbatches). Gradients of an earlier
        microbatch are first moved into the fp32 master gradients, so they are not summed in half.
        """
        self._fold_half_grads_into_master()
        loss = self.loss_fn(self.model, x, y)
        if loss.dtype != torch.float32:
            raise TypeError(f"loss_fn returned a {loss.dtype} loss; compute it in fp32 "
                            "(cast logits with .float())")
        self.scaler.scale(loss * loss_weight).backward()
        return loss.item()

    def step(self) -> bool:
        """Apply the accumulated gradients; returns False when the step was skipped (inf/NaN)."""
        self._fold_half_grads_into_master()
        skipped_before = self.scaler.skipped_steps
        self.scaler.step(self.optimizer)  # unscale in fp32, check, update masters unless overflow
        self.scaler.update()
        with torch.no_grad():
            for m, p in zip(self.master_params, self.half_params):
                p.copy_(m)  # round the fp32 master to the half copy the next forward uses
                m.grad = None  # the fp32 gradient copy is a transient of the step
        return self.scaler.skipped_steps == skipped_before

    def train_step(self, microbatches) -> float:
        """One optimizer step over a list of (x, y) microbatches; returns their mean loss."""
        microbatches = list(microbatches)
        if not microbatches:
            raise ValueError("train_step needs at least one (x, y) microbatch")
        losses = [self.backward(x, y, 1.0 / len(microbatches)) for x, y in microbatches]
        self.step()
        return sum(losses) / len(losses)

    def state_bytes(self) -> dict:
        """Bytes of model states, measured from the tensors themselves (each storage once):
        ``weights`` (half), ``gradients`` (half, as after ``backward``), ``master_weights`` (fp32),
        ``optimizer`` (the optimizer's per-element state, e.g. Adam m and v), ``step_counters``
        (0-dim state such as Adam's ``step``: a few bytes per tensor, not per element)."""
        def nbytes(tensors):
            seen, total = set(), 0
            for t in tensors:
                if t is not None and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.numel() * t.element_size()
            return total
        state = [v for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        return {"weights": nbytes(self.half_params), "gradients": nbytes(p.grad for p in self.half_params),
                "master_weights": nbytes(self.master_params),
                "optimizer": nbytes(t for t in state if t.dim() > 0),
                "step_counters": sum(t.numel() * t.element_size() for t in state if t.dim() == 0)}
