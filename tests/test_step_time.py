"""Chapter 00: a step's time from a machine profile -- the recorder writes the work, the replay prices it.

Synthetic records check the replay's rules one at a time (an op's seconds from the kernel table or the
roofline; a blocking collective waits for the last rank of its group; an asynchronous one only where the
step waits for it; a receive for its send; a record that does not match up is an error, not a hang).
Real records check the recorder: a DDP step on 2 ranks holds the GPT's ops, one all-reduce per bucket
launched asynchronously during backward, and the wait for each of them.

Tolerances. The replay prices synthetic records with a fixed profile: a step's seconds are sums and
maxima of a few dozen float64 terms, so pytest.approx's default rel 1e-6 is far above k·u ~ 1e-14 and
far below a wrong rule (a missed wait moves a step by milliseconds); counts and shapes are exact.
"""
from __future__ import annotations

import copy

import pytest
import torch

from minitorch_dist import costmodel
from minitorch_dist.analysis.profiles import load_profile
from minitorch_dist.analysis.workload import Comm, Mark, Op, Wait, WorkloadRecorder, rebuild_args, summarize

pytestmark = [pytest.mark.ch00, pytest.mark.timeout(120)]


def _profile(**changes):
    p = copy.deepcopy(load_profile("h100"))
    p.framework_overhead_s = 0.0
    for k, v in changes.items():
        setattr(p, k, v)
    return p


def _op(seconds_key="k", flops=0.0, kind="other", nbytes=0.0, phase="forward"):
    return Op("x", kind, flops, nbytes, phase, key=seconds_key)


def _ar(ranks=(0, 1), nbytes=1_000_000, async_op=False):
    return Comm("all_reduce", nbytes, len(ranks), async_op, "backward", ranks)


def test_an_op_costs_its_table_time_or_its_roofline():
    p = _profile(kernels={"k": 1e-3})
    assert costmodel.op_seconds(_op("k"), p) == (1e-3, True)
    gemm = _op("other", flops=2e12, kind="matmul")
    assert costmodel.op_seconds(gemm, p)[0] == pytest.approx(p.matmul_seconds(2e12, "fp32"))
    copy_op = _op("other", nbytes=3e9)
    assert costmodel.op_seconds(copy_op, p)[0] == pytest.approx(p.op_overhead_s + 3e9 / p.copy_bytes_per_s)
    assert costmodel.op_seconds(_op("other", kind="view"), p)[0] == p.op_overhead_s


def test_the_framework_costs_its_python_lines():
    p = _profile(kernels={"k": 1e-3}, python_line_s=1e-6, framework_overhead_s=0.0)
    op = _op("k")
    op.lines = 500
    res = costmodel.replay_step({0: [op]}, p)
    assert res["step_s"] == pytest.approx(1e-3 + 500e-6) and res["overhead_s"] == pytest.approx(500e-6)


def test_the_recorder_counts_the_steps_python_lines_not_its_own():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    x = torch.randn(4, 8)
    counts = []
    for _ in range(2):
        with WorkloadRecorder() as rec:
            model(x).sum().backward()
        counts.append(rec.lines)
        assert 0 < sum(o.lines for o in rec.items if isinstance(o, Op)) <= rec.lines
    assert counts[0] == counts[1]  # the first use's imports are not counted
    assert 20 < counts[1] < 2000  # nn.Module calls: tens of lines per module, not the mode's machinery


def test_a_blocking_collective_waits_for_the_slowest_rank():
    p = _profile(kernels={"slow": 5e-3, "fast": 1e-3})
    traces = {0: [_op("slow"), _ar()], 1: [_op("fast"), _ar()]}
    res = costmodel.replay_step(traces, p)
    t = costmodel.comm_seconds(_ar(), p)
    assert res["per_rank"][0]["step_s"] == pytest.approx(5e-3 + t)
    assert res["per_rank"][1]["step_s"] == pytest.approx(5e-3 + t)  # rank 1 waited 4 ms for rank 0
    assert res["step_s"] == pytest.approx(5e-3 + t)


def test_an_asynchronous_collective_costs_only_where_it_is_waited_for():
    p = _profile(kernels={"a": 1e-3, "b": 1e-3}, overlap=1.0)
    t = costmodel.comm_seconds(_ar(async_op=True), p)
    hidden = {r: [_ar(async_op=True), _op("a"), Wait(0)] for r in (0, 1)}
    res = costmodel.replay_step(hidden, p)
    assert res["step_s"] == pytest.approx(max(1e-3, t))
    p.overlap = 0.0  # the communication takes the core: it adds up with the compute
    res = costmodel.replay_step(hidden, p)
    assert res["step_s"] == pytest.approx(1e-3 + t)


def test_a_receive_waits_for_its_send():
    p = _profile(kernels={"f": 2e-3, "b": 1e-3})
    send = Comm("send", 65536, 2, True, "forward", (0, 1), peer=1)
    recv = Comm("recv", 65536, 2, False, "forward", (0, 1), peer=0)
    traces = {0: [Mark("F0", "start"), _op("f"), Mark("F0", "end"), send],
              1: [recv, Mark("F0", "start"), _op("b"), Mark("F0", "end")]}
    res = costmodel.replay_step(traces, p)
    arrival = 2e-3 + costmodel.comm_seconds(send, p)
    assert res["per_rank"][1]["step_s"] == pytest.approx(arrival + 1e-3)
    assert res["per_rank"][1]["spans"][0] == ("F0", "start", pytest.approx(arrival))


def test_a_receive_posted_early_costs_only_where_it_is_waited_for():
    p = _profile(kernels={"f": 2e-3, "b": 3e-3})
    send = Comm("send", 65536, 2, True, "forward", (0, 1), peer=1)
    early = Comm("recv", 65536, 2, True, "forward", (0, 1), peer=0)
    traces = {0: [_op("f"), send], 1: [early, _op("b"), Wait(0)]}
    arrival = 2e-3 + costmodel.comm_seconds(send, p)
    assert arrival < 3e-3  # the message arrives while rank 1 computes: the step never waits for it
    assert costmodel.replay_step(traces, p)["per_rank"][1]["step_s"] == pytest.approx(3e-3)
    late = {0: [_op("b"), _op("f"), send], 1: traces[1]}  # it arrives after: rank 1 waits from 3 ms
    assert costmodel.replay_step(late, p)["per_rank"][1]["step_s"] == pytest.approx(5e-3 + arrival - 2e-3)


def test_a_message_sent_while_its_sender_computes_moves_at_once_only_if_its_receive_was_posted():
    p = _profile(kernels={"f": 2e-3, "w": 4e-3, "b": 1e-3}, async_start_s=1.5e-3, overlap=1.0)
    send = Comm("send", 65536, 2, True, "forward", (0, 1), peer=1)
    t = costmodel.comm_seconds(send, p)
    sender = [_op("f"), send, _op("w"), Wait(1)]  # posts its send, computes on
    recv = lambda posted_early: Comm("recv", 65536, 2, posted_early, "forward", (0, 1), peer=0)
    asked_later = {0: sender, 1: [_op("f"), _op("b"), recv(False)]}
    posted = {0: sender, 1: [recv(True), _op("f"), _op("b"), Wait(0)]}
    late = costmodel.replay_step(asked_later, p)["per_rank"][1]["step_s"]
    early = costmodel.replay_step(posted, p)["per_rank"][1]["step_s"]
    assert late == pytest.approx(2e-3 + 1.5e-3 + t)  # waits for the sender's thread to get the core
    assert early == pytest.approx(3e-3) and 2e-3 + t < 3e-3  # arrived while rank 1 computed


def test_records_that_do_not_match_are_an_error_not_a_hang():
    p = _profile(kernels={"a": 1e-3})
    with pytest.raises(ValueError, match="do not match up"):
        costmodel.replay_step({0: [_ar()], 1: [_op("a")]}, p)


def test_the_measured_curve_replaces_the_line_where_it_was_measured():
    p = _profile(collective_sweeps={"all_reduce": [[1e3, 1e-3], [1e7, 2e-3]]}, world_size=2)
    assert costmodel.comm_seconds(_ar(nbytes=100_000), p) == pytest.approx(
        1e-3 * 2 ** 0.5 + p.collective_overhead_s)  # log-log midpoint
    big = _ar(nbytes=10 ** 9)  # outside the sweep: the α-β line
    a, b = p.alpha_beta("all_reduce")
    assert costmodel.comm_seconds(big, p) == pytest.approx(
        costmodel.collective_time("all_reduce", 10 ** 9, 2, a, b) + p.collective_overhead_s)


def test_the_recorder_writes_down_ops_flops_and_shapes():
    a, b = torch.randn(32, 16, requires_grad=True), torch.randn(16, 8)
    with WorkloadRecorder() as rec:
        (a @ b).relu().sum().backward()
    ops = [i for i in rec.items if isinstance(i, Op)]
    mm = [o for o in ops if o.kind == "matmul"]
    assert mm[0].flops == 2 * 32 * 16 * 8 and mm[0].phase == "forward"
    assert any(o.phase == "backward" for o in mm)
    assert "float32[32, 16]" in mm[0].key
    args, kwargs = rebuild_args(mm[0])  # the op runs again on fresh tensors of its shapes
    assert mm[0].func(*args, **kwargs).shape == (32, 8)
    assert summarize(rec.items)["flops"] >= 3 * 2 * 32 * 16 * 8 - 2 * 32 * 16 * 8  # forward + dA


def test_the_recorder_counts_each_storage_of_the_step_once():
    x = torch.ones(1000)
    with WorkloadRecorder() as rec:
        y = x * 2  # reads x, writes y
        y.add_(x)  # the same two storages again
        z = y[:10].sum()  # a view of y: its storage, not a new one
    assert rec.footprint == x.untyped_storage().nbytes() + y.untyped_storage().nbytes() \
        + z.untyped_storage().nbytes()


def test_an_op_is_timed_on_enough_argument_sets_to_span_its_steps_footprint():
    from minitorch_dist.analysis.op_timing import COPIES, argument_sets, time_kernels

    a = torch.randn(64, 32)
    with WorkloadRecorder() as rec:
        a.t() @ a  # a transposed argument: the copies keep its strides
    mm = next(o for o in rec.items if isinstance(o, Op) and o.kind == "matmul")
    assert len(argument_sets(mm, 0)) == 1  # hot: one set, always in cache
    sets = argument_sets(mm, 10 * int(mm.nbytes))
    assert len(sets) == 10
    first = [s[0][0] for s in sets]
    reach = lambda t: (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
    spans = sorted((t.data_ptr(), t.data_ptr() + reach(t)) for t in first)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # each set its own memory
    assert all(t.stride() == first[0].stride() and t.shape == first[0].shape for t in first)
    assert all(t.min() >= 0.5 and t.max() < 1.5 for t in first)  # filled as the first set is
    assert len(argument_sets(mm, 10 ** 12)) == COPIES
    table = time_kernels(rec.items, footprint=10 * int(mm.nbytes))
    assert table[mm.key] > 0


def _ddp_record():
    from minitorch_dist.analysis import techniques as T
    from minitorch_dist.analysis.workload import portable

    spec = T.make_step("ddp", "tiny", 2)
    spec.step()
    with WorkloadRecorder() as rec:
        spec.step()
    return portable(rec.items)


def test_a_ddp_step_records_its_bucket_all_reduces_and_their_waits():
    from minitorch_dist.runtime.launch import launch

    items = launch(_ddp_record, 2, timeout_s=100)[0]
    comms = [(i, c) for i, c in enumerate(items) if isinstance(c, Comm)]
    buckets = [(i, c) for i, c in comms if c.async_op]
    assert buckets and all(c.op == "all_reduce" and c.phase == "backward" for _, c in buckets)
    waits = {w.ref for w in items if isinstance(w, Wait)}
    assert {i for i, _ in buckets} <= waits
    ops = [o for o in items if isinstance(o, Op)]
    assert sum(o.kind == "matmul" for o in ops) >= 3 * 4 * 2  # four Linear layers per block, fwd + 2 bwd


def _alpha_beta_with_one_disturbed_sweep(disturbed_on_rank: int):
    """On the ranks: the first sweep of every collective is flat on one rank (as when other work
    disturbs it: no cost per byte to see), the next ones grow with the size."""
    import torch.distributed as dist

    from minitorch_dist.analysis import calibrate

    calls = {}

    def sweep_times(op, sweep, reps):
        calls[op] = calls.get(op, 0) + 1
        flat = calls[op] == 1 and dist.get_rank() == disturbed_on_rank
        return [1e-3 - s * 1e-12 if flat else 1e-4 + s * 1e-9 for s in sweep]  # flat: noise tilts it down

    calibrate._sweep_times = sweep_times
    out = calibrate._alpha_beta(quick=True)
    return calls, {op: fit["beta_s_per_byte"] for op, fit in out.items()}


@pytest.mark.timeout(120)
def test_a_sweep_that_cannot_see_bandwidth_is_measured_again_on_every_rank():
    from minitorch_dist.runtime.launch import launch

    for r, (calls, betas) in enumerate(launch(_alpha_beta_with_one_disturbed_sweep, 2, 1)):
        assert set(calls.values()) == {2}, (r, calls)  # both ranks retried together: no rank waits alone
        assert all(b > 0 for b in betas.values()), (r, betas)
