r"""Chapter 03 — zero-bubble schedules in a V: ZB-V and DualPipeV, as pure functions ``(p, m) -> Schedule``.

Both give each of the ``p`` ranks two model chunks in a V (:mod:`.actions`): rank ``r`` holds virtual
stages ``r`` (chunk 0, on the way down) and ``2p-1-r`` (chunk 1, on the way back up). A microbatch's
forward runs down ranks ``0 .. p-1``, turns on rank ``p-1`` without a message, and comes back up to
rank 0, which also computes the loss; its backward retraces the V. Two things follow:

* the first and the last virtual stage are on the same rank, so the gradient can start flowing back as
  soon as a forward ends there; the ramp-up of one direction overlaps the ramp-down of the other, which
  is what lets W (the weight gradient, Qi et al. 2024 §2) fill nearly all the bubble;
* every rank holds ``1/p`` of the model in two halves (``1×`` the parameters of 1F1B on the same p
  ranks), and a microbatch crosses ``2(p-1)`` rank boundaries each way, twice 1F1B's messages.

Papers and code:

* ZB-V: Qi, Wan, Huang, Lin 2024, "Zero Bubble Pipeline Parallelism" (ICLR 2024; arXiv 2401.10241 §6,
  "memory efficient zero bubble schedule"): zero bubble when ``t_F = t_B = t_W``, with 1F1B's peak
  activation memory; also the V-ZB building block of Qi et al. 2024, "Pipeline Parallelism with
  Controllable Memory" (NeurIPS 2024), §4. The action order is PyTorch's ``ScheduleZBVZeroBubble``
  (torch/distributed/pipelining/schedules.py).
* DualPipeV: DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.2.1 (DualPipe) and Table 2, cut in
  half into a V as in deepseek-ai/DualPipe's ``DualPipeV``: in the steady state a rank runs the forward of
  one chunk and the (whole) backward of the other *as one overlapped pair* "F&B", so that one pair's
  communication (in DeepSeek-V3: the MoE all-to-all and the pipeline sends) hides under the other's
  compute. The action order is PyTorch's ``ScheduleDualPipeV``.

Here an overlapped pair is two consecutive actions, recorded in ``Schedule.overlapped``; the simulator
and the executor run them one after the other (what the overlap buys needs two kinds of work at once
on a GPU: chapter 03, "Zero-bubble in a V").
"""
from __future__ import annotations

from collections import Counter, deque

from .actions import Action, Schedule, check_sizes

__all__ = ["zb_v", "dualpipe_v", "zbv_min_microbatches", "dualpipev_min_microbatches"]


def zbv_min_microbatches(p: int) -> int:
    """ZB-V's warm-up sends ``2p-1`` microbatches down rank 0's chunk before the first backward: m >= 2p-1."""
    return 2 * p - 1


def dualpipev_min_microbatches(p: int) -> int:
    """DualPipeV needs m >= 2p (deepseek-ai/DualPipe asserts ``num_chunks >= num_ranks * 2``)."""
    return 2 * p


def _check_m(name: str, p: int, m: int, least: int) -> None:
    check_sizes(p, m)
    if m < least:
        raise ValueError(f"{name} needs at least {least} microbatches for p={p} stages (m >= "
                         f"{'2p-1' if least == 2 * p - 1 else '2p'}), got m={m}; use m={least} or more")


class _Order:
    """One rank's action list under construction: ``run(kind, chunk)`` appends that kind's next
    microbatch on that chunk (microbatches go in order, per kind and chunk)."""

    def __init__(self):
        self.acts: list[Action] = []
        self.count: Counter = Counter()
        self.pending_w: deque = deque()  # split backwards whose W has not run yet (DualPipeV)
        self.pairs: list[int] = []

    def run(self, kind: str, chunk: int) -> Action:
        a = Action(kind, self.count[kind, chunk], chunk)
        self.count[kind, chunk] += 1
        self.acts.append(a)
        return a

    def steps(self, spec: str) -> None:
        """``steps("F1 B1 W1")``: run each kind+chunk in turn."""
        for tok in spec.split():
            self.run(tok[0], int(tok[1]))

    def done(self, kind: str, chunk: int) -> int:
        return self.count[kind, chunk]

    def backward(self, chunk: int, split: bool) -> None:
        """B of ``chunk``; ``split``: the input gradient now, its W queued for later (DualPipeV)."""
        a = self.run("B", chunk)
        if split:
            self.pending_w.append(Action("W", a.mb, chunk))

    def weights(self) -> None:
        """The oldest queued W, if any."""
        if self.pending_w:
            self.acts.append(self.pending_w.popleft())

    def pair(self, f_chunk: int) -> None:
        """F of one chunk overlapped with the whole B of the other (DualPipeV's F&B)."""
        self.pairs.append(len(self.acts))
        self.run("F", f_chunk)
        self.backward(1 - f_chunk, split=False)


def _zbv_rank(p: int, m: int, r: int) -> tuple[Action, ...]:
    """Rank r's ZB-V list (chunk 0 = virtual stage r, chunk 1 = virtual stage 2p-1-r)."""
    o = _Order()
    o.steps("F0 " * (2 * (p - r) - 1))  # warm-up: fill the way down
    o.steps("F1 F0 " * r)  # the first microbatches come back up: alternate the two chunks
    o.steps("F1 B1 W1 " * (p - r))  # chunk 1's first backwards, each W right away
    while o.done("F", 0) < m or o.done("F", 1) < o.done("F", 0):  # steady state
        if o.done("F", 0) < m:
            o.run("F", 0)
        o.steps("B0 W0 F1 B1 W1")
    o.steps("B0 B1 " * r)  # cool-down: B first (the rank before waits for it), W later
    o.steps("B0 W0 " * (p - r))
    for chunk in (1, 0):  # the deferred W fill the tail
        while o.done("W", chunk) < m:
            o.run("W", chunk)
    return tuple(o.acts)


def zb_v(p: int, m: int) -> Schedule:
    r"""ZB-V (Qi et al. 2024, arXiv 2401.10241 §6), in PyTorch's ``ScheduleZBVZeroBubble`` order.

    Rank ``r`` (chunk 0 = virtual stage ``r``, chunk 1 = ``2p-1-r``; ``X.c`` is chunk c's next microbatch):

    1. warm-up: ``2(p-r)-1`` forwards ``F.0``; then ``r`` pairs ``F.1 F.0``; then ``p-r`` triples
       ``F.1 B.1 W.1``;
    2. steady state, until every forward has run: ``F.0`` (while any is left), ``B.0 W.0``, ``F.1 B.1 W.1``;
    3. cool-down: ``r`` pairs ``B.0 B.1`` (their W deferred), ``p-r`` pairs ``B.0 W.0``, then the deferred
       ``W.1`` and ``W.0``.

    Worked example, ``p=2, m=3`` (``F2.1`` = forward of microbatch 2 on chunk 1)::

        stage 0 | F0 F1 F2 F0.1 B0.1 W0.1 F1.1 B1.1 W1.1 B0 W0 F2.1 B2.1 W2.1 B1 W1 B2 W2
        stage 1 | F0 F0.1 F1 F1.1 B0.1 W0.1 F2 B0 W0 F2.1 B1.1 W1.1 B1 B2.1 B2 W1 W2.1 W2

    With ``t_F = t_B = t_W = t`` it idles only the V's start-up, ``(p-1) t/2`` per rank (rank r waits
    ``r t/2`` for its first input and ends ``(p-1-r) t/2`` before the last rank), the least any schedule on
    the V can: :func:`~minitorch_dist.costmodel.pipeline.zbv_idle_time`. Every rank
    holds at most ``2p`` chunks' activations (``p`` microbatches' worth): 1F1B's stage 0. Needs
    ``m >= 2p-1`` (:func:`zbv_min_microbatches`); PyTorch pads smaller m and drops the padding.
    """
    _check_m("ZB-V", p, m, zbv_min_microbatches(p))
    return Schedule("zbv", p, m, 2, tuple(_zbv_rank(p, m, r) for r in range(p)), layout="v")


def _dualpipev_rank(p: int, m: int, r: int) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """Rank r's DualPipeV list and the positions of its overlapped F&B pairs."""
    o = _Order()
    o.steps("F0 " * (2 * (p - r - 1)))  # 1: forwards down the V
    o.steps("F0 F1 " * (r + 1))  # 2: both chunks
    for _ in range(p - r - 1):  # 3: zero bubble: B, its W, the next F
        o.backward(1, split=True)
        o.weights()
        o.run("F", 1)
    for i in range(m - 2 * p + r + 1):  # 4: the main step, overlapped pairs
        if i == 0 and r == p - 1:  # the bottom of the V: run the first two apart (less bubble)
            o.run("F", 0)
            o.backward(1, split=False)
        else:
            o.pair(0)
        o.pair(1)
    for _ in range(p - r - 1):  # 5: B of chunk 1, then a pair
        o.backward(1, split=False)
        o.pair(1)
    zb = False
    for i in range(r + 1):  # 6: both backwards; the second half split (zero bubble)
        zb = zb or (i == (r + 1) // 2 and r % 2 == 1)
        o.backward(1, split=zb)
        zb = zb or (i == (r + 1) // 2 and r % 2 == 0)
        o.backward(0, split=zb)
    for _ in range(p - r - 1):  # 7: a queued W, then B of chunk 0
        o.weights()
        o.backward(0, split=True)
    for _ in range(r + 1):  # 8: the remaining W
        o.weights()
    return tuple(o.acts), tuple(o.pairs)


def dualpipe_v(p: int, m: int) -> Schedule:
    r"""DualPipeV (DeepSeek-V3 §3.2.1, deepseek-ai/DualPipe ``DualPipeV``), in PyTorch's
    ``ScheduleDualPipeV`` order. Rank ``r``, its chunks 0 (virtual stage ``r``) and 1 (``2p-1-r``):

    1. ``2(p-r-1)`` forwards ``F.0``; 2. ``r+1`` pairs ``F.0 F.1``;
    3. ``p-r-1`` times ``B.1 W.1 F.1`` (split backward, its W at once);
    4. ``m-2p+r+1`` times the two overlapped pairs ``F.0&B.1``, ``F.1&B.0`` (whole backwards); on the
       last rank the first ``F.0``, ``B.1`` are not overlapped;
    5. ``p-r-1`` times ``B.1``, then the pair ``F.1&B.0``;
    6. ``r+1`` times ``B.1 B.0``, split from half way (a W queued for each);
    7. ``p-r-1`` times a queued W, then a split ``B.0``; 8. the ``r+1`` queued W left.

    Most backwards are whole (B then carries the weight gradient too): ``mixed_backward``. Worked
    example, ``p=2, m=4`` (``[F3 B1.1]`` an overlapped pair)::

        stage 0 | F0 F1 F2 F0.1 B0.1 W0.1 F1.1 [F3 B1.1] [F2.1 B0] B2.1 [F3.1 B1] B3.1 B2 W2 B3 W3
        stage 1 | F0 F0.1 F1 F1.1 F2 B0.1 [F2.1 B0] [F3 B1.1] [F3.1 B1] B2.1 B2 B3.1 B3 W3.1 W3

    Each rank holds ``1/p`` of the model: ``1×`` 1F1B's parameters on the same ranks, where DualPipe
    (two copies of the pipeline, one per direction) holds ``2×``. Needs ``m >= 2p``
    (:func:`dualpipev_min_microbatches`).
    """
    _check_m("DualPipeV", p, m, dualpipev_min_microbatches(p))
    ranks = [_dualpipev_rank(p, m, r) for r in range(p)]
    return Schedule("dualpipev", p, m, 2, tuple(a for a, _ in ranks), layout="v", mixed_backward=True,
                    overlapped=tuple(pairs for _, pairs in ranks))
