"""What the tests share: tolerances derived from the arithmetic, the single-process references, the
refusal idiom, and one launch running many cases that each fail on their own.

Tolerances
==========
A bound in this suite follows from the computation, never from the error one machine happened to
show: a CPU whose vector unit adds in another order (another MKL code path, another core) must pass
the same test.

**The model** (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., 2002). Every
floating-point operation returns the exact result times ``(1 + δ)``, ``|δ| <= u``, the unit roundoff
of its dtype (:func:`roundoff`: 2^-53 float64, 2^-24 float32, 2^-11 float16, 2^-8 bfloat16). A sum
of n terms, added in any order, is within ``γ_n · Σ|x_i|`` of the exact sum, ``γ_n = n·u / (1 - n·u)``
(§4.2, eq. 4.4); a dot product of length n likewise with ``Σ|a_i·b_i|`` (§3.1, eq. 3.4). So two
evaluations of one sum in two orders -- a reduction split over ranks against one process, a tiled
kernel against a library one -- differ by at most ``2·γ_n·Σ|x_i|``: :func:`reorder_bound`.

**A whole model** (a layer's or a GPT's forward and backward). To first order the errors of its
reductions add along its longest chain of dependent reductions (``depth``), each carried forward by the
condition of what follows it. The condition of a trained network, and how much curvature feeds a
perturbation of the weights back into the next step's gradient, have no bound we can write down
ahead of time; :data:`AMPLIFICATION` (2^10) stands for both. ``model_bound = AMPLIFICATION · depth ·
2γ_n · scale`` (:func:`model_bound`), where ``scale`` is the size of the values compared.

**Several optimizer steps.** A gradient off by ``δg`` moves SGD's parameters by ``lr·δg`` (with
momentum β at most ``lr·δg/(1-β)`` in all), Adam's by at most ``lr·δg/eps`` (the update
``m/(√v + eps)`` has slope at most ``1/eps`` in g); k steps add k such moves (:func:`sgd_bound`,
:func:`adam_bound`).

**Why multi-step comparisons run in float64.** The allowance and Adam's ``1/eps`` are affordable only
there: in float64 the bounds stay near 1e-9 of the values, while every wrong implementation the
tests guard against (a lost 1/n, a missing all-reduce, a gradient shard from the wrong rank, a stale
weight, one step of Adam's moments missing) moves them by 1e-5 or more. In float32 the same bounds
would be near 1 -- no test at all -- and a tighter one would be a guess about one CPU's rounding. So a
comparison of a model over steps runs in float64 (:func:`float64`); a float32, float16 or bfloat16
comparison is of one operation (or a short fixed chain), bounded by :func:`reorder_bound` with no
allowance. Exact comparisons (``==``, ``atol=0``) stay where exactness is the point: bytes, counts,
the same operations in the same order.
"""
from __future__ import annotations

import contextlib
import traceback

import torch

__all__ = ["AMPLIFICATION", "roundoff", "gamma", "reorder_bound", "model_bound", "sgd_bound", "adam_bound",
           "float64", "close", "close_model", "close_after_sgd", "within", "rounded", "attention_bounds",
           "dense_run", "refusal", "run_cases", "case", "CaseFailure"]

#: what the first-order account of a model's rounding cannot know (its condition, curvature feeding a
#: perturbation back over the steps), allowed for in float64 comparisons only: see the module docstring
AMPLIFICATION = 2.0 ** 10

_U = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
      torch.bfloat16: 2.0 ** -8}


def roundoff(dtype: torch.dtype) -> float:
    """The unit roundoff u of ``dtype``: half the distance from 1 to the next number."""
    if dtype not in _U:
        raise ValueError(f"no unit roundoff for {dtype}; one of {', '.join(map(str, _U))}")
    return _U[dtype]


def gamma(n: int, dtype: torch.dtype) -> float:
    """Higham's ``γ_n = n·u / (1 - n·u)``: the relative error bound of a sum or dot product of n terms."""
    nu = max(int(n), 1) * roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"n = {n} terms in {dtype}: n·u >= 1, no bound exists; use a wider dtype")
    return nu / (1 - nu)


def reorder_bound(n: int, scale, dtype: torch.dtype = torch.float32) -> float:
    """``2·γ_n·scale``: how far two evaluations of one sum (or dot product) of n terms, in two orders,
    can be apart; ``scale`` bounds ``Σ|x_i|`` (a float, or a tensor: its largest magnitude)."""
    return 2 * gamma(n, dtype) * _magnitude(scale)


def model_bound(*, n: int, depth: int, scale, dtype: torch.dtype = torch.float64) -> float:
    """``AMPLIFICATION · depth · 2γ_n · scale``: a model's forward and backward computed with its
    reductions (at most n terms each, at most ``depth`` of them chained) in another order."""
    if dtype != torch.float64:
        raise ValueError("model_bound carries an allowance only float64 affords; compare a model in float64 "
                         "(tests/_support.float64), or one operation with reorder_bound")
    return AMPLIFICATION * depth * reorder_bound(n, scale, dtype)


def sgd_bound(*, steps: int, lr: float, grad_err: float, momentum: float = 0.0) -> float:
    """How far the parameters can be after ``steps`` SGD steps whose gradients are each off by
    ``grad_err``: ``steps · lr · grad_err / (1 - momentum)``."""
    return steps * lr * grad_err / (1 - momentum)


def adam_bound(*, steps: int, lr: float, grad_err: float, eps: float) -> float:
    """Likewise for Adam(W): each step's update ``m/(√v + eps)`` moves by at most ``grad_err/eps``."""
    return steps * lr * grad_err / eps


def _magnitude(scale) -> float:
    if torch.is_tensor(scale):
        return float(scale.detach().abs().max()) if scale.numel() else 0.0
    return abs(float(scale))


@contextlib.contextmanager
def float64():
    """Tensors created inside are float64 by default (models, inputs): the dtype multi-step comparisons
    run in (see the module docstring)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def close(got, want, bound: float, where: str = "") -> None:
    """``|got - want| <= bound`` everywhere (``bound`` from the functions above), naming ``where``."""
    note = f"(bound {bound:.3g}, derived in tests/_support.py)"
    torch.testing.assert_close(got, want, atol=bound, rtol=0, msg=lambda s: f"{where}: {s}\n{note}")


def close_model(got, want, *, n: int, depth: int, where: str = "") -> None:
    """``close`` within ``model_bound(n, depth)`` scaled by ``want``'s size (at least 1): a model's output,
    gradient or loss computed with its reductions in another order, in float64."""
    scale = max(1.0, float(want.abs().max()) if torch.is_tensor(want) else abs(float(want)))
    bound = model_bound(n=n, depth=depth, scale=scale)
    if torch.is_tensor(want):
        close(got, want, bound, where)
    else:
        assert abs(got - want) <= bound, f"{where}: {got} vs {want}, bound {bound:.3g} (tests/_support.py)"


def close_after_sgd(got, want, grads, *, n: int, depth: int, steps: int, lr: float, momentum: float = 0.0,
                    where: str = "") -> None:
    """``close`` within ``sgd_bound`` of ``steps`` SGD steps whose gradients (as large as ``grads``) are
    each within ``model_bound(n, depth)``: weights trained in another order of reductions, in float64."""
    grad_err = model_bound(n=n, depth=depth, scale=max(1.0, max(float(g.abs().max()) for g in grads)))
    close(got, want, sgd_bound(steps=steps, lr=lr, grad_err=grad_err, momentum=momentum), where)


def within(got, want, bound, where=""):
    """|got - want| <= bound, element by element; equal infinities agree."""
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bound = torch.as_tensor(bound, dtype=torch.float64).cpu()
    diff = torch.where(got == want, 0.0, (got - want).abs())
    bad = ~(diff <= bound)
    if bad.any():
        raise AssertionError(f"{where}: {int(bad.sum())} of {got.numel()} elements beyond the bound; worst "
                             f"by {(diff - bound)[bad].max().item():.3g} (derived in tests/_support.py)")


def rounded(value, err, dtype):
    """What storing a result in ``dtype`` adds (nothing for fp32 and float64 results)."""
    if dtype in (torch.float32, torch.float64):
        return 0.0
    return roundoff(dtype) * (value.abs() + err + torch.finfo(dtype).smallest_normal)


def attention_bounds(q, k, v, causal, scale=None, do=None, *, acc=torch.float32, cast=False, block_n=32,
                      merged=False, evaluations=1):
    """Error bounds, element by element, of a tiled attention's o, lse and (with ``do``) dq, dk, dv
    computed in ``acc`` from q, k, v, against the exact values (first order: each score's dot product
    γ_{D+3}, the online softmax's running sums, the P·V product, the log-sum-exp, and in backward every
    term with the errors it carries; exp and log within 1 ulp); times
    ``evaluations`` when the reference is itself computed in ``acc``. ``cast``: P and dS are rounded
    to the inputs' dtype before their products (the Triton kernel's fp16 path). ``merged``: o and lse
    merged from key blocks (ring attention), each block's lse error moving the merge's weights."""
    dtype, u = q.dtype, roundoff(acc)
    g = lambda n: gamma(n, acc)
    uh = roundoff(dtype) if cast and dtype not in (torch.float32, torch.float64) else 0.0
    q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    D, Sq, Sk = q.shape[-1], q.shape[-2], k.shape[-2]
    c = D ** -0.5 if scale is None else scale
    visible = torch.ones(Sq, Sk, dtype=torch.bool)
    if causal:
        visible = visible.tril()
    s = (c * q @ k.transpose(-1, -2)).masked_fill(~visible, -torch.inf)
    e_s = torch.where(visible, g(D + 3) * c * (q.abs() @ k.abs().transpose(-1, -2)), 0.0)
    seen = visible.any(-1, keepdim=True)
    lse = torch.logsumexp(s, -1, keepdim=True)
    lse0 = torch.where(seen, lse, 0.0)
    p = torch.where(seen, torch.exp(s - lse0), 0.0)
    big = e_s.amax(-1, keepdim=True)
    hi = torch.where(visible, s, -torch.inf).amax(-1, keepdim=True)
    lo = torch.where(visible, s, torch.inf).amin(-1, keepdim=True)
    spread = torch.where(seen, hi - lo, 0.0)
    nt = -(-Sk // block_n) if Sk else 0
    rel_l = g(Sk + 7 * nt + 10) + 3 * u * spread
    e_lse = big + rel_l + 8 * u * (lse0.abs() + (lse0 - torch.where(seen, hi, 0.0)).abs())
    rel_p = 2 * big + rel_l + uh
    if merged:  # each block's weight exp(lse_i - lse): both lse's errors, the exp, the logaddexp
        e_lse = e_lse + 8 * u * lse0.abs()
        rel_p = rel_p + 2 * e_lse + 8 * u * spread
    o = p @ v
    e_o = (p @ v.abs()) * (rel_p + g(Sk + 2 * nt + 4))
    e_o = e_o + rounded(o, e_o, dtype)  # what the output (and the backward's D) holds
    n = evaluations
    out = dict(o=n * e_o, lse=n * torch.where(seen, e_lse, 0.0)[..., 0])
    if do is None:
        return out
    do = do.detach().double().cpu()
    e_delta = (do.abs() * e_o).sum(-1, keepdim=True) + g(D) * (do.abs() * o.abs()).sum(-1, keepdim=True)
    rel_pb = e_s + e_lse + 6 * u * ((torch.where(visible, s, 0.0) - lse0).abs() + lse0.abs()) + 4 * u + uh
    rel_pb = torch.where(visible, rel_pb, 0.0)
    mag = do.abs() @ v.abs().transpose(-1, -2) + (do.abs() * o.abs()).sum(-1, keepdim=True)  # |dP - D|
    e_dp = g(D) * (do.abs() @ v.abs().transpose(-1, -2))
    e_ds = p * (rel_pb * mag + e_dp + e_delta + (g(2) + uh) * mag)
    pa = p * mag  # |dS|
    e_dv = (p * rel_pb).transpose(-1, -2) @ do.abs() + g(Sq * group + 1) * (p.transpose(-1, -2) @ do.abs())
    e_dq = c * (e_ds @ k.abs() + g(Sk + 2) * (pa @ k.abs()))
    e_dk = c * (e_ds.transpose(-1, -2) @ q.abs() + g(Sq * group + 2) * (pa.transpose(-1, -2) @ q.abs()))
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    dq, dk, dv = c * ds @ k, c * ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do
    if group > 1:  # each kv head: the sum over its group's query heads
        fold = lambda t: t.unflatten(1, (-1, group)).sum(2)
        e_dk, e_dv, dk, dv = fold(e_dk), fold(e_dv), fold(dk), fold(dv)
    out.update(dq=n * (e_dq + rounded(dq, e_dq, dtype)), dk=n * (e_dk + rounded(dk, e_dk, dtype)),
               dv=n * (e_dv + rounded(dv, e_dv, dtype)), delta=n * e_delta[..., 0])
    return out


def dense_run(model_fn, steps: int, batch: int, seq: int, *, seed: int, **train_kw) -> dict:
    """The single-process reference every parallel GPT is compared with: ``model_fn()`` built under
    ``seed``, trained ``steps`` steps (:func:`minitorch_dist.models.train.train_steps`, one thread like a
    rank); its losses, last logits, gradients and parameters by name. Call it inside :func:`float64`
    for a float64 reference."""
    from minitorch_dist.models.train import train_steps
    from minitorch_dist.runtime.env import single_thread

    with single_thread():
        torch.manual_seed(seed)
        model = model_fn()
        run = train_steps(model, steps, batch, seq, **train_kw)
        return {"losses": run.losses, "logits": run.logits,
                "grads": {k: q.grad for k, q in model.named_parameters()},
                "params": {k: q.detach().clone() for k, q in model.named_parameters()}}


def refusal(call, *errors: type[BaseException]) -> str | None:
    """The message ``call()`` refuses with (one of ``errors``, default ValueError), or None if it ran."""
    expected = errors or (ValueError,)
    try:
        call()
    except expected as e:
        return str(e)
    return None


class CaseFailure:
    """What a case of :func:`run_cases` raised on a rank: its type, message and traceback, as data."""

    def __init__(self, name: str, exc: BaseException):
        self.name, self.kind, self.message = name, type(exc).__name__, str(exc)
        self.traceback = "".join(traceback.format_exception(exc))

    def __repr__(self) -> str:
        return f"CaseFailure({self.name!r}, {self.kind}: {self.message})"


def run_cases(cases: dict) -> dict:
    """Run every ``name -> fn()`` on this rank; a case that raises gives a :class:`CaseFailure` instead
    of ending the others. For one launch that runs many cases: each test then reads its own with
    :func:`case`, so one broken case fails one test, not every test of that world size.

    A case that raises after a collective its peers are still waiting in would hang them: cases that
    communicate must fail on every rank alike (a wrong result is returned, not raised, and checked in
    the test), which the library's refusals do (they check before communicating)."""
    out = {}
    for name, fn in cases.items():
        try:
            out[name] = fn()
        except Exception as e:  # handed to the test of this case, with its traceback
            out[name] = CaseFailure(name, e)
    return out


def case(results: dict, name: str, rank: int | None = None):
    """The value of case ``name`` from :func:`run_cases`' results; fails (this test only) if it raised."""
    value = results[name]
    if isinstance(value, CaseFailure):
        where = f" on rank {rank}" if rank is not None else ""
        raise AssertionError(f"case {name!r} raised{where}: {value.kind}: {value.message}\n{value.traceback}")
    return value
