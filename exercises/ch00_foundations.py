# generated from solutions/ch00_foundations.py by `make exercises`: fill in each NotImplementedError
# fingerprint e2b50d008d6e8159 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 00 exercises: ranks, collectives and their cost, memory math.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch00``.

1. :func:`recursive_doubling_all_gather`: a latency-optimal all-gather built from point-to-point
   messages (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication
   Operations in MPICH", §4.1).
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

# --- 1. recursive-doubling all-gather ----------------------------------------------------------


def recursive_doubling_all_gather(chunk: torch.Tensor) -> torch.Tensor:
    """Kind: build

    All-gather ``chunk`` from every rank by recursive doubling; call it on every rank.

    Returns what ``dist.all_gather_into_tensor`` returns: the chunks of ranks 0..n-1
    concatenated along dim 0, a tensor of shape ``(n * chunk.shape[0], *chunk.shape[1:])``.

    **The algorithm** (Thakur, Rabenseifner & Gropp 2005, §4.1). n must be a power of two.
    Rank r starts holding only its own block. At step k = 0, 1, ..., log2(n) - 1, with
    ``step = 2**k``, rank r and its partner ``r ^ step`` (r with bit k flipped) swap *every
    block they hold so far*: r holds the ``step`` consecutive blocks starting at
    ``(r // step) * step``, its partner the ``step`` blocks starting at
    ``(partner // step) * step``. After the swap each holds the 2*step blocks of their pair, so
    after log2(n) steps everyone holds all n. For n = 4::

        step 1:  0<->1, 2<->3     rank 0 holds blocks {0,1}, rank 2 holds {2,3}
        step 2:  0<->2, 1<->3     everyone holds {0,1,2,3}

    **The cost.** Each rank sends log2(n) messages of 1, 2, 4, ..., n/2 blocks: in all
    (n-1) blocks, i.e. (n-1)/n * S bytes for an output of S bytes, the same as the ring, in
    log2(n) steps instead of n-1:  t = log2(n)*alpha + (n-1)/n * S * beta.
    The tests check both counts with ``comm.meter()``.

    **Your task:** fill the loop over steps. Hints:

    - ``blocks[i]`` is rank i's block (a view into ``out``): receive straight into it.
      ``blocks[a:b]`` is contiguous, so it can be sent and received as it is.
    - Send and receive at the same time, or two partners that both send first deadlock.
      Build ``[dist.P2POp(dist.isend, tensor, peer), dist.P2POp(dist.irecv, tensor, peer)]`` and
      launch them with ``comm.batch_isend_irecv(ops)`` (call ``.wait()`` on each returned work),
      or use ``comm.isend`` / ``comm.irecv``. Use the ``comm`` wrappers, not ``dist`` directly:
      the meter counts only what goes through them.
    """
    if not dist.is_initialized():
        raise RuntimeError("recursive_doubling_all_gather runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    n, r = dist.get_world_size(), dist.get_rank()
    if n & (n - 1):
        raise ValueError(f"recursive doubling needs a power-of-two number of ranks, got {n}; "
                         "use 1, 2, 4, 8, ... ranks (or the ring all-gather)")
    if chunk.dim() == 0:
        raise ValueError("chunk must have at least one dimension (blocks are concatenated along dim 0)")
    out = chunk.new_empty((n * chunk.shape[0], *chunk.shape[1:]))
    blocks = out.view(n, *chunk.shape)  # blocks[i]: rank i's chunk, filled in place
    blocks[r] = chunk
    raise NotImplementedError("exercise: recursive_doubling_all_gather — see chapters/00_foundations.md")
    return out


# --- 2. fitting the alpha-beta model --------------------------------------------------------


def alpha_beta_from_timings(sizes_bytes, times_s, n: int) -> tuple[float, float]:
    """Kind: derive

    Fit latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) to ring all-reduce times.

    The ring all-reduce of an S-byte buffer on n ranks is a reduce-scatter then an all-gather,
    2(n-1) steps each sending S/n bytes (Patarasuk & Yuan 2009; Thakur et al. 2005 §4.4). Each
    message costs alpha + bytes*beta (Hockney 1994), so

        t(S) = 2(n-1) * alpha + 2(n-1)/n * S * beta        (``costmodel.allreduce_time``)

    which is *linear* in the unknowns (alpha, beta): one row ``[2(n-1), 2(n-1)/n * S_i]`` per
    measurement, and a least-squares solve gives both.

    **Your task:** return ``(alpha, beta)`` as Python floats, minimising the *relative* error
    ``sum_i ((model_i - t_i) / t_i)**2``, not the absolute one: a sweep spans many decades of
    sizes, and 1% noise on a 64 MB all-reduce is far larger than the whole latency term of a
    1 KB one, so an unweighted fit cannot see alpha. Hints:

    - build the design matrix ``A`` (one row per measurement, two columns) with numpy;
    - relative error = divide each row of ``A`` and each target by its ``t_i``
      (the targets become all ones);
    - ``np.linalg.lstsq(A, y, rcond=None)`` returns ``(coefficients, residuals, rank, sv)``.

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
    """Kind: derive

    Bytes of *model states* needed to train ``num_params`` parameters (no activations).

    Returns ``{"weights", "gradients", "optimizer", "total"}`` in bytes, where ``optimizer`` is
    everything the optimizer owns (its states, plus the fp32 master weights under mixed
    precision) and ``total = weights + gradients + optimizer``.

    **The rule** (ZeRO, Rajbhandari et al. 2020 §3.1; Transformer Math 101, EleutherAI 2023):

    - ``"fp32"``: weights 4 B/param, gradients 4 B/param; optimizer: 4 B per state tensor.
    - ``"mixed"``: weights 2 B/param (fp16/bf16), gradients 2 B/param; optimizer: an fp32 master
      copy of the weights (4 B/param) plus 4 B per state tensor (states stay fp32).

    ZeRO calls the optimizer's bytes per parameter K: mixed-precision Adam has K = 4 + 4 + 4 = 12,
    so training takes (2 + 2 + K) = 16 bytes per parameter, and GPT-2's 1.5B parameters need
    24 GB before a single activation is stored — the paper's opening example.

    **Your task:** fill the dict. ``OPTIMIZER_STATES[optimizer]`` says how many fp32 states the
    optimizer keeps. ``num_params`` may be an int (return ints) or a float such as 1.5e9.
    """
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {PRECISIONS}")
    raise NotImplementedError("exercise: training_memory_bytes — see chapters/00_foundations.md")


def largest_model_that_fits(device_bytes, optimizer: str = "adamw", precision: str = "mixed",
                            activation_bytes=0) -> int:
    """Kind: derive

    The largest parameter count whose model states and activations fit in ``device_bytes``.

    Plain data parallelism replicates everything: every rank holds all weights, gradients and
    optimizer states, so adding ranks never lets a bigger model fit (ZeRO §3.1, "Where did all
    the memory go?"). The largest trainable model is the largest integer N with

        training_memory_bytes(N, optimizer, precision)["total"] + activation_bytes <= device_bytes

    Return 0 when not even one parameter fits. An 80 GB device with mixed-precision AdamW
    (16 B/param) and no activations fits 80e9 / 16 = 5e9 parameters.

    **Your task:** compute N exactly, with integer arithmetic (``//``) rather than float
    division, so the answer is exact at the boundary. Hint: the model states are linear in N,
    so ``training_memory_bytes(1, ...)["total"]`` is the bytes per parameter.
    """
    if device_bytes < 0 or activation_bytes < 0:
        raise ValueError(f"device_bytes ({device_bytes}) and activation_bytes "
                         f"({activation_bytes}) must be >= 0")
    raise NotImplementedError("exercise: largest_model_that_fits — see chapters/00_foundations.md")


# --- 5. bytes on the wire: predicted, then counted ---------------------------------------------


def predict_and_meter_allreduce_bytes(x: torch.Tensor) -> dict:
    """Kind: measure

    Predict how many bytes this rank sends to all-reduce ``x``, with the ring and with recursive
    doubling, then run both on the ranks and count them. Call it on every rank (inside
    ``launch``), each rank with its own ``x`` of the same shape and dtype.

    Returns ``{"ring": {"predicted": p, "measured": m}, "recursive_doubling": {...}}`` in bytes,
    for *this* rank.

    **Predict** from the alpha-beta model's bandwidth terms, with S = ``x.numel() * x.element_size()``
    and n ranks: the ring sends ``2(n-1)/n * S`` per rank (the all-reduce's bus-bandwidth factor,
    2(n-1)/n: n-1 reduce-scatter steps and n-1 all-gather steps of S/n each); recursive doubling
    swaps the whole buffer in each of its log2(n) steps, ``log2(n) * S``.

    **Measure** by running ``collectives.ring_all_reduce`` and
    ``collectives.recursive_doubling_all_reduce`` (each on a *clone* of ``x``: they sum in place)
    inside ``with comm.meter() as m:``, one meter each. Every message they send goes through
    ``comm``, so ``m.wire_bytes["send"]`` is what really left this rank (a receive is not
    charged: the sender pays).

    **How close.** When n divides ``x.numel()`` the ring's chunks are equal and the count equals
    the prediction exactly. Otherwise the chunks differ by one element, and each rank's count is
    within ``2(n-1)/n * x.element_size()`` bytes of it (under two elements), while the counts of
    all ranks still add up to exactly ``2(n-1) * S``. Recursive doubling's count is always exact.
    The tests hold you to those tolerances, and check your measured counts against chunk sizes
    worked out independently.
    """
    if not dist.is_initialized():
        raise RuntimeError("predict_and_meter_allreduce_bytes runs inside ranks: call it from a function "
                           "started with minitorch_dist.launch(fn, n)")
    n = dist.get_world_size()
    if n & (n - 1):
        raise ValueError(f"recursive doubling needs a power-of-two number of ranks, got {n}")
    S = x.numel() * x.element_size()
    raise NotImplementedError("exercise: predict_and_meter_allreduce_bytes — see chapters/00_foundations.md")
