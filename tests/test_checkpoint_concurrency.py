"""Chapter 13: checkpoints under concurrency, and the errors of the cases that used to go wrong quietly.

**Two savers, one path.** Two processes save different weights to the same checkpoint at the same
moment, 20 times: afterwards the checkpoint is always one whole save (its metadata — the ``step`` —
and its tensors from the same save, every element), never a mix, never damaged, never gone; both
saves succeed (the second waits for the first's lock, :class:`.storage.SaveLock`); no staging
folder is left behind. **A reader during commits.** One process loops loads while another commits 20
saves of the same path: every load is exactly one save (metadata and tensors agree), or a clear
:class:`CheckpointError` that is retried; zero wrong tensors. Both print their counts.

**Bad cases.** Metadata without ``files`` or ``tensors`` (the key and the file named); a path that
is a file (said so, for a load and a save); a full disk (a real limit: ``RLIMIT_FSIZE`` in a
subprocess, EFBIG; and a 1.5 MiB tmpfs where this machine lets us mount one, ENOSPC): said so, the
staging folder removed, the previous checkpoint intact and loadable; a save that waits for another
save of the path and gives up naming the holder, then goes through once the holder dies (the OS
drops its lock); a script that exits right after ``async_save`` (no abort, the checkpoint on disk);
a rank function under ``launch`` that returns right after ``async_save`` (the checkpoint exists and
loads once ``launch`` returns); a rank whose part of a save fails ends it on every rank at once (the
previous checkpoint intact).

The weights are whole-number floats (save ``i`` writes ``i`` and ``-i``), compared exactly.
"""
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from minitorch_dist.resilience import CheckpointError, async_save, load, read_dense, save
from minitorch_dist.resilience.storage import lock_file, staging_dirs
from minitorch_dist.runtime.launch import launch

pytestmark = [pytest.mark.ch13, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
N = 1 << 17  # elements per tensor: two tensors of 512 KiB, so that a save takes a while
TRIALS = 20


def _state(i: int) -> dict:
    return {"model": {"a": torch.full((N,), float(i)), "b": torch.full((N,), -float(i))}, "step": i}


def _which_save(path) -> int:
    """The save whose weights the checkpoint at ``path`` holds; an AssertionError names a mix."""
    state = {"model": {"a": torch.zeros(N), "b": torch.zeros(N)}, "step": -1}
    load(state, path)
    i = state["step"]
    a, b = state["model"]["a"], state["model"]["b"]
    mixed = {"metadata": i, "a": sorted(set(a.unique().tolist())), "b": sorted(set((-b).unique().tolist()))}
    assert torch.equal(a, torch.full((N,), float(i))) and torch.equal(b, torch.full((N,), -float(i))), mixed
    return i


def _run(code: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env=env)


def _kill(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(10)


# --- two savers, one path -------------------------------------------------------------------------------


def _saver(path: str, i: int, start, errors) -> None:
    torch.set_num_threads(1)
    start.wait(30)
    time.sleep(random.Random(i).uniform(0, 0.02))  # either may go first
    try:
        save(_state(i), path, timeout_s=60)
    except BaseException as e:  # counted by the test
        errors.put(f"save {i}: {type(e).__name__}: {e}")
        raise


@pytest.mark.slow
def test_two_savers_of_one_path_never_mix_damage_or_lose_it(tmp_path):
    ctx = mp.get_context("fork")
    path = tmp_path / "ck"
    save(_state(0), path)
    errors = ctx.Queue()
    wrong = lost = 0
    for trial in range(TRIALS):
        i, j = 2 * trial + 1, 2 * trial + 2
        start = ctx.Barrier(2)
        procs = [ctx.Process(target=_saver, args=(str(path), k, start, errors)) for k in (i, j)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(90)
        finally:
            _kill(procs)
        why = errors.get(timeout=1) if not errors.empty() else "a saver was killed (hung)"
        assert [p.exitcode for p in procs] == [0, 0], why
        try:
            got = _which_save(path)
            wrong += got not in (i, j)
        except CheckpointError:
            lost += 1
        except AssertionError:
            wrong += 1
        assert not staging_dirs(path), staging_dirs(path)
    print(f"two savers x {TRIALS} trials: wrong tensors: {wrong}, lost checkpoints: {lost}")
    assert (wrong, lost) == (0, 0)


# --- a reader while saves commit ------------------------------------------------------------------------


def _writer(path: str, first: int, count: int) -> None:
    torch.set_num_threads(1)
    pause = random.Random(first)
    for i in range(first, first + count):
        save(_state(i), path, timeout_s=60)
        time.sleep(pause.uniform(0, 0.1))  # commits at varying points of the reader's loads


@pytest.mark.slow
def test_a_reader_during_commits_always_loads_one_whole_save(tmp_path):
    path = tmp_path / "ck"
    save(_state(0), path)
    writer = mp.get_context("fork").Process(target=_writer, args=(str(path), 1, TRIALS))
    loads, wrong, retried, seen = 0, 0, 0, set()
    try:
        writer.start()
        deadline = time.monotonic() + 240
        while writer.is_alive() and time.monotonic() < deadline:
            try:
                seen.add(_which_save(path))
                loads += 1
            except CheckpointError:
                retried += 1  # a clear error; the next load is another try
            except AssertionError:
                wrong += 1
        writer.join(30)
    finally:
        _kill([writer])
    assert writer.exitcode == 0
    assert _which_save(path) == TRIALS
    print(f"reader during {TRIALS} commits: {loads} loads, wrong tensors: {wrong}, clear errors retried: "
          f"{retried}, saves seen: {len(seen)}")
    assert wrong == 0 and loads > 0


# --- bad cases -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["files", "tensors"])
def test_metadata_without_files_or_tensors_names_the_key_and_the_file(tmp_path, key):
    path = tmp_path / "ck"
    save(_state(1), path)
    meta = json.loads((path / "metadata.json").read_text())
    del meta[key]
    (path / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=rf"ck/metadata.json has no '{key}' entry .* damaged"):
        _which_save(path)


def test_a_path_that_is_a_file_is_said_to_be_a_file(tmp_path):
    path = tmp_path / "model.pt"
    torch.save({"w": torch.ones(2)}, path)
    with pytest.raises(CheckpointError, match="model.pt: it is a file, not a checkpoint folder"):
        _which_save(path)
    with pytest.raises(CheckpointError, match="cannot save to .*model.pt: it is a file, not a checkpoint"):
        save(_state(1), path)
    assert path.is_file() and not staging_dirs(path)


_FILL_THE_LIMIT = """
import resource, signal, sys, time
import torch
from minitorch_dist.resilience import CheckpointError, save
path, n = sys.argv[1], int(sys.argv[2])
save({"model": {"a": torch.full((n,), 1.0), "b": torch.full((n,), -1.0)}, "step": 1}, path)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (n * 6, n * 6))  # the new file (8n bytes) does not fit
t0 = time.perf_counter()
try:
    save({"model": {"a": torch.full((n,), 2.0), "b": torch.full((n,), -2.0)}, "step": 2}, path)
except CheckpointError as e:
    print(f"{time.perf_counter() - t0:.3f} s: {e}")
"""


def test_a_full_disk_is_said_so_and_the_previous_checkpoint_stays(tmp_path):
    path = tmp_path / "ck"
    done = _run(_FILL_THE_LIMIT, path, N)
    assert done.returncode == 0, done.stderr[-2000:]
    print(done.stdout)
    assert "the disk is full: writing" in done.stdout and "EFBIG" in done.stdout, done.stdout + done.stderr
    assert "rank00000.pt" in done.stdout and "unexpected pos" not in done.stdout
    assert not staging_dirs(path)  # no half-written save keeps the space
    assert _which_save(path) == 1  # the previous checkpoint, whole


def test_a_full_tmpfs_is_said_so_and_its_space_given_back(tmp_path):
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mnt)],
                             capture_output=True, text=True, timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        path = mnt / "ck"
        save(_state(1), path)  # 1 MiB of tensors: the disk is nearly full
        with pytest.raises(CheckpointError, match=r"the disk is full: writing .*ck.partial-\w+/rank00000.pt "
                                                  r"failed with ENOSPC"):
            save(_state(2), path)
        assert not staging_dirs(path)
        assert _which_save(path) == 1
        save({"step": 3}, mnt / "small_one")  # the failed save's space was given back
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


_HOLD_THE_LOCK = """
import sys, time
from minitorch_dist.resilience.storage import SaveLock
SaveLock(sys.argv[1], 10)
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_save_waits_then_names_the_holder_and_a_dead_holder_frees_the_path(tmp_path):
    path = tmp_path / "ck"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_LOCK, str(path)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.perf_counter()
        with pytest.raises(CheckpointError, match=rf"another save of .*ck \(process {holder.pid} on .*\) has "
                                                  r"held ck.lock for more than 1 s"):
            save(_state(1), path, timeout_s=1)
        waited = time.perf_counter() - t0
        assert 1 <= waited < 30 and not path.exists() and not staging_dirs(path)
    finally:
        holder.kill()
        holder.wait(30)
    save(_state(2), path, timeout_s=30)  # the OS released the dead holder's lock
    assert _which_save(path) == 2 and lock_file(path).exists()


_EXIT_AFTER_ASYNC_SAVE = """
import sys
import torch
from minitorch_dist.resilience import async_save
n = int(sys.argv[2])
async_save({"model": {"a": torch.full((n,), 5.0), "b": torch.full((n,), -5.0)}, "step": 5}, sys.argv[1])
"""


def test_a_script_that_exits_right_after_async_save_finishes_it(tmp_path):
    path = tmp_path / "ck"
    done = _run(_EXIT_AFTER_ASYNC_SAVE, path, N)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert _which_save(path) == 5


def _async_save_and_return(path: str) -> str:
    r = dist.get_rank()
    async_save({"model": {f"r{r}": torch.full((N,), float(r + 1))}, "step": 7}, path)
    return "returned"


def test_a_rank_that_returns_right_after_async_save_under_launch_has_saved(tmp_path):
    path = tmp_path / "ck"
    assert launch(_async_save_and_return, 2, str(path), timeout_s=120) == ["returned", "returned"]
    dense = read_dense(path)  # right after launch: on disk, whole
    assert sorted(dense) == ["model.r0", "model.r1"]
    assert torch.equal(dense["model.r0"], torch.full((N,), 1.0))
    assert torch.equal(dense["model.r1"], torch.full((N,), 2.0))


class _UnwritableOnRank1:
    """A per-rank value that rank 1 cannot write (a function does not pickle): its part of the save fails."""

    per_rank = True

    def to_saved(self):
        return (lambda: 0) if dist.get_rank() == 1 else 0

    def restore(self, saved):
        pass


def _save_twice_second_fails(path: str) -> None:
    r = dist.get_rank()
    save({"model": {f"r{r}": torch.full((N,), 1.0)}, "step": 1}, path)
    save({"model": {f"r{r}": torch.full((N,), 2.0)}, "step": 2, "bad": _UnwritableOnRank1()}, path)


def test_a_rank_whose_part_fails_ends_the_save_on_every_rank_at_once(tmp_path):
    path = tmp_path / "ck"
    t0 = time.perf_counter()
    with pytest.raises(Exception, match=r"rank 1 could not write .*rank00001.pt"):
        launch(_save_twice_second_fails, 2, str(path), timeout_s=120)
    assert time.perf_counter() - t0 < 60  # rank 0 read rank 1's note: no wait for the save's timeout
    dense = read_dense(path)  # the first save, whole
    assert torch.equal(dense["model.r0"], torch.full((N,), 1.0))
    assert torch.equal(dense["model.r1"], torch.full((N,), 1.0))
    save({"step": 3}, path)  # launch may have killed rank 0 before it removed the staging folder: the
    assert not staging_dirs(path)  # next save of the path removes it
