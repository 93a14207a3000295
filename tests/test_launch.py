"""launch(): results in rank order, by-value functions, loud failures, hang reports, clean teardown."""
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

import minitorch_dist as mtd
from minitorch_dist import comm
from minitorch_dist.runtime.launch import LaunchTimeout, RankError, launch

pytestmark = pytest.mark.ch00


def _rank_and_args(a, b):
    return (mtd.rank(), mtd.world_size(), a + b, torch.get_num_threads(), str(mtd.device()))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_results_come_back_in_rank_order(n):
    out = launch(_rank_and_args, n, 3, 4)
    assert out == [(r, n, 7, 1, "cpu") for r in range(n)]  # one intra-op thread per CPU rank


def _notebook_cell_function():
    """Build a function the way a notebook cell does: its module (``__main__`` of a kernel) is not
    importable in the ranks, and it reads a global of that cell. Only serialisation by value works."""
    cell = textwrap.dedent("""
        import torch
        import torch.distributed as dist
        SCALE = 10.0                      # a global the function reads
        def cell_fn(x):
            t = torch.tensor([float(dist.get_rank())]) * SCALE + x
            dist.all_reduce(t)
            return t.item()
    """)
    ns = {"__name__": "notebook_cell_not_importable"}
    exec(compile(cell, "<notebook cell>", "exec"), ns)
    return ns["cell_fn"]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_notebook_defined_function_with_a_global_runs_on_4_ranks(start_method):
    fn = _notebook_cell_function()
    out = launch(fn, 4, 1.0, start_method=start_method)
    assert out == [4 * 1.0 + 10.0 * (0 + 1 + 2 + 3)] * 4


def _print_per_rank():
    print(f"I am rank {mtd.rank()}")
    return None


def test_rank_prints_are_shown_in_rank_order(capsys):
    launch(_print_per_rank, 3)
    assert capsys.readouterr().out.splitlines() == [f"[rank {r}] I am rank {r}" for r in range(3)]


def test_the_profilers_start_and_stop_marks_are_not_echoed(tmp_path, capsys):
    """torch's profiler prints a timestamped mark at each start and stop: noise in a notebook."""
    from minitorch_dist.runtime.launch import _echo_outputs
    (tmp_path / "rank0.err").write_text(
        "USDT:2026-12-07 12:50:09 32025:32025 SyncActivityProfilerHandler.cpp:52] profiler_start\n"
        "STAGE:2026-12-07 22:06:30 8420:8420 SyncActivityProfilerHandler.cpp:51] Completed Stage: Warm Up\n"
        "a warning the rank printed\n")
    _echo_outputs(str(tmp_path), 1)
    assert capsys.readouterr().err.splitlines() == ["[rank 0] a warning the rank printed"]


def _raise_on_rank_1():
    if mtd.rank() == 1:
        raise ValueError("rank one is unhappy")
    comm.all_reduce(torch.zeros(4))  # the others block: launch must not wait for them
    return "unreachable"


def test_a_raising_rank_reaches_the_caller_with_its_traceback_and_nothing_is_left_running():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(_raise_on_rank_1, 4, timeout_s=60)
    assert time.monotonic() - t0 < 20  # not the 60 s timeout: the failure is reported at once
    e = info.value
    assert e.rank == 1
    assert "rank 1 of 4 failed" in str(e)
    assert "ValueError: rank one is unhappy" in e.remote_traceback
    assert "_raise_on_rank_1" in e.remote_traceback  # the rank's own frames, not the caller's
    assert mp.active_children() == []


def _hang_on_rank_0():
    if mtd.rank() == 0:
        comm.all_reduce(torch.zeros(3))  # rank 1 never joins this all-reduce
    else:
        comm.barrier()
        time.sleep(600)


def test_a_hang_becomes_an_error_naming_each_ranks_last_op():
    timeout = 4
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_hang_on_rank_0, 2, timeout_s=timeout)
    assert time.monotonic() - t0 <= timeout + 15
    e = info.value
    assert e.last_ops[0].startswith("in all_reduce float32[3] on 2 ranks")
    assert e.last_ops[1] == "in barrier"
    assert "rank 0: in all_reduce" in str(e) and "rank 1: in barrier" in str(e)
    assert mp.active_children() == []


def _start_a_grandchild_then_hang(pidfile):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(pidfile, "w") as f:
        f.write(str(p.pid))
    time.sleep(600)


def test_timeout_kills_what_the_ranks_started(tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(LaunchTimeout):
        launch(_start_a_grandchild_then_hang, 1, str(pidfile), timeout_s=3)
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        try:  # a killed grandchild is a zombie until init reaps it: count that as gone
            if open(f"/proc/{pid}/stat").read().split()[2] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        os.kill(pid, 9)
        pytest.fail("a process started by a rank outlived the launch")


def _return_unpicklable():
    import threading
    return threading.Lock()


def test_an_unpicklable_result_is_a_clear_error():
    with pytest.raises(RankError, match="lock"):
        launch(_return_unpicklable, 2)


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        launch(_rank_and_args, 0, 1, 2)
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="needs one GPU per rank"):
            launch(_rank_and_args, 2, 1, 2, backend="nccl")


def _sum_ranks():
    t = torch.tensor([mtd.rank() + 1.0])
    comm.all_reduce(t)
    return t.item()


def test_two_launches_at_once_do_not_collide(tmp_path):
    """Two programs launching at the same moment (two notebooks, two test runs) each get their own
    rendezvous: no port, no shared file."""
    script = tmp_path / "two.py"
    script.write_text(textwrap.dedent("""
        import sys, torch, minitorch_dist as mtd
        def f():
            t = torch.tensor([mtd.rank() + 1.0]); mtd.comm.all_reduce(t); return t.item()
        n = int(sys.argv[1])
        for _ in range(5):
            assert mtd.launch(f, n) == [n * (n + 1) / 2] * n
        print("ok", n)
    """))
    procs = [subprocess.Popen([sys.executable, str(script), str(n)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for n in (2, 4)]
    for p, n in zip(procs, (2, 4)):
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert out.strip() == f"ok {n}"


@pytest.mark.slow
def test_fifty_launches_in_a_row_tear_down_cleanly():
    """gloo has been seen to SIGABRT a rank at destroy_process_group; the barrier before it (and
    leaving with os._exit once the result is sent) must make teardown reliable."""
    for i in range(50):
        assert launch(_sum_ranks, 4, timeout_s=60) == [10.0] * 4, f"launch {i}"
    assert mp.active_children() == []

