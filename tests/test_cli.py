"""The command line: ``python -m minitorch_dist {tour,grade,estimate,plan,schedule}``.

One run goes through a real subprocess (the entry point as a user types it); the rest call
`main(argv)` in-process, which parses the same arguments, to keep the file fast.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from minitorch_dist import costmodel
from minitorch_dist.__main__ import (
    EXIT_BROKEN_PIPE,
    MAX_CHART_COLUMNS,
    MAX_SCHEDULE_WORK,
    MODELS,
    OUTPUTS,
    build_parser,
    main,
)
from minitorch_dist.course.registry import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

COMMANDS = ("tour", "grade", "estimate", "plan", "schedule", "dryrun", "calibrate", "predict", "figures")


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "minitorch_dist", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO_ROOT)


def test_help_lists_every_command():
    out = cli("--help")
    assert out.returncode == 0, out.stderr
    for cmd in COMMANDS:
        assert cmd in out.stdout
    assert "chapter 12" in out.stdout and "chapter 03" in out.stdout


def test_estimate_reproduces_zero_table_1(capsys):
    """ZeRO (Rajbhandari et al. 2020) Table 1: 7.5B parameters, N_d = 64, K = 12."""
    assert main(["estimate", "--params", "7.5e9", "--dp", "64"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()}
    assert set(rows) == {"0", "1", "2", "3"}
    for stage, figure in [("0", "120 GB"), ("1", "31.4 GB"), ("2", "16.6 GB"), ("3", "1.88 GB")]:
        assert figure in rows[stage], rows[stage]


@pytest.mark.parametrize("cmd", ["tour", "grade", "estimate", "plan", "schedule"])
def test_each_command_has_help(cmd, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([cmd, "--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_schedule_prints_1f1b_and_its_bubble(capsys):
    """Chapter 03's 1F1B for p = 4, m = 6: stage 3 starts at slot 3 and the simulated bubble is the
    formula's (p-1)/(m+p-1) = 1/3."""
    assert main(["schedule", "--name", "1f1b", "-p", "4", "-m", "6"]) == 0
    out = capsys.readouterr().out
    rows = [line.split(": ", 1)[1].split() for line in out.splitlines() if line.startswith("stage ")]
    assert len(rows) == 4 and rows[3][:4] == ["..", "..", "..", "F0"]
    assert all(sum(c.startswith("F") for c in row) == 6 and sum(c.startswith("B") for c in row) == 6
               for row in rows)
    fractions = [line.split()[2].rstrip(";") for line in out.splitlines()
                 if line.startswith("bubble fraction")]
    assert fractions == [f"{costmodel.pipeline_bubble_fraction('1f1b', 4, 6):.3f}"] == ["0.333"]
    assert "costmodel.pipeline_bubble_fraction: 0.333" in out


def test_schedule_rejects_bad_input_naming_the_choices(capsys):
    assert main(["schedule", "--name", "foo"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main(["schedule", "--name", "1f1b", "-v", "2"]) == 2
    assert "interleaved" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # unknown flags are argparse errors now that every command is written
        main(["schedule", "--model", "gpt3-175b"])


def test_plan_searches_gpt3_on_h100s(capsys):
    """Chapter 12's planner (tests/test_planner.py checks its numbers): the issue's own command."""
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "1024", "--gpu", "h100", "--top", "5"]) == 0
    out = capsys.readouterr().out
    assert "chosen: tp=" in out and "published for 1024 x A100" in out and "MFU" in out
    with pytest.raises(SystemExit):  # --gpus is required
        main(["plan", "--model", "gpt3-175b"])


def test_estimate_one_stage_and_fit_column(capsys):
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero", "1", "--gpu-mem-gb", "32"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 1 and rows[0].startswith("1 ") and rows[0].split()[-1] == "yes"  # 31.4 <= 32
    assert main(["estimate", "--params", "7.5e9", "--dp", "64", "--zero", "1", "--gpu-mem-gb", "30"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    assert rows[0].split()[-1] == "no"


def test_estimate_named_model_matches_costmodel(capsys):
    n, _ = MODELS["gpt2-xl"]
    assert main(["estimate", "--model", "gpt2-xl", "--dp", "8", "--zero", "3"]) == 0
    out = capsys.readouterr().out
    expected = costmodel.zero_memory_bytes(n, 8, 3, k=12) / 1e9
    assert f"{expected:.3g} GB" in out and "Radford" in out


def test_estimate_fp32_shards_each_part(capsys):
    """fp32 SGD-with-momentum: 4 + 4 + 4 bytes per parameter; stage 2 keeps only the weights whole."""
    assert main(["estimate", "--params", "1e9", "--dp", "4", "--zero", "2", "--precision", "fp32",
                 "--optimizer", "sgd"]) == 0
    parts = costmodel.model_state_bytes(1e9, "fp32", "sgd")
    expected = parts["weights"] + (parts["gradients"] + parts["optimizer"]) / 4
    assert f"{expected / 1e9:.3g} GB" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["estimate", "--dp", "64"], "one of the arguments --params --model is required"),
    (["estimate", "--params", "1e9", "--zero", "4"], "invalid choice: 4"),
    (["grade", "--impl", "answers"], "invalid choice: 'answers'"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_estimate_rejects_unknown_optimizer(capsys):
    assert main(["estimate", "--params", "1e9", "--optimizer", "lion"]) == 2
    assert "unknown optimizer 'lion'" in capsys.readouterr().err


@pytest.mark.parametrize("cmd, flag", [("grade", "--chapter"), ("tour", "--chapters")])
def test_unknown_chapter_exits_2(cmd, flag, capsys):
    assert main([cmd, flag, "ch15"]) == 2
    assert "no chapter 'ch15'" in capsys.readouterr().err


# --- bad numbers, impossible plans and oversized schedules: clear errors, never a hang or a table of nan ---


@pytest.mark.timeout(30)
@pytest.mark.parametrize("argv, message", [
    (["estimate", "--params", "nan"], "argument --params: must be a positive, finite number of parameters "
                                      "(e.g. --params 7.5e9), got 'nan'"),
    (["estimate", "--params", "inf"], "argument --params: must be a positive, finite number"),
    (["estimate", "--params", "-1"], "argument --params: must be a positive, finite number"),
    (["estimate", "--params", "1e9", "--gpu-mem-gb", "-1"],
     "argument --gpu-mem-gb: must be a positive, finite number of GB (e.g. --gpu-mem-gb 80), got '-1'"),
    (["estimate", "--params", "1e9", "--gpu-mem-gb", "nan"], "argument --gpu-mem-gb: must be a positive"),
    (["estimate", "--params", "1e9", "--dp", "0"],
     "argument --dp: must be a whole number >= 1 (e.g. --dp 64), got '0'"),
    (["plan", "--model", "tiny", "--gpus", "8", "--top", "-3"],
     "argument --top: must be a whole number >= 1 (e.g. --top 5), got '-3'"),
    (["plan", "--model", "tiny", "--gpus", "8", "--top", "0"], "argument --top: must be a whole number >= 1"),
    (["grade", "--timeout", "-1"],
     "argument --timeout: must be a positive number of seconds (e.g. --timeout 120), got '-1'"),
    (["grade", "--timeout", "0"], "argument --timeout: must be a positive number of seconds"),
    (["grade", "--timeout", "nan"], "argument --timeout: must be a positive number of seconds"),
    (["schedule", "-p", "0"], "argument -p: must be a whole number >= 1 (e.g. -p 4 -m 8), got '0'"),
    (["schedule", "-m", "-3"], "argument -m: must be a whole number >= 1"),
    (["schedule", "--name", "interleaved", "-v", "0"], "argument -v: must be a whole number >= 1"),
])
def test_bad_numbers_are_argparse_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_plan_says_which_divisibility_rule_fails_and_which_gpu_counts_work(capsys):
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "1000"]) == 1
    out = capsys.readouterr().out
    assert "0 configurations satisfy divisibility" in out
    assert ("Nothing fits: 1000 GPUs = tp*pp*dp has no factorization with tp | 8 GPUs per node" in out
            and "dp*b | global batch 1536; use 768 or 1024 GPUs." in out), out
    assert "--recompute" not in out and "--zero" not in out  # neither would help


@pytest.mark.timeout(60)
def test_plan_says_how_far_memory_is_from_fitting(capsys):
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "8"]) == 1
    out = capsys.readouterr().out
    assert ("Nothing fits: the smallest memory per GPU among the 642 valid configurations is 398.8 GB" in out
            and "> 72.0 GB usable (90% of 80 GB" in out), out  # Megatron's 18 B/param (fp32 main_grad)
    assert "the model states alone are 3,143 GB, more than 8 GPUs hold: use at least 48 GPUs." in out
    # a narrower search is told what it left out, and only that
    narrow = ["--zero", "0", "1", "--recompute", "none"]
    assert main(["plan", "--model", "gpt3-175b", "--gpus", "64", *narrow]) == 1
    out = capsys.readouterr().out
    assert ("try full recomputation (--recompute full), ZeRO-3 (--zero 3), sequence parallelism "
            "(--sequence-parallel), more GPUs." in out), out


@pytest.mark.serial  # held to wall-clock time
@pytest.mark.timeout(30)
def test_schedule_refuses_more_than_it_can_simulate_in_seconds(capsys):
    start = time.monotonic()
    assert main(["schedule", "-p", "1024", "-m", "8192"]) == 2
    assert time.monotonic() - start < 5
    out = capsys.readouterr()
    assert out.out == ""
    assert (f"p*m*v = 8,388,608 (stages x microbatches x chunks) is over the {MAX_SCHEDULE_WORK:,} the "
            f"simulator replays in a few seconds; use smaller -p or -m." in out.err)
    assert "costmodel.pipeline_bubble_fraction: 0.111" in out.err  # the formula still answers


@pytest.mark.serial  # held to wall-clock time
@pytest.mark.timeout(60)
def test_schedule_at_the_limit_runs_in_seconds_and_leaves_out_a_wide_chart(capsys):
    """The naive schedule is the simulator's worst case (one stage busy at a time); at the limit it
    still replays in seconds, and its chart, far wider than a screen, is left out."""
    start = time.monotonic()
    assert main(["schedule", "--name", "naive", "-p", "316", "-m", "316"]) == 0
    elapsed = time.monotonic() - start
    out = capsys.readouterr().out
    assert 316 * 316 <= MAX_SCHEDULE_WORK and elapsed < 30, elapsed
    assert "chart left out: " in out and f"over {MAX_CHART_COLUMNS:,}; use smaller -p or -m" in out
    assert not any(line.startswith("stage ") for line in out.splitlines())
    assert "bubble fraction 0.997; peak stashed microbatches per stage 1 at most, 1 at least" in out


def test_usage_line_names_every_command():
    usage = build_parser().format_usage()
    assert "{" + ",".join(COMMANDS) + "}" in usage, usage


@pytest.mark.timeout(60)
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """``python -m minitorch_dist schedule | head -3``: the pipe is closed before the command writes
    (its imports take a second); it exits with 128 + SIGPIPE and no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "minitorch_dist", "schedule", "-p", "8", "-m", "16"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO_ROOT)
    proc.stdout.close()
    _, err = proc.communicate(timeout=50)
    assert proc.returncode == EXIT_BROKEN_PIPE and EXIT_BROKEN_PIPE == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()


def test_every_option_that_writes_a_file_is_checked_before_the_run():
    """Every command's --json / --out (a file it writes) is in OUTPUTS, whose paths main checks first."""
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    writes = {(cmd, flag) for cmd, parser in sub.choices.items() for action in parser._actions
              for flag in action.option_strings if flag in ("--json", "--out")}
    assert writes == {(cmd, flag) for cmd, (_, flag, _) in OUTPUTS.items()}


def _dryrun_175b(*extra):
    return ["dryrun", "--model", "gpt3-175b", "--dp", "8", "--tp", "8", "--pp", "16", *extra]


@pytest.mark.timeout(30)
@pytest.mark.serial  # held to wall-clock time
@pytest.mark.parametrize("argv, message", [
    (_dryrun_175b("--json", "/nonexistent/dir/x.json"),
     "--json /nonexistent/dir/x.json: the folder /nonexistent/dir does not exist; create it first"),
    (["predict", "--technique", "ddp", "--profile", "h100", "--json", "{tmp}"],
     "is a folder: name a file in it"),
    (["calibrate", "--world", "2", "--out", "{tmp}/a_file/profile.json"], "a_file is a file, not a folder"),
], ids=["dryrun-missing-folder", "predict-folder", "calibrate-under-a-file"])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(argv, message, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    start = time.monotonic()
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    assert time.monotonic() - start < 5  # before the run: no ranks, no meta model
    out = capsys.readouterr()
    assert message.replace("{tmp}", str(tmp_path)) in out.err and out.out == ""


def test_an_output_folder_without_write_permission_is_refused(tmp_path, monkeypatch, capsys):
    """(Permissions are what ``os.access`` says: stubbed here, as a root user may write anywhere.)"""
    monkeypatch.setattr("minitorch_dist.__main__.os.access", lambda *a: False)
    assert main(_dryrun_175b("--json", str(tmp_path / "x.json"))) == 2
    assert f"{tmp_path} is not writable by this user; choose a path you can write" in capsys.readouterr().err
