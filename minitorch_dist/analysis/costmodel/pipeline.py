"""Chapter 03 — pipeline parallelism: the bubble of each schedule and the activations it stashes.

Huang et al. 2019 (GPipe); Narayanan et al. 2021 (PipeDream-2BW §3; Megatron-LM §2.2);
Qi et al. 2024 (Zero Bubble Pipeline Parallelism §3).
"""
from __future__ import annotations

# --- pipeline bubbles -----------------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1")


def zb_h1_idle_time(p, t_f, t_b, t_w) -> float:
    """Idle time per stage of the ZB-H1 schedule (Qi et al. 2024, Zero Bubble Pipeline
    Parallelism, §3.1): ``(p-1) * (t_F + t_B - t_W)``, where backward is split into B (input
    gradient) and W (weight gradient). 1F1B idles ``(p-1) * (t_F + t_B + t_W)``; with
    t_F = t_B = t_W ZB-H1 idles one third of that, in the same memory as 1F1B."""
    if p < 1:
        raise ValueError(f"pipeline stages p must be >= 1, got {p}")
    if min(t_f, t_b, t_w) < 0 or t_w > min(t_f, t_b):
        # Outside this regime a deferred W no longer fits in the slot it fills: the simulator
        # (pipeline/simulator.py) then shows more idle, e.g. (t_F, t_B, t_W) = (1, 2, 2), p = 4
        # idles 8, not 3.
        raise ValueError(f"the ZB-H1 idle formula holds for t_w <= min(t_f, t_b); got t_f={t_f}, "
                         f"t_b={t_b}, t_w={t_w}")
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




def pipeline_stashed_microbatches(schedule, p, m, stage=0, v=1) -> float:
    """Peak number of microbatches whose activations ``stage`` holds at once, in units of one
    microbatch through the stage's *whole* share of the model (a chunk counts 1/v).

    * ``"naive"``: 1 (one microbatch in flight).
    * ``"gpipe"``: ``m``; all forwards run before the first backward (Huang et al. 2019 §2.2).
    * ``"1f1b"``: ``min(p - stage, m)``; ``p - stage - 1`` warm-up forwards, then each forward is
      paired with a backward that frees one (Narayanan et al. 2021, PipeDream-2BW §3.1).
    * ``"zb-h1"``: ``min(p, m)`` on *every* stage. A microbatch is stashed until its W (weight
      gradient) has run, and stage r defers up to r W's, so every stage reaches 1F1B's stage-0
      peak: the *maximum over stages* equals 1F1B's (Qi et al. 2024 §3.1), not each stage's.
    * ``"interleaved"``: Megatron-LM runs ``w = 2(p - stage - 1) + (v-1)p`` warm-up chunk
      forwards (schedules.py of Megatron-LM, after Narayanan et al. 2021 §2.2.2), so the peak is
      ``min(w + 1, v*m)`` chunks, i.e. ``min(w + 1, v*m) / v`` microbatches: about
      ``p(1 + 1/v)`` on stage 0.
    """
    if schedule not in SCHEDULES + ("naive",):
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES + ('naive',)}")
    if p < 1 or m < 1 or v < 1 or not 0 <= stage < p:
        raise ValueError(f"need p, m, v >= 1 and 0 <= stage < p; got p={p}, m={m}, v={v}, stage={stage}")
    if schedule == "naive":
        return 1
    if schedule == "gpipe":
        return m
    if schedule == "1f1b" or (schedule == "interleaved" and v == 1):  # v = 1 *is* 1F1B
        return min(p - stage, m)
    if schedule == "zb-h1":
        return min(p, m)
    warmup = 2 * (p - stage - 1) + (v - 1) * p
    return min(warmup + 1, v * m) / v


def pipeline_p2p_bytes(p, m, activation_bytes, v=1) -> float:
    """Bytes sent point-to-point in one step by all stages together: every microbatch crosses
    each of the ``p*v - 1`` boundaries between consecutive (virtual) stages twice, its
    activation forward and the activation's gradient backward, ``activation_bytes`` (b·s·h
    elements) each. Interleaving multiplies the messages by about v (Narayanan et al. 2021
    §2.2.2: "the amount of communication also increases by v")."""
    if p < 1 or m < 1 or v < 1 or activation_bytes < 0:
        raise ValueError(f"need p, m, v >= 1 and activation_bytes >= 0; got p={p}, m={m}, v={v}")
    return 2 * m * (p * v - 1) * activation_bytes
