"""Chapter 10 — mixture of experts: expert capacity, dropped tokens, parameters vs FLOPs, all-to-all bytes.

Shazeer et al. 2017, "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
Layer", §2 (noisy top-k gating: parameters grow with E, compute with k). Lepikhin et al. 2021,
"GShard", §2.2 and Algorithm 1 (top-2 gating, expert capacity 2N/E, all-to-all dispatch /
combine). Fedus et al. 2021, "Switch Transformers", §2.1-2.2 and eq. (3) (expert capacity =
tokens per batch / experts x capacity factor; overflow tokens are dropped). Zhou et al. 2022,
"Mixture-of-Experts with Expert Choice Routing", §3.1 (each expert takes k = n·c/e tokens).

Modern MoE training adds: Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for
Mixture-of-Experts" (the MaxVio metric; the bias update, Algorithm 1) with DeepSeek-V3 §2.1.2; Gale et al.
2023, "MegaBlocks" (dropless: compute follows the routed load, nothing padded or dropped); Hwang et al.
2023, "Tutel" (the all-to-all pipelined with the experts in chunks).

Notation: T tokens routed together (one group / one rank's batch), E experts, k experts per
token, h hidden size, d_ff the expert MLP width, n ranks of expert parallelism, e bytes per
element. An *assignment* is one (token, expert) pair: a batch has T·k of them before capacity.

    capacity        C = ceil(cf · T · k / E)
    dropped         Σ_i max(0, N_i - C),  N_i = assignments that chose expert i
    active params   what one token touches: k experts per MoE layer (+ the router), not E
    all-to-all      dispatch + combine each move T·k·h·e per rank, (n-1)/n of it off-rank
    dropless        expert FLOPs 4·h·d_ff·Σ_i N_i (forward): the routed load, no padding, no drops
    aux-free        no loss term; per step one all-reduce of the E loads of every MoE layer
    chunked EP      d + m·p + c per layer forward when p >= d + c (m chunks; d, p, c per chunk)

This module imports no library code: the routers in :mod:`minitorch_dist.sparsity` call
:func:`moe_capacity` so that the formula and the implementation cannot drift apart.
"""
from __future__ import annotations

import math
from fractions import Fraction

from .collectives import all_to_all_time, bus_bytes


def _int(name, value, low=0):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    return value


def _check_sizes(hidden, d_ff, n_experts, n_moe_layers, n_dense_layers, shared_params):
    for name, v in (("hidden", hidden), ("d_ff", d_ff), ("n_experts", n_experts)):
        _int(name, v, 1)
    for name, v in (("n_moe_layers", n_moe_layers), ("n_dense_layers", n_dense_layers),
                    ("shared_params", shared_params)):
        _int(name, v)


def _check_k(k, n_experts):
    _int("k", k, 1)
    if k > n_experts:
        raise ValueError(f"k = {k} experts per token exceeds n_experts = {n_experts}; use k <= n_experts")


# --- capacity and dropped tokens -----------------------------------------------------------------


def moe_capacity(tokens, n_experts, k=1, capacity_factor=1.0) -> int:
    """Expert capacity ``C = ceil(capacity_factor · tokens · k / n_experts)``: the most
    assignments one expert processes per batch; the rest are dropped (passed on by the residual).

    Switch Transformers eq. (3): "expert capacity = (tokens per batch / number of experts) ×
    capacity factor" (k = 1); GShard Algorithm 1 uses ``2N/E`` for top-2, i.e. k = 2, cf = 1.
    Expert Choice (Zhou et al. 2022, eq. 1) gives each expert ``k = n·c/e`` tokens: the same
    formula with k = 1 (see :func:`expert_choice_capacity`). Rounded up, so cf = 1 with a
    perfectly even load drops nothing. The product is computed in exact rational arithmetic from
    the decimal ``capacity_factor`` is written as, so ``moe_capacity(50, 1, 1, 1.1)`` is 55, not
    the 56 that ``ceil(1.1 * 50)`` gives in floating point.
    """
    _int("tokens", tokens)
    _int("n_experts", n_experts, 1)
    _check_k(k, n_experts)
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float, Fraction)) \
            or not capacity_factor > 0 or math.isinf(capacity_factor):
        raise ValueError("capacity_factor must be a finite number > 0 (1.0 = an even share), got "
                         f"{capacity_factor!r}")
    cf = Fraction(str(capacity_factor)) if isinstance(capacity_factor, float) else Fraction(capacity_factor)
    return math.ceil(cf * tokens * k / n_experts)


def expert_choice_capacity(tokens, n_experts, capacity_factor=1.0) -> int:
    """Tokens each expert picks under Expert Choice routing, ``min(T, ceil(T·c/E))`` (Zhou et al.
    2022, §3.1, eq. 1: "k = n × c / e", c = the average number of experts per token). An expert
    cannot pick more tokens than there are, hence the cap at T."""
    return min(tokens, moe_capacity(tokens, n_experts, 1, capacity_factor))


def dropped_tokens(loads, capacity) -> int:
    """Assignments dropped when expert i is asked for ``loads[i]`` and takes at most ``capacity``:
    ``Σ_i max(0, loads[i] - C)``. Which ones are dropped depends on the priority order (Switch:
    token order; GShard top-2: first choices before second), how many does not."""
    _int("capacity", capacity)
    loads = [int(x) for x in (loads.tolist() if hasattr(loads, "tolist") else loads)]
    if any(x < 0 for x in loads):
        raise ValueError(f"expert loads must be >= 0, got {loads}")
    return sum(max(0, x - capacity) for x in loads)


def _binomial_excess(n, q, c) -> float:
    """``E[max(0, X - c)]`` for X ~ Binomial(n, q), exactly: ``E[X] - c + Σ_{x<c} (c - x) P(X = x)``
    (a sum of at most c terms; the pmf in log space so that large n does not overflow)."""
    if c >= n or q <= 0.0:
        return 0.0
    if q >= 1.0:
        return float(n - c)
    lq, l1q = math.log(q), math.log1p(-q)
    below = sum((c - x) * math.exp(math.lgamma(n + 1) - math.lgamma(x + 1) - math.lgamma(n - x + 1)
                                   + x * lq + (n - x) * l1q) for x in range(c))
    return max(0.0, n * q - c + below)


def expected_dropped_tokens(tokens, n_experts, k=1, capacity_factor=1.0, probs=None) -> float:
    """Expected number of dropped assignments when each token picks its k experts at random.

    Token t picks a set of k distinct experts; ``probs[i]`` is the share of assignments that go to
    expert i (sums to 1; default uniform, 1/E), so a token includes expert i with probability
    ``k·probs[i]`` independently of the other tokens, and expert i's load is
    ``N_i ~ Binomial(T, k·probs[i])`` (for k = 1: Binomial(T, 1/E) under uniform routing). By
    linearity of expectation, whatever the correlation between experts,

        E[dropped] = Σ_i E[max(0, N_i - C)],     C = moe_capacity(T, E, k, cf)

    each term summed exactly over the binomial pmf. This is what a *random* router drops; a
    trained router with a skewed load drops more, which is the point of the auxiliary loss.
    """
    C = moe_capacity(tokens, n_experts, k, capacity_factor)
    if probs is None:
        probs = [1.0 / n_experts] * n_experts
    probs = [float(p) for p in (probs.tolist() if hasattr(probs, "tolist") else probs)]
    if len(probs) != n_experts:
        raise ValueError(f"probs has {len(probs)} entries but there are n_experts = {n_experts}")
    if any(p < 0 for p in probs) or abs(sum(probs) - 1.0) > 1e-6:
        raise ValueError("probs must be >= 0 and sum to 1 (a distribution over experts), "
                         f"got sum {sum(probs)}")
    if any(k * p > 1 + 1e-9 for p in probs):
        raise ValueError(f"k·probs[i] <= 1 is needed: a token picks each expert at most once (k = {k})")
    return sum(_binomial_excess(tokens, min(1.0, k * p), C) for p in probs)


# --- parameters and FLOPs: dense vs MoE ----------------------------------------------------------


def expert_params(hidden, d_ff, bias=True) -> int:
    """One expert (a transformer MLP, h -> d_ff -> h): ``2·h·d_ff`` weights + ``d_ff + h`` biases."""
    return 2 * hidden * d_ff + (d_ff + hidden if bias else 0)


def moe_params(hidden, d_ff, n_experts, n_moe_layers, n_dense_layers=0, bias=True, noisy=False,
               shared_params=0) -> int:
    """Total parameters of the feed-forward part of a model with MoE layers (Shazeer et al. 2017 §2):
    each MoE layer holds E experts and a router ``w_gate [h, E]`` (no bias; noisy top-k adds
    ``w_noise [h, E]``); each dense layer one MLP. ``shared_params``: everything else (attention,
    embeddings, norms), added as is. With ``n_moe_layers=0`` this is the dense model."""
    _check_sizes(hidden, d_ff, n_experts, n_moe_layers, n_dense_layers, shared_params)
    router = (2 if noisy else 1) * hidden * n_experts
    per_moe = n_experts * expert_params(hidden, d_ff, bias) + router
    return n_moe_layers * per_moe + n_dense_layers * expert_params(hidden, d_ff, bias) + shared_params


def moe_params_per_token(hidden, d_ff, n_experts, n_moe_layers, k=1, n_dense_layers=0, bias=True, noisy=False,
                         shared_params=0) -> int:
    """Parameters one token *uses* (the "active" parameters): k experts and the router per MoE
    layer, every dense layer, all ``shared_params``. Grows with k, not with E: the MoE promise
    ("greater than 1000x improvements in model capacity with only minor losses in computational
    efficiency", Shazeer et al. 2017, abstract)."""
    _check_sizes(hidden, d_ff, n_experts, n_moe_layers, n_dense_layers, shared_params)
    _check_k(k, n_experts)
    router = (2 if noisy else 1) * hidden * n_experts  # every token is scored against every expert
    expert = expert_params(hidden, d_ff, bias)
    return n_moe_layers * (k * expert + router) + n_dense_layers * expert + shared_params


def moe_flops_per_token(hidden, d_ff, n_experts, n_moe_layers, k=1, n_dense_layers=0,
                        shared_params=0) -> float:
    """Forward matmul FLOPs per token, 2 per weight used (Kaplan et al. 2020 §2.1):

        2·shared_params + n_dense·4·h·d_ff + n_moe·(k·4·h·d_ff + 2·h·E)

    the last term the router's ``x @ w_gate``. Biases, softmax, top-k and the gather / scatter
    of dispatch are left out (O(h) or O(E) per token). Dense model: ``n_moe_layers=0``; an MoE
    with k = 1 costs one dense MLP plus the router whatever E is (Switch Transformers §2:
    "increase the parameter count while keeping the floating point operations constant").
    Training FLOPs are ~3x this (backward = 2x forward)."""
    _check_sizes(hidden, d_ff, n_experts, n_moe_layers, n_dense_layers, shared_params)
    _check_k(k, n_experts)
    mlp = 4 * hidden * d_ff
    return 2.0 * shared_params + n_dense_layers * mlp + n_moe_layers * (k * mlp + 2 * hidden * n_experts)


# --- expert parallelism: the all-to-all ----------------------------------------------------------


def expert_parallel_send_matrix(counts, n_ranks):
    """``S[i][j]``: assignments rank i sends to rank j in the dispatch all-to-all, from
    ``counts[i][e]`` = assignments rank i kept for expert e. Rank j owns experts
    ``[j·E/n, (j+1)·E/n)`` (GShard §2.2: experts sharded over devices, tokens over the batch)."""
    _int("n_ranks", n_ranks, 1)
    counts = [[int(x) for x in row] for row in (counts.tolist() if hasattr(counts, "tolist") else counts)]
    if len(counts) != n_ranks:
        raise ValueError(f"counts has {len(counts)} rows but there are {n_ranks} ranks: one row per rank")
    E = len(counts[0])
    if any(len(row) != E for row in counts):
        raise ValueError("every rank's counts row must have one entry per expert")
    if E % n_ranks:
        raise ValueError(f"n_experts {E} is not divisible by {n_ranks} ranks (expert parallel degree); "
                         f"use a multiple of {n_ranks} experts or a degree that divides {E}")
    per = E // n_ranks
    return [[sum(row[j * per:(j + 1) * per]) for j in range(n_ranks)] for row in counts]


def all_to_all_bytes_moe(tokens, hidden, n=None, k=1, bytes_per_element=4, include_self=False,
                         backward=False):
    """Bytes each rank sends in the dispatch and combine all-to-alls of one expert-parallel MoE layer.

    GShard §2.2 / Algorithm 1: dispatch sends every kept assignment's h-vector to the rank that
    owns its expert; combine sends the expert outputs back, the same sizes the other way. With
    ``include_self=False`` the part a rank "sends" to itself (a local copy) is not counted.

    * ``tokens`` an int T (tokens per rank) and uniform routing: each rank's input is
      ``T·k·h·e`` bytes per all-to-all, (n-1)/n of it to other ranks, so
      ``2·T·k·h·e·(n-1)/n`` per rank (``2·T·k·h·e`` with ``include_self``). Returns a float.
    * ``tokens`` an n x n matrix ``S[i][j]`` (assignments rank i sends to rank j, e.g. from
      :func:`expert_parallel_send_matrix`): rank i sends ``Σ_j S[i][j]`` in dispatch and
      ``Σ_j S[j][i]`` in combine (times h·e). Returns a list, one entry per rank. k must be 1:
      the matrix already counts assignments.

    ``backward=True`` adds the backward pass, which runs the two all-to-alls again with the
    splits swapped (the same bytes): x2. With ``include_self=True`` this is what the comm
    meter's ``bytes["all_to_all"]`` records (a rank's whole input); a counts exchange, if the
    implementation does one, is :func:`moe_counts_exchange_bytes`.
    """
    _int("hidden", hidden, 1)
    _int("bytes_per_element", bytes_per_element, 1)
    passes = 2 if backward else 1
    if hasattr(tokens, "tolist") and not isinstance(tokens, int):
        tokens = tokens.tolist()
    if isinstance(tokens, (list, tuple)):
        S = [[int(x) for x in row] for row in tokens]
        m = len(S)
        if m == 0 or any(len(row) != m for row in S) or any(x < 0 for row in S for x in row):
            raise ValueError("the send matrix must be square (n x n) with counts >= 0")
        if n is not None and n != m:
            raise ValueError(f"the send matrix is {m} x {m} but n = {n}")
        if k != 1:
            raise ValueError("a send matrix already counts (token, expert) assignments; leave k at 1")
        row_bytes = hidden * bytes_per_element
        out = []
        for i in range(m):
            sent = sum(S[i][j] for j in range(m) if include_self or j != i)       # dispatch
            returned = sum(S[j][i] for j in range(m) if include_self or j != i)   # combine
            out.append(passes * (sent + returned) * row_bytes)
        return out
    _int("tokens", tokens)
    if n is None:
        raise ValueError("n (the expert-parallel degree) is needed when tokens is a count, not a send matrix")
    _int("n", n, 1)
    _int("k", k, 1)
    S = tokens * k * hidden * bytes_per_element  # one rank's whole input to one all-to-all
    one = S if include_self else bus_bytes("all_to_all", S, n)
    return float(2 * passes * one)


def moe_counts_exchange_bytes(n_experts, n, bytes_per_count=8, include_self=False) -> float:
    """Bytes one rank sends in the all-to-all of per-expert counts that precedes dispatch (each
    rank tells rank j how many rows to expect for each of j's E/n experts: E int64 counts in all,
    (n-1)/n of them off-rank). Without it the receiver could not size its buffer."""
    _int("n_experts", n_experts, 1)
    _int("n", n, 1)
    S = n_experts * bytes_per_count
    return float(S if include_self else bus_bytes("all_to_all", S, n))


def moe_all_to_all_time(tokens, hidden, n, alpha, beta, k=1, bytes_per_element=4, backward=False) -> float:
    """Seconds of all-to-all per MoE layer under uniform routing: 2 calls (4 with ``backward``) of
    :func:`~.collectives.all_to_all_time` on a ``T·k·h·e``-byte input, ``(n-1)·α + (n-1)/n·S·β`` each."""
    S = tokens * k * hidden * bytes_per_element
    return (4 if backward else 2) * all_to_all_time(S, n, alpha, beta)


# --- modern MoE training: balance without a loss, drop nothing, hide the all-to-all -------------------


def load_imbalance(loads) -> float:
    """``max_i N_i / mean_i N_i``: 1 when perfectly balanced, E when one expert takes everything. It is
    ``1 + MaxVio`` of Wang et al. 2024 (their metric: ``MaxVio = (max_i Load_i - mean Load) / mean Load``);
    the busiest expert sets the layer's time and, with a capacity, what is dropped."""
    loads = [float(x) for x in (loads.tolist() if hasattr(loads, "tolist") else loads)]
    if not loads or any(x < 0 for x in loads) or sum(loads) <= 0:
        raise ValueError(f"loads must be counts >= 0 per expert with a positive total, got {loads}")
    return max(loads) / (sum(loads) / len(loads))


def aux_free_sync_bytes(n_experts, n_moe_layers, n, bytes_per_count=8) -> float:
    """Bytes per rank per training step of auxiliary-loss-free balancing in a parallel run: one
    all-reduce of the E int64 loads of every MoE layer (``2(n-1)/n · L·E·8``), so that every rank
    applies the bias update of the global batch (Wang et al. 2024 Algorithm 1; DeepSeek-V3 §2.1.2
    updates "at the end of each step" from the whole batch's load). It adds no loss term and no
    gradient, unlike the auxiliary loss (Switch eq. 4), whose cost is a gradient into every router."""
    _int("n_experts", n_experts, 1)
    _int("n_moe_layers", n_moe_layers)
    _int("n", n, 1)
    return bus_bytes("all_reduce", n_moe_layers * n_experts * bytes_per_count, n)


def aux_free_steps_to_shift(score_gap, bias_update_rate=0.001) -> int:
    """Steps before the bias can overturn a selection decided by an affinity gap ``score_gap``: each
    step moves a bias by exactly γ (``b_i ← b_i ± γ``), two experts' biases apart by at most 2γ, so
    at least ``ceil(gap / 2γ)`` steps. γ = 0.001 (DeepSeek-V3) is slow on purpose: the bias follows
    the load, it does not chase each batch."""
    if not bias_update_rate > 0:
        raise ValueError(f"bias_update_rate must be > 0 (DeepSeek-V3 uses 0.001), got {bias_update_rate!r}")
    if not score_gap >= 0:
        raise ValueError(f"score_gap must be >= 0, got {score_gap!r}")
    return math.ceil(Fraction(str(score_gap)) / (2 * Fraction(str(bias_update_rate))))


def dropless_expert_flops(loads, hidden, d_ff) -> float:
    """Forward matmul FLOPs of a dropless MoE layer's experts (MegaBlocks): ``4·h·d_ff · Σ_i N_i``, the
    assignments routed (``N_i`` to expert i), every one computed, none padded. x3 for training."""
    _int("hidden", hidden, 1)
    _int("d_ff", d_ff, 1)
    loads = [int(x) for x in (loads.tolist() if hasattr(loads, "tolist") else loads)]
    if any(x < 0 for x in loads):
        raise ValueError(f"expert loads must be >= 0, got {loads}")
    return 4.0 * hidden * d_ff * sum(loads)


def capacity_expert_flops(n_experts, capacity, hidden, d_ff) -> float:
    """Forward matmul FLOPs of a capacity-based layer that computes fixed [E, C, h] buffers (GShard's
    einsum, Switch's static shapes): ``4·h·d_ff · E·C`` whatever the load — padding where an expert has
    fewer than C rows, drops (:func:`dropped_tokens`) where it has more."""
    _int("n_experts", n_experts, 1)
    _int("capacity", capacity)
    _int("hidden", hidden, 1)
    _int("d_ff", d_ff, 1)
    return 4.0 * hidden * d_ff * n_experts * capacity


def chunked_moe_layer_time(dispatch_time, expert_time, combine_time, chunks=1, latency=0.0) -> float:
    """Forward seconds of one expert-parallel MoE layer whose all-to-alls are pipelined with its experts
    in ``chunks`` = m pieces (Tutel's adaptive pipelining, Hwang et al. 2023), on a model of one link
    that carries the all-to-alls one after another in launch order and one compute unit:

        d = D/m + α,  p = P/m,  c = Cb/m + α            (α = ``latency`` of one all-to-all call)
        schedule     dispatch 0 | wait; for each chunk i: launch dispatch i+1, experts i (p),
                     launch combine i, wait dispatch i+1 | wait every combine

    computed step by step (exact for that schedule). Closed forms: m = 1 gives d + p + c (the plain
    layer, nothing hidden); when the compute hides the traffic, p >= d + c, it is ``d + m·p + c``
    (only the first dispatch and the last combine exposed); when the link is the bottleneck it tends
    to ``m·(d + c)``, the communication alone. Each extra chunk costs 2α more on the link."""
    for name, v in (("dispatch_time", dispatch_time), ("expert_time", expert_time),
                    ("combine_time", combine_time), ("latency", latency)):
        if not v >= 0:
            raise ValueError(f"{name} must be >= 0 seconds, got {v!r}")
    m = _int("chunks", chunks, 1)
    d, p, c = dispatch_time / m + latency, expert_time / m, combine_time / m + latency
    t = link = d  # dispatch 0 crossed the link; the rank waited for it
    for i in range(m):
        nxt = None
        if i + 1 < m:  # launched right after the wait: queued behind what the link still carries
            link = nxt = max(t, link) + d
        t += p  # chunk i's experts
        link = max(t, link) + c  # combine i, launched when its experts are done
        if nxt is not None:
            t = max(t, nxt)  # wait for dispatch i+1
    return max(t, link)


def chunked_moe_exposed_comm(dispatch_time, expert_time, combine_time, chunks=1, latency=0.0) -> float:
    """The communication a rank waits on: :func:`chunked_moe_layer_time` minus the experts' compute P.
    D + Cb (+ 2α) when m = 1; ``d + c`` when the compute hides the rest (p >= d + c)."""
    return chunked_moe_layer_time(dispatch_time, expert_time, combine_time, chunks, latency) - expert_time
