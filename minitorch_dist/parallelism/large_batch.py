"""Chapter 01 — large-batch optimisers: the linear scaling rule, gradual warmup, LARS and LAMB.

Data parallelism multiplies the batch by the number of ranks; these are the tools
that keep a k-times larger batch training as well as the small one.

- Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour":
  §2.1 linear scaling rule ("when the minibatch size is multiplied by k, multiply the learning
  rate by k"), §2.2 gradual warmup (ramp up to that rate over the first steps).
- You, Gitman & Ginsburg 2017, "Large Batch Training of Convolutional Networks": LARS,
  Algorithm 1. One global rate is too large for some layers and too small for others at large
  batch (their ‖w‖/‖∇w‖ differ by orders of magnitude), so each layer gets its own rate.
- You et al. 2020 (ICLR), "Large Batch Optimization for Deep Learning: Training BERT in
  76 minutes": LAMB, Algorithm 2. The same layer-wise trust ratio, applied to Adam's update;
  its experiments scale the learning rate with the square root of the batch.

**Why layer-wise adaptation.** With weight decay 0, the LARS step of a layer is
``lr·η·‖w‖·g/‖g‖`` and the LAMB step is ``lr·φ(‖w‖)·r/‖r‖``: their norms are ``lr·η·‖w‖`` and
``lr·φ(‖w‖)``, whatever the scale of the gradient. Every layer moves by the same *fraction*
of its weights, so no layer diverges while another stalls.

Conventions:

- A "layer" is one parameter tensor; norms are Frobenius norms of the whole tensor.
- Trust ratio 1 when ‖w‖ = 0 (a zero-initialised bias would never move otherwise) or when the
  norm it divides by is 0 (nothing to scale; avoids 0/0), as TF's LARSOptimizer does.
- ``exclude_from_adaptation(p) -> bool`` picks tensors that get neither the trust ratio nor
  weight decay. LARS default: every tensor with ``p.ndim <= 1`` (biases, LayerNorm/BatchNorm
  scales), as in the LARS reference code, since their norms say nothing about a layer's scale.
  LAMB default: none, as in Algorithm 2: LAMB's ``lr`` is a *relative* step (‖Δw‖ = lr·φ(‖w‖)),
  far too large as the absolute Adam step an excluded tensor would take; on the tiny GPT,
  excluding 1-D tensors stalls training at the lr that suits the rest.
- The last trust ratio of each tensor is kept in ``optimizer.state[p]["trust_ratio"]`` (a 0-d
  tensor, so no GPU sync per step); :func:`trust_ratios` collects them for a plot.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["LARS", "LAMB", "trust_ratios", "linear_scaling_lr", "sqrt_scaling_lr", "warmup_schedule"]


def _one_dim(p: torch.Tensor) -> bool:
    """LARS's default exclusion: biases and normalisation scales (1-D tensors)."""
    return p.ndim <= 1


def _nothing(p: torch.Tensor) -> bool:
    """LAMB's default: every tensor is adapted."""
    return False


def _check(name: str, value, lo: float, hi: float = math.inf, lo_open: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        (value > lo if lo_open else value >= lo) and value < hi)
    if not ok:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo}, {hi}), got {value!r}")


def _ratio(w_norm: torch.Tensor, u_norm: torch.Tensor, trust: torch.Tensor) -> torch.Tensor:
    """``trust`` where both norms are positive, else 1 (the convention above), as a 0-d tensor."""
    return torch.where((w_norm > 0) & (u_norm > 0), trust, torch.ones_like(trust))


class _Layerwise(torch.optim.Optimizer):
    """The loop both optimisers share; a subclass writes ``_update(p, g, state, group, adapt)``."""

    def __init__(self, params, defaults: dict, exclude, default_exclude):
        if exclude is not None and not callable(exclude):
            raise ValueError(f"exclude_from_adaptation must be None or a callable p -> bool "
                             f"(e.g. lambda p: p.ndim <= 1), got {exclude!r}")
        # Kept off the param groups: a lambda there would make state_dict() unpicklable.
        self.exclude_from_adaptation = exclude or default_exclude
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ValueError(f"{type(self).__name__} needs dense gradients (a layer norm of a sparse "
                                     "one is not computed)")
                adapt = not self.exclude_from_adaptation(p)
                self.state[p]["trust_ratio"] = self._update(p, p.grad, self.state[p], group, adapt)
        return loss


class LARS(_Layerwise):
    r"""Layer-wise Adaptive Rate Scaling: momentum SGD with a per-layer learning rate.

    You, Gitman & Ginsburg 2017, Algorithm 1, for each layer l at step t (γ = ``lr``, the global
    rate from any scheduler; m = ``momentum``; β = ``weight_decay``; η = ``trust_coefficient``,
    the LARS coefficient of the paper's local-LR definition)::

        g     = ∇L(w_t)                                   (stochastic gradient of layer l)
        λ     = η · ‖w_t‖ / (‖g‖ + β‖w_t‖ + eps)          (local LR)
        v_t+1 = m · v_t + γ · λ · (g + β w_t)             (momentum on the scaled step)
        w_t+1 = w_t − v_t+1                               (weight update)

    ``eps`` only guards the division. λ is stored as the tensor's ``"trust_ratio"``; it is 1 when
    ‖w‖ = 0 or ‖g‖ = 0. Excluded tensors (default: 1-D, see module doc) take λ = 1 and β = 0:
    plain momentum SGD, which with a constant γ is exactly ``torch.optim.SGD(lr=γ, momentum=m)``.
    γ sits *inside* the momentum buffer, as in the paper (torch's SGD multiplies after).
    """

    def __init__(self, params, lr: float, momentum: float = 0.9, weight_decay: float = 0.0,
                 trust_coefficient: float = 0.001, eps: float = 1e-8,
                 exclude_from_adaptation: Callable[[torch.Tensor], bool] | None = None):
        _check("lr", lr, 0.0)
        _check("momentum", momentum, 0.0, 1.0)
        _check("weight_decay", weight_decay, 0.0)
        _check("trust_coefficient (LARS η)", trust_coefficient, 0.0, lo_open=True)
        _check("eps", eps, 0.0)
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay,
                                      trust_coefficient=trust_coefficient, eps=eps),
                         exclude_from_adaptation, _one_dim)

    def _update(self, p, g, state, group: dict[str, Any], adapt):
        ratio, step = torch.ones((), device=p.device, dtype=p.dtype), g
        if adapt:
            wd, eta = group["weight_decay"], group["trust_coefficient"]
            w_norm, g_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(g)
            ratio = _ratio(w_norm, g_norm, eta * w_norm / (g_norm + wd * w_norm + group["eps"]))  # local LR
            step = g.add(p, alpha=wd) if wd != 0 else g
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        v = state["momentum_buffer"]
        v.mul_(group["momentum"]).add_(step * ratio, alpha=group["lr"])  # momentum
        p.sub_(v)  # weight update
        return ratio


class LAMB(_Layerwise):
    r"""Layer-wise Adaptive Moments for Batch training: Adam's update with a per-layer trust ratio.

    You et al. 2020, Algorithm 2, for each layer at step t (η_t = ``lr``; λ = ``weight_decay``)::

        m_t = β1 m_t−1 + (1 − β1) g_t                     (first moment)
        v_t = β2 v_t−1 + (1 − β2) g_t²                    (second moment)
        m̂ = m_t / (1 − β1^t),  v̂ = v_t / (1 − β2^t)       (bias correction, if bias_correction)
        r_t = m̂ / (√v̂ + ε)                                (the "ratio": Adam's step)
        u_t = r_t + λ x_t                                 (decay added *before* the trust ratio)
        x_t+1 = x_t − η_t · φ(‖x_t‖) / ‖u_t‖ · u_t          (layer-wise update)

    φ(z) = min(max(z, γ_l), γ_u) with (γ_l, γ_u) = ``clamp_trust``: the paper only asks φ to be
    bounded and gives no values; (0, 10) is a common choice in open implementations. ``None``
    makes φ the identity. The ratio φ(‖x‖)/‖u‖ is stored as the tensor's ``"trust_ratio"``; it is 1
    when ‖x‖ = 0 or ‖u‖ = 0. With the ratio equal to 1 the update is x − η(r + λx) =
    (1 − ηλ)x − ηr: exactly ``torch.optim.AdamW`` (decoupled weight decay). Excluded tensors
    (default: none, see module doc) take ratio 1 and λ = 0, i.e. Adam.
    """

    def __init__(self, params, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.01, bias_correction: bool = True,
                 clamp_trust: tuple[float, float] | None = (0.0, 10.0),
                 exclude_from_adaptation: Callable[[torch.Tensor], bool] | None = None):
        _check("lr", lr, 0.0)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (β1, β2), got {betas!r}")
        _check("betas[0] (β1)", betas[0], 0.0, 1.0)
        _check("betas[1] (β2)", betas[1], 0.0, 1.0)
        _check("eps", eps, 0.0)
        _check("weight_decay", weight_decay, 0.0)
        if not isinstance(bias_correction, bool):
            raise ValueError(f"bias_correction must be True or False, got {bias_correction!r}")
        if clamp_trust is not None:
            pair = isinstance(clamp_trust, (tuple, list)) and len(clamp_trust) == 2
            if not (pair and all(isinstance(c, (int, float)) for c in clamp_trust)
                    and 0 <= clamp_trust[0] <= clamp_trust[1]):
                raise ValueError(f"clamp_trust must be None or a pair (low, high) with 0 <= low <= high "
                                 f"bounding φ(‖w‖), e.g. (0, 10); got {clamp_trust!r}")
            clamp_trust = (float(clamp_trust[0]), float(clamp_trust[1]))
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, clamp_trust=clamp_trust),
                         exclude_from_adaptation, _nothing)

    def _update(self, p, g, state, group: dict[str, Any], adapt):
        (b1, b2), clamp = group["betas"], group["clamp_trust"]
        if "step" not in state:  # the same names as torch.optim.AdamW's state
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        state["step"] += 1
        t, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
        m.mul_(b1).add_(g, alpha=1 - b1)  # first moment
        v.mul_(b2).addcmul_(g, g, value=1 - b2)  # second moment
        if group["bias_correction"]:
            m, v = m / (1 - b1**t), v / (1 - b2**t)
        u = m / (v.sqrt() + group["eps"])  # Adam's step r_t
        ratio = torch.ones((), device=p.device, dtype=p.dtype)
        if adapt:
            if group["weight_decay"] != 0:
                u = u.add(p, alpha=group["weight_decay"])  # u_t = r_t + λ x_t
            w_norm, u_norm = torch.linalg.vector_norm(p), torch.linalg.vector_norm(u)
            phi = w_norm if clamp is None else w_norm.clamp(*clamp)
            ratio = _ratio(w_norm, u_norm, phi / u_norm)
        p.sub_(u * ratio, alpha=group["lr"])  # layer-wise update
        return ratio


def trust_ratios(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> dict[str, float]:
    """The last trust ratio of every tensor that has stepped, as floats, for a plot or a table.

    Keys are parameter names when ``model`` is given (``model.named_parameters()``), else
    ``"group{g}.{i}"`` (group index, position in the group).
    """
    names = {p: n for n, p in model.named_parameters()} if model is not None else {}
    return {names.get(p, f"group{gi}.{i}"): float(optimizer.state[p]["trust_ratio"])
            for gi, group in enumerate(optimizer.param_groups) for i, p in enumerate(group["params"])
            if "trust_ratio" in optimizer.state.get(p, {})}


def linear_scaling_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Goyal et al. 2017, §2.1: multiply the batch by k, multiply the learning rate by k.

    η = base_lr · batch / base_batch. Their ImageNet rule is η = 0.1 · kn/256, so a batch of
    8192 gets 0.1 · 8192/256 = 3.2. (The rule stops holding past ~8k for ResNet-50, which is
    where LARS/LAMB take over.)
    """
    _check_batches(base_lr, base_batch, batch)
    return base_lr * batch / base_batch


def sqrt_scaling_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """Square-root scaling: multiply the batch by k, multiply the learning rate by √k.

    η = base_lr · √(batch / base_batch). The rule of the Adam family (LAMB's experiments, You et
    al. 2020): the mean gradient of a k-times larger batch has 1/k of the variance, so its noise
    (a standard deviation) shrinks by √k, and an adaptive optimizer, whose step is already
    normalised by √v, takes steps √k larger for the same noise. Linear scaling
    (:func:`linear_scaling_lr`) is the rule for SGD.
    """
    _check_batches(base_lr, base_batch, batch)
    return base_lr * math.sqrt(batch / base_batch)


def _check_batches(base_lr, base_batch, batch) -> None:
    _check("base_lr", base_lr, 0.0)
    for name, b in (("base_batch", base_batch), ("batch", batch)):
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"{name} must be a positive int (a number of examples), got {b!r}")


def warmup_schedule(optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int | None = None,
                    decay: str = "cosine") -> LambdaLR:
    """Gradual warmup (Goyal et al. 2017, §2.2), then a decay; a ``LambdaLR`` over the groups' lr.

    The factor multiplying each group's lr at step s (call ``scheduler.step()`` after
    ``optimizer.step()``, as usual)::

        s <  W:  (s + 1) / W                      linear ramp; the first step already moves
        s >= W:  1                                decay="constant"
                 1 − p                            decay="linear"
                 ½ (1 + cos(π p))                 decay="cosine" (Loshchilov & Hutter 2017)
        with p = min(1, (s − W) / (T − W)),  W = warmup_steps, T = total_steps

    Goyal et al. ramp from the small-batch rate η to kη over 5 epochs; the ramp here starts at
    lr/W, which is η when W = k. ``total_steps`` is needed by the linear and cosine decays.
    """
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
        raise ValueError(f"warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if decay not in ("cosine", "linear", "constant"):
        raise ValueError(f"decay must be 'cosine', 'linear' or 'constant', got {decay!r}")
    if total_steps is None and decay != "constant":
        raise ValueError(f"decay={decay!r} needs total_steps (the step where the lr reaches 0); "
                         f"pass total_steps > warmup_steps or use decay='constant'")
    if total_steps is not None and (isinstance(total_steps, bool) or not isinstance(total_steps, int)
                                    or total_steps <= warmup_steps):
        raise ValueError(f"total_steps must be an int > warmup_steps={warmup_steps}, got {total_steps!r}")
    W, T = warmup_steps, total_steps

    def factor(s: int) -> float:
        if s < W:
            return (s + 1) / W
        if decay == "constant":
            return 1.0
        p = min(1.0, (s - W) / (T - W))
        return 1.0 - p if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * p))

    return LambdaLR(optimizer, factor)
