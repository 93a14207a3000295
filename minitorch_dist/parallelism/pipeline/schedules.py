"""Chapter 03 — pipeline schedules as pure functions: ``(p, m[, v]) -> Schedule``, one action list per
stage.

A schedule says, for each of the ``p`` pipeline stages (ranks), in which order it runs the
forward (F) and backward (B) passes of the ``m`` microbatches of one training step. Zero-bubble
schedules split the backward into B, the gradient with respect to the stage's *input* (which the
previous stage is waiting for), and W, the gradient with respect to the stage's *weights* (which
nobody waits for). With interleaving each rank holds ``v`` model chunks; chunk ``c`` on rank
``r`` is virtual stage ``c*p + r`` of the ``p*v``-stage model; the V schedules (ZB-V, DualPipeV, in
:mod:`.v_schedules`) place rank ``r``'s two chunks at ``r`` and ``2p-1-r`` instead (:mod:`.actions`).

Papers:
* naive model parallelism: one microbatch in flight, every other stage idle.
* GPipe, all-forward-all-backward: Huang et al. 2019, "GPipe", §2.2 and Fig. 2.
* 1F1B (PipeDream-Flush): Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training" (PipeDream-2BW), §3; Narayanan et al. 2021, "Efficient Large-Scale Language Model
  Training on GPU Clusters Using Megatron-LM", §2.2.1, Fig. 4 (top).
* interleaved 1F1B: Narayanan et al. 2021 (Megatron-LM), §2.2.2, Fig. 4 (bottom).
* ZB-H1: Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1, Fig. 3.
* ZB-V: ibid. (arXiv 2401.10241) §6; DualPipeV: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report",
  §3.2.1, cut in half as in deepseek-ai/DualPipe (:mod:`.v_schedules`).

The schedules know nothing about time or tensors: :mod:`.simulator` times them and
:mod:`.executor` runs them on ranks.
"""
from __future__ import annotations

from .actions import KINDS, Action, Schedule, check_sizes
from .v_schedules import dualpipe_v, zb_v

__all__ = ["KINDS", "Action", "Schedule", "SCHEDULES", "naive", "gpipe", "one_f_one_b", "interleaved_1f1b",
           "zb_h1", "zb_v", "dualpipe_v", "make_schedule", "validate_structure"]

_check = check_sizes


def naive(p: int, m: int = 1) -> Schedule:
    """Naive model parallelism: each microbatch goes all the way forward and back before the
    next starts, so exactly one stage is busy at any time (bubble ``(p-1)/p``)."""
    _check(p, m)
    acts = tuple(a for i in range(m) for a in (Action("F", i), Action("B", i)))
    return Schedule("naive", p, m, 1, (acts,) * p)


def gpipe(p: int, m: int) -> Schedule:
    """GPipe: every stage runs all m forwards, then all m backwards (Huang et al. 2019, Fig. 2c).

    The bubble is ``(p-1)/(m+p-1)`` of the step, but each stage stashes the activations of all
    ``m`` microbatches at the turn from forward to backward."""
    _check(p, m)
    acts = tuple([Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)])
    return Schedule("gpipe", p, m, 1, (acts,) * p)


def one_f_one_b(p: int, m: int) -> Schedule:
    """1F1B / PipeDream-Flush (Narayanan et al. 2021, §2.2.1): stage r runs ``p-r-1`` warm-up
    forwards, then alternates one forward with one backward, then drains the backwards.

    Same bubble as GPipe, ``(p-1)/(m+p-1)``, but stage r never holds more than ``p-r``
    microbatches' activations: a backward frees one as soon as the steady state begins."""
    _check(p, m)
    stages = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):  # steady state: F of microbatch warmup+i, then B of i
            acts += [Action("F", warmup + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warmup, m)]
        stages.append(tuple(acts))
    return Schedule("1f1b", p, m, 1, tuple(stages))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    r"""Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM §2.2.2, Fig. 4 bottom).

    Each rank holds ``v`` model chunks (chunk ``c`` on rank ``r`` is virtual stage ``c*p + r``),
    so a microbatch visits every rank ``v`` times and each visit costs ``1/v`` of a stage. The
    bubble shrinks by ``v``: ``(p-1)/(v m)`` of the ideal time instead of ``(p-1)/m``, for ``v``
    times the point-to-point messages. The order is Megatron-LM's
    ``forward_backward_pipelining_with_interleaving`` (megatron/core/pipeline_parallel/schedules.py):

    * the ``k``-th forward on a rank (``k = 0 .. v m - 1``) runs microbatches in groups of ``p``
      per chunk: chunk :math:`c_F(k) = \lfloor k/p \rfloor \bmod v` of microbatch
      :math:`\mu(k) = \lfloor k/(p v) \rfloor p + k \bmod p`;
    * the ``k``-th backward runs the same microbatch on the mirrored chunk,
      :math:`c_B(k) = v - 1 - c_F(k)` (gradients enter at the last chunk);
    * rank ``r`` runs :math:`w_r = \min(2(p-r-1) + (v-1)p,\; v m)` warm-up forwards, then
      ``v m - w_r`` pairs (forward ``w_r + i``, backward ``i``), then the ``w_r`` remaining
      backwards (cool-down).

    Worked example, ``p=2, m=4, v=2`` (``F2.1`` = forward of microbatch 2 on chunk 1);
    rank 0 warms up with ``w_0 = 2*1 + 1*2 = 4`` forwards, rank 1 with ``w_1 = 2``::

        stage 0 | F0 F1 F0.1 F1.1 F2 B0.1 F3 B1.1 F2.1 B0 F3.1 B1 B2.1 B3.1 B2 B3
        stage 1 | F0 F1 F0.1 B0.1 F1.1 B1.1 F2 B0 F3 B1 F2.1 B2.1 F3.1 B3.1 B2 B3

    Megatron needs ``m`` divisible by ``p`` (a group of ``p`` microbatches walks through all
    chunks before the next group starts), so this does too. Older Megatron releases also made
    every forward a warm-up one when ``m == p``; the rule above (current Megatron-core) caps
    ``w_r`` at ``v m`` instead. With ``v = 1`` Megatron runs the plain 1F1B schedule (warm-up
    ``p - r - 1``, not ``2(p-r-1)``), and so does this function, for any ``m``.
    """
    _check(p, m, v)
    if v == 1:
        return Schedule("interleaved", p, m, 1, one_f_one_b(p, m).stages)
    if m % p:
        fix = -(-m // p) * p
        raise ValueError(f"interleaved 1F1B needs m divisible by p (and m >= p): m={m}, p={p}; use m={fix}")
    total = v * m

    def forward(k: int) -> Action:
        return Action("F", (k // (p * v)) * p + k % p, (k // p) % v)

    def backward(k: int) -> Action:
        return Action("B", (k // (p * v)) * p + k % p, v - 1 - (k // p) % v)

    stages = []
    for r in range(p):
        warmup = min(2 * (p - r - 1) + (v - 1) * p, total)
        acts = [forward(k) for k in range(warmup)]
        for i in range(total - warmup):  # steady state: one forward, one backward
            acts += [forward(warmup + i), backward(i)]
        acts += [backward(k) for k in range(total - warmup, total)]
        stages.append(tuple(acts))
    return Schedule("interleaved", p, m, v, tuple(stages))


def zb_h1(p: int, m: int) -> Schedule:
    r"""ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3.1, Fig. 3 top).

    The backward is split into B (gradient of the stage's input: the previous stage waits for
    it) and W (gradient of the stage's weights: nobody waits for it). Stage ``r`` keeps 1F1B's
    ``p-r-1`` warm-up forwards and its F/B alternation, but defers its W passes by ``r``
    microbatches, so that B reaches the first stage sooner and the deferred W fill the tail:

    * warm-up: :math:`F_0 \dots F_{p-r-2}`;
    * steady state, ``i = 0 .. m-p+r``: :math:`F_{p-r-1+i}, B_i`, then :math:`W_{i-r}` if
      :math:`i \ge r`;
    * cool-down: each remaining :math:`B_i` followed by the oldest pending W, then the last
      ``r`` W passes.

    Every stage then holds ``p`` microbatches in flight (F started, W not finished), 1F1B's
    worst stage: the paper's "maximum peak memory over all workers doesn't exceed that of
    1F1B". The idle time per stage is :math:`(p-1)(t_F + t_B - t_W)` against 1F1B's
    :math:`(p-1)(t_F + t_B + t_W)`, exactly so in the regime :math:`t_W \le \min(t_F, t_B)`.

    Worked example, ``p=4, m=8`` (the paper's Fig. 3, microbatches counted from 0)::

        stage 0 | F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
        stage 1 | F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
        stage 2 | F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
        stage 3 | F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7

    Needs ``m >= p``: with fewer microbatches the last stages have nothing to defer and the
    bubble formula no longer holds.
    """
    _check(p, m)
    if m < p:
        raise ValueError("ZB-H1 needs at least as many microbatches as stages: "
                         f"m={m} < p={p}; use m={p} or more")
    stages = []
    for r in range(p):
        warmup = p - r - 1
        acts = [Action("F", i) for i in range(warmup)]
        w_next = 0  # oldest microbatch whose W is still pending
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
            if i >= r:  # W deferred by r microbatches on stage r
                acts.append(Action("W", w_next))
                w_next += 1
        for i in range(m - warmup, m):  # cool-down: B as soon as it arrives, W in its shadow
            acts += [Action("B", i), Action("W", w_next)]
            w_next += 1
        acts += [Action("W", j) for j in range(w_next, m)]  # the W that fill the tail bubble
        stages.append(tuple(acts))
    return Schedule("zb-h1", p, m, 1, tuple(stages))


SCHEDULES = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "zb-h1": zb_h1,
    "zbv": zb_v,
    "dualpipev": dualpipe_v,
}
V_SHAPED = ("zbv", "dualpipev")  # two chunks per rank, placed in a V (:mod:`.v_schedules`)


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The schedule called ``name`` (a key of :data:`SCHEDULES`) for ``p`` stages and ``m``
    microbatches; ``v`` model chunks per rank applies to ``"interleaved"`` only. The V schedules
    (``"zbv"``, ``"dualpipev"``) always hold 2 chunks per rank: leave ``v`` out (or pass 2)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    if name in V_SHAPED:
        if v not in (1, 2):
            raise ValueError(f"{name!r} places exactly 2 chunks per rank in a V; got v={v}, leave v out")
        return SCHEDULES[name](p, m)
    if v != 1:
        raise ValueError(f"v={v} model chunks per rank only applies to 'interleaved'; use v=1 for {name!r}")
    return SCHEDULES[name](p, m)


def validate_structure(schedule: Schedule) -> None:
    """Raise ``ValueError`` unless every rank runs, for each microbatch and each of its chunks,
    exactly one F, one B, and one W iff the schedule splits the backward, in the order F, B, W
    (with ``mixed_backward``, at most one W: a B without one is a whole backward).

    This checks each rank's list alone; whether the ranks together can run without deadlock is
    the simulator's ``check_dependencies``."""
    p, m, v, split = schedule.p, schedule.m, schedule.v, schedule.splits_backward
    if len(schedule.stages) != p:
        raise ValueError(f"{schedule.name}: {len(schedule.stages)} action lists for p={p} stages")
    kinds = KINDS if split else KINDS[:2]
    for r, acts in enumerate(schedule.stages):
        seen: dict[tuple[str, int, int], int] = {}
        for pos, a in enumerate(acts):
            if a.kind not in kinds:
                raise ValueError(f"{schedule.name} stage {r} step {pos}: "
                                 f"unknown kind in {a} (expected {kinds})")
            if not (0 <= a.mb < m and 0 <= a.chunk < v):
                raise ValueError(f"{schedule.name} stage {r} step {pos}: "
                                 f"{a} outside m={m} microbatches, v={v} chunks")
            if (a.kind, a.mb, a.chunk) in seen:
                raise ValueError(f"{schedule.name} stage {r}: {a} runs twice (steps "
                                 f"{seen[a.kind, a.mb, a.chunk]} and {pos})")
            seen[a.kind, a.mb, a.chunk] = pos
            before = kinds[kinds.index(a.kind) - 1] if a.kind != "F" else None
            if before and (before, a.mb, a.chunk) not in seen:
                raise ValueError(f"{schedule.name} stage {r} step {pos}: {a} runs before "
                                 f"{Action(before, a.mb, a.chunk)}")
        needed = KINDS[:2] if schedule.mixed_backward else kinds
        missing = [str(Action(k, i, c)) for k in needed for i in range(m) for c in range(v)
                   if (k, i, c) not in seen]
        if missing:
            raise ValueError(f"{schedule.name} stage {r} never runs {', '.join(missing[:6])}"
                             + (" ..." if len(missing) > 6 else ""))
