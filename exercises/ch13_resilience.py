# generated from solutions/ch13_resilience.py by `make exercises`: fill in each NotImplementedError
# fingerprint 23a2a57669a9d9d5 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 13 exercises: saving, resharding and surviving failures — the gather from incremental saves,
the writers of a deduplicated save on ranks of unequal bandwidth, the commit that keeps the previous
checkpoint, the optimal interval, the work a failure costs, predicted and then measured.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch13``.

1. :func:`gather_latest_pieces` (build): the core of resharding (PyTorch Distributed Checkpoint's
   load planner; Lian et al. 2024, "Universal Checkpointing", §3), from an incremental checkpoint:
   pieces saved at different steps, the newest winning where they overlap (Mohan et al. 2021,
   "CheckFreq", and Check-N-Run's differential checkpoints: Eisenman et al. 2022, NSDI, §4).
2. :func:`plan_writers_by_bandwidth` (build): each piece held by several ranks written once, by
   the holder that would finish it first given its write bandwidth: list scheduling on machines of
   different speeds (Graham 1966; Gonzalez, Ibarra & Sahni 1977, "Bounds for LPT schedules on
   uniform processors", SIAM J. Comput. 6(1)); DCP's ``dedup_save_plans`` is the equal-speed case.
3. :func:`commit_keeping_previous` (build): the commit of a checkpoint by renames, so that a crash
   at any instant leaves a complete checkpoint, keeping the previous one beside it for a rollback
   (POSIX ``rename``; Pillai et al. 2014, OSDI, §2: the update-by-rename protocol).
4. :func:`interval_and_waste` (derive): how often to save (Young 1974; Daly 2006, §2).
5. :func:`lost_steps` (derive): the steps a failure throws away, from the save schedule.
6. :func:`measure_lost_steps` (measure): a real job on two ranks, one killed mid-step, and the steps
   it redid, beside the prediction (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.4;
   CheckFreq §2: work lost counted in iterations).
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

import torch

# --- 1. resharding: scatter the saved pieces, gather the wanted positions --------------------------


def _positions(x, numel: int, what: str) -> torch.Tensor:
    """``x`` as a 1-D int64 tensor of flat positions, each in ``[0, numel)``."""
    if not torch.is_tensor(x):
        x = torch.as_tensor(list(x), dtype=torch.long)
    if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
        raise TypeError(f"{what} must hold integer positions, got dtype {x.dtype}")
    if x.dim() != 1:
        raise ValueError(f"{what} must be 1-D (flat positions in the dense tensor), "
                         f"got shape {tuple(x.shape)}")
    x = x.long()
    if x.numel() and (int(x.min()) < 0 or int(x.max()) >= numel):
        raise ValueError(f"{what} has positions outside [0, {numel}), the {numel} elements of the "
                         f"dense tensor")
    return x


def _check_pieces(pieces, numel: int) -> tuple[list, torch.dtype]:
    """``[(step, positions, values)]`` checked, and their one dtype (float32 if there are none)."""
    checked = []
    for i, piece in enumerate(pieces):
        if len(piece) != 3:
            raise ValueError(f"piece {i} must be (step, positions, values), got {len(piece)} items")
        step, pos, values = piece
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"piece {i}'s step must be an int (the step it was saved at), got {step!r}")
        pos = _positions(pos, numel, f"piece {i}'s positions")
        if not torch.is_tensor(values):
            raise TypeError(f"piece {i}'s values must be a tensor, got {type(values).__name__}")
        if values.numel() != pos.numel():
            raise ValueError(f"piece {i} has {pos.numel()} positions but {values.numel()} values")
        checked.append((step, pos, values))
    dtypes = {values.dtype for _, _, values in checked}
    if len(dtypes) > 1:
        raise ValueError(f"the pieces have different dtypes {sorted(map(str, dtypes))}: one tensor "
                         f"has one dtype")
    dtype = dtypes.pop() if dtypes else torch.float32
    return checked, dtype


def gather_latest_pieces(pieces, dense_shape, want) -> torch.Tensor:
    """Kind: build · about 40 minutes

    The elements at flat positions ``want`` of a dense tensor saved incrementally, in pieces from
    several steps.

    A checkpoint holds each tensor as *pieces*: a saving rank's local elements, with the flat
    position each one has in the dense tensor (the single-process model's). Positions describe any
    layout (tensor-parallel rows or columns, a fully sharded run, ZeRO-1's every n-th element:
    ``Placement.positions()``). An *incremental* checkpoint saves a full base once and then, at
    later steps, only the pieces that changed; so a position may be held by pieces of different
    steps, and the newest step's value is the tensor's value. Pieces of the same step that overlap
    are replicas and hold equal values.

    ``pieces`` is a list, in no particular order, of ``(step, positions, values)``: ``step`` an int,
    ``positions`` a 1-D int64 tensor, ``values`` a tensor of any shape with as many elements,
    row-major. ``dense_shape`` is the dense tensor's shape (``()`` for a scalar such as Adam's step);
    ``want`` the flat positions this rank of the new layout needs, any subset in any order, repeats
    allowed. The arguments are checked for you.

    Return the 1-D tensor of ``want.numel()`` elements, each the value of the newest piece that holds
    that position, in the pieces' dtype (float32 if there are none), a new tensor that shares no
    memory with any piece. A wanted position that no piece holds must raise ``ValueError`` saying how
    many wanted elements no piece covers ("7 wanted elements are in no saved piece"); positions
    nobody wants may stay uncovered.

    The tests reshard between eight layouts of a known tensor (rows, columns, fused QKV columns, FSDP
    runs, ZeRO-1 strides, DP x TP), from incremental saves listed in shuffled order, in float64,
    bfloat16 and int64, a scalar, partial saves that cover only what is wanted, and the error.

    Reference: ``minitorch_dist/resilience/loading.py`` (loads the pieces of one save; here several
    saves overlap and the newest must win whatever the order of the list).
    """
    dense_shape = tuple(int(s) for s in dense_shape)
    numel = math.prod(dense_shape)
    want = _positions(want, numel, "want")
    checked, dtype = _check_pieces(pieces, numel)
    raise NotImplementedError("exercise: gather_latest_pieces — see chapters/13_resilience.md")


# --- 2. who writes each piece ------------------------------------------------------------------------


def _check_bandwidth(bandwidth, n: int) -> list:
    bandwidth = list(bandwidth)
    if len(bandwidth) != n:
        raise ValueError(f"bandwidth has {len(bandwidth)} entries for {n} ranks: one per rank")
    for r, b in enumerate(bandwidth):
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b < float("inf"):
            raise ValueError(f"rank {r}'s bandwidth must be a number of bytes per second > 0, got {b!r}")
    return bandwidth


def plan_writers_by_bandwidth(plans, bandwidth) -> dict:
    """Kind: build · about 45 minutes

    Each distinct piece written once, by one of its holders, on ranks that write at different speeds.

    Before a save, every rank lists the pieces it holds: ``plans[r]`` is rank r's list of
    ``(name, placement_key, nbytes)`` (equal keys: the same elements). A piece several ranks hold (a
    DDP replica, a LayerNorm under tensor parallelism) must be written by exactly one of them. Each
    rank writes its own file in parallel, rank r at ``bandwidth[r]`` bytes per second (one node's
    ranks share a slower disk, another's write to a fast burst buffer), so the save lasts as long as
    the rank that *finishes* last.

    The rule, greedy list scheduling on machines of different speeds: take the distinct pieces in
    sorted order of ``(name, placement_key)`` and give each to the holder that would finish writing
    it earliest, counting what it was given before; on a tie, the lowest rank. Every rank computes
    the same answer from the same lists. A piece held by one rank has no choice. With equal
    bandwidths this is DCP's ``dedup_save_plans``.

    ``plans`` and ``bandwidth`` (one positive number per rank) are checked for you (``sizes`` maps
    each distinct piece to its bytes). Return ``{(name, placement_key): writer_rank}``, one entry per
    distinct piece.

    The tests check the rule piece by piece on synthetic plans (full replication, disjoint shards,
    partial replication, pairs) with seeded random bandwidths, by hand, with equal bandwidths
    against the library's planner on the plans of real layouts, and bad input.

    Reference: ``minitorch_dist/resilience/checkpoint.py`` (``_writers`` balances bytes, which is
    the right rule only when every rank writes equally fast).
    """
    plans = [list(plan) for plan in plans]
    bandwidth = _check_bandwidth(bandwidth, len(plans))
    sizes: dict = {}
    for r, plan in enumerate(plans):
        seen = set()
        for entry in plan:
            if len(entry) != 3:
                raise ValueError(f"rank {r}'s plan has the entry {entry!r}; each is "
                                 f"(name, placement_key, nbytes)")
            name, key, nbytes = entry
            if isinstance(nbytes, bool) or int(nbytes) != nbytes or nbytes < 0:
                raise ValueError(f"rank {r}: piece {(name, key)} has {nbytes!r} bytes; a whole number >= 0")
            piece = (name, key)
            if piece in seen:
                raise ValueError(f"rank {r} lists the piece {piece} twice")
            seen.add(piece)
            if sizes.setdefault(piece, int(nbytes)) != nbytes:
                raise ValueError(f"the piece {piece} is {sizes[piece]} bytes on one rank and {nbytes} on "
                                 f"rank {r}: equal placement keys must mean equal elements")
    raise NotImplementedError("exercise: plan_writers_by_bandwidth — see chapters/13_resilience.md")


# --- 3. the commit: renames, never a moment without a checkpoint -----------------------------------


def commit_keeping_previous(new_folder, path) -> Path:
    """Kind: build · about 40 minutes

    Put the complete checkpoint folder ``new_folder`` at ``path``, and keep the checkpoint that was at
    ``path`` at ``path.prev`` (``path.with_name(path.name + ".prev")``), replacing the one kept
    there before; so that a newest checkpoint found corrupt can be rolled back by one.

    A save writes into ``step_000120.partial/``, and only when every file is there does it *commit*.
    The commit must be crash-safe: at every instant, whatever is at ``path`` is a complete checkpoint
    (the old or the new one, never a part of one), and when nothing is at ``path`` the old one is
    complete at ``path.prev``. POSIX ``rename`` is atomic (``os.replace``, within one file system),
    but a folder cannot be renamed onto a non-empty folder, and a copy is not atomic.

    Afterwards ``path`` holds the new checkpoint and ``new_folder`` is gone; if a checkpoint was at
    ``path``, it is at ``path.prev`` (whatever was at ``path.prev`` before is gone); if none was,
    ``path.prev`` is left as it was (it may be the only older checkpoint). Use ``os.replace`` and
    ``shutil.rmtree`` (called as such), and return ``path``.

    The tests check the final state for every combination of an old checkpoint and an older one at
    ``.prev``, that the files were renamed (the same inodes), and, with a file system made to crash
    before each of your operations in turn, the invariant above.

    Reference: ``minitorch_dist/resilience/storage.py`` (its commit moves the old checkpoint aside
    to ``.old`` and deletes it; here it is kept).
    """
    new_folder, path = Path(new_folder), Path(path)
    if not new_folder.is_dir():
        raise FileNotFoundError(f"{new_folder} is not a folder: nothing to commit")
    if new_folder.resolve() == path.resolve():
        raise ValueError(f"{new_folder} is already at {path}")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a folder: it is not a checkpoint to replace")
    prev = path.with_name(path.name + ".prev")
    raise NotImplementedError("exercise: commit_keeping_previous — see chapters/13_resilience.md")


# --- 4. how often to save ----------------------------------------------------------------------------


def interval_and_waste(mtbf_s: float, checkpoint_s: float, restart_s: float = 0.0) -> tuple[float, float]:
    """Kind: derive · about 25 minutes

    Young's optimum checkpoint interval τ and the fraction of the machine still wasted at τ.

    The model (Young 1974, to first order; Daly 2006 §2 for the restart term): a job saves a
    checkpoint, taking ``checkpoint_s`` = C seconds, after every τ seconds of work; failures strike
    on average every ``mtbf_s`` = M seconds, each equally likely at any moment of an interval, and
    each costs a restart of ``restart_s`` = R seconds plus the work done since the last checkpoint.
    Failures during a save or a restart are ignored (fine while C, R, τ << M). Write the fraction of
    each second of work that is lost to saving and to failures, as a function of τ; saving often makes
    one part large, saving rarely the other.

    Return ``(tau, waste)``: the τ in seconds that minimises it, and the fraction wasted at that τ,
    both in closed form in M, C and R (no numerical search). Does R change τ?

    The tests compare with a brute-force minimisation over a fine grid, with the library's cost
    model (``costmodel.resilience``) on seeded random inputs, with Daly's figure, and with how τ
    scales in M and C.
    """
    for name, value in (("mtbf_s", mtbf_s), ("checkpoint_s", checkpoint_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not restart_s >= 0:
        raise ValueError(f"restart_s must be >= 0, got {restart_s!r}")
    raise NotImplementedError("exercise: interval_and_waste — see chapters/13_resilience.md")


# --- 5. the steps a failure costs --------------------------------------------------------------------


def lost_steps(fail_step: int, every: int, start: int = 0) -> int:
    """Kind: derive · about 20 minutes

    How many steps a failure makes the job compute again, predicted from its save schedule.

    Steps are numbered 0, 1, 2, ... A job saves a checkpoint after every ``every`` steps: once
    step ``every - 1`` is done it saves ``step_{every}`` (the state before step ``every``), once
    step ``2*every - 1`` is done ``step_{2*every}``, and so on — the step numbers count from 0
    whatever step the job started at. This attempt of the job started at step ``start`` (0, or the
    step of the checkpoint it loaded when it began). During step ``fail_step`` a rank dies: its
    gradients were computed, its update never happened. The next attempt loads the latest complete
    checkpoint and computes again every step from there: those that had finished since the
    checkpoint, and the one that was in progress.

    For example, with ``every = 3`` checkpoints hold steps 3, 6, 9, ...; a failure in step 7
    resumes from step 6 and redoes steps 6 and 7: 2. A failure in step 6 resumes from step 6 too,
    saved just before: 1, the step in progress. With no checkpoint yet the attempt resumes from
    ``start``.

    Return that number of steps. The tests check it by hand, against the save-and-fail loop
    simulated step by step, and for its mean over a uniform failure step.
    """
    for name, value in (("fail_step", fail_step), ("every", every), ("start", start)):
        if isinstance(value, bool) or int(value) != value:
            raise ValueError(f"{name} must be a whole number, got {value!r}")
    fail_step, every, start = int(fail_step), int(every), int(start)
    if every < 1:
        raise ValueError(f"every must be >= 1 (steps between checkpoints), got {every}")
    if not 0 <= start <= fail_step:
        raise ValueError(f"start ({start}) must be >= 0 and <= fail_step ({fail_step}): the failing step "
                         f"is one this attempt runs")
    raise NotImplementedError("exercise: lost_steps — see chapters/13_resilience.md")


# --- 6. the steps a failure costs, measured ---------------------------------------------------------------


def measure_lost_steps(cfg, steps: int, every: int, fail_step: int, folder) -> dict:
    """Kind: measure · about 30 minutes

    Run a real job through a failure and measure the steps it redid, beside your prediction.

    The job: the GPT ``cfg`` trained for ``steps`` steps (4 sequences of 16 tokens a step) in the
    ``"zero3"`` layout on 2 ranks, saving a checkpoint into ``folder`` every ``every`` steps; in step
    ``fail_step`` its rank 1 is killed (SIGKILL, after the backward, before the update), and a new
    attempt on 2 ranks resumes from the latest complete checkpoint and finishes the job. The
    library's elastic driver runs exactly this and keeps a log of every attempt.

    Return ``{"predicted": ..., "resumed_from": ..., "steps_redone": ...}``: your prediction
    (:func:`lost_steps`, the first attempt starting at step 0), and, *measured from the run*, the step
    the second attempt resumed from and the number of steps it computed again (those finished since
    that checkpoint and the one in progress).

    The tests run it for two failure steps and compare your measurement with the run's own log in
    ``folder`` (``events.jsonl``: a measurement from no run leaves no log), and your prediction with
    the save-and-fail loop simulated step by step.

    Reference: ``minitorch_dist/resilience/elastic.py`` (``run_elastic``, ``Failure``,
    ``ElasticRun.lost_work``).
    """
    for name, value in (("steps", steps), ("every", every), ("fail_step", fail_step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    if not 0 <= fail_step < steps:
        raise ValueError(f"fail_step ({fail_step}) must be a step the job runs: "
                         f"0 <= fail_step < steps ({steps})")
    raise NotImplementedError("exercise: measure_lost_steps — see chapters/13_resilience.md")
