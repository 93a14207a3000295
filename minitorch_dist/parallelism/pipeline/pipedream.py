"""Chapter 03 — weight versions in flight under asynchronous pipelining: PipeDream and PipeDream-2BW.

Without a flush at the end of every step, 1F1B never drains: stage r keeps running one forward
and one backward, and the optimizer updates the weights while other microbatches are still in
the pipeline. A microbatch's backward must then use the *same* weights its forward used, or its
gradient is wrong. Keeping those old versions is *weight stashing*.

* PipeDream (Narayanan, Harlap et al. 2019, SOSP, §3.3 "weight stashing"): every minibatch (here:
  every microbatch) updates the weights as soon as its backward is done on a stage. Stage r
  (0-indexed) of p runs ``w_r = p - r - 1`` forwards ahead of its backwards, so when microbatch
  j's forward runs, ``j - w_r`` updates have been applied; the ``w_r + 1 = p - r`` microbatches in
  flight each hold a different version. Stage r stashes up to ``p - r`` versions, and its update
  is  ``W(t+1) = W(t) - lr * grad f(W(t - p + r + 1))``: a staleness of ``p - r - 1`` updates
  that differs from stage to stage (the paper's "vertical sync" would make it uniform).
* PipeDream-2BW (Narayanan et al. 2021, ICML, §3.1 "double-buffered weight updates"): the weights
  change once per batch of ``m >= p`` microbatches (gradients are accumulated over the batch). A
  new version is used by the first batch that *enters* the pipeline after it exists, on every
  stage alike. With ``m >= p`` batch b's first microbatch enters before version b exists but
  after version b-1 does, so batch b computes its gradient at ``W(b-1)`` while ``W(b)`` is
  current: ``W(t+1) = W(t) - lr * grad f(W(t-1))``, a delay of exactly one step, and each stage
  holds at most 2 versions (the one in use, the one being built) -- ``2|W|/p`` weight memory
  per stage instead of PipeDream's ``(p - r)|W|/p``. (A single stage, p = 1, has nothing in
  flight: its next batch already sees the newest weights, i.e. plain synchronous SGD.)

:func:`weight_versions` replays the asynchronous 1F1B order of :func:`~.schedules.one_f_one_b`
over ``steps * m`` microbatches (no flush) stage by stage, records the version every forward and
backward used, asserts they agree (stashing), and reports the versions held and the staleness.
Version ``u`` means "the weights after u optimizer updates on that stage".
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .schedules import Schedule, one_f_one_b

POLICIES = ("pipedream", "2bw")


@dataclass
class WeightVersions:
    """Result of :func:`weight_versions`. ``[r][j]`` indexes stage r, microbatch j (0..steps*m-1)."""

    policy: str
    p: int
    m: int
    steps: int
    schedule: Schedule                 # the flush-free 1F1B order that was replayed (simulate/gantt it)
    forward_version: list[list[int]]   # version microbatch j's forward used on stage r
    backward_version: list[list[int]]  # version its backward used: the stashed one, == forward_version
    latest_at_backward: list[list[int]]  # newest version when the backward ran: what it would use unstashed
    max_versions: list[int]            # per stage: most weight versions held at once
    staleness: list[list[int]]         # updates the forward's version lags sequential SGD's

    @property
    def max_staleness(self) -> list[int]:
        """Per stage, the largest staleness any microbatch saw."""
        return [max(row) for row in self.staleness]

    @property
    def unstashed_mismatches(self) -> list[int]:
        """Per stage, how many backwards would have used different weights than their forward
        had the stage not stashed versions (why PipeDream needs stashing at all)."""
        return [sum(f != b for f, b in zip(fw, lb))
                for fw, lb in zip(self.forward_version, self.latest_at_backward)]


def _replay_stage(acts, policy: str, m: int, n: int, batch_version: list[int] | None):
    """One stage's list in order: which version each F/B uses, and the most versions held.

    Version u is held from the end of the action that created it (the optimizer step after a
    backward) until the end of its last use, and at least until u+1 replaces it. A version whose
    last use is the very backward that creates the next one is freed as the new one appears
    (the new weights overwrite its buffer)."""
    current = 0                       # newest version on this stage (= updates applied so far)
    fwd, bwd, latest = [None] * n, [None] * n, [None] * n
    stash: dict[int, int] = {}        # microbatch in flight (F run, B not yet) -> its version
    born, last_use = {0: 0}, {}       # version -> first action index it is held at / last one using it
    for k, a in enumerate(acts):
        if a.kind == "F":
            # PipeDream: newest weights; 2BW: the version fixed for the microbatch's batch.
            ver = current if policy == "pipedream" else batch_version[a.mb // m]
            if ver > current:
                raise AssertionError(f"{policy}: microbatch {a.mb} needs version {ver} before it exists")
            fwd[a.mb] = stash[a.mb] = ver
        elif a.kind == "B":
            ver = bwd[a.mb] = stash.pop(a.mb)   # weight stashing: the forward's own version
            latest[a.mb] = current
            if ver != fwd[a.mb]:
                raise AssertionError(f"{policy}: backward of microbatch {a.mb} used version {ver}, "
                                     f"its forward {fwd[a.mb]}")
        last_use[ver] = k
        if a.kind == "B" and (policy == "pipedream" or (a.mb + 1) % m == 0):
            current += 1                  # optimizer step: a new version (2BW: once per batch)
            born[current] = k + 1
    held = [0] * (len(acts) + 1)          # difference array over action indices
    for u, start in born.items():
        end = max(last_use.get(u, -1), born.get(u + 1, len(acts)) - 1) + 1
        held[start] += 1
        held[end] -= 1
    running, most = 0, 0
    for h in held[:-1]:
        running += h
        most = max(most, running)
    return fwd, bwd, latest, most


def weight_versions(p: int, m: int, steps: int = 4, policy: str = "2bw") -> WeightVersions:
    """Replay ``steps`` batches of ``m`` microbatches through a flush-free 1F1B pipeline of
    ``p`` stages under ``policy`` ("pipedream": update after every microbatch with weight
    stashing; "2bw": double-buffered, one update per batch, applied one step late).

    Expected (module docstring): PipeDream holds ``p - r`` versions on stage r with staleness
    ``p - r - 1``; 2BW holds 2 on every stage (once a second version exists) with staleness 1.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; expected one of {POLICIES}")
    for name, x in (("p", p), ("m", m), ("steps", steps)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if policy == "2bw" and m < p:
        raise ValueError(f"PipeDream-2BW needs m >= p microbatches per batch (Narayanan et al. 2021 §3.1: "
                         f"m >= d) so that only two versions are in flight; got m={m}, p={p}: raise m")
    n = steps * m
    sched = replace(one_f_one_b(p, n), name=f"{policy} (1F1B without flush)")

    batch_version = None
    if policy == "2bw":
        # A batch takes the newest version stage 0 has when the batch's first microbatch enters.
        batch_version, current = [], 0
        for a in sched[0]:
            if a.kind == "F" and a.mb % m == 0:
                batch_version.append(current)
            if a.kind == "B" and (a.mb + 1) % m == 0:
                current += 1

    per_stage = [_replay_stage(sched[r], policy, m, n, batch_version) for r in range(p)]
    fwd = [s[0] for s in per_stage]
    # Sequential SGD would run microbatch j (PipeDream) / batch j // m (2BW) at version j / j // m.
    ideal = (lambda j: j) if policy == "pipedream" else (lambda j: j // m)
    return WeightVersions(
        policy=policy, p=p, m=m, steps=steps, schedule=sched,
        forward_version=fwd,
        backward_version=[s[1] for s in per_stage],
        latest_at_backward=[s[2] for s in per_stage],
        max_versions=[s[3] for s in per_stage],
        staleness=[[ideal(j) - f[j] for j in range(n)] for f in fwd],
    )
