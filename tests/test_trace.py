"""Chapter 01 — profiler traces of a DDP step: one Chrome-trace JSON per rank, with the all-reduces
in it; a step without communication shows none.

Tolerances: the summary's milliseconds are sums of the spans' durations, written here as exact
decimals; pytest.approx's default rel 1e-6 covers their float64 sums (k·u ~ 1e-15)."""
from __future__ import annotations

import json

import pytest
import torch

from minitorch_dist.analysis.trace import ddp_gpt_step, record_step, trace_steps, trace_summary
from minitorch_dist.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.ch01


def forward_only_step():
    """A plain model's forward, no backward, no DDP: nothing to communicate."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    x = torch.randint(0, 64, (2, 32))

    def step():
        with torch.no_grad():
            return model(x)[0].sum().item()

    return step


@pytest.mark.timeout(120)
def test_ddp_step_trace_has_allreduce_and_matmuls(tmp_path):
    paths = trace_steps(ddp_gpt_step, 2, str(tmp_path))
    assert paths == [str(tmp_path / "step-rank0.json"), str(tmp_path / "step-rank1.json")]
    for path in paths:
        with open(path) as f:
            assert "traceEvents" in json.load(f)
        s = trace_summary(path)
        assert any("allreduce" in c or "all_reduce" in c for c in s["collectives"]), s
        assert "c10d::allreduce_" in s["collectives"] and "gloo:all_reduce" in s["collectives"], s
        assert {"aten::mm", "aten::addmm"} & set(s["compute_ops"]), s
        assert s["compute_ms"] > 0 and s["comm_ms"] > 0 and s["n_events"] > 100


@pytest.mark.timeout(120)
def test_forward_only_step_has_no_collective(tmp_path):
    paths = trace_steps(forward_only_step, 2, str(tmp_path), name="fwd")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["fwd-rank0.json", "fwd-rank1.json"]
    for path in paths:
        s = trace_summary(path)
        assert s["collectives"] == [] and s["comm_ms"] == 0, s
        assert s["compute_ms"] > 0 and "aten::addmm" in s["compute_ops"], s


@pytest.mark.timeout(120)
def test_record_step_without_a_process_group(tmp_path):
    calls = []
    path = record_step(lambda: calls.append(torch.ones(8, 8) @ torch.ones(8, 8)), str(tmp_path / "new"),
                       warmup=2, name="mm")
    assert len(calls) == 3 and path == str(tmp_path / "new" / "mm-rank0.json")
    s = trace_summary(path)
    assert s["compute_ops"] == ["aten::matmul", "aten::mm"] and s["collectives"] == []  # @ -> matmul -> mm
    with pytest.raises(ValueError, match="warmup"):
        record_step(lambda: None, str(tmp_path), warmup=-1)


@pytest.mark.timeout(120)
def test_summary_counts_nested_ops_once_and_skips_look_alikes(tmp_path):
    def ev(name, ts, dur, cat="cpu_op", tid=1):
        return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur}

    events = [
        ev("aten::linear", 0, 100), ev("aten::addmm", 10, 80),  # nested: 100 us, not 180
        ev("aten::bmm", 200, 50),
        ev("aten::broadcast_tensors", 300, 5),  # an aten op, not a collective
        ev("send_step", 0, 1000, cat="user_annotation"),  # a user's label, not a collective
        ev("c10d::allreduce_", 400, 10), ev("gloo:all_reduce", 405, 300, cat="user_annotation", tid=2),
        {"ph": "i", "name": "Record Window End", "pid": 1, "tid": 1, "ts": 900},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = trace_summary(str(path))
    assert s["compute_ms"] == pytest.approx(0.150)
    assert s["compute_ops"] == ["aten::addmm", "aten::bmm", "aten::linear"]
    assert s["collectives"] == ["c10d::allreduce_", "gloo:all_reduce"]
    assert s["comm_ms"] == pytest.approx(0.300)  # the backend's span; the c10d op only enqueued it
    assert s["n_events"] == 7
    path.write_text("[]")
    with pytest.raises(ValueError, match="traceEvents"):
        trace_summary(str(path))
