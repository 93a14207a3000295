"""Chapter 03 — pipeline parallelism: the bubble of each schedule and the activations it stashes.

Huang et al. 2019 (GPipe); Narayanan et al. 2021 (PipeDream-2BW §3; Megatron-LM §2.2);
Qi et al. 2024 (Zero Bubble Pipeline Parallelism §3, and §6 for ZB-V); DeepSeek-AI 2024 (DeepSeek-V3
Technical Report §3.2.1, Table 2: DualPipe) and deepseek-ai/DualPipe (DualPipeV).
"""
from __future__ import annotations

# --- pipeline bubbles -----------------------------------------------------------------------

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
V_SCHEDULES = ("zbv", "dualpipev")  # two chunks per rank, placed in a V: rank r holds stages r and 2p-1-r


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
    if schedule in V_SCHEDULES:
        _check_v(schedule, p, m, v)
    elif v != 1 and schedule != "interleaved":
        raise ValueError(f"v={v} model chunks per stage only applies to schedule 'interleaved'")
    if schedule == "zb-h1":  # assume t_F = t_B = t_W = 1/3: idle (p-1)/3 of a full F+B+W
        return zb_h1_idle_time(p, 1, 1, 1) / 3, m
    if schedule == "zbv":
        return zbv_idle_time(p, 1, 1, 1) / 3, m
    if schedule == "dualpipev":
        return dualpipev_idle_time(p, 1, 1, 1) / 3, m
    return (p - 1) / v, m


def pipeline_bubble_fraction(schedule, p, m, v=1) -> float:
    """Bubble as a fraction of the *total* step time: ``idle / (ideal + idle)``.

    * ``"gpipe"`` (Huang et al. 2019) and ``"1f1b"`` (PipeDream-Flush, Narayanan et al. 2021
      §2.2.1): ``(p-1) / (m + p-1)``; the same bubble, 1F1B only stores fewer activations.
    * ``"interleaved"`` (v model chunks per device, Narayanan et al. 2021 §2.2.2):
      ``(p-1) / (v*m + p-1)``.
    * ``"zb-h1"`` (Qi et al. 2024 §3.1), *assuming t_F = t_B = t_W*: idle (p-1)*t vs 1F1B's
      3*(p-1)*t, so ``(p-1) / (3m + p-1)``. Use :func:`zb_h1_idle_time` for other ratios.
    * ``"zbv"`` (Qi et al. 2024 §6), t_F = t_B = t_W: idle (p-1)*t/2, so ``(p-1) / (6m + p-1)``
      (:func:`zbv_idle_time`).
    * ``"dualpipev"`` (DeepSeek-V3 Table 2, its F&B run back to back), t_F = t_B = t_W: idle
      (p-1)*t, ZB-H1's: ``(p-1) / (3m + p-1)`` (:func:`dualpipev_idle_time`).

    For the paper's form, bubble over ideal time, see :func:`pipeline_bubble_ratio`.
    """
    idle, ideal = _bubble_parts(schedule, p, m, v)
    return idle / (ideal + idle)


def pipeline_bubble_ratio(schedule, p, m, v=1) -> float:
    """Bubble time over ideal (bubble-free) time: Narayanan et al. 2021's "bubble time fraction".

    gpipe / 1f1b: ``(p-1)/m`` (§2.2.1); interleaved: ``(p-1)/(v*m)`` (§2.2.2);
    zb-h1 and dualpipev (t_F = t_B = t_W): ``(p-1)/(3m)``; zbv: ``(p-1)/(6m)``.
    Can exceed 1; ``pipeline_bubble_fraction`` cannot.
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
    * ``"zbv"``: ``p`` on every stage, ``2p`` half-size chunks: 1F1B's peak (its stage 0), "the same
      activation memory as 1F1B" (Qi et al. 2024 §6), and now on every rank alike.
    * ``"dualpipev"``: ``p + 1/2`` on every stage, ``2p + 1`` chunks: DeepSeek-V3 Table 2's "PP+1"
      activations per device, with PP = 2p stages of one chunk each.
    """
    if schedule not in SCHEDULES + ("naive",):
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {SCHEDULES + ('naive',)}")
    if p < 1 or m < 1 or v < 1 or not 0 <= stage < p:
        raise ValueError(f"need p, m, v >= 1 and 0 <= stage < p; got p={p}, m={m}, v={v}, stage={stage}")
    if schedule in V_SCHEDULES:
        _check_v(schedule, p, m, v)
        return p if schedule == "zbv" else p + 0.5
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


# --- zero bubble in a V: ZB-V and DualPipeV ---------------------------------------------------------

def v_min_microbatches(schedule, p) -> int:
    """Fewest microbatches a V schedule runs on ``p`` ranks: ZB-V ``2p-1`` (rank 0's warm-up fills the
    V, PyTorch's ``ScheduleZBVZeroBubble``), DualPipeV ``2p`` (deepseek-ai/DualPipe asserts
    ``num_chunks >= num_ranks * 2``)."""
    if schedule not in V_SCHEDULES:
        raise ValueError(f"{schedule!r} is not a V schedule; expected one of {V_SCHEDULES}")
    return 2 * p - 1 if schedule == "zbv" else 2 * p


def _check_v(schedule, p, m, v=2) -> None:
    if v not in (1, 2):
        raise ValueError(f"{schedule!r} places exactly 2 chunks per rank in a V; got v={v}, leave v out")
    least = v_min_microbatches(schedule, p)
    if m < least:
        raise ValueError(f"{schedule} needs m >= {least} microbatches for p={p}, got m={m}; "
                         f"use m={least} or more")


def v_shape_min_idle(p, t_f) -> float:
    """The least idle time per rank of *any* schedule on the V placement: ``(p-1) * t_F / 2``.

    Rank ``p-1`` holds virtual stages ``p-1`` and ``p`` (Qi et al. 2024 §6); the first microbatch's
    forward must cross ``p-1`` chunks of half a rank's share (``t_F/2`` each) before it has anything to
    do, and every rank has the same work, so every rank idles at least that long. (On one chunk per
    rank the same argument gives ``(p-1) t_F``: the V halves the start-up by halving the chunks.)"""
    if p < 1 or t_f < 0:
        raise ValueError(f"need p >= 1 and t_f >= 0; got p={p}, t_f={t_f}")
    return (p - 1) * t_f / 2


def zbv_idle_time(p, t_f, t_b, t_w) -> float:
    """Idle time per rank of ZB-V (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", arXiv 2401.10241
    §6), independent of m: ``(p-1) * max(t_B, 2(t_B - t_W)) / 2``, for ``t_F <= t_B`` and ``t_W <= t_B``.

    With ``t_F = t_B = t_W = t`` it is ``(p-1) t / 2``, :func:`v_shape_min_idle`: only the start-up that
    no schedule avoids, the paper's "zero bubble" (its bubble rate 0 at ``T_F = T_B = T_W``), against
    ZB-H1's ``(p-1) t`` and 1F1B's ``3 (p-1) t``. Away from equal times the paper gives no closed form;
    this one is read off the schedule's replay (``pipeline/simulator.py``: each of the ``p-1`` hops of
    the V costs half a B, or ``t_B - t_W`` twice when W is too short to fill the gaps), and the tests
    check it there. Times are per microbatch for a rank's whole share (a chunk takes half)."""
    if p < 1 or min(t_f, t_b, t_w) < 0 or t_f > t_b or t_w > t_b:
        raise ValueError(f"the ZB-V idle formula holds for t_f <= t_b and t_w <= t_b; got t_f={t_f}, "
                         f"t_b={t_b}, t_w={t_w} (pipeline/simulator.py replays any times)")
    return (p - 1) * max(t_b, 2 * (t_b - t_w)) / 2


def dualpipe_idle_time(pp, f_and_b, b, w) -> float:
    """DualPipe's bubble, DeepSeek-V3 Technical Report Table 2: ``(PP/2 - 1)(F&B + B - 3W)``.

    ``PP``: pipeline stages (even); ``F&B``: time of a forward chunk and a backward chunk run as one
    mutually overlapped pair; ``B``: a *full* backward chunk (input and weight gradients); ``W``: a
    weight-gradient chunk. The same table: 1F1B ``(PP-1)(F+B)``, ZB1P ``(PP-1)(F+B-2W)``. For
    DualPipeV (deepseek-ai/DualPipe) the same formula holds with PP stages on PP/2 devices:
    :func:`dualpipev_idle_time`."""
    if pp < 2 or pp % 2:
        raise ValueError(f"DualPipe needs an even number of stages PP >= 2, got PP={pp}")
    return (pp / 2 - 1) * (f_and_b + b - 3 * w)


def dualpipev_idle_time(p, t_f, t_b, t_w) -> float:
    """DualPipeV's idle time per rank on ``p`` ranks: :func:`dualpipe_idle_time` with ``PP = 2p`` chunks
    of half a rank's share: ``F = t_F/2``, full ``B = (t_B + t_W)/2``, ``W = t_W/2`` and the pair run back
    to back, ``F&B = F + B`` (no communication to hide): ``(p-1)(t_F + 2 t_B - t_W) / 2``.

    With ``t_F = t_B = t_W = t``: ``(p-1) t``, ZB-H1's and twice ZB-V's: on one device an overlapped
    pair still computes one chunk after the other; what DualPipe buys is a pair shorter than F + B
    because the other chunk's communication (the MoE all-to-all) hides under it. The simulator, which
    starts a pair when both its inputs are there, gives exactly this when ``t_F = t_B >= t_W``."""
    if p < 1 or min(t_f, t_b, t_w) < 0:
        raise ValueError(f"need p >= 1 and times >= 0; got p={p}, t_f={t_f}, t_b={t_b}, t_w={t_w}")
    f, b_full, w = t_f / 2, (t_b + t_w) / 2, t_w / 2
    return dualpipe_idle_time(2 * p, f + b_full, b_full, w)


def pipeline_parameter_copies(schedule) -> int:
    """Parameters a rank holds, in units of 1F1B's ``1/p`` of the model on the same ``p`` ranks.

    DeepSeek-V3 Table 2: 1F1B and ZB1P ``1×``, DualPipe ``2×`` (two copies of the pipeline, one per
    direction, so each rank keeps two stages' weights *and* their gradients and optimizer states).
    DualPipeV cuts DualPipe in half: rank r keeps virtual stages r and 2p-1-r of a 2p-stage model,
    ``2 × 1/(2p) = 1/p`` of it: ``1×`` (the DualPipe README's "2×" counts in stages of ``1/(2p)``).
    ZB-V and interleaved likewise hold their chunks once: ``1×``."""
    if schedule == "dualpipe":
        return 2
    if schedule not in SCHEDULES + ("naive",):
        raise ValueError(f"unknown schedule {schedule!r}; expected one of "
                         f"{SCHEDULES + ('naive', 'dualpipe')}")
    return 1


def v_pipeline_p2p_bytes(p, m, activation_bytes) -> float:
    """Bytes sent point to point in one step of a V schedule (ZB-V, DualPipeV), all ranks together.

    A microbatch crosses ``2p - 1`` boundaries between the ``2p`` virtual stages each way, but the turn
    of the V (stage ``p-1`` to ``p``) stays on rank ``p-1``: ``2(p-1)`` messages each way,
    ``activation_bytes`` each. ``4 m (p-1)`` messages in all, twice 1F1B's :func:`pipeline_p2p_bytes`
    (the ZB-V authors list its "pipeline communication volume" as 2× 1F1B's, in
    sail-sg/zero-bubble-pipeline-parallelism)."""
    if p < 1 or m < 1 or activation_bytes < 0:
        raise ValueError(f"need p, m >= 1 and activation_bytes >= 0; got p={p}, m={m}")
    return 4 * m * (p - 1) * activation_bytes
