"""The comm meter counts every op, and its wire bytes equal the ring-model (busbw) formula.

Tolerances. The collectives move and add small integers (every sum exact in its dtype), so their
results are compared exactly (``_same``: dtype and values). A wire-byte count is the meter's product of
a busbw factor and a byte count against the same product written here: a few float64 operations in
another order (k·u <= 1e-15), compared at rel 1e-12 (FORMULA); one byte too many moves it by >= 1/S.
"""
import pytest
import torch
import torch.distributed as dist

import minitorch_dist as mtd
from minitorch_dist import comm
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch00

FORMULA = dict(rel=1e-12)  # the meter's wire bytes against the formula: a few float64 operations


def _same(got, want):
    """The same dtype and the same values, exactly (small integers: every sum is exact)."""
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)

# The busbw factors, written out here independently of costmodel.BUS_FACTORS.
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
}


def _every_op():
    """Run each collective once on known buffers; return the meter summary and the results."""
    r, n = mtd.rank(), mtd.world_size()
    k = 6  # elements per rank-shard
    out = {}
    with comm.meter() as m:
        a = torch.full((n * k,), float(r + 1))
        comm.all_reduce(a)
        out["all_reduce"] = a

        full = torch.arange(n * k, dtype=torch.float64) * (r + 1)
        shard = torch.empty(k, dtype=torch.float64)
        comm.reduce_scatter(shard, full)
        out["reduce_scatter"] = shard

        gathered = torch.empty(n * k, dtype=torch.bfloat16)
        comm.all_gather(gathered, torch.full((k,), float(r), dtype=torch.bfloat16))
        out["all_gather"] = gathered

        send = torch.arange(n * k, dtype=torch.int32) + 100 * r
        recv = torch.empty(n * k, dtype=torch.int32)
        comm.all_to_all(recv, send)
        out["all_to_all"] = recv

        b = torch.full((n * k,), float(r))
        comm.broadcast(b, src=0)
        out["broadcast"] = b

        w = comm.all_reduce(torch.ones(5), async_op=True)
        w.wait()
    return m.summary(), m.ops(), out, m.total_wire_bytes


@pytest.mark.parametrize("n", [2, 4])
def test_meter_bytes_equal_the_busbw_formula_for_every_op(n):
    results = launch(_every_op, n)
    k = 6
    full_bytes = {  # S: the full buffer of each op
        "all_reduce": n * k * 4 + 5 * 4,  # the float32 one plus the async float32[5]
        "reduce_scatter": n * k * 8,
        "all_gather": n * k * 2,
        "all_to_all": n * k * 4,
        "broadcast": n * k * 4,
    }
    for r, (summary, ops, out, total_wire) in enumerate(results):
        assert ops == ["all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "all_reduce"]
        assert summary["all_reduce"]["calls"] == 2
        for op, S in full_bytes.items():
            assert summary[op]["bytes"] == S, op
            assert summary[op]["wire_bytes"] == pytest.approx(RING_FACTOR[op](n) * S, **FORMULA), op
        want_total = sum(RING_FACTOR[op](n) * S for op, S in full_bytes.items())
        assert total_wire == pytest.approx(want_total, **FORMULA)
        # ...and the collectives really did what they say.
        _same(out["all_reduce"], torch.full((n * k,), n * (n + 1) / 2))
        expect_rs = (torch.arange(n * k, dtype=torch.float64) * (n * (n + 1) / 2))[r * k:(r + 1) * k]
        _same(out["reduce_scatter"], expect_rs)
        _same(out["all_gather"], torch.arange(n).repeat_interleave(k).to(torch.bfloat16))
        expect_a2a = torch.cat([torch.arange(r * k, (r + 1) * k, dtype=torch.int32) + 100 * src
                                for src in range(n)])
        _same(out["all_to_all"], expect_a2a)
        _same(out["broadcast"], torch.zeros(n * k))


def _p2p_and_uneven_all_to_all():
    r, n = mtd.rank(), mtd.world_size()
    with comm.meter() as m:
        if r == 0:
            comm.send(torch.ones(10), dst=1)
        elif r == 1:
            comm.recv(torch.empty(10), src=0)
        nxt, prv = (r + 1) % n, (r - 1) % n
        buf = torch.empty(3)
        ops = [dist.P2POp(dist.isend, torch.full((3,), float(r)), nxt),
               dist.P2POp(dist.irecv, buf, prv)]
        for w in comm.batch_isend_irecv(ops):
            w.wait()
        # uneven all-to-all: rank r sends j+1 elements to rank j
        in_splits = [j + 1 for j in range(n)]
        out_splits = [r + 1] * n
        inp = torch.full((sum(in_splits),), float(r))
        out = torch.empty(sum(out_splits))
        comm.all_to_all(out, inp, out_splits, in_splits)
    return m.summary(), buf, out


@pytest.mark.parametrize("n", [2, 4])
def test_point_to_point_is_charged_to_the_sender_and_uneven_all_to_all_works(n):
    for r, (s, buf, out) in enumerate(launch(_p2p_and_uneven_all_to_all, n)):
        sends = 1 + (1 if r == 0 else 0)
        recvs = 1 + (1 if r == 1 else 0)
        assert s["send"]["calls"] == sends and s["recv"]["calls"] == recvs
        assert s["send"]["wire_bytes"] == s["send"]["bytes"] == 12 + (40 if r == 0 else 0)
        assert s["recv"]["wire_bytes"] == 0
        _same(buf, torch.full((3,), float((r - 1) % n)))
        _same(out, torch.arange(n, dtype=torch.float32).repeat_interleave(r + 1))
        assert s["all_to_all"]["bytes"] == 4 * sum(j + 1 for j in range(n))


def test_meters_nest_and_a_meter_outside_launch_sees_nothing_from_ranks():
    with comm.meter() as outer:
        comm.record("all_reduce", 100, 4)
        with comm.meter() as inner:
            comm.record("broadcast", 10, 4)
    assert outer.calls == {"all_reduce": 1, "broadcast": 1}
    assert inner.calls == {"broadcast": 1}
    assert outer.total_wire_bytes == pytest.approx(150 + 10, **FORMULA)
    comm.record("all_reduce", 100, 4)  # outside any meter: not counted anywhere
    assert outer.calls["all_reduce"] == 1
    assert "all_reduce" in outer.table()


def test_single_rank_moves_nothing_and_unknown_ops_are_rejected():
    with comm.meter() as m:
        comm.record("all_reduce", 1000, 1)
    assert m.wire_bytes["all_reduce"] == 0
    with pytest.raises(ValueError, match="unknown collective"):
        comm.record("all_reduce_typo", 10, 2)


def test_nested_meters_that_counted_the_same_calls_both_close():
    """Meters compare equal when they counted the same calls: leaving one must not remove the other."""
    with comm.meter() as outer:
        with comm.meter() as inner:
            pass
        assert inner == outer and inner is not outer
        comm.record("all_reduce", 8, 2)  # the outer meter goes on counting
    assert outer.calls["all_reduce"] == 1 and not inner.calls.get("all_reduce")
