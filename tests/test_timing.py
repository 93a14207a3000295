"""The course's one clock (``runtime.timing``), its one dtype table (``runtime.dtypes``), its one table
formatter (``runtime.tables``), and the rule that every tensor a measurement makes is filled by a
generator of its own device.

The clock: warm-up runs are not timed, ``before`` runs before every run and is never timed, the
statistic is the caller's, and a CPU or ``meta`` device never touches CUDA. The CUDA paths (the
synchronise, the events) run here against stand-ins for ``torch.cuda``'s functions, which check the
order of calls; on a GPU the ``gpu``-marked tests time real kernels.

The generators: on a GPU, filling a CUDA tensor from a CPU generator fails ("Expected a 'cuda' device
type for generator"). Without a GPU, ``meta`` stands in (as in test_meta_standin.py): ops recorded on
meta tensors are rebuilt, and every fill is checked to use no generator of another device.
"""
from __future__ import annotations

import inspect
import statistics
import time

import pytest
import torch

from minitorch_dist.analysis.op_timing import argument_sets
from minitorch_dist.analysis.workload import (
    DeviceGenerators,
    Op,
    WorkloadRecorder,
    fresh_tensor,
    rebuild_args,
)
from minitorch_dist.runtime import dtypes, timing
from minitorch_dist.runtime.tables import format_table

pytestmark = pytest.mark.timeout(60)


def _no_cuda(monkeypatch):
    """Make every CUDA call this module's code could make raise."""
    def boom(*a, **k):
        raise AssertionError("CUDA was touched")
    for name in ("synchronize", "Event", "device", "is_initialized"):
        monkeypatch.setattr(torch.cuda, name, boom)


# --- the clock ------------------------------------------------------------------------------------


def test_sync_waits_only_for_a_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for dev in ("cpu", torch.device("meta"), torch.empty(1, device="meta"), None):
        timing.sync(dev)
    assert calls == []  # nothing to wait for, and CUDA never asked
    timing.sync("cuda:1")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    timing.sync()  # no device named, CUDA in use: the current device
    assert calls == [(torch.device("cuda:1"),), ()]


def test_warmup_and_before_are_not_timed_and_cpu_never_touches_cuda(monkeypatch):
    _no_cuda(monkeypatch)
    log = []
    times = timing.timed_runs(lambda: (log.append("run"), time.sleep(0.01)), reps=3, warmup=2,
                              device="cpu", before=lambda: (log.append("before"), time.sleep(0.05)),
                              cuda_events=True)  # ignored off a GPU
    assert log == ["before", "run"] * 5 and len(times) == 3
    assert all(0.01 <= t < 0.05 for t in times)  # the 50 ms before each run is not in it


def test_seconds_reduces_the_runs_with_the_callers_statistic():
    naps = iter([0.001, 0.03, 0.001, 0.002])  # one warm-up, then three runs: the middle one is slow
    fn = lambda: time.sleep(next(naps))
    assert timing.seconds(fn, reps=3, warmup=1, reduce=lambda ts: ts) == pytest.approx([0.03, 0.001, 0.002],
                                                                                       abs=0.02)
    naps = iter([0.001, 0.03, 0.001, 0.002])
    assert timing.seconds(fn, reps=3, warmup=1, reduce=min) < 0.025
    naps = iter([0.001, 0.002, 0.04, 0.002])
    assert timing.seconds(fn, reps=3, warmup=1) < 0.03  # the median: one slow run does not move it
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="reps"):
            timing.timed_runs(lambda: None, reps=bad)


def test_cuda_events_time_each_run_and_leave_before_out(monkeypatch):
    """The GPU path, read through stand-ins: ``before`` is queued ahead of the start event, each run
    sits between its two events, and the result is the events' milliseconds in seconds."""
    log = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.at = None

        def record(self):
            log.append("record")
            self.at = len(log)

        def synchronize(self):
            log.append("wait")

        def elapsed_time(self, end):
            return float(end.at - self.at)  # "milliseconds": log entries between the two events

    class Device:
        def __init__(self, dev):
            assert dev == torch.device("cuda:0")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append("sync"))
    times = timing.timed_runs(lambda: log.append("run"), reps=2, warmup=1, device="cuda:0",
                              before=lambda: log.append("before"), cuda_events=True)
    assert log == ["before", "run"] + ["before", "record", "run", "record", "wait"] * 2
    assert times == [2e-3, 2e-3]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_matmul_is_timed_when_done_not_when_launched():
    a = torch.randn(4096, 4096, device="cuda")
    wall = timing.seconds(lambda: a @ a, reps=5, warmup=2, device="cuda")
    events = timing.seconds(lambda: a @ a, reps=5, warmup=2, device="cuda", cuda_events=True)
    launch = timing.seconds(lambda: a @ a, reps=5, warmup=2, device="cpu")  # no wait: the launch only
    flops = 2 * 4096 ** 3
    assert flops / wall < 2e15 and flops / events < 2e15  # no GPU does a 4096 GEMM faster than this
    assert launch < events


# --- the dtype table ---------------------------------------------------------------------------------


def test_every_spelling_of_a_dtype_has_one_short_name():
    for spelling in (torch.bfloat16, "torch.bfloat16", "bfloat16", "bf16", "BF16"):
        assert dtypes.short_name(spelling) == "bf16"
    assert dtypes.short_name(torch.float8_e4m3fn) == "fp8_e4m3" and dtypes.short_name("half") == "fp16"
    assert dtypes.to_dtype("float32") is torch.float32 and dtypes.to_dtype(torch.float16) is torch.float16
    assert dtypes.torch_name("bf16") == "bfloat16" and dtypes.torch_name(torch.int64) == "int64"
    assert dtypes.short_name(torch.int64, "fp32") == "fp32"
    with pytest.raises(ValueError, match="unknown dtype"):
        dtypes.short_name(torch.int64)
    assert all(dtypes.short_name(d) == k for k, d in dtypes.DTYPES.items())
    assert set(dtypes.ALIASES.values()) <= set(dtypes.DTYPES)


def test_the_cost_model_reads_the_one_dtype_table():
    from minitorch_dist import costmodel as cm
    for spelling, short in dtypes.ALIASES.items():
        if short in cm.FORMATS:
            assert cm.format_name(spelling) == cm.format_name(dtypes.to_dtype(spelling)) == short
    assert all(cm.FORMATS[k].torch_name == dtypes.torch_name(k) for k in cm.FORMATS)
    with pytest.raises(ValueError, match="unknown number format"):
        cm.format_name("float64")  # a dtype the table knows, but not a format of chapter 08
    for spelling in ("half", "float16", torch.float16, "torch.float16"):
        assert cm.ridge_point("h100", spelling) == cm.ridge_point("h100", "fp16")
    assert cm.ridge_point("h100", "tf32") > cm.ridge_point("h100", "fp32")  # peaks the dtype table lacks


# --- the table formatter -------------------------------------------------------------------------------


def test_table_columns_align_left_unless_told():
    rows, header = [["ddp", "1.5"], ["zero-3", "12.25"]], ["technique", "GiB"]
    assert format_table(rows, header).splitlines() == ["technique  GiB", "---------  -----", "ddp        1.5",
                                                       "zero-3     12.25"]
    assert format_table(rows, header, align="ll") == format_table(rows, header)
    assert format_table(rows, header, align="lr").splitlines() == ["technique    GiB", "---------  -----",
                                                                   "ddp          1.5", "zero-3     12.25"]
    for bad in ("l", "lrl", "lc"):
        with pytest.raises(ValueError, match="one 'l' or 'r' per column"):
            format_table(rows, header, align=bad)


# --- every generator follows its tensor's device ------------------------------------------------------


def _fills(monkeypatch) -> list:
    """(tensor device, generator device or None) of every ``uniform_`` from now on."""
    seen, plain = [], torch.Tensor.uniform_

    def uniform_(self, *args, generator=None, **kwargs):
        seen.append((self.device, None if generator is None else generator.device))
        return plain(self, *args, generator=generator, **kwargs)
    monkeypatch.setattr(torch.Tensor, "uniform_", uniform_)
    return seen


def _recorded_mm(device: str) -> Op:
    a, b = torch.randn(8, 4, device=device), torch.randn(4, 3, device=device)
    with WorkloadRecorder(count_lines=False) as rec:
        a @ b
    return next(o for o in rec.items if isinstance(o, Op) and o.kind == "matmul")


def test_args_rebuilt_on_meta_use_no_generator_of_another_device(monkeypatch):
    op = _recorded_mm("meta")
    fills = _fills(monkeypatch)
    args, _ = rebuild_args(op)
    sets = argument_sets(op, 10 * int(op.nbytes))  # the pools the kernel table times ops on
    assert all(t.is_meta for t in args) and len(sets) == 10 and all(s[0][0].is_meta for s in sets)
    assert fills and all(dev.type == "meta" for dev, _ in fills)
    assert all(g is None or g == dev for dev, g in fills), fills  # a CPU generator here fails on CUDA


def test_cpu_args_come_from_a_seeded_cpu_generator(monkeypatch):
    op = _recorded_mm("cpu")
    fills = _fills(monkeypatch)
    first, again, other = (rebuild_args(op, seed=s)[0] for s in (1, 1, 2))
    assert all(g == dev == torch.device("cpu") for dev, g in fills)
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])
    assert fresh_tensor(("T", (2, 2), (2, 1), torch.int64, "cpu")).eq(0).all()


def test_each_device_gets_a_generator_of_its_own(monkeypatch):
    made = []

    class Generator:  # torch.Generator(device="cuda") needs a GPU: record what would be made
        def __init__(self, device="cpu"):
            self.device = torch.device(device)
            made.append(self.device)

        def manual_seed(self, seed):
            self.seed = seed
            return self

    monkeypatch.setattr(torch, "Generator", Generator)
    gens = DeviceGenerators(seed=7)
    assert gens["cuda:0"].device == torch.device("cuda:0") and gens["cuda:0"].seed == 7
    assert gens["cpu"].device == torch.device("cpu") and gens["meta"] is None
    assert made == [torch.device("cuda:0"), torch.device("cpu")]  # one each, made once


def test_timer_and_median_seconds_read_the_one_clock(monkeypatch):
    from minitorch_dist.analysis import meters, op_timing

    calls = []
    real = timing.timed_runs

    def spy(*args, **kwargs):
        calls.append(inspect.signature(real).bind(*args, **kwargs).arguments)
        return real(*args, **kwargs)
    monkeypatch.setattr(meters, "timed_runs", spy)
    monkeypatch.setattr(timing, "timed_runs", spy)
    assert meters.Timer.measure(lambda: None, repeat=2)["median"] >= 0
    assert op_timing.median_seconds(lambda: None, reps=3, barrier=False, stat=statistics.fmean) >= 0
    assert len(calls) == 2 and calls[1]["device"] == torch.device("cpu") and calls[1]["before"] is None
