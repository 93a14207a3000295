"""Chapter 13, held-out: an incremental checkpoint of a 3-D tensor whose base save lost a piece (steps 2,
9 and 10, listed oldest last, the step-10 piece in a local shape of its own); writers on three ranks
with a tie in finish time between ranks of different bandwidths, and equal bandwidths other than 1;
the commit of checkpoints with a nested folder, given as strings under a dotted name, interrupted at
each of its file-system operations; Young's interval where it comes out whole, the steps lost when the
attempt started from a checkpoint off the save schedule; and a real job that redoes three steps.

Expected values are exact: worked by hand, the library's own planner (``_writers``) for equal
bandwidths, the folders' files read back (contents and inodes), and the job's own log. Young's interval
and waste are a square root and a few divisions of float64 numbers: rel 1e-12 >> k·u.
"""
import json
import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from minitorch_dist.models.gpt import GPTConfig
from minitorch_dist.resilience.checkpoint import _writers

pytestmark = [pytest.mark.ch13, pytest.mark.timeout(120)]


# --- gather_latest_pieces: a lost piece, three saves -------------------------------------------------

SHAPE = (2, 3, 4)  # 24 elements, d[i] = i + 0.5


def _d(positions, plus=0.0):
    return torch.tensor(positions, dtype=torch.float64) + 0.5 + plus


def test_gather_latest_pieces_held_out_a_lost_piece(ex):
    # the base at step 2: three runs of 8 like FSDP on 3 ranks, but the middle one ([8, 16)) was lost
    base = [(2, torch.arange(0, 8), _d(range(0, 8))), (2, torch.arange(16, 24), _d(range(16, 24)))]
    # step 9 re-saved [8, 16) (+500) as a (2, 4) tensor; step 10 every 4th element from 1 (+1000) as (3, 2)
    at9 = (9, torch.arange(8, 16), _d(range(8, 16), 500).reshape(2, 4))
    at10 = (10, torch.arange(1, 24, 4), _d(range(1, 24, 4), 1000).reshape(3, 2))
    pieces = [at10, base[0], at9, base[1]]  # the oldest listed last
    want = torch.tensor([9, 13, 8, 0, 1, 23, 21, 9, 15])
    got = ex.gather_latest_pieces(pieces, SHAPE, want)
    expect = torch.tensor([1009.5, 1013.5, 508.5, 0.5, 1001.5, 23.5, 1021.5, 1009.5, 515.5],
                          dtype=torch.float64)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, expect, rtol=0, atol=0)
    # without step 9: of 8, 9, 10, 11, 12, 0 only 9 (step 10) and 0 (base) are held: 4 uncovered
    with pytest.raises(ValueError) as info:
        ex.gather_latest_pieces([at10, *base], SHAPE, torch.tensor([8, 9, 10, 11, 12, 0]))
    assert re.search(r"\b4\b", str(info.value)), \
        f"4 wanted elements are uncovered; the error says: {info.value}"
    # ...but a rank that wants only what the saves hold loads, although [8, 16) is incomplete
    got = ex.gather_latest_pieces([*base, at10], SHAPE, torch.tensor([13, 9, 7, 16]))
    torch.testing.assert_close(got, torch.tensor([1013.5, 1009.5, 7.5, 16.5], dtype=torch.float64),
                               rtol=0, atol=0)


# --- plan_writers_by_bandwidth: a tie in time, equal bandwidths ------------------------------------------


def test_plan_writers_by_bandwidth_held_out_a_tie_in_time(ex):
    plans = [[("c", "k", 3), ("b", "k", 2), ("a", "k", 2)],  # listed out of order
             [("b", "k", 2), ("c", "k", 3), ("a", "k", 2)],
             [("c", "k", 3)]]
    # a: rank 0 at 2/1 = 2 s, rank 1 at 2/2 = 1 s -> 1.  b: rank 0 at 2/1 = 2, rank 1 at (2 + 2)/2 = 2:
    # a tie -> rank 0.  c: rank 0 at (2 + 3)/1 = 5, rank 1 at (2 + 3)/2 = 2.5, rank 2 at 3/3 = 1 -> 2
    got = ex.plan_writers_by_bandwidth(plans, [1.0, 2.0, 3.0])
    assert got == {("a", "k"): 1, ("b", "k"): 0, ("c", "k"): 2}


def _three_rank_plans(seed):
    """Three ranks: replicated biases, weights cut in thirds, a pair (ranks 0 and 2) sharing a buffer."""
    rng = random.Random(seed)
    plans = [[] for _ in range(3)]
    for i in range(5):
        w, b = rng.choice([12, 48, 300, 3000]), rng.choice([4, 8, 40])
        for r in range(3):
            plans[r] += [(f"h.{i}.w", f"third{r}", w // 3), (f"h.{i}.b", "whole", b)]
        buf = rng.choice([8, 16, 640])
        for r in (0, 2):
            plans[r].append((f"h.{i}.buf", "pair", buf))
    for plan in plans:
        rng.shuffle(plan)
    return plans


def test_plan_writers_by_bandwidth_held_out_equal_bandwidths(ex):
    for seed in range(3):
        plans = _three_rank_plans(seed)
        got = ex.plan_writers_by_bandwidth(plans, [5e8] * 3)  # equal, not 1: in seconds the rule is in bytes
        assert got == _writers(plans), f"seed {seed}: differs from the save's own planner"


# --- commit_keeping_previous: a nested checkpoint, interrupted at each operation -----------------------

OLD = {"metadata.json": b'{"step": 4}', "shards/rank00000.pt": b"old " * 40}
NEW = {"metadata.json": b'{"step": 8}', "shards/rank00000.pt": b"new " * 40, "shards/rank00001.pt": b"n1"}
OLDER = {"metadata.json": b'{"step": 0}', "shards/rank00000.pt": b"older " * 40}


class _Crash(Exception):
    pass


def _crash_at(monkeypatch, k, calls):
    """Make the k-th file-system operation of the commit (not one inside another) raise before it acts."""
    inside = []

    def wrap(name, real):
        def op(*args, **kwargs):
            if inside:
                return real(*args, **kwargs)
            calls.append(name)
            if len(calls) == k:
                raise _Crash(name)
            inside.append(1)
            try:
                return real(*args, **kwargs)
            finally:
                inside.pop()
        return op

    for mod, name in ((os, "replace"), (os, "rename"), (shutil, "rmtree"), (shutil, "move"),
                      (shutil, "copytree")):
        monkeypatch.setattr(mod, name, wrap(name, getattr(mod, name)))


def _write(folder, files):
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def _read(folder):
    if not folder.is_dir():
        return None
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _setup(root, old, stale):
    path, new = root / "run.v2.step_000008", root / "run.v2.step_000008.partial"
    prev = root / "run.v2.step_000008.prev"
    _write(new, NEW)
    if old:
        _write(path, OLD)
    if stale:
        _write(prev, OLDER)
    return new, path, prev


def test_commit_keeping_previous_held_out_interrupted_at_each_point(ex, tmp_path, monkeypatch):
    for old, stale in ((True, True), (True, False), (False, True)):
        _commit_interrupted(ex, tmp_path / f"old{old:d}-stale{stale:d}", monkeypatch, old, stale)


def _commit_interrupted(ex, root, monkeypatch, old, stale):
    new, path, prev = _setup(root / "whole", old, stale)
    inode = (new / "shards" / "rank00001.pt").stat().st_ino
    calls = []
    with monkeypatch.context() as m:
        _crash_at(m, None, calls)
        out = ex.commit_keeping_previous(str(new), str(path))
    assert Path(out) == path
    assert _read(path) == NEW and not new.exists()
    assert (path / "shards" / "rank00001.pt").stat().st_ino == inode, "the new checkpoint was copied in"
    assert _read(prev) == (OLD if old else OLDER), f"{prev.name}: {_read(prev) and sorted(_read(prev))}"
    assert sorted(p.name for p in (root / "whole").iterdir()) == sorted({path.name, prev.name}), \
        "only the checkpoint and the one kept beside it remain"
    for k in range(1, len(calls) + 1):
        new, path, prev = _setup(root / f"crash{k}", old, stale)
        with monkeypatch.context() as m:
            seen = []
            _crash_at(m, k, seen)
            with pytest.raises(_Crash):
                ex.commit_keeping_previous(str(new), str(path))
        what = f"crash before operation {k} of {len(calls)} ({seen[-1]})"
        at_path = _read(path)
        assert at_path in (None, OLD, NEW), f"{what}: {path.name} holds a part of a checkpoint"
        if old:
            assert at_path in (OLD, NEW) or _read(prev) == OLD, f"{what}: no complete checkpoint anywhere"
        else:
            assert _read(prev) == OLDER, f"{what}: with nothing at {path.name} the older one is all there is"
        assert at_path == NEW or _read(new) == NEW, f"{what}: the new checkpoint is lost"


# --- the derive exercises, by hand ---------------------------------------------------------------------


def test_interval_and_waste_and_lost_steps_held_out_by_hand(ex):
    tau, waste = ex.interval_and_waste(200.0, 1.0, 20.0)
    assert tau == pytest.approx(20.0, rel=1e-12), "√(2·200·1) = 20 s"
    assert waste == pytest.approx(0.2, rel=1e-12), "1/20 + (20/2 + 20)/200 = 0.05 + 0.15"
    tau, waste = ex.interval_and_waste(5e4, 10.0, 100.0)
    assert tau == pytest.approx(1000.0, rel=1e-12) and waste == pytest.approx(0.022, rel=1e-12)
    # an attempt that loaded a checkpoint off the schedule (step 9; saves at multiples of 4)
    assert ex.lost_steps(10, 4, start=9) == 2, "no save since step 9 yet: redo 9 and 10"
    assert ex.lost_steps(12, 4, start=9) == 1, "step_12 was saved just before step 12 began"
    assert ex.lost_steps(11, 5, start=3) == 2, "from step_10: redo 10 and 11"
    assert ex.lost_steps(5, 100, start=2) == 4, "no save this attempt: redo 2, 3, 4, 5"
    assert ex.lost_steps(13, 13, start=13) == 1


# --- measure_lost_steps: a job that redoes three steps -----------------------------------------------------

LOST_CFG = GPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)


def test_measure_lost_steps_held_out_three_steps_redone(ex, tmp_path):
    # saves at 3 and 6; rank 1 dies in step 5: the second attempt resumes from 3 and redoes 3, 4, 5
    got = ex.measure_lost_steps(LOST_CFG, 7, 3, 5, tmp_path)
    log = tmp_path / "events.jsonl"
    assert log.exists(), "no job ran: a measurement needs a run (its log, events.jsonl, is missing)"
    events = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = next(e["step"] for e in events if e["event"] == "start" and e["attempt"] == 1)
    assert resumed == 3, "sanity: the job resumed from step_3"
    assert (got["predicted"], got["resumed_from"], got["steps_redone"]) == (3, 3, 3), got
