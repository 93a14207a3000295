"""Chapter 13 exercises, autograded: resharding from an incremental save, the writers of a deduplicated save
on ranks of unequal bandwidth, the commit that keeps the previous checkpoint, Young's interval and its
waste, the steps a failure costs, predicted and measured.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Every
expected value comes from an independent source: a known dense tensor cut by slicing (rows,
columns, ``[u, v)`` runs, every n-th element), and incremental saves whose newest values are known,
listed in orders that put the oldest last; the writers' rule checked piece by piece (each piece once,
by a holder, the one that finishes it first at its turn, Graham's bound) with seeded random
bandwidths, and with equal bandwidths the library's own planner on the plans of real layouts (DDP,
ZeRO-1, ZeRO-3, TP, DP x TP, listed by ranks that trained one step); a file system whose renames and
deletions are made to crash at every point of the commit; a brute-force minimisation of the waste
over a fine grid, its closed forms and the library's cost model on seeded inputs; the save-and-fail
loop simulated step by step; and real jobs on two ranks whose rank 1 is killed mid-step, read back
from their own logs. The two harnesses that judge a whole answer are shown failing on a deliberately
wrong one (every piece written by rank 0; delete the old checkpoint, then rename the new one in).

Checks of bad input first make a valid call, so a stub fails them too.

Tolerances (see tests/_support.py). Pieces, writers, files and step counts are exact. Young's interval
against the brute force: the waste C/τ + (τ/2 + R)/M is convex in τ, so the grid's best point lies
within one grid step (the ratio ρ of neighbours, 1 + 6.3e-5) of the optimum, since the waste's
rise over one step near it (~(ρ - 1)² of itself) dwarfs its float64 rounding (~10 u); and there its
waste exceeds the least by at most (C/τ)·ρ³·(ρ - 1)², under ρ³·(ρ - 1)² of the waste (4e-9), plus the
two sides' rounding. The closed forms are each a few float64 operations: rel 1e-12 >> k·u (and a
derivative that cancels to 0 within 1e-12/M, far above its ~4u/M); pytest.approx's default rel 1e-6
likewise holds formulas that agree to k·u.
"""
import math
import os
import random
import re
import shutil
import sys

import cloudpickle
import numpy as np
import pytest
import torch

from minitorch_dist import launch
from minitorch_dist.costmodel import resilience as cmr
from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.resilience.checkpoint import _writers
from minitorch_dist.resilience.placement import Placement

from _support import gamma

pytestmark = [pytest.mark.ch13, pytest.mark.timeout(120)]

# The rank function below is sent to the ranks by value, so spawned ranks need not import this file.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 1. gather_latest_pieces ------------------------------------------------------------------------

SHAPE = (6, 8)  # 48 elements


def _dense(dtype=torch.float32):
    return torch.arange(48, dtype=torch.float64).mul(1.5).add(0.25).to(dtype).view(SHAPE)


# Each layout: per rank, its placement and how to cut its local tensor out of the dense one by slicing.
LAYOUTS = {
    "whole": [(Placement(SHAPE), lambda d: d)],
    "tp-rows": [(Placement(SHAPE, cut=(0, ((0, 3),))), lambda d: d[0:3]),
                (Placement(SHAPE, cut=(0, ((3, 6),))), lambda d: d[3:6])],
    "tp-cols": [(Placement(SHAPE, cut=(1, ((0, 4),))), lambda d: d[:, 0:4]),
                (Placement(SHAPE, cut=(1, ((4, 8),))), lambda d: d[:, 4:8])],
    "tp-qkv": [(Placement(SHAPE, cut=(1, ((0, 2), (4, 6)))), lambda d: torch.cat([d[:, 0:2], d[:, 4:6]], 1)),
               (Placement(SHAPE, cut=(1, ((2, 4), (6, 8)))), lambda d: torch.cat([d[:, 2:4], d[:, 6:8]], 1))],
    "fsdp-3": [(Placement(SHAPE, flat=(u, 1, 16)), lambda d, u=u: d.reshape(-1)[u:u + 16])
               for u in (0, 16, 32)],
    "fsdp-5": [(Placement(SHAPE, flat=(u, 1, min(10, 48 - u))), lambda d, u=u: d.reshape(-1)[u:u + 10])
               for u in (0, 10, 20, 30, 40)],
    "zero1-3": [(Placement(SHAPE, flat=(r, 3, 16)), lambda d, r=r: d.reshape(-1)[r::3]) for r in range(3)],
    "dp2-tp2": [(Placement(SHAPE, cut=(1, ((4 * t, 4 * t + 4),)), flat=(dp, 2, 12)),
                 lambda d, t=t, dp=dp: d[:, 4 * t:4 * t + 4].reshape(-1)[dp::2])
                for t in (0, 1) for dp in (0, 1)],
}


def _saved(layout, dtype=torch.float32):
    """The pieces a layout saves: (positions, local values cut by slicing, in the local shape)."""
    d = _dense(dtype)
    return [(pl.positions(), cut(d).clone()) for pl, cut in LAYOUTS[layout]]


def _gather(ex, pieces, shape, want, step=0):
    """Pieces of one save, (positions, values), given as saved at ``step``."""
    return ex.gather_latest_pieces([(step, pos, values) for pos, values in pieces], shape, want)


@pytest.mark.parametrize("src", list(LAYOUTS))
def test_gather_latest_pieces_reshards_between_layouts(ex, src):
    pieces = _saved(src)
    d = _dense()
    for dst, ranks in LAYOUTS.items():
        for r, (pl, cut) in enumerate(ranks):
            got = _gather(ex, pieces, SHAPE, pl.positions())
            want = cut(d).reshape(-1)
            what = f"saved as {src}, loaded as {dst} rank {r}"
            assert torch.is_tensor(got) and got.dim() == 1, f"{what}: expected a 1-D tensor, got {got!r}"
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, what=what: f"{what}: {m}")


def test_gather_latest_pieces_any_order_duplicates_and_replicas(ex):
    d = _dense().reshape(-1)
    pieces = _saved("tp-rows") + _saved("zero1-3") + _saved("whole")  # overlapping replicas, equal values
    random.Random(0).shuffle(pieces)
    want = torch.tensor([47, 0, 5, 5, 30, 12, 0, 46])
    got = _gather(ex, pieces, SHAPE, want)
    torch.testing.assert_close(got, d[want], rtol=0, atol=0)
    empty = _gather(ex, pieces, SHAPE, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,) and empty.dtype == torch.float32, f"want nothing: got {empty!r}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_gather_latest_pieces_keeps_the_dtype(ex, dtype):
    pieces = _saved("fsdp-5", dtype)
    want = LAYOUTS["tp-cols"][1][0].positions()
    got = _gather(ex, pieces, SHAPE, want)
    assert got.dtype == dtype, f"pieces of {dtype} gave a tensor of {got.dtype}"
    torch.testing.assert_close(got, _dense(dtype)[:, 4:8].reshape(-1), rtol=0, atol=0)


def test_gather_latest_pieces_a_scalar(ex):
    # Adam's step: a 0-d tensor, one element at position 0, held whole by every rank
    pieces = [(torch.tensor([0]), torch.tensor(7.0)), (torch.tensor([0]), torch.tensor(7.0))]
    got = _gather(ex, pieces, (), torch.tensor([0]))
    torch.testing.assert_close(got, torch.tensor([7.0]), rtol=0, atol=0)  # a copy: exact


def test_gather_latest_pieces_does_not_alias_the_pieces(ex):
    pieces = _saved("whole")
    before = pieces[0][1].clone()
    got = _gather(ex, pieces, SHAPE, torch.arange(48))
    got.zero_()
    torch.testing.assert_close(pieces[0][1], before, rtol=0, atol=0,
                               msg="changing the result changed a saved piece")


def test_gather_latest_pieces_names_the_uncovered_count(ex):
    fsdp = _saved("fsdp-5")
    _gather(ex, fsdp, SHAPE, torch.arange(48))  # a valid call first: all five cover everything
    # ranks 0 and 2 only hold [0, 10) and [20, 30): rows 0-2 of the dense tensor (0..23) miss 10..19
    pieces = [fsdp[0], fsdp[2]]
    rows = LAYOUTS["tp-rows"][0][0].positions()
    with pytest.raises(ValueError) as info:
        _gather(ex, pieces, SHAPE, rows)
    assert re.search(r"\b10\b", str(info.value)), \
        f"10 wanted elements are uncovered; the error says: {info.value}"
    # and a count that is not a piece's size: want 7 of the missing ones among covered ones
    want = torch.tensor([0, 1, 11, 12, 13, 20, 21, 14, 15, 16, 17])
    with pytest.raises(ValueError) as info:
        _gather(ex, pieces, SHAPE, want)
    assert re.search(r"\b7\b", str(info.value)), \
        f"7 wanted elements are uncovered; the error says: {info.value}"
    # covered ones alone are fine
    ok = _gather(ex, pieces, SHAPE, torch.tensor([0, 9, 20, 29]))
    torch.testing.assert_close(ok, _dense().reshape(-1)[[0, 9, 20, 29]], rtol=0, atol=0)


def test_gather_latest_pieces_rejects_bad_input(ex):
    pieces = _saved("tp-rows")
    _gather(ex, pieces, SHAPE, torch.arange(4))  # a valid call first
    with pytest.raises(ValueError, match="outside"):
        _gather(ex, pieces, SHAPE, torch.tensor([48]))
    with pytest.raises(ValueError, match="24 positions but 23 values"):
        _gather(ex, [(pieces[0][0], pieces[0][1].reshape(-1)[:23])], SHAPE, torch.arange(4))
    with pytest.raises(ValueError, match="different dtypes"):
        _gather(ex, [pieces[0], (pieces[1][0], pieces[1][1].double())], SHAPE, torch.arange(4))


def _incremental(dtype):
    """A base save of the whole tensor at step 0, then two partial saves of changed values: step 5
    (rows 0-2, +100) and step 3 (ZeRO-1 rank 1's every third element from 1, +50). The newest wins."""
    d = _dense(dtype)
    base = [(0, pos, v) for pos, v in _saved("whole", dtype)]
    rows_pl = LAYOUTS["tp-rows"][0][0]
    z1_pl = LAYOUTS["zero1-3"][1][0]
    at5 = (5, rows_pl.positions(), (d[0:3] + 100).clone())
    at3 = (3, z1_pl.positions(), (d.reshape(-1)[1::3] + 50).clone())
    want = d.reshape(-1).clone()
    want[1::3] += 50
    want[:24] = d.reshape(-1)[:24] + 100     # step 5 is newer than step 3 where they overlap
    return base, at3, at5, want


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_gather_latest_pieces_the_newest_piece_wins(ex, dtype):
    base, at3, at5, full = _incremental(dtype)
    orders = [[*base, at3, at5], [at5, at3, *base], [at3, *base, at5], [at5, *base, at3]]
    for seed in range(4):
        order = [*base, at3, at5]
        random.Random(seed).shuffle(order)
        orders.append(order)
    want = torch.tensor([0, 1, 4, 23, 24, 25, 26, 28, 47, 1, 46])
    for order in orders:
        steps = [step for step, _, _ in order]
        got = ex.gather_latest_pieces(order, SHAPE, want)
        torch.testing.assert_close(got, full[want], rtol=0, atol=0,
                                   msg=lambda m, steps=steps: f"pieces listed at steps {steps}: {m}")
        whole = ex.gather_latest_pieces(order, SHAPE, torch.arange(48))
        torch.testing.assert_close(whole, full, rtol=0, atol=0)


def test_gather_latest_pieces_partial_saves_suffice_for_what_is_wanted(ex):
    # no base: only the two partial saves; a rank that wants only positions they hold needs no more
    _, at3, at5, full = _incremental(torch.float32)
    want = torch.tensor([23, 1, 25, 0, 31])      # 23, 0: rows (step 5); 1: both, step 5 wins; 25, 31: step 3
    got = ex.gather_latest_pieces([at5, at3], SHAPE, want)
    torch.testing.assert_close(got, full[want], rtol=0, atol=0)
    with pytest.raises(ValueError) as info:   # 24 and 26 are in neither: 2 uncovered
        ex.gather_latest_pieces([at3, at5], SHAPE, torch.tensor([24, 1, 26]))
    assert re.search(r"\b2\b", str(info.value)), \
        f"2 wanted elements are uncovered; the error says: {info.value}"


# --- 2. plan_writers_by_bandwidth ------------------------------------------------------------------------

CFG4 = GPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=4, n_embd=16)
REAL_LAYOUTS = ["ddp", "zero1", "zero3", "tp", "dp2-tp2"]


def _plans_of(layouts):
    """On a rank: for each layout, this rank's plan after one training step (the save's first stage)."""
    from minitorch_dist.resilience.checkpoint import flatten
    from minitorch_dist.resilience.trainers import Trainer

    out = {}
    for name in layouts:
        trainer = Trainer(name, CFG4, 4, 16)
        trainer.step(0)  # the optimizer state exists: it is saved too
        tensors, _, _ = flatten(trainer.state(step=1))
        out[name] = [(k, s.placement.key(), s.local.numel() * s.local.element_size())
                     for k, s in sorted(tensors.items())]
    return out


@pytest.fixture(scope="module")
def real_plans():
    """{layout: plans} listed by 4 ranks of each layout."""
    per_rank = launch(_plans_of, 4, REAL_LAYOUTS, timeout_s=60)
    return {name: [per_rank[r][name] for r in range(4)] for name in REAL_LAYOUTS}


def _synthetic(kind, n, seed=0):
    """Plans of n ranks: ``full`` replication (DDP), ``disjoint`` pieces (ZeRO-3), ``partial``
    replication (TP: half the tensors cut, the rest replicated), ``groups`` (replicas within pairs)."""
    rng = random.Random(seed)
    sizes = {f"layer{i}.{p}": rng.choice([4, 64, 256, 1024, 4096]) for i in range(6) for p in ("w", "b", "g")}
    plans = [[] for _ in range(n)]
    for name, nbytes in sizes.items():
        for r in range(n):
            if kind == "full" or (kind == "partial" and name.endswith((".b", ".g"))):
                plans[r].append((name, "whole", nbytes))
            elif kind in ("disjoint", "partial"):
                plans[r].append((name, f"part{r}of{n}", nbytes // n))
            else:  # groups: ranks 2g and 2g + 1 hold the same piece
                plans[r].append((name, f"group{r // 2}", nbytes // 2))
    for plan in plans:
        rng.shuffle(plan)  # the answer must not depend on the order a rank lists its pieces
    return plans


def _check_writers(got, plans, what, bandwidth=None):
    """Each distinct piece once, by one of its holders, the one that would finish it first (lowest rank
    on a tie) at its turn; returns the bytes each rank writes."""
    bandwidth = bandwidth or [1.0] * len(plans)
    holders, sizes = {}, {}
    for r, plan in enumerate(plans):
        for name, key, nbytes in plan:
            holders.setdefault((name, key), set()).add(r)
            sizes[(name, key)] = nbytes
    assert isinstance(got, dict), f"{what}: expected a dict, got {type(got).__name__}"
    assert set(got) == set(holders), (f"{what}: pieces missing {sorted(set(holders) - set(got))[:3]}, "
                                      f"unknown {sorted(set(got) - set(holders))[:3]}")
    load = [0] * len(plans)
    for piece in sorted(holders):
        w = got[piece]
        assert w in holders[piece], f"{what}: {piece} given to rank {w}, which does not hold it"
        best = min(((load[q] + sizes[piece]) / bandwidth[q], q) for q in holders[piece])
        mine = ((load[w] + sizes[piece]) / bandwidth[w], w)
        assert mine == best, (f"{what}: {piece} given to rank {w} (it would finish at {mine[0]:.4g} s); the "
                              f"holder that finishes it first (least loaded in time) is rank {best[1]} "
                              f"({best[0]:.4g} s)")
        load[w] += sizes[piece]
    return load


def test_plan_writers_by_bandwidth_by_hand(ex):
    plans = [[("a", "k", 10), ("b", "k", 5)],
             [("b", "k", 5), ("a", "k", 10), ("c", "k", 1)]]
    # a: both at 0 B -> rank 0 (10 B); b: rank 1 has 0 B -> rank 1; c: only rank 1 holds it
    assert ex.plan_writers_by_bandwidth(plans, [1.0, 1.0]) == {("a", "k"): 0, ("b", "k"): 1, ("c", "k"): 1}
    # rank 1 writes 4x as fast: a (10 B) finishes at 10/1 on rank 0, 10/4 on rank 1 -> rank 1; then
    # b (5 B): rank 0 at 5/1 = 5, rank 1 at (10 + 5)/4 = 3.75 -> rank 1 again; c: rank 1
    assert ex.plan_writers_by_bandwidth(plans, [1.0, 4.0]) == {("a", "k"): 1, ("b", "k"): 1, ("c", "k"): 1}
    # a piece's own time counts: both idle, rank 0 slower -> the faster rank 1, not the lowest rank
    assert ex.plan_writers_by_bandwidth([[("a", "k", 8)], [("a", "k", 8)]], [1.0, 2.0]) == {("a", "k"): 1}
    # the same tensor in two placements is two pieces
    two = ex.plan_writers_by_bandwidth([[("w", "rows0", 8)], [("w", "rows1", 8)]], [1.0, 100.0])
    assert two == {("w", "rows0"): 0, ("w", "rows1"): 1}, "a piece held by one rank has no choice"
    assert ex.plan_writers_by_bandwidth([[], []], [1.0, 1.0]) == {}


@pytest.mark.parametrize("kind", ["full", "disjoint", "partial", "groups"])
@pytest.mark.parametrize("n", [2, 4, 6])
def test_plan_writers_by_bandwidth_unequal_speeds(ex, kind, n):
    rng = random.Random(100 * n + len(kind))
    for seed in range(3):
        plans = _synthetic(kind, n, seed=seed)
        bandwidth = [rng.choice([1.0, 2.0, 3.0, 8.0]) * 1e9 for _ in range(n)]
        got = ex.plan_writers_by_bandwidth(plans, bandwidth)
        load = _check_writers(got, plans, f"{kind} on {n} ranks, bandwidths {bandwidth}", bandwidth)
        distinct = {(name, key): nbytes for plan in plans for name, key, nbytes in plan}
        assert sum(load) == sum(distinct.values()), "each distinct piece's bytes written once"


@pytest.mark.parametrize("kind", ["full", "disjoint", "partial", "groups"])
@pytest.mark.parametrize("n", [1, 2, 4, 6])
def test_plan_writers_by_bandwidth_properties(ex, kind, n):
    plans = _synthetic(kind, n, seed=n)
    got = ex.plan_writers_by_bandwidth(plans, [1.0] * len(plans))
    load = _check_writers(got, plans, f"{kind} on {n} ranks")
    if kind == "full":  # Graham's bound: at most one piece above the average
        total, biggest = sum(nbytes for _, _, nbytes in plans[0]), max(nbytes for _, _, nbytes in plans[0])
        assert max(load) <= total / n + biggest, f"loads {load}: above total/n + max piece"
        assert sum(load) == total, f"loads {load}: the replicas were not written exactly once ({total} B)"
    if kind == "disjoint":
        assert all(got[(name, key)] == r for r, plan in enumerate(plans) for name, key, _ in plan)


def test_plan_writers_by_bandwidth_catches_a_wrong_variant(ex):
    plans = _synthetic("full", 4)
    got = ex.plan_writers_by_bandwidth(plans, [1.0] * len(plans))
    _check_writers(got, plans, "the exercise")  # the exercise itself first
    everything_on_rank0 = {(name, key): 0 for name, key, _ in plans[0]}
    with pytest.raises(AssertionError, match="finishes it first"):
        _check_writers(everything_on_rank0, plans, "all on rank 0")


@pytest.mark.parametrize("layout", REAL_LAYOUTS)
def test_plan_writers_by_bandwidth_real_layouts(ex, real_plans, layout):
    plans = real_plans[layout]
    got = ex.plan_writers_by_bandwidth(plans, [1.0] * len(plans))
    load = _check_writers(got, plans, layout)
    assert got == _writers(plans), f"{layout}: differs from the save's own planner"
    distinct = {(name, key): nbytes for plan in plans for name, key, nbytes in plan}
    assert sum(load) == sum(distinct.values()), f"{layout}: each distinct piece's bytes written once"
    if layout == "ddp":  # every rank holds everything: each writes about a quarter
        assert max(load) <= sum(load) / 4 + max(distinct.values())


def test_plan_writers_by_bandwidth_rejects_bad_input(ex):
    ex.plan_writers_by_bandwidth([[("a", "k", 4)], [("a", "k", 4)]], [1.0, 1.0])  # a valid call first
    with pytest.raises(ValueError, match="4 bytes on one rank and 8 on rank 1"):
        ex.plan_writers_by_bandwidth([[("a", "k", 4)], [("a", "k", 8)]], [1.0, 1.0])
    with pytest.raises(ValueError, match="twice"):
        ex.plan_writers_by_bandwidth([[("a", "k", 4), ("a", "k", 4)]], [1.0])
    with pytest.raises(ValueError, match="name, placement_key, nbytes"):
        ex.plan_writers_by_bandwidth([[("a", 4)]], [1.0])
    with pytest.raises(ValueError, match="one per rank"):
        ex.plan_writers_by_bandwidth([[("a", "k", 4)], [("a", "k", 4)]], [1.0])
    with pytest.raises(ValueError, match="bandwidth must be"):
        ex.plan_writers_by_bandwidth([[("a", "k", 4)], [("a", "k", 4)]], [1.0, 0.0])


# --- 3. commit_keeping_previous ------------------------------------------------------------------------

OLD = {"metadata.json": b'{"step": 3}', "rank00000.pt": b"old weights " * 50}
NEW = {"metadata.json": b'{"step": 6}', "rank00000.pt": b"new weights " * 50, "rank00001.pt": b"more"}
OLDER = {"metadata.json": b'{"step": 0}', "rank00000.pt": b"older weights " * 50}


def _write(folder, files):
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _read(folder):
    """The folder's files and contents, or None if it is not a folder."""
    if not folder.is_dir():
        return None
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def _setup(tmp_path, old=True, stale=False):
    path, new = tmp_path / "step_000006", tmp_path / "step_000006.partial"
    _write(new, NEW)
    if old:
        _write(path, OLD)
    if stale:  # an older checkpoint kept by the commit before
        _write(path.with_name(path.name + ".prev"), OLDER)
    return new, path, path.with_name(path.name + ".prev")


class Crash(Exception):
    """The machine went down here."""


class CrashingFS:
    """Count the file-system operations a commit makes (``os.replace``, ``os.rename``, ``shutil.rmtree``,
    ``shutil.move``, ``shutil.copytree``) and make the ``crash_at``-th one raise :class:`Crash` before it
    does anything. Operations inside another one are not counted."""

    NAMES = [(os, "replace"), (os, "rename"), (shutil, "rmtree"), (shutil, "move"), (shutil, "copytree")]

    def __init__(self, monkeypatch, crash_at=None):
        self.calls, self.crash_at, self._inside = [], crash_at, False
        for mod, name in self.NAMES:
            monkeypatch.setattr(mod, name, self._wrap(name, getattr(mod, name)))

    def _wrap(self, name, real):
        def op(*args, **kwargs):
            if self._inside:
                return real(*args, **kwargs)
            self.calls.append(name)
            if len(self.calls) == self.crash_at:
                raise Crash(f"crash at {name}{args}")
            self._inside = True
            try:
                return real(*args, **kwargs)
            finally:
                self._inside = False
        return op


def _a_complete_checkpoint_exists(path, old, what):
    """The invariant when a checkpoint was at ``path`` before the commit: whatever is at ``path`` is
    whole (the old or the new), and when nothing is there the old one is whole at ``.prev``."""
    at_path, at_old = _read(path), _read(old)
    assert at_path in (None, OLD, NEW), f"{what}: {path.name} holds a part of a checkpoint: {sorted(at_path)}"
    assert at_path in (OLD, NEW) or at_old == OLD, \
        f"{what}: no complete checkpoint: {path.name} holds {at_path and sorted(at_path)}, " \
        f"{old.name} holds {at_old and sorted(at_old)}"


@pytest.mark.parametrize("old, stale", [(True, False), (False, False), (True, True), (False, True)])
def test_commit_keeping_previous_final_state(ex, tmp_path, old, stale):
    new, path, old_path = _setup(tmp_path, old, stale)
    inode = (new / "rank00000.pt").stat().st_ino
    out = ex.commit_keeping_previous(new, path)
    assert out == path
    assert _read(path) == NEW, f"{path.name} should hold the new checkpoint, holds {_read(path)}"
    assert not new.exists(), f"{new.name} should be gone: it was renamed to {path.name}"
    kept = OLD if old else (OLDER if stale else None)
    assert _read(old_path) == kept, (f"{old_path.name} should hold "
                                     f"{'the checkpoint that was at ' + path.name if old else 'what it held'}"
                                     f", holds {_read(old_path) and sorted(_read(old_path))}")
    assert (path / "rank00000.pt").stat().st_ino == inode, \
        "the files were copied, not renamed: a copy is not atomic (and writes every byte again)"


@pytest.mark.parametrize("old, stale", [(True, False), (False, False), (True, True), (False, True)])
def test_commit_keeping_previous_survives_a_crash_anywhere(ex, tmp_path, monkeypatch, old, stale):
    with monkeypatch.context() as m:  # how many operations does a commit make?
        new, path, old_path = _setup(tmp_path / "count", old, stale)
        fs = CrashingFS(m)
        ex.commit_keeping_previous(new, path)
        n_ops = len(fs.calls)
    assert n_ops >= 1
    for k in range(1, n_ops + 1):
        with monkeypatch.context() as m:
            new, path, old_path = _setup(tmp_path / f"crash{k}", old, stale)
            fs = CrashingFS(m, crash_at=k)
            with pytest.raises(Crash):
                ex.commit_keeping_previous(new, path)
        what = f"crash at operation {k} of {n_ops} ({fs.calls[-1]})"
        if old:
            _a_complete_checkpoint_exists(path, old_path, what)
        else:
            assert _read(path) in (None, NEW), f"{what}: {path.name} holds a part of a checkpoint"
            if stale:
                assert _read(old_path) == OLDER, f"{what}: with nothing at {path.name}, the older one is all"
        assert _read(path) == NEW or _read(new) == NEW, \
            f"crash at operation {k}: the new checkpoint is neither at {path.name} nor still at {new.name}"


def test_commit_keeping_previous_crash_between_the_renames(ex, tmp_path, monkeypatch):
    new, path, old_path = _setup(tmp_path)
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append((os.fspath(src), os.fspath(dst)))
        if len(calls) == 2:
            raise Crash("down between the two renames")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Crash):
        ex.commit_keeping_previous(new, path)
    monkeypatch.undo()
    assert calls[0] == (str(path), str(old_path)), f"the first rename should move {path.name} aside: {calls}"
    assert _read(old_path) == OLD, "the old checkpoint must survive, whole, at .prev"
    assert _read(new) == NEW, "the new checkpoint, not yet committed, is still whole"


def test_commit_keeping_previous_catches_a_wrong_variant(ex, tmp_path, monkeypatch):
    def delete_then_rename(new, path):  # opens a window with no checkpoint at all
        shutil.rmtree(path)
        os.replace(new, path)

    ex.commit_keeping_previous(*_setup(tmp_path / "ok")[:2])  # the exercise itself first
    new, path, old_path = _setup(tmp_path / "wrong")
    CrashingFS(monkeypatch, crash_at=2)
    with pytest.raises(Crash):
        delete_then_rename(new, path)
    with pytest.raises(AssertionError, match="no complete checkpoint"):
        _a_complete_checkpoint_exists(path, old_path, "delete, then rename")


def test_commit_keeping_previous_rejects_bad_input(ex, tmp_path):
    new, path, _ = _setup(tmp_path)
    ex.commit_keeping_previous(new, path)  # a valid call first
    with pytest.raises(FileNotFoundError, match="not a folder"):
        ex.commit_keeping_previous(tmp_path / "nothing.partial", path)
    (tmp_path / "file").write_text("x")
    _write(tmp_path / "x.partial", NEW)
    with pytest.raises(ValueError, match="not a folder"):
        ex.commit_keeping_previous(tmp_path / "x.partial", tmp_path / "file")


# --- 4. interval_and_waste ------------------------------------------------------------------------------

DAY = 86400.0
WASTE_CASES = [  # (M, C, R) in seconds
    (DAY, 300.0, 0.0),  # Daly's Fig. 3: M = 24 h, C = 5 min
    (6 * 3600.0, 300.0, 120.0),  # Daly's Fig. 4
    (cmr.mtbf_seconds(), 60.0, 600.0),  # Llama 3's interruptions, a one-minute save, ten-minute restart
    (3600.0, 1.0, 30.0),
    (1e6, 1e3, 0.0),
    (100.0, 2.0, 5.0),
]


def _brute_force(M, C, R):
    """The τ of least waste over a fine geometric grid from 1 ms to 10⁸ s, that waste, and the grid's
    ratio of neighbours."""
    tau = np.geomspace(1e-3, 1e8, 400_001)  # neighbours 1.0000633 apart
    waste = C / tau + (tau / 2 + R) / M
    i = int(np.argmin(waste))
    return float(tau[i]), float(waste[i]), float((tau[1:] / tau[:-1]).max())


@pytest.mark.parametrize("M, C, R", WASTE_CASES)
def test_interval_and_waste_brute_force(ex, M, C, R):
    tau, waste = ex.interval_and_waste(M, C, R)
    tau0, waste0, rho = _brute_force(M, C, R)
    rounding = gamma(16, torch.float64)  # each side's few float64 operations
    # within one grid step of the optimum; its waste within ρ³(ρ - 1)² of the least (module docstring)
    assert tau == pytest.approx(tau0, rel=rho - 1 + rounding, abs=0), \
        f"M={M}, C={C}, R={R}: τ = {tau}; the grid's best is {tau0}"
    assert waste == pytest.approx(waste0, rel=rho ** 3 * (rho - 1) ** 2 + rounding, abs=0), \
        f"M={M}, C={C}, R={R}: waste {waste}; the least on the grid is {waste0}"


@pytest.mark.parametrize("M, C, R", WASTE_CASES)
def test_interval_and_waste_closed_forms(ex, M, C, R):
    tau, waste = ex.interval_and_waste(M, C, R)
    assert waste == pytest.approx(math.sqrt(2 * C / M) + R / M, rel=1e-12), "at the optimum: √(2C/M) + R/M"
    assert -C / tau ** 2 + 1 / (2 * M) == pytest.approx(0, abs=1e-12 / M), "the waste's derivative at τ is 0"
    assert C / tau == pytest.approx(tau / (2 * M), rel=1e-12), "at τ saving and lost work cost alike"
    assert waste == pytest.approx(cmr.first_order_waste(tau, M, C, R), rel=1e-12)


@pytest.mark.parametrize("seed", range(5))
def test_interval_and_waste_equals_the_costmodel_on_seeded_inputs(ex, seed):
    rng = random.Random(1300 + seed)
    M = 10 ** rng.uniform(3, 7)
    C, R = M * 10 ** rng.uniform(-6, -2), M * 10 ** rng.uniform(-6, -2) * rng.choice([0, 1])
    tau, waste = ex.interval_and_waste(M, C, R)
    # a square root, a product, a few divisions on each side: rel 1e-12 >> 10·u
    assert tau == pytest.approx(cmr.young_interval(M, C), rel=1e-12)
    assert waste == pytest.approx(cmr.first_order_waste(cmr.young_interval(M, C), M, C, R), rel=1e-12)


def test_interval_and_waste_daly_figure(ex):
    tau, _ = ex.interval_and_waste(DAY, 300.0)
    assert tau == pytest.approx(7200.0), "M = 24 h, C = 5 min: √(2·1440·5) = 120 min"
    # Daly's higher-order optimum, 117 min in his Fig. 3, lies just below Young's
    assert 0.95 < cmr.daly_interval(DAY, 300.0) / tau < 1.0


def test_interval_and_waste_scaling(ex):
    tau, waste = ex.interval_and_waste(3600.0, 10.0)
    tau4, waste4 = ex.interval_and_waste(4 * 3600.0, 10.0)
    assert tau4 == pytest.approx(2 * tau) and waste4 == pytest.approx(waste / 2), \
        "four times the MTBF: twice the interval, half the waste"
    tau_r, waste_r = ex.interval_and_waste(3600.0, 10.0, restart_s=360.0)
    assert tau_r == pytest.approx(tau), "the restart is paid once per failure whatever τ: it does not move τ"
    assert waste_r == pytest.approx(waste + 0.1), "a 360 s restart every 3600 s adds 10 % waste"


def test_interval_and_waste_rejects_bad_input(ex):
    ex.interval_and_waste(100.0, 1.0)  # a valid call first
    with pytest.raises(ValueError, match="mtbf_s"):
        ex.interval_and_waste(0.0, 1.0)
    with pytest.raises(ValueError, match="checkpoint_s"):
        ex.interval_and_waste(100.0, -1.0)
    with pytest.raises(ValueError, match="restart_s"):
        ex.interval_and_waste(100.0, 1.0, restart_s=-1.0)


# --- 5. lost_steps -----------------------------------------------------------------------------------------


def _simulate(fail_step, every, start):
    """Run the job's loop step by step, keeping the latest checkpoint; the steps redone at the failure."""
    latest = start  # what this attempt loaded (or step 0)
    for step in range(start, fail_step + 1):
        if step == fail_step:  # dies mid-step: redo from the latest checkpoint up to and including this one
            return len(range(latest, fail_step + 1))
        if (step + 1) % every == 0:  # finished a step that ends an interval: saved
            latest = step + 1
    raise AssertionError("unreachable")


def test_lost_steps_by_hand(ex):
    assert ex.lost_steps(7, 3) == 2, "checkpoints at 3, 6; a failure in step 7 redoes 6 and 7"
    assert ex.lost_steps(6, 3) == 1, "step_6 was saved just before step 6 began: only step 6 is redone"
    assert ex.lost_steps(2, 3) == 3, "no checkpoint yet: steps 0, 1, 2"
    assert ex.lost_steps(0, 1) == 1, "saving after every step: only the step in progress"


@pytest.mark.parametrize("every", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("start", [0, 4, 6, 10])
def test_lost_steps_brute_force(ex, every, start):
    for fail_step in range(start, start + 3 * every + 2):
        want = _simulate(fail_step, every, start)
        got = ex.lost_steps(fail_step, every, start)
        assert got == want, (f"every {every}, attempt started at step {start}, failure in step {fail_step}: "
                             f"got {got}; the job redoes {want}")


def test_lost_steps_averages_half_an_interval(ex):
    # failures equally likely in every step: (every + 1) / 2 steps on average, τ/2 plus the step itself
    for every in (4, 10, 25):
        mean = sum(ex.lost_steps(s, every) for s in range(every, 101 * every)) / (100 * every)
        assert mean == pytest.approx((every + 1) / 2)


def test_lost_steps_rejects_bad_input(ex):
    ex.lost_steps(5, 2)  # a valid call first
    with pytest.raises(ValueError, match="every"):
        ex.lost_steps(5, 0)
    with pytest.raises(ValueError, match="start"):
        ex.lost_steps(5, 2, start=6)


# --- 6. measure_lost_steps ----------------------------------------------------------------------------------

# (steps, every, fail_step): resumes from 3 and redoes 2; resumes from 2 and redoes 1
LOST_CASES = [(6, 3, 4), (5, 2, 2)]
LOST_CFG = GPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)


@pytest.fixture(scope="module")
def lost_runs(ex, tmp_path_factory):
    """Each case run once by the exercise, in a folder of its own: (its answer, or the error it raised,
    and the folder)."""
    out = {}
    for case in LOST_CASES:
        folder = tmp_path_factory.mktemp("drill")
        steps, every, fail_step = case
        try:
            out[case] = (ex.measure_lost_steps(LOST_CFG, steps, every, fail_step, folder), folder)
        except Exception as e:  # handed to the tests of this case
            out[case] = (e, folder)
    return out


def _lost(lost_runs, case):
    got, folder = lost_runs[case]
    if isinstance(got, Exception):
        raise got
    return got, folder


def _from_the_log(folder):
    """What the job's own log says: (the step the second attempt resumed from, the steps it redid)."""
    import json

    log = folder / "events.jsonl"
    assert log.exists(), \
        f"no job ran in {folder}: a measurement needs a run (its log, events.jsonl, is missing)"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = next(e["step"] for e in events if e["event"] == "start" and e["attempt"] == 1)
    redone = [e for e in events if e["event"] == "step" and e["attempt"] == 0 and e["step"] >= resumed]
    return resumed, len(redone) + 1  # the steps finished since the checkpoint, and the one in progress


@pytest.mark.parametrize("case", LOST_CASES)
def test_measure_lost_steps_measures_the_run(lost_runs, case):
    got, folder = _lost(lost_runs, case)
    resumed, redone = _from_the_log(folder)
    assert got["resumed_from"] == resumed, \
        f"{case}: resumed from {got['resumed_from']}; the log says {resumed}"
    assert got["steps_redone"] == redone, f"{case}: {got['steps_redone']} steps redone; the log says {redone}"


@pytest.mark.parametrize("case", LOST_CASES)
def test_measure_lost_steps_predicts_what_it_measures(lost_runs, case):
    got, _ = _lost(lost_runs, case)
    steps, every, fail_step = case
    assert got["predicted"] == _simulate(fail_step, every, 0), f"{case}: the prediction"
    assert got["predicted"] == got["steps_redone"]


def test_measure_lost_steps_rejects_bad_input(ex, lost_runs, tmp_path):
    _lost(lost_runs, LOST_CASES[0])  # a valid call first
    with pytest.raises(ValueError, match="fail_step"):
        ex.measure_lost_steps(LOST_CFG, 4, 2, 4, tmp_path)
