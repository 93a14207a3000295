# generated from solutions/ch03_pipeline.py by `make exercises`: fill in each NotImplementedError
# fingerprint f14e2fb528c4d4bb of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 03 exercises: pipeline schedules under a memory limit, the bubble of a timeline, the
zero-bubble trick, and an executor that picks its own order on ranks.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch03``.

A schedule here is plain data: one list of strings per stage, ``"F3"`` the forward of
microbatch 3, ``"B3"`` its backward, ``"W3"`` its weight-gradient backward when the backward is
split. ``minitorch_dist.parallelism.pipeline.simulator`` times such lists; the tests use it.
Exercises 6 and 7 run on ranks.

1. :func:`gpipe_rounds_schedule` (build): GPipe in rounds of at most k microbatches, so a stage
   never stashes more than k (Huang et al. 2019, "GPipe", §2.2, Fig. 2c).
2. :func:`one_f_one_b_capped` (build): 1F1B when each stage may hold at most ``cap`` microbatches
   (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
   Megatron-LM", §2.2.1, Fig. 4 top; PipeDream-2BW §3).
3. :func:`bubble_from_timeline` (measure): the idle ("bubble") fraction of a recorded or simulated
   timeline, the number GPipe's (p-1)/(m+p-1) predicts; measured on a real step too.
4. :func:`zb_h1_from_1f1b` (derive): ZB-H1 from 1F1B by splitting each backward into B (input
   gradient) and W (weight gradient) and deferring the W's (Qi et al. 2024, "Zero Bubble Pipeline
   Parallelism", §3.1, Fig. 3).
5. :func:`v_stage` (derive) and :func:`zbv_actions_any_m` (build): the V placement of two chunks
   per rank and one rank's ZB-V order, for any number of microbatches (Qi et al. 2024, arXiv
   2401.10241 §6).
6. :func:`run_stage_budgeted` (build): an executor with no schedule: each rank picks its next
   action from a memory budget, sends activations forward and gradients back, point to point
   (Huang et al. 2019 §2.2; Narayanan et al. 2021 §2.2). Its gradients must be the single
   process's and PyTorch's.
7. :func:`predict_pipeline_sends` (measure): the messages and bytes each rank sends in a step,
   predicted, then counted on ranks (Narayanan et al. 2021 §2.2.2: interleaving multiplies them).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def _check_pm(p, m) -> None:
    for name, x in (("p", p), ("m", m)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int (p pipeline stages, m microbatches), got {x!r}")


def _check_positive(name, x, what) -> None:
    if isinstance(x, bool) or not isinstance(x, int) or x < 1:
        raise ValueError(f"{name} must be a positive int ({what}), got {x!r}")


# --- 1. GPipe in rounds ---------------------------------------------------------------------------


def gpipe_rounds_schedule(p: int, m: int, k: int) -> list[list[str]]:
    """Kind: build · about 20 minutes

    GPipe for ``p`` stages and ``m`` microbatches when a stage may stash at most ``k``
    microbatches' activations: one list of actions per stage.

    GPipe (Huang et al. 2019, §2.2, Fig. 2c) runs every forward before any backward, so each
    stage holds all m microbatches at the turn. When m activations do not fit, run the step as
    consecutive GPipe *rounds*, each over the next microbatches in order, at most ``k`` of them,
    the gradients accumulating across rounds. A round starts only when the one before has
    drained, so each round pays the fill and drain again: the price of the memory saved.

    **Interface.** ``p``, ``m``, ``k`` positive ints (``k >= m`` is plain GPipe). Return
    ``[stage_0, ..., stage_{p-1}]``, each its own list (not p references to one) of strings
    ``"F<i>"`` and ``"B<i>"``, every microbatch 0..m-1 once each way. Bad arguments raise
    ``ValueError``.

    **What the tests check.** Hand-worked cases (an uneven last round included); ``k >= m`` is the
    library's GPipe; in the simulator, no deadlock, a peak stash of ``min(k, m)`` on every stage,
    and a step time equal to the sum of the rounds' GPipe times, ``(m_j + p - 1)(t_F + t_B)`` each.

    Reference: ``minitorch_dist/parallelism/pipeline/schedules.py`` (``gpipe`` is one round; the
    rounds are yours).
    """
    _check_pm(p, m)
    _check_positive("k", k, "the most microbatches a stage may stash")
    raise NotImplementedError("exercise: gpipe_rounds_schedule — see chapters/03_pipeline.md")


# --- 2. 1F1B under a cap ----------------------------------------------------------------------------


def one_f_one_b_capped(p: int, m: int, cap: int) -> list[list[str]]:
    """Kind: build · about 30 minutes

    The 1F1B (PipeDream-Flush) schedule for ``p`` stages and ``m`` microbatches when no stage may
    hold more than ``cap`` microbatches between their forward and their backward.

    1F1B (Narayanan et al. 2021, §2.2.1, Fig. 4 top) runs a few warm-up forwards, then alternates
    one forward with one backward, then drains the backwards; stage r holds at most
    ``min(p - r, m)`` microbatches, the first stage the most. Under a tighter memory budget the
    warm-ups must shrink. Keep 1F1B's shape (warm-up forwards, then forward-backward pairs, then
    the backwards left), with each stage's warm-up as long as both its place in the pipe and the
    cap allow: no shorter, or the pipe idles more than it has to.

    **Interface.** ``p``, ``m``, ``cap`` positive ints. Return the p lists of ``"F<i>"`` /
    ``"B<i>"`` strings, microbatches in order each way. Bad arguments raise ``ValueError``.

    **What the tests check.** Hand-worked cases; ``cap >= p`` is the library's 1F1B and ``cap = 1``
    its naive schedule (one microbatch in the pipe at a time); stage r's peak in flight is exactly
    ``min(p - r, cap, m)``; in the simulator, no deadlock, the same stashes, and a step no shorter
    as the cap falls.

    Reference: ``minitorch_dist/parallelism/pipeline/schedules.py`` (``one_f_one_b`` is the
    uncapped case).
    """
    _check_pm(p, m)
    _check_positive("cap", cap, "the most microbatches a stage may hold")
    raise NotImplementedError("exercise: one_f_one_b_capped — see chapters/03_pipeline.md")


# --- 3. the bubble of a timeline ----------------------------------------------------------------


def bubble_from_timeline(events, p: int) -> float:
    """Kind: measure · about 25 minutes

    The fraction of device-time the ``p`` stages spend idle during the step ``events`` span.

    ``events`` are objects with ``.rank`` (the stage, 0..p-1), ``.t_start`` and ``.t_end``
    (``minitorch_dist.runtime.timeline.Event``: what ranks record and what the simulator
    returns). The step is the window from the first event's start to the last event's end, over
    all stages. A stage is busy at an instant when any of its events covers it: recorded spans can
    overlap or nest, and an instant counts once. The bubble is the idle share of the p stages'
    device-time in that window; a stage with no events idled the whole step. Two stages, stage 0
    busy [0, 2), stage 1 busy [1, 3): the bubble is 1/3.

    **Interface.** Return a float in [0, 1]. Bad input (an event outside 0..p-1, one that ends
    before it starts, events that span no time) raises ``ValueError`` (scaffolded).

    **What the tests check.** Hand-worked and 200 seeded random timelines against
    ``runtime.timeline.bubble_fraction``; simulated GPipe and 1F1B steps against the cost model's
    ``(p-1)/(m+p-1)``; and a *real* 1F1B step on 4 ranks, recorded by a ``Timeline`` listening to
    the library's executor, against the timeline module's measurement of the same events.

    Reference: ``minitorch_dist/runtime/timeline.py`` (``bubble_fraction``, ``busy_fraction``:
    read them after yours works).
    """
    events = list(events)
    if isinstance(p, bool) or not isinstance(p, int) or p < 1:
        raise ValueError(f"p must be a positive int (the number of stages), got {p!r}")
    if not events:
        raise ValueError("no events: nothing to measure")
    for e in events:
        if not 0 <= e.rank < p:
            raise ValueError(f"event on rank {e.rank} is outside stages 0..{p - 1}; pass the right p")
        if e.t_end < e.t_start:
            raise ValueError(f"event on rank {e.rank} ends ({e.t_end}) before it starts ({e.t_start})")
    if not max(e.t_end for e in events) > min(e.t_start for e in events):
        raise ValueError("the events span no time (every one is an instant at the same time)")
    raise NotImplementedError("exercise: bubble_from_timeline — see chapters/03_pipeline.md")


# --- 4. ZB-H1 from 1F1B --------------------------------------------------------------------------


def zb_h1_from_1f1b(stages: list[list[str]]) -> list[list[str]]:
    """Kind: derive · about 30 minutes

    ZB-H1 (Qi et al. 2024, §3.1, Fig. 3): the 1F1B schedule with each backward split and the
    weight-gradient halves deferred as far as 1F1B's memory allows.

    A backward does two things: B, the gradient with respect to the stage's *input*, which the
    stage before is waiting for, and W, the gradient with respect to the stage's *weights*, which
    nobody needs until the optimizer step. A microbatch's activations stay stashed until its W has
    run. Assume:

    - every stage keeps its 1F1B order of F's and B's;
    - each stage defers its W's by a fixed lag of its own, d microbatches: W i runs right after
      B i+d, and the W's left at the end run there, oldest first;
    - the memory the devices must have is 1F1B's peak, stage 0's p microbatches; no stage may ever
      hold more than that, whatever the number of microbatches m (so a stage's lag depends on p
      and its place in the pipe, not on m);
    - within that, each lag is as long as it can be.

    Derive from these each stage's lag, and so where its W's go. (Why it pays: the time a stage
    would have spent waiting for the stage after it is filled with W's; ``costmodel.zb_h1_idle_time``
    is the idle that results, a third of 1F1B's when t_F = t_B = t_W.)

    ``stages`` is a 1F1B schedule (one list of ``"F<i>"`` / ``"B<i>"`` strings per stage);
    p = ``len(stages)``. Return the ZB-H1 lists, ``"W<i>"`` added for every ``"B<i>"``.

    **What the tests check.** Hand-worked cases; the library's ``zb_h1``; F and B kept in order,
    each W after its B; in the simulator, no deadlock, the idle per stage of
    ``costmodel.zb_h1_idle_time`` for several durations, and 1F1B's peak stash. Then over seeded
    random inputs: 50 sizes (p, m), fewer microbatches than stages included, against the library's
    ``zb_h1`` (for m < p, which it refuses, its schedule of p microbatches with those from m on
    left out) and every stage's peak stash against ``costmodel.pipeline_stashed_microbatches``; 50
    random sizes and durations (t_W <= t_F, t_B) against ``costmodel.zb_h1_idle_time``.
    """
    if not stages:
        raise ValueError("need at least one stage list")
    for r, acts in enumerate(stages):
        bad = [a for a in acts if not (isinstance(a, str) and a[:1] in ("F", "B") and a[1:].isdigit())]
        if bad:
            raise ValueError(f"stage {r}: expected 1F1B actions like 'F3' and 'B3' (no W yet), got {bad[:3]}")
    raise NotImplementedError("exercise: zb_h1_from_1f1b — see chapters/03_pipeline.md")


# --- 5. ZB-V: the V placement and one rank's order -----------------------------------------------


def v_stage(p: int, rank: int, chunk: int) -> int:
    """Kind: derive · about 10 minutes

    The virtual stage that ``chunk`` (0 or 1) of ``rank`` holds when ``p`` ranks hold a
    ``2p``-stage model, two stages (its chunks) per rank, placed in a V (ZB-V, Qi et al. 2024 §6;
    DualPipeV).

    Assume:

    - virtual stage 0 (the embedding) is chunk 0 of rank 0;
    - a microbatch's forward runs through the chunks 0 of all p ranks before it reaches any chunk 1;
    - consecutive stages sit on the same rank or on neighbouring ranks (a hand-over is at most
      one hop);
    - the last stage (the loss) sits on the same rank as the first, so the tied embedding's two
      uses share a device.

    Megatron's interleaving keeps the first two assumptions and loops instead: its rank p-1 hands
    its output to rank 0, p-1 hops away. Derive where the V puts each chunk.

    Return the virtual stage, an int in ``0 .. 2p-1``. Bad arguments raise ``ValueError``
    (scaffolded).

    **What the tests check.** Hand-worked cases; the library's V placement (the ZB-V schedule's
    ``virtual_stage``) for several p and for 50 seeded random (p, rank, chunk) with p up to 24, and
    its inverse (``placement``) for 50 random stages; every stage held once; the hand-overs.
    """
    _check_pm(p, 1)
    if not (isinstance(rank, int) and 0 <= rank < p and chunk in (0, 1)):
        raise ValueError(f"need 0 <= rank < p={p} and chunk 0 or 1, got rank={rank!r}, chunk={chunk!r}")
    raise NotImplementedError("exercise: v_stage — see chapters/03_pipeline.md")


def zbv_actions_any_m(p: int, m: int, rank: int) -> list[str]:  # noqa: C901 - the phases, as listed above
    """Kind: build · about 90 minutes

    Rank ``rank``'s ZB-V action list for ``p`` ranks and *any* number ``m >= 1`` of microbatches (Qi et
    al. 2024, arXiv 2401.10241 §6), as strings: ``"F3"`` the forward of microbatch 3 on chunk 0,
    ``"F3.1"`` on chunk 1; ``"B3"``, ``"W3.1"`` likewise (B the input gradient, W the weight gradient:
    every backward is split). Chunks are placed in a V (:func:`v_stage`).

    ZB-V's promise: with t_F = t_B = t_W = t, every rank idles only the V's start-up, ``(p-1)t/2``,
    while holding no more activations than 1F1B's first stage, p microbatches. The order has three
    phases per rank: a warm-up that fills the V down and back up, a steady state that keeps both
    chunks busy one F, B and W at a time, and a cool-down that runs the B's the rank before waits
    for first and defers W's to fill the drain. For p = 2, m = 3::

        rank 0 | F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 F2.1 B2.1 W2.1 B1 W1 B2 W2
        rank 1 | F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 B1 B2.1 B2 W1 W2.1 W2

    The published order (and the library's, and PyTorch's) needs ``m >= 2p - 1``: rank 0's warm-up
    alone runs 2p-1 forwards. Yours must also work for fewer microbatches, a short step or a
    debugging run, with the same shape: where the pipe runs dry, leave out what cannot run.

    **Interface.** Return the list of strings, each (kind, chunk) taking its microbatches in order
    0, 1, 2, ..., every one of the m microbatches once per kind and chunk.

    **What the tests check.** For ``m >= 2p - 1``: PyTorch's ``ScheduleZBVZeroBubble`` order, rank by
    rank, at ten sizes; in the simulator, no deadlock, idle exactly ``(p-1)t/2`` per rank, the cost
    model's bubble, and a peak stash of p on every rank. For every ``m < 2p - 1`` with p <= 5: all
    ranks' lists are a complete, deadlock-free schedule that holds at most ``min(p, m)`` microbatches
    on a rank and takes no longer than the step with ``m = 2p - 1``.

    Reference: ``minitorch_dist/parallelism/pipeline/v_schedules.py`` (``zb_v``: the published order,
    which refuses ``m < 2p - 1``).
    """
    _check_pm(p, m)
    if not (isinstance(rank, int) and 0 <= rank < p):
        raise ValueError(f"rank must be in 0..{p - 1}, got {rank!r}")
    raise NotImplementedError("exercise: zbv_actions_any_m — see chapters/03_pipeline.md")


# --- 6. the executor: a rank that picks its own order ------------------------------------------------


def run_stage_budgeted(stage, inputs, targets, boundary_shape, budget: int) -> list[float]:
    """Kind: build · about 75 minutes

    One rank's step of a pipeline with no schedule handed in: the rank picks its own next action
    from a memory budget, sends activations forward and their gradients back, point to point.
    Every rank of ``launch(fn, p)`` calls it; rank r holds stage r of p (p = the world size).

    **The order.** A rank holds a microbatch from its forward until its backward. Rank r may hold
    at most ``min(p - r, budget)``: 1F1B's bound (Narayanan et al. 2021 §2.2.1), tightened by the
    budget. It runs the next forward whenever it has one left and holds fewer than that, otherwise
    the backward of the oldest microbatch it holds. With ``budget >= p`` this is 1F1B; with
    ``budget = 1``, one microbatch in the pipe at a time. Every rank derives its order alone, with
    no message about it, and the neighbours' orders still fit (think about why).

    **Interface.**

    - ``stage``: this rank's module. On rank 0 it takes token ids, ``stage(inputs[i])``; on the last
      rank it takes the hidden states and the targets and returns the microbatch's mean loss,
      ``stage(h, targets[i])``; in between, ``stage(h)`` returns hidden states.
    - ``inputs`` / ``targets``: the m microbatches' token ids and targets (every rank gets them;
      rank 0 reads the inputs, the last rank the targets); m = ``len(inputs)``.
    - ``boundary_shape``: the shape of the hidden states one stage passes to the next, in torch's
      default dtype (``torch.empty(boundary_shape)``): every message's shape.
    - ``budget``: a positive int, the most microbatches any rank may hold.

    Return the unscaled microbatch losses in microbatch order on the last rank, ``[]`` on the
    others. The weight gradients accumulate in the stage's parameters' ``.grad`` and must add up to
    the gradient of the whole batch's mean loss. Send with ``comm.isend`` and receive with
    ``comm.recv`` (the metered wrappers). A finished microbatch must not stay alive.

    **What the tests check**, on 2 and 4 ranks in float64, at budgets 1, 2 and >= p: every gradient
    equals one process's on the whole batch and PyTorch's ``Schedule1F1B``; the losses; the order
    each rank ran its forwards and backwards; only point-to-point sends, m activations forward
    (unless last) and m gradients back (unless first); at each forward, the microbatches the rank
    still holds, none whose backward has run; bad input refused.

    Reference: ``minitorch_dist/parallelism/pipeline/executor.py`` (``run_schedule`` runs a given
    schedule; yours makes its own).
    """
    inputs, targets = list(inputs), list(targets)
    if not inputs or len(inputs) != len(targets):
        raise ValueError(f"need one target per input microbatch, got {len(inputs)} inputs and "
                         f"{len(targets)} targets")
    _check_positive("budget", budget, "the most microbatches a rank may hold; 1 runs one at a time")
    if not dist.is_initialized():
        raise RuntimeError("run_stage_budgeted runs on ranks: call it inside launch(fn, p)")
    m = len(inputs)
    rank, p = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == p - 1
    raise NotImplementedError("exercise: run_stage_budgeted — see chapters/03_pipeline.md")


# --- 7. the messages of a step, predicted and counted --------------------------------------------


def predict_pipeline_sends(p: int, m: int, activation_bytes: int, v: int = 1) -> dict:
    """Kind: measure · about 30 minutes

    Predict the point-to-point messages, and their bytes, that *each rank* sends in one step of a
    pipeline of ``p`` ranks and ``m`` microbatches; the tests then count them on ranks. Each rank
    holds ``v`` chunks in Megatron's loop: chunk c of rank r is virtual stage ``c·p + r`` of
    ``p·v``, and v = 1 is GPipe or 1F1B (Narayanan et al. 2021 §2.2.2).

    Assume consecutive virtual stages exchange one activation per microbatch forward and its
    gradient backward, ``activation_bytes`` each (b·s·h elements), and that a tensor handed between
    two virtual stages on the same rank is handed over in memory, not sent.

    **Interface.** Return ``{"messages": [per rank], "bytes": [per rank]}`` for one step (whatever
    the schedule's order: GPipe, 1F1B and ZB-H1 send the same messages). Bad arguments raise
    ``ValueError`` (scaffolded).

    **What the tests check.** The per-rank split adds up to the cost model's total at several
    sizes; then, exactly (counted, no tolerance), what ``comm.meter()`` counts on every rank of a
    real 1F1B step and a real interleaved step (v = 2) of the library's executor on 4 ranks.

    Reference: ``minitorch_dist/costmodel/pipeline.py`` (``pipeline_p2p_bytes`` gives the
    total of all ranks; you split it by rank).
    """
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if not activation_bytes >= 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    raise NotImplementedError("exercise: predict_pipeline_sends — see chapters/03_pipeline.md")
