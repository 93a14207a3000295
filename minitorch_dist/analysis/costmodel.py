"""The formulas the course quotes, each once, each with its source.

Every notebook plots these (theory) next to a meter (measured). A chapter that needs a new
formula adds it here, with the paper and equation in its docstring.

Sections: collectives (alpha-beta ring model and its latency-optimal rivals) · model size and
FLOPs · model-state memory (mixed precision, ZeRO) · activation memory · pipeline bubbles.
Units: bytes, seconds, FLOPs; ``GB`` = 1e9 bytes as the papers print, ``GiB`` = 2**30.
"""
from __future__ import annotations

import math

GB = 1e9  #: decimal gigabyte: the unit of the ZeRO and Megatron papers
GiB = 2**30  #: binary gibibyte: what torch.cuda.memory_allocated() / 2**30 prints

# --- collectives: the ring model ------------------------------------------------------------

#: Bytes each rank sends per byte of the collective's full buffer, under the ring algorithm.
#: These are the "bus bandwidth" factors of nccl-tests (PERFORMANCE.md): busbw = algbw * factor.
#: The full buffer is the tensor being all-reduced / broadcast, the *unsharded* tensor of a
#: reduce-scatter or all-gather, and a rank's whole input of an all-to-all.
BUS_FACTORS = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,  # the sender is charged; counting both would double the wire
}


def bus_bytes(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank puts on the wire for collective ``op`` on a buffer of ``nbytes`` over ``n`` ranks.

    Ring model (Patarasuk & Yuan 2009; nccl-tests PERFORMANCE.md "bus bandwidth"):
    all-reduce 2(n-1)/n * S, reduce-scatter and all-gather (n-1)/n * S, all-to-all (n-1)/n * S,
    broadcast S. With n = 1 nothing moves.
    """
    if op not in BUS_FACTORS:
        raise ValueError(f"unknown collective {op!r}; expected one of {sorted(BUS_FACTORS)}")
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")
    if n == 1:
        return 0.0
    return BUS_FACTORS[op](n) * nbytes


# Latency terms: how many sequential message steps each algorithm takes on n ranks.
_STEPS = {
    "all_reduce": lambda n: 2 * (n - 1),  # reduce-scatter ring, then all-gather ring
    "reduce_scatter": lambda n: n - 1,
    "all_gather": lambda n: n - 1,
    "all_to_all": lambda n: n - 1,  # pairwise exchange
    "broadcast": lambda n: n - 1,  # pipelined ring: the first chunk crosses n-1 links
    "send": lambda n: 1,
}

def _check_n(n):
    if n < 1:
        raise ValueError(f"world size must be >= 1, got {n}")


def collective_time(op: str, nbytes: float, n: int, alpha: float, beta: float) -> float:
    """Alpha-beta time of ring collective ``op``: ``steps(n)*alpha + bus_bytes(op, S, n)*beta``.

    Hockney's model, per message t = alpha + m*beta (alpha: latency in s, beta: s per byte =
    1/bandwidth), summed over the steps of the ring algorithms of Thakur, Rabenseifner & Gropp
    (2005) and Patarasuk & Yuan (2009). Computation (the reduction) is ignored.
    """
    if op not in _STEPS:
        raise ValueError(f"no alpha-beta model for {op!r}; expected one of {sorted(_STEPS)}")
    _check_n(n)
    if n == 1:
        return 0.0
    return _STEPS[op](n) * alpha + bus_bytes(op, nbytes, n) * beta


def allreduce_time(nbytes, n, alpha, beta):
    """Ring all-reduce (Patarasuk & Yuan 2009; Thakur et al. 2005 §4.4, Rabenseifner's algorithm).

    Reduce-scatter then all-gather, each n-1 steps moving S/n bytes:
    ``t = 2(n-1)*alpha + 2(n-1)/n * S * beta``. Bandwidth-optimal: the beta term tends to 2*S*beta,
    independent of n.
    """
    return collective_time("all_reduce", nbytes, n, alpha, beta)


def reduce_scatter_time(nbytes, n, alpha, beta):
    """Ring reduce-scatter of an S-byte buffer (Thakur et al. 2005 §4.5):
    ``t = (n-1)*alpha + (n-1)/n * S * beta``."""
    return collective_time("reduce_scatter", nbytes, n, alpha, beta)


def all_gather_time(nbytes, n, alpha, beta):
    """Ring all-gather producing an S-byte buffer (Thakur et al. 2005 §4.1):
    ``t = (n-1)*alpha + (n-1)/n * S * beta``."""
    return collective_time("all_gather", nbytes, n, alpha, beta)


def all_to_all_time(nbytes, n, alpha, beta):
    """Pairwise-exchange all-to-all, S = one rank's whole input (Thakur et al. 2005 §4.6):
    n-1 steps each sending S/n bytes, ``t = (n-1)*alpha + (n-1)/n * S * beta``."""
    return collective_time("all_to_all", nbytes, n, alpha, beta)


def broadcast_time(nbytes, n, alpha, beta):
    """Pipelined ring broadcast (the NCCL algorithm; bus factor 1):
    ``t = (n-1)*alpha + S*beta``, in the limit of many small chunks. Thakur et al. 2005 §4.2
    use a binomial tree for short messages, ``ceil(log2 n) * (alpha + S*beta)``."""
    return collective_time("broadcast", nbytes, n, alpha, beta)


def p2p_time(nbytes, alpha, beta):
    """One point-to-point message (Hockney 1994): ``t = alpha + S*beta``."""
    return alpha + nbytes * beta


def recursive_doubling_allreduce_time(nbytes, n, alpha, beta):
    """Recursive-doubling all-reduce (Thakur et al. 2005 §4.4): log2(n) rounds, each rank
    swapping its whole S-byte buffer with its partner: ``t = ceil(log2 n) * (alpha + S*beta)``.
    Latency-optimal, so best for small messages; ceil models non-powers of two optimistically."""
    _check_n(n)
    return math.ceil(math.log2(n)) * (alpha + nbytes * beta)


def tree_allreduce_time(nbytes, n, alpha, beta):
    """Binomial-tree all-reduce: tree reduce to a root, then tree broadcast
    (Thakur et al. 2005 §4.3-4.4): ``t = 2*ceil(log2 n) * (alpha + S*beta)``, full-size messages
    on every level (no pipelining). Twice recursive doubling; O(log n) latency versus the ring's O(n)."""
    return 2 * recursive_doubling_allreduce_time(nbytes, n, alpha, beta)


def ring_latency_bandwidth_crossover(n, alpha, beta):
    """Message size at which the ring all-reduce's latency and bandwidth terms are equal:
    ``2(n-1)*alpha = 2(n-1)/n * S * beta``  =>  ``S = n * alpha / beta``.

    Below it the 2(n-1) latencies dominate (log-step algorithms such as recursive doubling win);
    above it the bytes dominate and the ring's minimal traffic wins (Thakur et al. 2005 §4.4).
    """
    _check_n(n)
    return n * alpha / beta


def naive_allreduce_time(nbytes, n, alpha, beta):
    """Reduce to a root, then broadcast from it, all messages through the root:
    ``t = 2(n-1) * (alpha + S*beta)``.

    Assumption (one-port model): the root sends or receives one message at a time, so its
    n-1 incoming and n-1 outgoing full-size messages are serialised. The bandwidth term grows
    linearly with n: the root is the bottleneck the ring removes.
    """
    _check_n(n)
    return 2 * (n - 1) * (alpha + nbytes * beta)


def fit_alpha_beta(sizes_bytes, times_s, n, op="all_reduce"):
    """Fit (alpha, beta) to measured collective times by least squares on the ring model
    ``t = steps(n)*alpha + busfactor(n)*S*beta`` (see :func:`collective_time`).

    Residuals are *relative*, ``(model - t) / t``: a sweep spans many decades of sizes, and
    plain squared error would let 1% noise on the largest message swamp the latency of the
    smallest. Non-negative: both must be >= 0 physically. If the unconstrained solution has a
    negative coefficient (noise can push alpha below zero), that coefficient is fixed at 0 and
    the other refit alone, which is the exact NNLS solution for two unknowns.
    Returns ``(alpha_seconds, beta_seconds_per_byte)``; bandwidth = 1/beta.
    """
    import numpy as np

    if op not in _STEPS:
        raise ValueError(f"no alpha-beta model for {op!r}; expected one of {sorted(_STEPS)}")
    if n < 2:
        raise ValueError(f"need n >= 2 ranks to fit a collective (n={n} moves no bytes)")
    S = np.asarray(sizes_bytes, dtype=np.float64).ravel()
    t = np.asarray(times_s, dtype=np.float64).ravel()
    if S.shape != t.shape:
        raise ValueError(f"{S.size} sizes but {t.size} times; pass one time per size")
    if np.unique(S).size < 2:
        raise ValueError("need at least two distinct message sizes to separate alpha from beta")
    if np.any(t <= 0):
        raise ValueError("times must be > 0 seconds")
    # rows divided by t: least squares on relative error, target 1
    A = np.stack([np.full_like(S, _STEPS[op](n)), BUS_FACTORS[op](n) * S], axis=1) / t[:, None]
    t = np.ones_like(t)
    (alpha, beta), *_ = np.linalg.lstsq(A, t, rcond=None)
    if alpha >= 0 and beta >= 0:
        return float(alpha), float(beta)
    # Best fit on each boundary (one coefficient at 0); keep the one with smaller residual.
    candidates = []
    for j in (0, 1):
        col = A[:, j]
        c = max(0.0, float(col @ t) / float(col @ col))
        coef = [0.0, 0.0]
        coef[j] = c
        candidates.append((float(np.sum((A @ np.array(coef) - t) ** 2)), coef))
    return tuple(min(candidates, key=lambda rc: rc[0])[1])


# --- model size and compute -----------------------------------------------------------------

def transformer_params(cfg) -> int:
    """Exact parameter count of a GPT-2 style decoder (Radford et al. 2019), ``cfg`` duck-typed.

    Reads ``n_layer``, ``n_embd`` (h), ``vocab_size`` (V), ``block_size`` (T) and optionally
    ``mlp_ratio`` (r, default 4; MLP width ``int(r*h)``), ``bias`` (default True: every Linear
    and LayerNorm has a bias), ``tie_embeddings`` (default True: lm_head shares the token embedding).

    Per block (b = 1 with bias, else 0; f = int(r*h))::

        ln_1  h + b*h     attn.qkv  3h^2 + b*3h     attn.proj  h^2 + b*h
        ln_2  h + b*h     mlp.fc    h*f + b*f       mlp.proj   f*h + b*h

    plus ``ln_f (h + b*h) + wte V*h + wpe T*h + (lm_head V*h, no bias, if untied)``.
    """
    h, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    b = 1 if getattr(cfg, "bias", True) else 0
    f = int(getattr(cfg, "mlp_ratio", 4) * h)
    ln = h + b * h
    block = 2 * ln + (3 * h * h + b * 3 * h) + (h * h + b * h) + (h * f + b * f) + (f * h + b * h)
    total = L * block + ln + V * h + T * h
    if not getattr(cfg, "tie_embeddings", True):
        total += V * h
    return int(total)


def transformer_params_approx(n_layer, hidden) -> float:
    """``12 * L * h^2``: the non-embedding parameters with a 4h MLP, biases and norms dropped
    (Kaplan et al. 2020 §2.1, N = 2*d_model*n_layer*(2*d_attn + d_ff); Narayanan et al. 2021 §5.1)."""
    return 12 * n_layer * hidden**2


def training_flops(params, tokens) -> float:
    """``C = 6 * N * D`` training FLOPs (Kaplan et al. 2020 §2.1; Hoffmann et al. 2022 §3):
    2 FLOPs per parameter per token forward (multiply + add), 4 backward; attention ignored."""
    return 6 * params * tokens


def megatron_flops_per_step(batch, seq, layers, hidden, vocab, recompute=False) -> float:
    """FLOPs of one training step of a GPT (Narayanan et al. 2021, §5.1, eq. 3 and Appendix).

    Counting only matmuls (2 FLOPs per multiply-add), one layer's forward is
    ``24*B*s*h^2 + 4*B*s^2*h`` (QKV 6Bsh^2, scores 2Bs^2h, attn*V 2Bs^2h, proj 2Bsh^2, MLP 16Bsh^2)
    and the logit layer's is ``2*B*s*h*V``. Backward costs twice forward. Per step:

    * ``recompute=True`` (full activation recomputation: 4 forward-equivalents per layer, as in
      the paper): ``F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))``  (eq. 3);
    * ``recompute=False`` (3 forward-equivalents): ``F = 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h))``.

    The logit layer is never recomputed (6BshV in both), hence 16 vs 12 in the vocab term.
    ``recompute=False`` is the *model* FLOPs used for MFU.
    """
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def model_flops_utilization(flops_per_step, step_time_s, peak_flops_per_device, n_devices=1) -> float:
    """MFU (Chowdhery et al. 2022, PaLM, Appendix B): achieved model FLOP/s over peak FLOP/s,
    ``flops_per_step / (step_time_s * peak_flops_per_device * n_devices)``. Pass *model* FLOPs
    (e.g. ``megatron_flops_per_step(..., recompute=False)`` or ``training_flops``): recomputation
    is work the hardware does but not progress, so it is left out."""
    if step_time_s <= 0 or peak_flops_per_device <= 0 or n_devices < 1:
        raise ValueError("step_time_s and peak_flops_per_device must be > 0 and n_devices >= 1")
    return flops_per_step / (step_time_s * peak_flops_per_device * n_devices)


# --- memory: model states -------------------------------------------------------------------

#: Bytes of optimizer state per parameter, kept in fp32 (Transformer Math 101, EleutherAI 2023).
#: adafactor is approximate: its factored second moment (row + column sums, O(r+c) per r x c
#: matrix) is neglected and an fp32 first moment is kept (beta1 > 0, as commonly run); with
#: beta1 = 0 it is ~0, model that with "sgd_nomomentum". adamw_8bit: two 1-byte states (Dettmers 2022).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adamw_8bit": 2, "sgd": 4, "sgd_nomomentum": 0, "adafactor": 4}

#: (weight bytes, gradient bytes, fp32 master-copy bytes) per parameter for each precision.
PRECISIONS = {"fp32": (4, 4, 0), "mixed": (2, 2, 4)}


def optimizer_bytes_per_param(precision="mixed", optimizer="adamw") -> int:
    """K of the ZeRO paper: bytes per parameter the optimizer owns (master copy + states).
    Mixed-precision AdamW: K = 4 + 4 + 4 = 12 (Rajbhandari et al. 2020 §3.1)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_BYTES)}")
    return PRECISIONS[precision][2] + OPTIMIZER_STATE_BYTES[optimizer]


def model_state_bytes(num_params, precision="mixed", optimizer="adamw") -> dict:
    """Bytes of model states (no activations, no buffers) for training ``num_params`` parameters.

    Transformer Math 101 (Anthony, Biderman & Schoelkopf, EleutherAI 2023); ZeRO §3.1.

    * ``"fp32"``:  weights 4 + gradients 4 + optimizer states (AdamW m, v: 8) = 16 B/param;
    * ``"mixed"`` (fp16 or bf16 compute): weights 2 + gradients 2 + optimizer (fp32 master 4
      + m 4 + v 4 = 12) = 16 B/param: mixed precision saves compute and activations, not states.

    Returns a dict of bytes: ``weights``, ``gradients``, ``optimizer`` (everything the optimizer
    owns: the ZeRO paper's K*Psi, master copy included), ``master_weights`` (the part of
    ``optimizer`` that is the fp32 copy), and ``total = weights + gradients + optimizer``.
    ``num_params`` may be a float (e.g. 7.5e9).
    """
    k = optimizer_bytes_per_param(precision, optimizer)
    w, g, master = PRECISIONS[precision]
    parts = {
        "weights": w * num_params,
        "gradients": g * num_params,
        "optimizer": k * num_params,
        "master_weights": master * num_params,
    }
    parts["total"] = parts["weights"] + parts["gradients"] + parts["optimizer"]
    return parts


def zero_memory_bytes(num_params, dp, stage, k=12) -> float:
    """Model-state bytes per device under ZeRO-DP (Rajbhandari et al. 2020, §5.1 and Figure 1).

    fp16 parameters (2*Psi) and gradients (2*Psi), K*Psi bytes of optimizer state, N = dp ranks::

        stage 0 (plain DP)            (2 + 2 + K) * Psi
        stage 1 (P_os)                 4*Psi + K*Psi/N
        stage 2 (P_os+g)               2*Psi + (2 + K)*Psi/N
        stage 3 (P_os+g+p)            (2 + 2 + K) * Psi / N
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    P, N = num_params, dp
    return {0: (4 + k) * P, 1: 4 * P + k * P / N, 2: 2 * P + (2 + k) * P / N, 3: (4 + k) * P / N}[stage]


# --- memory: activations --------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


def activation_memory_bytes(seq, batch, hidden, heads, layers=1, tp=1,
                            sequence_parallel=False, recompute="none") -> float:
    """Activation bytes stored for backward by ``layers`` transformer layers, 16-bit activations
    (Korthikanti et al. 2022, §4, eq. 1 and Table 2). s = seq, b = batch, h = hidden, a = heads,
    t = tp. Per layer:

    ====================  ========================================  =====================
    recompute             tensor parallel only                      tensor + sequence par.
    ====================  ========================================  =====================
    "none"                s*b*h*(10 + 24/t + 5*a*s/(h*t))           s*b*h/t*(34 + 5*a*s/h)
    "selective"           s*b*h*(10 + 24/t)                         34*s*b*h/t
    "full"                2*s*b*h  (the layer input only)           2*s*b*h/t
    ====================  ========================================  =====================

    With t = 1 the first row is eq. 1, ``s*b*h*(34 + 5*a*s/h)``: 34sbh from the matmul inputs,
    norms, GeLU and dropout masks, 5as^2b from the attention scores, softmax and its dropout.
    The 10sbh that TP alone cannot shard are the LayerNorm and dropout activations, which SP
    splits along the sequence. Selective recompute drops the 5as/h attention term.
    Embeddings, the final norm and the output layer (Korthikanti §4.3) are not included.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                    ("layers", layers), ("tp", tp)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        per_layer = 2 * sbh / t if sequence_parallel else 2 * sbh
    elif sequence_parallel:
        per_layer = sbh / t * (34 + (5 * a * s / h if recompute == "none" else 0))
    else:
        per_layer = sbh * (10 + 24 / t + (5 * a * s / (h * t) if recompute == "none" else 0))
    return layers * per_layer


# --- pipeline bubbles -----------------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def zb_h1_idle_time(p, t_f, t_b, t_w) -> float:
    """Idle time per stage of the ZB-H1 schedule (Qi et al. 2024, Zero Bubble Pipeline
    Parallelism, §3.1): ``(p-1) * (t_F + t_B - t_W)``, where backward is split into B (input
    gradient) and W (weight gradient). 1F1B idles ``(p-1) * (t_F + t_B + t_W)``; with
    t_F = t_B = t_W ZB-H1 idles one third of that, in the same memory as 1F1B."""
    if p < 1:
        raise ValueError(f"pipeline stages p must be >= 1, got {p}")
    if min(t_f, t_b, t_w) < 0 or t_w > t_f + t_b:
        raise ValueError("need t_f, t_b, t_w >= 0 and t_w <= t_f + t_b (the schedule's regime)")
    return (p - 1) * (t_f + t_b - t_w)


def _bubble_parts(schedule, p, m, v):
    """(idle, ideal) per stage in units of one microbatch's forward+backward on one stage."""
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")
    if v != 1 and schedule != "interleaved":
        raise ValueError(f"v={v} model chunks per stage only applies to schedule 'interleaved'")
    if schedule == "zb-h1":  # assume t_F = t_B = t_W = 1/3: idle (p-1)/3 of a full F+B+W
        return zb_h1_idle_time(p, 1, 1, 1) / 3, m
    return (p - 1) / v, m


def pipeline_bubble_fraction(schedule, p, m, v=1) -> float:
    """Bubble as a fraction of the *total* step time: ``idle / (ideal + idle)``.

    * ``"gpipe"`` (Huang et al. 2019) and ``"1f1b"`` (PipeDream-Flush, Narayanan et al. 2021
      §2.2.1): ``(p-1) / (m + p-1)``; the same bubble, 1F1B only stores fewer activations.
    * ``"interleaved"`` (v model chunks per device, Narayanan et al. 2021 §2.2.2):
      ``(p-1) / (v*m + p-1)``.
    * ``"zb-h1"`` (Qi et al. 2024 §3.1), *assuming t_F = t_B = t_W*: idle (p-1)*t vs 1F1B's
      3*(p-1)*t, so ``(p-1) / (3m + p-1)``. Use :func:`zb_h1_idle_time` for other ratios.

    For the paper's form, bubble over ideal time, see :func:`pipeline_bubble_ratio`.
    """
    idle, ideal = _bubble_parts(schedule, p, m, v)
    return idle / (ideal + idle)


def pipeline_bubble_ratio(schedule, p, m, v=1) -> float:
    """Bubble time over ideal (bubble-free) time: Narayanan et al. 2021's "bubble time fraction".

    gpipe / 1f1b: ``(p-1)/m`` (§2.2.1); interleaved: ``(p-1)/(v*m)`` (§2.2.2);
    zb-h1 (t_F = t_B = t_W): ``(p-1)/(3m)``. Can exceed 1; ``pipeline_bubble_fraction`` cannot.
    """
    idle, ideal = _bubble_parts(schedule, p, m, v)
    return idle / ideal


# --- data parallelism (ch01) ----------------------------------------------------------------
#
# Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training"
# (VLDB): §3.2.2 gradient bucketing, §3.2.3 overlapping the all-reduces with backward.


def bucket_assignment(param_bytes, cap_bytes, first_cap_bytes=None, keys=None) -> list[list[int]]:
    """Cut a sequence of parameters into gradient buckets; return each bucket's indices.

    ``param_bytes`` lists the parameters' gradient sizes *in the order their gradients are
    expected to become ready* -- for DDP, reverse registration order (Li et al. 2020 §3.2.2-3.2.3:
    backward visits layers roughly in the reverse of the forward). The rule, greedy in one pass:

    * bucket 0 may hold ``first_cap_bytes`` (default ``cap_bytes``), every later one ``cap_bytes``;
    * a parameter joins the open bucket unless the bucket is non-empty and adding it would push
      the bucket past its cap (or its ``keys`` entry, e.g. its dtype, differs from the bucket's):
      then the open bucket closes and the parameter starts the next one;
    * so a parameter bigger than the cap gets a bucket of its own, and no bucket with two or more
      parameters exceeds its cap.

    (torch's ``_compute_bucket_assignment_by_size`` closes a bucket *after* it reaches the cap,
    so its buckets overshoot by up to one parameter, and keeps one open bucket per dtype.)
    Returns ``[[i, ...], ...]``, indices into ``param_bytes``, in bucket order.
    """
    if cap_bytes <= 0:
        raise ValueError(f"bucket cap must be > 0 bytes, got {cap_bytes}")
    first_cap_bytes = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if first_cap_bytes <= 0:
        raise ValueError(f"first bucket cap must be > 0 bytes, got {first_cap_bytes}")
    keys = [None] * len(param_bytes) if keys is None else list(keys)
    if len(keys) != len(param_bytes):
        raise ValueError(f"{len(param_bytes)} parameter sizes but {len(keys)} keys; pass one key per parameter")
    buckets: list[list[int]] = []
    open_, open_bytes, open_key = [], 0, None
    for i, (nbytes, key) in enumerate(zip(param_bytes, keys)):
        if nbytes < 0:
            raise ValueError(f"parameter {i} has a negative size {nbytes}")
        cap = first_cap_bytes if not buckets else cap_bytes
        if open_ and (key != open_key or open_bytes + nbytes > cap):
            buckets.append(open_)
            open_, open_bytes = [], 0
        open_.append(i)
        open_bytes += nbytes
        open_key = key
    if open_:
        buckets.append(open_)
    return buckets


def bucket_sizes(param_bytes_in_reverse_order, cap_bytes, first_cap_bytes=None, keys=None) -> list[int]:
    """Bytes of each gradient bucket under the rule of :func:`bucket_assignment`.

    E.g. 4-byte parameters ``[4, 4, 4, 4]`` with a 4-byte first bucket and an 8-byte cap give
    ``[4, 8, 4]``. The number of all-reduces per step is ``len(bucket_sizes(...))``.
    """
    idx = bucket_assignment(param_bytes_in_reverse_order, cap_bytes, first_cap_bytes, keys)
    return [sum(param_bytes_in_reverse_order[i] for i in b) for b in idx]


def ddp_allreduce_schedule(t_forward, t_backward, bucket_bytes, n, alpha, beta) -> list[tuple]:
    """When each bucket's all-reduce becomes ready, starts and ends, overlapped with backward.

    Model (Li et al. 2020 §3.2.3; all-reduce cost :func:`allreduce_time`, ring alpha-beta):

    * backward produces gradient bytes at a constant rate, so bucket i is ready when the
      cumulative bytes of buckets 0..i have been produced:
      ``ready_i = t_f + t_b * (B_0 + ... + B_i) / (B_0 + ... + B_last)``  (an assumption: real
      layers differ in FLOPs per byte);
    * all-reduces run one at a time in bucket order (every rank must issue them in the same
      order), so ``start_i = max(ready_i, end_(i-1))`` and ``end_i = start_i + allreduce_time(B_i)``;
    * communication and computation do not slow each other down (separate engines/links).

    Returns ``[(ready_i, start_i, end_i), ...]`` in seconds from the start of forward.
    """
    if t_forward < 0 or t_backward < 0:
        raise ValueError(f"need t_forward, t_backward >= 0, got {t_forward}, {t_backward}")
    if any(b < 0 for b in bucket_bytes):
        raise ValueError("bucket sizes must be >= 0 bytes")
    total = float(sum(bucket_bytes))
    out, cum, prev_end = [], 0.0, 0.0
    for b in bucket_bytes:
        cum += b
        ready = t_forward + t_backward * (cum / total if total > 0 else 1.0)
        start = max(ready, prev_end)
        prev_end = start + allreduce_time(b, n, alpha, beta)
        out.append((ready, start, prev_end))
    return out


def ddp_step_time(t_forward, t_backward, bucket_bytes, n, alpha, beta, overlap=True) -> float:
    """Modelled time of one DDP step (forward + backward + gradient all-reduce), Li et al. 2020 §3.2.3.

    * ``overlap=True``: buckets are all-reduced during backward as they fill
      (:func:`ddp_allreduce_schedule`): ``T = max(t_f + t_b, end of the last all-reduce)``.
      Only the communication that outlasts backward is exposed; the last bucket's is always.
    * ``overlap=False`` (all-reduce after backward, bucket by bucket):
      ``T = t_f + t_b + sum_i allreduce_time(B_i)``.

    Fewer, larger buckets pay fewer alphas but start later: the bucket-size trade-off of the
    paper's §3.2.2 and its evaluation (§5).
    """
    if not overlap:
        if t_forward < 0 or t_backward < 0:
            raise ValueError(f"need t_forward, t_backward >= 0, got {t_forward}, {t_backward}")
        return t_forward + t_backward + sum(allreduce_time(b, n, alpha, beta) for b in bucket_bytes)
    sched = ddp_allreduce_schedule(t_forward, t_backward, bucket_bytes, n, alpha, beta)
    return max([t_forward + t_backward] + [end for _, _, end in sched])
