"""launch() refuses what would hurt the machine, and leaves nothing behind: a world size beyond the
per-core limit, unsupported settings, a deadline that counts start-up, what a rank started in a
session of its own, and ranks whose torchrun died."""
import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

from minitorch_dist.runtime import env, supervise
from minitorch_dist.runtime.launch import LaunchTimeout, RankError, launch

pytestmark = pytest.mark.ch00


def _alive(pid: int) -> bool:
    """Is ``pid`` a live process (a zombie is dead: it only waits to be reaped)?"""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return False


def _wait_until(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# --- the per-core limit ---------------------------------------------------------------------


def test_a_world_size_beyond_the_per_core_limit_is_refused_at_once():
    too_many = env.RANKS_PER_CORE * env.usable_cores() + 1
    t0 = time.monotonic()
    override = r"launch\(\.\.\., oversubscribe=True\) or set MTD_OVERSUBSCRIBE=1"
    with pytest.raises(ValueError, match=override) as info:
        launch(abs, too_many, 1)
    assert time.monotonic() - t0 < 1
    assert f"launch(world_size={too_many})" in str(info.value)
    assert f"the limit is {env.RANKS_PER_CORE} ranks per core" in str(info.value)
    with pytest.raises(ValueError, match="fewer ranks"):
        launch(abs, 1000, 1)


def test_the_limit_leaves_room_for_every_course_run_even_on_one_core(monkeypatch):
    monkeypatch.setattr(env, "usable_cores", lambda: 1)
    env.check_world_size(8, None)  # the largest launch of the course
    with pytest.raises(ValueError, match="limit is 8 ranks per core"):
        env.check_world_size(9, None)
    env.check_world_size(9, True)
    monkeypatch.setenv("MTD_OVERSUBSCRIBE", "1")
    env.check_world_size(9, None)
    env.check_world_size(9, True)
    with pytest.raises(ValueError, match="limit is 8"):
        env.check_world_size(9, False)  # the keyword wins over the variable
    monkeypatch.setenv("MTD_OVERSUBSCRIBE", "maybe")
    with pytest.raises(ValueError, match=r"MTD_OVERSUBSCRIBE='maybe': use 1 .* or 0"):
        env.check_world_size(9, None)


# --- settings from the environment ----------------------------------------------------------


@pytest.mark.parametrize("var, value, message", [
    ("MTD_START_METHOD", "forkserver", r"MTD_START_METHOD='forkserver': launch supports fork or spawn"),
    ("MTD_START_METHOD", "Spawn", r"MTD_START_METHOD='Spawn': launch supports fork or spawn"),
    ("MTD_THREADS", "0", r"MTD_THREADS='0': .* must be a positive integer such as 1 \(the default\)"),
    ("MTD_THREADS", "two", r"MTD_THREADS='two'"),
    ("MTD_THREADS", "-1", r"MTD_THREADS='-1'"),
])
def test_unsupported_settings_are_refused_naming_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=message):
        launch(abs, 2, 1)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("kwargs, message", [
    ({"start_method": "forkserver"}, r"start_method='forkserver': launch supports fork or spawn"),
    ({"threads": 0}, r"threads must be a positive int .* got 0"),
])
def test_unsupported_keywords_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        launch(abs, 2, 1, **kwargs)


# --- the deadline counts start-up --------------------------------------------------------------


def _sleep(seconds):
    time.sleep(seconds)


@pytest.mark.timeout(60)
def test_the_deadline_counts_from_the_call_start_up_included(monkeypatch):
    """Starting the ranks is made slow (0.4 s each): the deadline passes while they start."""
    watch = supervise.Reaper.watch

    def slow_watch(self, pid):
        time.sleep(0.4)
        watch(self, pid)

    monkeypatch.setattr(supervise.Reaper, "watch", slow_watch)
    importlib.import_module("torch._dynamo")  # a first fork launch imports it (~1.5 s): not timed here
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(_sleep, 8, 30, timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 3
    e = info.value
    assert not e.last_ops[0].startswith("not started"), str(e)
    assert e.last_ops[7] == "not started (the deadline passed while the ranks were being started)"
    assert "-7: not started (the deadline passed" in str(e), str(e)  # one line for the ranks not started


@pytest.mark.timeout(60)
def test_many_ranks_with_a_tiny_timeout_fail_by_the_deadline():
    n = env.RANKS_PER_CORE * env.usable_cores() + 4  # over the limit: the override is needed
    timeout_s = 1.0
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout, match=f"launch timed out after {timeout_s:g} s"):
        launch(_sleep, n, 30, timeout_s=timeout_s, oversubscribe=True)
    assert time.monotonic() - t0 < timeout_s + 5


# --- what a rank started dies with it --------------------------------------------------------

DAEMON = ("import subprocess, sys; p = subprocess.Popen(['sleep', '60'], start_new_session=True); "
          "open(sys.argv[1], 'w').write(str(p.pid))")


def _start_a_session_child(pidfile, how):
    """Start ``sleep 60`` in a session of its own, then end as ``how`` says."""
    if how == "daemon":  # through a parent that exits at once, with an empty environment
        subprocess.run([sys.executable, "-c", DAEMON, pidfile], env={"PATH": os.environ["PATH"]},
                       timeout=30, check=True)
    else:
        child = subprocess.Popen(["sleep", "60"], start_new_session=True)
        with open(pidfile, "w") as f:
            f.write(str(child.pid))
    if how == "raise":
        raise ValueError("this rank fails after starting a child")
    if how == "exit":
        os._exit(3)
    if how == "hang":
        time.sleep(60)
    return "returned"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, raises", [("return", None), ("daemon", None), ("raise", RankError),
                                         ("exit", RankError), ("hang", LaunchTimeout)])
def test_a_child_in_its_own_session_dies_with_the_rank(tmp_path, how, raises):
    pidfile = str(tmp_path / f"child.{uuid.uuid4().hex}")
    try:
        if raises is None:
            assert launch(_start_a_session_child, 1, pidfile, how, timeout_s=30) == ["returned"]
        else:
            with pytest.raises(raises):
                launch(_start_a_session_child, 1, pidfile, how, timeout_s=3 if how == "hang" else 30)
        pid = int(open(pidfile).read())
        assert _wait_until(lambda: not _alive(pid), 2), f"the rank's child {pid} outlived the launch"
    finally:
        if os.path.exists(pidfile) and open(pidfile).read().strip():
            _kill(int(open(pidfile).read()))


# --- under torchrun: the agent dies -----------------------------------------------------------

TRAIN = textwrap.dedent("""
    import os, sys, time, torch, minitorch_dist as mtd
    def train(flag):
        t = torch.ones(1000)
        for step in range(100000):
            mtd.comm.all_reduce(t)
            t /= mtd.world_size()
            if step == 10:
                open(f"{flag}.{mtd.rank()}", "w").close()
            time.sleep(0.01)
    mtd.launch(train, 2, sys.argv[1], timeout_s=120)
""")


def _marked(marker: str) -> list[int]:
    pids, needle = [], marker.encode()
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) != os.getpid():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if needle in f.read() and _alive(int(pid)):
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_under_torchrun_ranks_stop_at_once_when_the_agent_is_killed(tmp_path):
    script, flag, marker = tmp_path / "train.py", tmp_path / "training", uuid.uuid4().hex
    script.write_text(TRAIN)
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(flag)], env={**os.environ, "OMP_NUM_THREADS": "1", "MTD_TEST_MARKER": marker},
        start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert _wait_until(lambda: all(os.path.exists(f"{flag}.{r}") for r in (0, 1)), 60), "no training"
        agent.kill()
        agent.wait(timeout=10)
        t0 = time.monotonic()
        assert _wait_until(lambda: not _marked(marker), 10), "the ranks trained on after torchrun died"
        assert time.monotonic() - t0 < 5
        out = agent.stdout.read().decode(errors="replace")
        assert "so this rank stops now: no one is left to stop it" in out, out[-3000:]
        assert len(out) < 20_000, f"{len(out)} characters of output: {out[-3000:]}"
    finally:
        agent.kill()
        agent.wait()
        for pid in _marked(marker):
            _kill(pid)
