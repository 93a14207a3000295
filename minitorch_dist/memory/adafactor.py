"""Chapter 06 — Adafactor: adaptive learning rates with sublinear memory (Shazeer & Stern 2018).

Adam keeps two numbers per parameter, a first moment m and a second moment v: for an r x c
weight matrix that is 2*r*c floats of optimizer state, twice the model. Under ZeRO that state
is K = 12 of the 16 bytes per parameter (Rajbhandari et al. 2020, §3.1), the largest share.
Adafactor ("Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", ICML 2018) shrinks
it to r + c floats per matrix with three ideas:

* §3, factored second moments. Keep only the row sums R = V 1_c (r numbers) and the column
  sums C = 1_r^T V (c numbers) of the running average of G², and rebuild
  ``V-hat = R C^T / (1_r^T R)``, the rank-1 matrix with those row and column sums (it
  minimises the generalised KL divergence to V among non-negative rank-1 matrices). Tensors
  of rank > 2 are factored over their last two dims; vectors keep the full v (it is small).
* §4, no first moment. With beta1 = 0 the update G / sqrt(V-hat) can be unstable when V-hat
  lags G² (a too-fast-decaying beta2, or stale statistics); *update clipping* caps its RMS:
  ``U-hat = U / max(1, RMS(U) / d)``.
* §5 and §7, relative step size and increasing decay. The step is a fraction of the
  parameter's own scale, ``alpha_t = max(eps2, RMS(theta_{t-1})) * rho_t`` with
  ``rho_t = min(1e-2, 1/sqrt(t))``, and the second-moment decay grows with t,
  ``beta2-hat_t = 1 - t^(-0.8)``, so the first step sees G² exactly (no bias correction needed)
  and later steps average over ever longer windows.

This file follows ``torch.optim.Adafactor`` (torch >= 2.5) so the two can be checked against
each other step for step; it uses the same state names (``row_var``, ``col_var``,
``variance``, ``step``), so state dicts load into either. Where torch (and therefore this
file) departs from the paper, as torch's documentation says:

* ``lr`` caps the relative step size, ``rho_t = min(lr, 1/sqrt(t))``; ``lr = 1e-2`` is the paper.
* eps1 is applied to the rebuilt V-hat and to sqrt(V-hat), not added to G² before the row and
  column averages (the paper's Algorithm 4 adds eps1 = 1e-30 to G² itself).
* R and C hold row and column *means* instead of sums: R C^T / mean(R) equals
  (sum-R)(sum-C)^T / sum(sum-R) exactly and stays in range for large matrices.

Not implemented, only named: SM3 (Anil et al. 2019, "Memory-Efficient Adaptive Optimization")
reaches the same O(r + c) memory differently, keeping per-row and per-column *maxima* of the
accumulated squared gradients (a cover of the matrix by rows and columns) and taking, for each
entry, the minimum over the covers it belongs to -- an upper bound on Adagrad's accumulator
instead of a rank-1 estimate of Adam's.
"""
from __future__ import annotations

import torch


def _rms(x: torch.Tensor) -> float:
    """Root mean square of all entries: ||x||_2 / sqrt(numel) (Shazeer & Stern 2018, §5)."""
    return x.norm(2).item() / x.numel() ** 0.5


def mean_square(G: torch.Tensor, dim: int) -> torch.Tensor:
    """mean(G², dim) kept as a size-1 dim, computed as ||G||² / n along ``dim``: no r x c temporary
    G² (the memory Adafactor exists to save), and the same rounding as ``torch.optim.Adafactor``,
    so the two agree bit for bit rather than to the last few ulps."""
    return torch.linalg.vector_norm(G, dim=dim, keepdim=True).square_().div_(G.size(dim))


def factored_second_moment(row_var: torch.Tensor, col_var: torch.Tensor, eps1: float) -> torch.Tensor:
    """V-hat from its factors (Shazeer & Stern 2018, §3, eq. 4 / Algorithm 4).

    ``row_var`` (shape ``[..., r, 1]``) holds the running mean over columns of G², ``col_var``
    (``[..., 1, c]``) the running mean over rows. Their outer product divided by the mean of
    ``row_var`` is the rank-1 matrix whose row and column means equal R and C::

        V-hat = R C^T / mean(R)          (= R_sum C_sum^T / (1^T R_sum) in the paper's sums)

    ``mean(R)`` is clamped at ``eps1`` so an all-zero gradient does not divide by zero.
    """
    return (row_var @ col_var).div_(row_var.mean(dim=-2, keepdim=True).clamp(min=eps1))


class Adafactor(torch.optim.Optimizer):
    r"""Adafactor without momentum (Shazeer & Stern 2018, Algorithms 4 and 5, §7 hyper-parameters).

    For each parameter theta with gradient G at step t = 1, 2, ...::

        beta2-hat_t = 1 - t^beta2_decay                        (§7: beta2_decay = -0.8)
        rho_t       = min(lr, 1 / sqrt(t))                      (§5: relative step size)
        alpha_t     = max(eps2, RMS(theta_{t-1})) * rho_t       (§5: scale by the parameter)
        theta       = theta * (1 - lr * weight_decay)           (decoupled weight decay)
        if G has >= 2 dims (factored over its last two, §3):
            R_t   = beta2-hat_t R_{t-1} + (1 - beta2-hat_t) mean_cols(G²)
            C_t   = beta2-hat_t C_{t-1} + (1 - beta2-hat_t) mean_rows(G²)
            V-hat = R_t C_t^T / max(mean(R_t), eps1)
        else:
            V-hat = V_t = beta2-hat_t V_{t-1} + (1 - beta2-hat_t) G²
        U_t     = G / max(sqrt(V-hat), eps1)
        U-hat_t = U_t / max(1, RMS(U_t) / d)                    (§4: update clipping)
        theta_t = theta - alpha_t * U-hat_t

    Args mirror ``torch.optim.Adafactor``: ``lr`` (cap of rho_t, default 1e-2 as in the paper),
    ``beta2_decay`` (<= 0), ``eps = (eps1, eps2)`` with eps1 None meaning the dtype's machine
    epsilon, ``d`` (clipping threshold >= 1) and ``weight_decay``.

    State per parameter: ``step`` (a 0-d fp32 tensor, as in torch) and either ``row_var``
    ``[..., r, 1]`` and ``col_var`` ``[..., 1, c]`` (r + c floats per matrix) or ``variance``
    (numel floats per vector): ``costmodel.adafactor_state_bytes`` counts exactly these.
    """

    def __init__(self, params, lr: float = 1e-2, beta2_decay: float = -0.8,
                 eps: tuple = (None, 1e-3), d: float = 1.0, weight_decay: float = 0.0):
        if not lr >= 0.0:
            raise ValueError(f"lr must be >= 0 (it caps the relative step size rho_t), got {lr}")
        if not beta2_decay <= 0.0:
            raise ValueError(f"beta2_decay must be <= 0 so that beta2-hat_t = 1 - t^beta2_decay grows "
                             f"towards 1 (the paper uses -0.8), got {beta2_decay}")
        eps1, eps2 = eps
        if eps1 is not None and not eps1 >= 0.0:
            raise ValueError(f"eps1 must be >= 0 or None (machine epsilon), got {eps1}")
        if not eps2 >= 0.0:
            raise ValueError(f"eps2 must be >= 0, got {eps2}")
        if not d >= 1.0:
            raise ValueError(f"clipping threshold d must be >= 1 (the paper uses 1.0), got {d}")
        if not weight_decay >= 0.0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params,
                         dict(lr=lr, beta2_decay=beta2_decay, eps=eps, d=d, weight_decay=weight_decay))

    def _state_for(self, p: torch.Tensor) -> dict:
        """The parameter's state, created on its first step: factors for >= 2-D, full v for 1-D."""
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            if p.dim() >= 2:  # one (R, C) pair per leading index: shapes [..., r, 1] and [..., 1, c]
                state["row_var"] = p.new_zeros(*p.shape[:-1], 1)
                state["col_var"] = p.new_zeros(*p.shape[:-2], 1, p.shape[-1])
            else:
                state["variance"] = torch.zeros_like(p)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        """One Adafactor step for every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd, d = group["lr"], group["weight_decay"], group["d"]
            eps1, eps2 = group["eps"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse or torch.is_complex(p):
                    raise RuntimeError("Adafactor supports dense real parameters only "
                                       "(use torch.optim.SparseAdam for sparse gradients)")
                G, state = p.grad, self._state_for(p)
                e1 = torch.finfo(p.dtype).eps if eps1 is None else eps1
                state["step"] += 1
                t = state["step"].item()

                one_minus_beta2 = t ** group["beta2_decay"]        # 1 - beta2-hat_t; 1 at t = 1
                rho = min(lr, 1.0 / t ** 0.5)
                alpha = max(eps2, _rms(p)) * rho                   # from theta_{t-1}, before decay
                if wd != 0:
                    p.mul_(1 - lr * wd)

                if G.dim() >= 2:  # lerp_(x, w): R <- R + w (x - R) = beta2-hat R + (1 - beta2-hat) x
                    state["row_var"].lerp_(mean_square(G, dim=-1), one_minus_beta2)
                    state["col_var"].lerp_(mean_square(G, dim=-2), one_minus_beta2)
                    v_hat = factored_second_moment(state["row_var"], state["col_var"], e1)
                else:
                    state["variance"].lerp_(G * G, one_minus_beta2)
                    v_hat = state["variance"].clone()
                U = v_hat.clamp_(min=e1 * e1).rsqrt_().mul_(G)       # G / max(sqrt(V-hat), eps1)
                p.add_(U, alpha=-alpha / max(1.0, _rms(U) / d))    # update clipping, §4
        return loss
