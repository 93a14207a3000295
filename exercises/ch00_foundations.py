# generated from solutions/ch00_foundations.py by `make exercises`: fill in each NotImplementedError
# fingerprint 9211650bca972a71 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 00 exercises: ranks, collectives and their cost, memory math.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch00``.

1. :func:`bruck_all_gather`: a latency-optimal all-gather for any number of ranks, built from
   point-to-point messages (Bruck et al. 1997, §3; Thakur, Rabenseifner & Gropp 2005, §4.1).
2. :func:`alpha_beta_from_timings`: the alpha-beta (Hockney 1994) cost of a ring all-reduce, fitted
   to a timing table (Patarasuk & Yuan 2009; Thakur et al. 2005 §4.4).
3. :func:`training_memory_bytes`: bytes of model states for training (Rajbhandari et al. 2020,
   ZeRO, §3.1; Anthony, Biderman & Schoelkopf 2023, "Transformer Math 101").
4. :func:`largest_model_that_fits`: the largest model plain data parallelism can train on one
   device.
5. :func:`predict_and_meter_allreduce_bytes`: predict the bytes each rank sends in a ring and a
   recursive-doubling all-reduce, then count them on real ranks.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from minitorch_dist.runtime import collectives, comm

# --- 1. a log-step all-gather for any number of ranks -----------------------------------------


def bruck_all_gather(chunk: torch.Tensor) -> torch.Tensor:
    """Kind: build · about 60 minutes

    All-gather ``chunk`` from every rank in ceil(log2 n) rounds, for *any* number of ranks n;
    call it on every rank.

    Returns what ``dist.all_gather_into_tensor`` returns: the chunks of ranks 0..n-1
    concatenated along dim 0, a tensor of shape ``(n * chunk.shape[0], *chunk.shape[1:])``,
    with ``chunk``'s dtype. Raises ``RuntimeError`` outside ranks and ``ValueError`` for a
    0-dimensional chunk (the scaffolding below does both).

    Recursive doubling (Thakur, Rabenseifner & Gropp 2005, §4.1) needs n to be a power of two:
    its partner ``r ^ 2**k`` does not exist on 3, 5 or 6 ranks. Bruck et al. (1997, "Efficient
    algorithms for all-to-all communications in multiport message-passing systems", §3) keep
    the log-step latency for every n: in each round a rank sends to one rank and receives from
    another, and the number of blocks a rank holds doubles each round until it holds all n.

    **What the tests check**, on 2, 3, 4, 5 and 6 ranks, each rank with a different chunk:

    - the result equals ``dist.all_gather_into_tensor`` bit for bit, on every rank, for 1-D and
      2-D chunks in float32, int64 and bfloat16;
    - only point-to-point messages go through ``comm`` (no collective), exactly
      ``ceil(log2 n)`` sends and ``ceil(log2 n)`` receives per rank;
    - no block is sent twice: each rank sends ``n - 1`` blocks in all, which is the
      all-gather's lower bound ``(n-1)/n * S`` bytes for an output of S bytes
      (``costmodel.bus_bytes("all_gather", S, n)``), the same as the ring, in ceil(log2 n)
      steps instead of n - 1.

    Send and receive through the ``comm`` wrappers (``comm.batch_isend_irecv`` of
    ``dist.P2POp``s, or ``comm.isend`` / ``comm.irecv``): the meter counts only what goes through
    them, and two ranks that both block in a send deadlock. The chapter's exercise section has
    graded hints.

    Reference: ``minitorch_dist/runtime/collectives.py`` (recursive_doubling_all_reduce swaps with
    partner r XOR 2^k and folds extra ranks; you gather instead, for any n, with no fold).
    """
    if not dist.is_initialized():
        raise RuntimeError("bruck_all_gather runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    n, r = dist.get_world_size(), dist.get_rank()
    if chunk.dim() == 0:
        raise ValueError("chunk must have at least one dimension (blocks are concatenated along dim 0)")
    out = chunk.new_empty((n * chunk.shape[0], *chunk.shape[1:]))
    raise NotImplementedError("exercise: bruck_all_gather — see chapters/00_foundations.md")
    return out


# --- 2. fitting the alpha-beta model --------------------------------------------------------


def alpha_beta_from_timings(sizes_bytes, times_s, n: int) -> tuple[float, float]:
    """Kind: derive · about 30 minutes

    Fit latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) to ring all-reduce times.

    ``sizes_bytes[i]`` is the buffer size S_i of one timed ring all-reduce on ``n`` ranks and
    ``times_s[i]`` its time. Assume the ring of the chapter (Patarasuk & Yuan 2009; Thakur et al.
    2005 §4.4): a reduce-scatter then an all-gather, where every message costs
    ``alpha + bytes * beta`` (Hockney 1994). Derive the time of one all-reduce in terms of S, n,
    alpha and beta (``costmodel.allreduce_time`` holds the answer; work it out before you look).

    **Your task:** return ``(alpha, beta)`` as Python floats, the pair that minimises the
    *relative* squared error ``sum_i ((model_i - t_i) / t_i)**2``, not the absolute one: a
    sweep spans many decades of sizes, and 1% noise on a 64 MB all-reduce is far larger than
    the whole latency term of a 1 KB one, so an unweighted fit cannot see alpha.

    **What the tests check:** exact timings give back alpha and beta to the rounding of a
    least-squares solve, for random links and n; noisy timings give the same pair as
    ``costmodel.fit_alpha_beta`` and land within 5 standard errors of the truth.

    ``S`` and ``t`` below are float64 arrays, already checked.
    """
    S = np.asarray(sizes_bytes, dtype=np.float64).ravel()
    t = np.asarray(times_s, dtype=np.float64).ravel()
    if n < 2:
        raise ValueError(f"need n >= 2 ranks to fit an all-reduce (n={n} moves no bytes)")
    if S.shape != t.shape:
        raise ValueError(f"{S.size} sizes but {t.size} times; pass one time per size")
    if np.unique(S).size < 2:
        raise ValueError("need at least two distinct message sizes to separate alpha from beta")
    if np.any(t <= 0):
        raise ValueError("times must be > 0 seconds")
    raise NotImplementedError("exercise: alpha_beta_from_timings — see chapters/00_foundations.md")


# --- 3. memory of model states ----------------------------------------------------------------

#: How many fp32 tensors of parameter size each optimizer keeps (its *states*):
#: Adam/AdamW the first and second moments m and v; SGD with momentum one buffer; plain SGD none.
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 1, "sgd_nomomentum": 0}

#: Precisions: "fp32" trains in fp32 throughout; "mixed" (Micikevicius et al. 2018) computes in
#: fp16/bf16 and lets the optimizer keep an fp32 master copy of the weights.
PRECISIONS = ("fp32", "mixed")


def training_memory_bytes(num_params, optimizer: str = "adamw", precision: str = "mixed") -> dict:
    """Kind: derive · about 20 minutes

    Bytes of *model states* needed to train ``num_params`` parameters (no activations).

    Returns ``{"weights", "gradients", "optimizer", "total"}`` in bytes, where ``optimizer`` is
    everything the optimizer owns (its states, plus the fp32 master weights under mixed
    precision) and ``total = weights + gradients + optimizer``.

    **The assumptions** (ZeRO, Rajbhandari et al. 2020 §3.1; Transformer Math 101, EleutherAI
    2023). ``"fp32"`` trains in fp32 throughout. ``"mixed"`` (Micikevicius et al. 2018) keeps the
    weights forward and backward read in a 16-bit dtype and the gradients in the weights' dtype,
    and the optimizer updates an fp32 master copy of the weights. Every optimizer state is an
    fp32 tensor of parameter size; ``OPTIMIZER_STATES[optimizer]`` says how many the optimizer
    keeps. Work out the bytes per parameter of each part from these; ZeRO's opening example is a
    check: GPT-2's 1.5B parameters with mixed-precision Adam need 24 GB before a single
    activation is stored.

    ``num_params`` may be an int (return ints) or a float such as 1.5e9. The tests compare with
    ``costmodel.model_state_bytes`` for every optimizer and precision, on random sizes.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    raise NotImplementedError("exercise: training_memory_bytes — see chapters/00_foundations.md")


def largest_model_that_fits(device_bytes, optimizer: str = "adamw", precision: str = "mixed",
                            activation_bytes=0) -> int:
    """Kind: derive · about 20 minutes

    The largest parameter count whose model states and activations fit in ``device_bytes``.

    Plain data parallelism replicates everything: every rank holds all weights, gradients and
    optimizer states, so adding ranks never lets a bigger model fit (ZeRO §3.1, "Where did all
    the memory go?"). Return the largest integer N whose model states
    (:func:`training_memory_bytes`) plus ``activation_bytes`` are at most ``device_bytes``, and 0
    when not even one parameter fits; an ``int``.

    **What the tests check:** the exact boundary (N fits, N + 1 does not) on random devices up
    to 2 TB, where a float division is off by one, and ZeRO's figures.
    """
    if device_bytes < 0 or activation_bytes < 0:
        raise ValueError(f"device_bytes ({device_bytes}) and activation_bytes "
                         f"({activation_bytes}) must be >= 0")
    raise NotImplementedError("exercise: largest_model_that_fits — see chapters/00_foundations.md")


# --- 5. bytes on the wire: predicted, then counted ---------------------------------------------


def predict_and_meter_allreduce_bytes(x: torch.Tensor) -> dict:
    """Kind: measure · about 40 minutes

    Predict how many bytes this rank sends to all-reduce ``x``, with the ring and with recursive
    doubling, then run both on the ranks and count them. Call it on every rank (inside
    ``launch``), each rank with its own ``x`` of the same shape and dtype; ``x`` is left as it
    was.

    Returns ``{"ring": {"predicted": p, "measured": m}, "recursive_doubling": {...}}`` in bytes,
    for *this* rank.

    **Predict** from the alpha-beta model's bandwidth terms (the chapter's cost section), with
    S = ``x.numel() * x.element_size()`` and n ranks, for the two algorithms as
    ``collectives.ring_all_reduce`` and ``collectives.recursive_doubling_all_reduce`` run them.

    **Measure** by running those two all-reduces on the ranks inside ``comm.meter()``: every
    message they send goes through ``comm``, and the meter's ``wire_bytes`` says what really
    left this rank (a receive is not charged: the sender pays).

    **What the tests check**, on 4 ranks with a tensor of 1001 elements (which 4 does not
    divide): the predictions exactly; each rank's measured count equal to what that rank really
    sends, worked out from the ring's uneven chunks (so a count computed from the formula does
    not pass), within ``2(n-1)/n * x.element_size()`` bytes of the prediction, and summing over
    ranks to ``2(n-1) * S``; recursive doubling's count equal to its prediction; ``x`` unchanged.

    Reference: ``minitorch_dist/runtime/collectives.py`` (the two all-reduces you run, and
    ``metered``, which meters one call; you predict first and meter each on its own).
    """
    if not dist.is_initialized():
        raise RuntimeError("predict_and_meter_allreduce_bytes runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    n = dist.get_world_size()
    if n & (n - 1):
        raise ValueError(f"recursive doubling needs a power-of-two number of ranks, got {n}")
    S = x.numel() * x.element_size()
    raise NotImplementedError("exercise: predict_and_meter_allreduce_bytes — see chapters/00_foundations.md")
