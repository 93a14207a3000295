"""Chapter 13 — what saving costs and how often to save: checkpoint bytes and time, the optimal interval.

Young 1974, "A first order approximation to the optimum checkpoint interval" (CACM 17(9)): with a
mean time between failures M and a checkpoint that takes C seconds, saving every τ seconds of work
wastes, per second of work, C/τ for the saves and, on a failure every M seconds, τ/2 of lost work on
average, so the waste ``C/τ + τ/(2M)`` is least at τ = √(2·M·C). Daly 2006, "A higher order estimate
of the optimum checkpoint interval for restart dumps" (Future Generation Computer Systems 22(3)),
his more complete cost function: for exponentially distributed failures that may also strike a
save or a restart (R seconds), the expected wall time of W seconds of work in segments of τ is

    T(τ) = M · e^{R/M} · (e^{(τ+C)/M} − 1) · W/τ

and its minimum, by perturbation, is τ ≈ √(2MC)·[1 + ⅓√(C/2M) + ⅑(C/2M)] − C for C < 2M (else M);
his Figs. 3-5 (C = 5 min; M = 24 h, 6 h, 15 min) give 117, 57 and 9.1 min.

The checkpoint itself: the weights and the optimizer state of every parameter, once
(:func:`checkpoint_bytes`), written by all ranks in parallel at the storage's aggregate bandwidth.
Llama 3 (Dubey et al. 2024, §3.3.1 and §3.3.4): 419 unexpected interruptions in a 54-day snapshot
of the 405B pre-training run; a storage fabric sustaining 2 TB/s (7 TB/s peak).
"""
from __future__ import annotations

import math

LLAMA3_INTERRUPTIONS, LLAMA3_DAYS = 419, 54  #: Dubey et al. 2024 §3.3.4
LLAMA3_STORAGE_BYTES_PER_S = 2e12  #: sustained, Dubey et al. 2024 §3.3.1 ("2 TB/s", Tectonic)

#: Bytes of state per parameter a checkpoint holds: the weights in their dtype plus the optimizer.
STATE_BYTES = {
    "fp32-adam": 4 + 4 + 4,  # weights, exp_avg, exp_avg_sq (this chapter's runs)
    "mixed-adam": 2 + 4 + 4 + 4,  # bf16 weights, fp32 master and moments: ZeRO §3.1's 16 less the gradient
    "fp32-sgd": 4,
}


def _positive(**kw) -> None:
    for k, v in kw.items():
        if not v > 0:
            raise ValueError(f"{k} must be > 0, got {v!r}")


def checkpoint_bytes(n_params: int, kind: str = "mixed-adam") -> int:
    """Bytes of one checkpoint of ``n_params`` parameters: ``STATE_BYTES[kind]`` each (each element
    written once, whatever the layout: replicas are deduplicated)."""
    if kind not in STATE_BYTES:
        raise ValueError(f"unknown state kind {kind!r}: one of {', '.join(STATE_BYTES)}")
    return int(n_params) * STATE_BYTES[kind]


def checkpoint_seconds(nbytes: float, bytes_per_s: float) -> float:
    """C: seconds to write ``nbytes`` at the aggregate write bandwidth of the storage."""
    _positive(bytes_per_s=bytes_per_s)
    return nbytes / bytes_per_s


def save_stall_seconds(nbytes: float, copy_bytes_per_s: float, write_bytes_per_s: float,
                       hash_bytes_per_s: float, asynchronous: bool = False) -> float:
    """How long a rank's training stops for a save of its ``nbytes`` (this chapter's ``save``):
    copy them to host memory, then, unless the writing runs in the background, write and fsync them
    and read them back once for their SHA-256::

        sync:   nbytes / copy + nbytes / write + nbytes / hash          async: nbytes / copy

    (the plan, the metadata and the renames add milliseconds: not modelled). On a GPU the copy is
    device to pinned host memory over PCIe; here, CPU memory to CPU memory."""
    _positive(copy_bytes_per_s=copy_bytes_per_s, write_bytes_per_s=write_bytes_per_s,
              hash_bytes_per_s=hash_bytes_per_s)
    stall = nbytes / copy_bytes_per_s
    return stall if asynchronous else stall + nbytes / write_bytes_per_s + nbytes / hash_bytes_per_s


def mtbf_seconds(interruptions: int = LLAMA3_INTERRUPTIONS, days: float = LLAMA3_DAYS) -> float:
    """M: mean time between failures from a count over a period (default: Llama 3's 419 in 54 days)."""
    _positive(interruptions=interruptions, days=days)
    return days * 86400 / interruptions


def young_interval(mtbf_s: float, checkpoint_s: float) -> float:
    """Young's optimum: τ = √(2·M·C) seconds of work between checkpoints."""
    _positive(mtbf_s=mtbf_s, checkpoint_s=checkpoint_s)
    return math.sqrt(2 * mtbf_s * checkpoint_s)


def daly_interval(mtbf_s: float, checkpoint_s: float) -> float:
    """Daly's higher-order optimum: √(2MC)·[1 + ⅓√(C/2M) + ⅑·C/2M] − C when C < 2M, else M."""
    _positive(mtbf_s=mtbf_s, checkpoint_s=checkpoint_s)
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * mtbf_s * checkpoint_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s


def first_order_waste(interval_s: float, mtbf_s: float, checkpoint_s: float, restart_s: float = 0.0) -> float:
    """Young's waste per second of work: C/τ for saving, (τ/2 + R)/M for the work lost and the restart."""
    _positive(interval_s=interval_s, mtbf_s=mtbf_s)
    return checkpoint_s / interval_s + (interval_s / 2 + restart_s) / mtbf_s


def expected_runtime(work_s: float, interval_s: float, mtbf_s: float, checkpoint_s: float,
                     restart_s: float = 0.0) -> float:
    """Daly's complete cost function: the expected wall time of ``work_s`` of work saved every
    ``interval_s``, for
    exponential failures of mean ``mtbf_s`` that may also strike a save or a restart."""
    _positive(work_s=work_s, interval_s=interval_s, mtbf_s=mtbf_s)
    M = mtbf_s
    return M * math.exp(restart_s / M) * math.expm1((interval_s + checkpoint_s) / M) * work_s / interval_s


def expected_lost_work(interval_s: float) -> float:
    """Work lost to one failure striking uniformly within an interval: τ/2 (Young's assumption)."""
    _positive(interval_s=interval_s)
    return interval_s / 2
