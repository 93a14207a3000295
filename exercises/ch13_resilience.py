# generated from solutions/ch13_resilience.py by `make exercises`: fill in each NotImplementedError
# fingerprint 612ef15667934859 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 13 exercises: saving, resharding and surviving failures — the gather at positions, the
writers of a deduplicated save, the atomic commit, the optimal interval, the work a failure costs.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch13``.

The first line of each exercise's docstring says its kind: *build* (write a piece of the system),
*derive* (turn a model of the cost into a formula) or *measure* (predict a number, then check it
against a run). Nothing here needs ranks; the tests start some to compare with real runs.

1. :func:`scatter_gather_pieces` (build): the core of resharding. Saved pieces of a tensor, each
   with the flat positions its elements have in the dense tensor, are scattered back into the
   dense tensor; a rank of the new layout gathers its own positions (PyTorch Distributed
   Checkpoint's load planner; Lian et al. 2024, "Universal Checkpointing: Efficient and Flexible
   Checkpointing for Large Scale Distributed Training", §3: any parallel layout in, any out).
2. :func:`plan_writers` (build): a piece held by several ranks (DDP's replicas, tensor
   parallelism's norms) is written once, by the holder with the fewest bytes so far: DCP's
   ``dedup_save_plans``, which is Graham's greedy list scheduling (Graham 1966, "Bounds for
   certain multiprocessing anomalies", Bell System Technical Journal 45(9)).
3. :func:`replace_folder_atomically` (build): the commit of a checkpoint by renames, so that a
   crash at any instant leaves one complete checkpoint (POSIX ``rename``; Pillai et al. 2014,
   "All File Systems Are Not Created Equal: On the Complexity of Crafting Crash-Consistent
   Applications", OSDI, §2: the update-by-rename protocol).
4. :func:`interval_and_waste` (derive): how often to save. Young 1974, "A first order
   approximation to the optimum checkpoint interval" (CACM 17(9)): τ = √(2·M·C); and the
   fraction of the machine it still wastes (Daly 2006, "A higher order estimate of the optimum
   checkpoint interval for restart dumps", §2, for the restart term).
5. :func:`lost_steps` (measure): the steps a failure throws away, predicted from the save
   schedule, then measured on a job whose rank is killed mid-step (Dubey et al. 2024, "The Llama 3
   Herd of Models", §3.3.4: 419 interruptions in 54 days; Mohan et al. 2021, "CheckFreq: Frequent,
   Fine-Grained DNN Checkpointing", FAST, §2: work lost counted in iterations).
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


def scatter_gather_pieces(pieces, dense_shape, want) -> torch.Tensor:
    """Kind: build

    The elements at flat positions ``want`` of a dense tensor that was saved in pieces.

    A checkpoint written by one layout holds each tensor as *pieces*: every saving rank's local
    elements, with the flat position each one has in the dense tensor (the tensor of the
    single-process model). Positions describe any layout: a tensor-parallel slice of rows or of
    columns, a fully sharded ``[u, v)`` run of the flattened tensor, ZeRO-1's every n-th element,
    or a mixture (``Placement.positions()`` computes them). A rank of the *new* layout needs the
    elements at its own positions ``want``. With ``D`` the dense tensor, flattened::

        for each piece (p, v):     D[p[i]] = v[i]          scatter: rebuild the dense tensor
        result:                    out[j]  = D[want[j]]    gather: this rank's elements

    Pieces may overlap (replicas hold the same values, so which one lands last does not matter),
    and ``want`` may ask for any positions, in any order. A position that ``want`` asks for and no
    piece holds is a checkpoint that cannot give this rank its tensor: that must be an error, never
    an uninitialised value.

    ``pieces`` is a list of ``(positions, values)``: ``positions`` a 1-D int64 tensor, ``values``
    a tensor of any shape with as many elements, read in row-major order (``values.reshape(-1)``).
    ``dense_shape`` is the shape of the dense tensor (``()`` for a scalar such as Adam's step).
    The arguments are checked for you (positions in range, matching lengths, one dtype).

    **Your task:** return the 1-D tensor ``out`` of ``want.numel()`` elements, in the pieces' dtype
    (float32 if there are no pieces). Build the dense tensor once (``torch.empty``), scatter every
    piece into it and record which positions some piece covered (a boolean mask). If any wanted
    position is uncovered, raise ``ValueError`` whose message says how many wanted elements no
    piece covers (e.g. "7 wanted elements are in no saved piece").
    """
    dense_shape = tuple(int(s) for s in dense_shape)
    numel = math.prod(dense_shape)
    want = _positions(want, numel, "want")
    checked = []
    for i, (pos, values) in enumerate(pieces):
        pos = _positions(pos, numel, f"piece {i}'s positions")
        if not torch.is_tensor(values):
            raise TypeError(f"piece {i}'s values must be a tensor, got {type(values).__name__}")
        if values.numel() != pos.numel():
            raise ValueError(f"piece {i} has {pos.numel()} positions but {values.numel()} values")
        checked.append((pos, values))
    dtypes = {values.dtype for _, values in checked}
    if len(dtypes) > 1:
        raise ValueError(f"the pieces have different dtypes {sorted(map(str, dtypes))}: one tensor "
                         f"has one dtype")
    dtype = dtypes.pop() if dtypes else torch.float32
    raise NotImplementedError("exercise: scatter_gather_pieces — see chapters/13_resilience.md")


# --- 2. who writes each piece ------------------------------------------------------------------------


def plan_writers(plans) -> dict:
    """Kind: build

    Each distinct piece written once, by one of its holders, with the bytes spread over the ranks.

    Before a save, every rank lists the pieces it holds: ``plans[r]`` is rank r's list of
    ``(name, placement_key, nbytes)``, where ``name`` is the tensor's dense name and
    ``placement_key`` names which elements of it the rank holds (equal keys: the same elements).
    All ranks exchange their lists, so each computes the same answer from the same input. A piece
    that several ranks hold — a DDP replica is held by every rank, a layer norm under tensor
    parallelism by every rank of the group — must be written by exactly one of them, or the
    checkpoint grows with the number of replicas. Which one? Each rank writes its own file in
    parallel, so the save takes as long as the busiest rank: spread the bytes. The greedy rule
    (PyTorch DCP's ``dedup_save_plans``) takes the pieces in sorted order of
    ``(name, placement_key)`` and gives each to the holder that has been given the fewest bytes so
    far, the lowest rank on a tie. When every rank holds every piece (DDP) this is Graham's list
    scheduling: the busiest rank ends at most one piece above the average,

        max_r load(r) <= total / n + max piece bytes.

    A piece held by one rank only (a ZeRO-3 shard) has no choice: its holder writes it.

    ``plans`` is checked for you: well-formed entries, no piece twice in one rank's list, and the
    same ``nbytes`` for a piece on every rank that holds it (``sizes`` maps each distinct piece
    ``(name, placement_key)`` to its bytes).

    **Your task:** return ``{(name, placement_key): writer_rank}`` with one entry per distinct
    piece, by the greedy rule above.
    """
    plans = [list(plan) for plan in plans]
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
    raise NotImplementedError("exercise: plan_writers — see chapters/13_resilience.md")


# --- 3. the commit: renames, never a moment without a checkpoint -----------------------------------


def replace_folder_atomically(new_folder, path) -> Path:
    """Kind: build

    Put the complete checkpoint folder ``new_folder`` at ``path``, replacing any checkpoint there,
    so that a crash at any instant leaves a complete checkpoint.

    A save writes into ``step_000120.partial/`` and only when every file is there, and flushed,
    does it *commit*: the folder takes its real name. Writing in place instead would leave, after
    a crash half-way, a folder with the right name and half the files — the worst case, a
    checkpoint that looks complete. Renaming is the tool, because POSIX makes ``rename`` atomic: a
    reader sees the old name or the new one, never something between (``os.replace``; within one
    file system). But a folder cannot be renamed onto a non-empty folder, and deleting the old
    checkpoint first opens a window in which none exists. So the old one is moved aside first::

        if path exists:   os.replace(path, path.old)       the old checkpoint, complete, at path.old
        always:           os.replace(new_folder, path)      the new one, complete, at path
        finally:          remove path.old

    At every instant a complete checkpoint exists at ``path`` or at ``path.old`` (and a reader
    that finds only ``path.old`` knows a commit was interrupted: rename it back). ``path.old`` is
    ``path.with_name(path.name + ".old")``. A ``path.old`` left by an earlier interrupted commit is
    stale once ``path`` exists: remove it before moving ``path`` aside.

    **Your task:** carry out the three steps with ``os.replace`` (call it as ``os.replace``) and
    ``shutil.rmtree``, and return ``path``. Afterwards ``path`` holds the new checkpoint, and
    neither ``new_folder`` nor ``path.old`` exists.
    """
    new_folder, path = Path(new_folder), Path(path)
    if not new_folder.is_dir():
        raise FileNotFoundError(f"{new_folder} is not a folder: nothing to commit")
    if new_folder.resolve() == path.resolve():
        raise ValueError(f"{new_folder} is already at {path}")
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a folder: it is not a checkpoint to replace")
    old = path.with_name(path.name + ".old")
    raise NotImplementedError("exercise: replace_folder_atomically — see chapters/13_resilience.md")


# --- 4. how often to save ----------------------------------------------------------------------------


def interval_and_waste(mtbf_s: float, checkpoint_s: float, restart_s: float = 0.0) -> tuple[float, float]:
    """Kind: derive

    Young's optimum checkpoint interval τ and the fraction of the machine still wasted at τ.

    A job saves a checkpoint, taking C seconds, after every τ seconds of work; failures strike on
    average every M seconds (the mean time between failures), and each one costs a restart of R
    seconds plus the work done since the last checkpoint — τ/2 on average, for a failure equally
    likely at any moment of the interval. Per second of work the job then loses

        waste(τ) = C/τ  +  (τ/2 + R)/M
                   saving   recomputing and restarting

    (Young 1974, to first order: this ignores failures during a save or a restart, fine while
    C, R, τ << M). Saving often makes the first term large, saving rarely the second.

    **Your task:** minimise ``waste(τ)`` by hand — set its derivative to zero — and return
    ``(tau, waste)``: the minimising τ in seconds and ``waste(tau)``, the fraction wasted at the
    optimum, as a closed form in M, C and R (no numerical search). Does R change τ?
    """
    for name, value in (("mtbf_s", mtbf_s), ("checkpoint_s", checkpoint_s)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")
    if not restart_s >= 0:
        raise ValueError(f"restart_s must be >= 0, got {restart_s!r}")
    raise NotImplementedError("exercise: interval_and_waste — see chapters/13_resilience.md")


# --- 5. the steps a failure costs --------------------------------------------------------------------


def lost_steps(fail_step: int, every: int, start: int = 0) -> int:
    """Kind: measure

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

    **Your task:** return that number of steps. The tests check it against brute force and
    against a real job on two ranks whose rank 1 is killed in step ``fail_step``
    (``minitorch_dist.resilience.elastic.run_elastic``, ``ElasticRun.lost_work()``).
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
