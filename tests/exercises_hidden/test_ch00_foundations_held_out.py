"""Chapter 00, held out: the log-step all-gather on 7 ranks (one short of a power of two: the last round
sends 3 blocks, not 4) with a 3-D float64 chunk, against PyTorch's all-gather bit for bit, and its
messages by the comm meter (ceil(log2 7) = 3 of each, 1 + 2 + 3 blocks sent). Exact: bytes move, nothing
is computed.
"""
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from minitorch_dist import comm

pytestmark = pytest.mark.ch00
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

SHAPE = (2, 3, 2)


def _on_ranks(impl):
    r, n = dist.get_rank(), dist.get_world_size()
    chunk = torch.randn(SHAPE, generator=torch.Generator().manual_seed(70 + r), dtype=torch.float64)
    expected = chunk.new_empty((n * SHAPE[0], *SHAPE[1:]))
    dist.all_gather_into_tensor(expected, chunk)
    with comm.meter() as m:
        got = impl(chunk)
    return got, expected, [e.nbytes for e in m.events if e.op == "send"], dict(m.calls)


@pytest.fixture(scope="module")
def gathered(ex, launches):
    return launches(_on_ranks, ex.bruck_all_gather, timeout_s=60)


def test_bruck_all_gather_seven_ranks_3d_float64(gathered):
    block = 2 * 3 * 2 * 8
    for r, (got, expected, sends, calls) in enumerate(gathered(7)):
        assert torch.equal(got, expected), f"rank {r} of 7: not PyTorch's all-gather"
        assert calls.get("send") == calls.get("recv") == 3, f"rank {r}: {calls}"
        assert sends == [block, 2 * block, 3 * block], f"rank {r}: message sizes {sends}"
