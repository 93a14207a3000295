"""launch() when things go wrong: the right rank is blamed, nothing outlives a killed caller, and
under torchrun a failure or a hang reaches every rank."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import uuid

import pytest
import torch
import torch.distributed as dist

import minitorch_dist as mtd
from minitorch_dist import comm
from minitorch_dist.runtime.failures import blame, is_peer_gone
from minitorch_dist.runtime.launch import RankError, launch

pytestmark = pytest.mark.ch00
RESET = ("RuntimeError: [../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1234: "
         "Connection reset by peer. This is typically caused by a remote worker hanging")


# --- processes, found by a marker in their environment -------------------------------------


def _marked(marker: str) -> list[int]:
    """PIDs of live processes whose environment holds ``marker`` (zombies have none)."""
    pids, needle = [], marker.encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def _describe(pids: list) -> str:
    """``pid state ppid pgid cmdline`` of each process, for a failure message."""
    rows = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")[:120]
            rows.append(f"{pid} {fields[0]} ppid={fields[1]} pgid={fields[2]} {cmd}")
        except OSError:
            rows.append(f"{pid} (gone)")
    return "; ".join(rows)


def _kill_marked(marker: str) -> None:
    for pid in _marked(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _wait_until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()


# --- blame: which rank, and how it failed ---------------------------------------------------


def test_blame_names_the_cause_not_the_peer_that_lost_it():
    assert is_peer_gone(RESET) and not is_peer_gone("ValueError: bad shape")
    e = blame({0: RESET, 1: "rank 1 died without reporting a result: exited with code 3."}, {1}, 2)
    assert e.rank == 1 and list(e.consequences) == [0] and e.others == ()
    assert "rank 0 then failed as a consequence" in str(e)
    e = blame({2: "ValueError: two", 1: "ValueError: one", 0: RESET}, set(), 4)
    assert (e.rank, e.others, list(e.consequences)) == (1, (2,), [0])
    assert blame({1: RESET, 3: RESET}, set(), 4).rank == 1  # no cause in sight: the lowest


def _exit_3_on_rank_1():
    if mtd.rank() == 1:
        print("rank 1 is leaving", file=sys.stderr, flush=True)
        os._exit(3)
    comm.all_reduce(torch.zeros(4))  # rank 0 then fails with "Connection reset/closed by peer"


def _sigkill_on_rank_1():
    if mtd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    comm.all_reduce(torch.zeros(4))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fn, how", [(_exit_3_on_rank_1, "exited with code 3"),
                                     (_sigkill_on_rank_1, "killed by signal SIGKILL (9)")])
def test_a_rank_that_dies_is_blamed_with_its_exit_and_stderr(fn, how):
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        launch(fn, 2, timeout_s=30)
    assert time.monotonic() - t0 < 10
    e = info.value
    assert e.rank == 1, str(e)
    assert f"rank 1 died without reporting a result: {how}." in str(e)
    if fn is _exit_3_on_rank_1:
        assert "Last 1 lines of its stderr (rank1.err):\n    rank 1 is leaving" in str(e)
    assert set(e.consequences) <= {0}  # rank 0 lost its peer: a consequence, if it failed in time


def _mismatched_all_reduce():
    dist.all_reduce(torch.zeros(3 if mtd.rank() == 1 else 5))


@pytest.mark.timeout(60)
def test_a_gloo_abort_names_the_rank_that_aborted():
    """On torch 2.13 CPU, gloo aborts (SIGABRT) the rank that receives more bytes than it expects
    (here the one with the smaller buffer); its peer then fails with "Connection reset by peer"."""
    with pytest.raises(RankError) as info:
        launch(_mismatched_all_reduce, 2, timeout_s=30)
    e = info.value
    assert e.rank == 1, str(e)
    assert "killed by signal SIGABRT (6)" in str(e)
    assert "Is there a distributed collective mismatch" in e.remote_traceback  # from its stderr
    assert set(e.consequences) <= {0}


class _FailsToUnpickle:
    def __reduce__(self):
        return int, ("not a number",)


def _unpicklable_here():
    return _FailsToUnpickle() if mtd.rank() == 1 else 0


@pytest.mark.timeout(60)
def test_a_result_that_cannot_be_unpickled_names_the_rank_and_the_type():
    with pytest.raises(RankError) as info:
        launch(_unpicklable_here, 2)
    e = info.value
    assert e.rank == 1
    assert "rank 1 returned a" in str(e) and "_FailsToUnpickle" in str(e)
    assert "could not be unpickled in the caller" in str(e) and "ValueError: invalid literal" in str(e)


@pytest.mark.parametrize("world_size, timeout_s, message", [
    (True, 10, "world_size must be a positive int, got True"),
    (2, None, r"timeout_s=None: .* e\.g\. timeout_s=24 \* 3600"),
    (2, 0, "timeout_s must be a positive, finite number of seconds, got 0"),
    (2, -1.5, "got -1.5"),
    (2, float("inf"), "got inf"),
])
def test_bad_world_size_and_timeout_are_clear_errors(world_size, timeout_s, message):
    with pytest.raises(ValueError, match=message):
        launch(abs, world_size, 1, timeout_s=timeout_s)


# --- no orphans ---------------------------------------------------------------------------

PARENT = textwrap.dedent("""
    import os, subprocess, sys, time, torch
    import minitorch_dist as mtd
    def fn(case, pidfile):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(f"{pidfile}.{mtd.rank()}", "w") as f:
            f.write(f"{os.getpid()} {child.pid}")
        if case == "deadlock":  # rank 0 all-reduces, rank 1 waits at a barrier: forever
            mtd.comm.all_reduce(torch.zeros(3)) if mtd.rank() == 0 else mtd.comm.barrier()
        time.sleep(600)
    mtd.launch(fn, 2, sys.argv[1], sys.argv[2], timeout_s=120, start_method=sys.argv[3])
""")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case, sig, start_method", [
    ("sleep", signal.SIGKILL, "fork"), ("deadlock", signal.SIGKILL, "fork"),
    ("deadlock", signal.SIGTERM, "fork"), ("sleep", signal.SIGTERM, "spawn")])
def test_ranks_and_what_they_started_die_with_a_killed_caller(tmp_path, case, sig, start_method):
    marker = f"MTD_TEST_MARKER={uuid.uuid4().hex}"
    tmpdir, script, pidfile = tmp_path / "tmp", tmp_path / "parent.py", tmp_path / "pid"
    tmpdir.mkdir()
    script.write_text(PARENT)
    env = {**os.environ, "TMPDIR": str(tmpdir), marker.split("=")[0]: marker.split("=")[1]}
    parent = subprocess.Popen([sys.executable, str(script), case, str(pidfile), start_method], env=env,
                              start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        started = _wait_until(lambda: all(os.path.exists(f"{pidfile}.{r}") for r in (0, 1)), 40)
        assert started, parent.stderr.read().decode()[-2000:] if parent.poll() is not None else "no ranks"
        assert len(_marked(marker)) >= 6  # parent, reaper, 2 ranks, 2 grandchildren
        assert list(tmpdir.glob("mtd-launch-*"))
        parent.send_signal(sig)
        parent.wait(timeout=10)
        assert _wait_until(lambda: not _marked(marker), 5), f"left running: {_describe(_marked(marker))}"
        assert _wait_until(lambda: not list(tmpdir.glob("mtd-launch-*")), 5), "the run folder remains"
    finally:
        parent.kill()
        parent.wait()
        _kill_marked(marker)


ORPHAN = textwrap.dedent("""
    import os, sys, time
    from minitorch_dist.runtime import supervise
    supervise.set_parent_death_signal = lambda sig=None: False  # as on macOS: the watchdog alone
    os.setpgrp()
    supervise.die_with_parent(int(sys.argv[1]), sys.argv[2])
    open(sys.argv[3], "w").close()
    time.sleep(600)
""")


@pytest.mark.timeout(60)
def test_without_the_kernels_help_the_watchdog_ends_an_orphan(tmp_path):
    """The parent's PID is captured before the child starts; once the parent is gone the child
    removes the run folder and kills its own process group."""
    rundir, ready, marker = tmp_path / "mtd-launch-x", tmp_path / "ready", uuid.uuid4().hex
    rundir.mkdir()
    middle = ("import os, subprocess, sys, time; "
              "subprocess.Popen([sys.executable, '-c', sys.argv[1], str(os.getpid()), *sys.argv[2:]]); "
              "time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", middle, ORPHAN, str(rundir), str(ready)],
                              env={**os.environ, "MTD_TEST_MARKER": marker}, start_new_session=True)
    try:
        assert _wait_until(ready.exists, 40)
        parent.kill()
        parent.wait(timeout=10)
        assert _wait_until(lambda: not _marked(marker), 5), f"left running: {_describe(_marked(marker))}"
        assert not rundir.exists()
    finally:
        parent.kill()
        parent.wait()
        _kill_marked(marker)


# --- under torchrun -------------------------------------------------------------------------

UNDER_TORCHRUN = textwrap.dedent("""
    import sys, time, torch, minitorch_dist as mtd
    case, timeout_s = sys.argv[1], float(sys.argv[2])
    def f(x):
        if case == "raise" and mtd.rank() == 1:
            raise ValueError("rank one is unhappy")
        if case == "hang":
            mtd.comm.all_reduce(torch.zeros(3)) if mtd.rank() == 0 else time.sleep(600)
        t = torch.tensor([mtd.rank() + x]); mtd.comm.all_reduce(t); return (mtd.rank(), t.item())
    out = mtd.launch(f, 2, 1.0, timeout_s=timeout_s)
    sys.stdout.write(f"RESULT {mtd.rank()} {out}\\n")  # one write: the ranks share the pipe
""")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _run_all(cmds: list, tmp_path, timeout: float) -> list:
    """Run the commands at once (each in its own session), bounded; kill everything they started."""
    script = tmp_path / "under_torchrun.py"
    script.write_text(UNDER_TORCHRUN)
    marker = uuid.uuid4().hex
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MTD_TEST_MARKER": marker}
    procs = [subprocess.Popen([*TORCHRUN, *c[:-2], str(script), *c[-2:]], env=env, text=True,
                              start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for c in cmds]
    try:
        return [(p.communicate(timeout=timeout)[0], p.returncode) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
        _kill_marked(marker)


@pytest.mark.timeout(60)
def test_under_torchrun_results_are_gathered(tmp_path):
    [(out, rc)] = _run_all([["--standalone", "--nproc-per-node", "2", "ok", "30"]], tmp_path, 50)
    assert rc == 0, out[-3000:]
    assert "RESULT 0 [(0, 3.0), (1, 3.0)]" in out and "RESULT 1 [(0, 3.0), (1, 3.0)]" in out


@pytest.mark.timeout(60)
def test_under_torchrun_a_raising_rank_ends_every_rank_with_its_error(tmp_path):
    t0 = time.monotonic()
    [(out, rc)] = _run_all([["--standalone", "--nproc-per-node", "2", "raise", "30"]], tmp_path, 50)
    assert rc != 0
    assert time.monotonic() - t0 < 30  # well within timeout_s: the failure is shared at once
    # rank 1 raises it; rank 0, blocked in an all-reduce rank 1 never joins, prints it and ends
    assert "[rank1]: minitorch_dist.runtime.failures.RankError: rank 1 of 2 failed:" in out, out
    assert "[rank 0] launch: a peer failed while this rank was still in fn (last op: in all_reduce" in out
    assert out.count("RankError: rank 1 of 2 failed:") == 2
    assert out.count("ValueError: rank one is unhappy") >= 2
    assert "rank      : 1" in out.split("Root Cause")[1]  # torchrun's own summary blames rank 1


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_torchrun_a_hang_becomes_launch_timeout(tmp_path):
    timeout_s = 4
    t0 = time.monotonic()
    [(out, rc)] = _run_all([["--standalone", "--nproc-per-node", "2", "hang", str(timeout_s)]], tmp_path, 50)
    assert rc != 0
    assert timeout_s <= time.monotonic() - t0 < timeout_s + 20
    assert "LaunchTimeout: launch timed out after 4 s" in out, out
    assert "rank 0: in all_reduce float32[3] on 2 ranks" in out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_under_torchrun_two_nodes_meet_through_c10d_rendezvous(tmp_path):
    """Two "nodes" on this machine, as the README runs many: torchrun --nnodes 2 with a c10d
    rendezvous at 127.0.0.1:<a free port>."""
    node = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    runs = _run_all([[*node, "--node-rank", str(i), "ok", "30"] for i in (0, 1)], tmp_path, 50)
    for out, rc in runs:
        assert rc == 0, out[-3000:]
    both = "".join(out for out, _ in runs)
    assert "RESULT 0 [(0, 3.0), (1, 3.0)]" in both and "RESULT 1 [(0, 3.0), (1, 3.0)]" in both

