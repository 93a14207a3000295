"""costmodel.compression: the payload formulas against what the compressors really put on the wire
(``Payload.nbytes`` of a real ``compress``), PowerSGD's compress test against its implementation, and
the reduction time against the ring model's all-reduce and all-gather.

Tolerances: payload bytes are integers, compared exactly; a time is a few float64 operations against
the same written out here (pytest.approx's default rel 1e-6 >> k·u)."""
import math

import pytest
import torch

from minitorch_dist import costmodel as cm
from minitorch_dist.communication import FP16, QSGD, PowerSGD, RandomK, Sign, TopK

pytestmark = pytest.mark.ch09

SHAPES = [(7,), (16, 12), (33, 5), (8, 3, 4), (300,)]


@pytest.mark.parametrize("shape", SHAPES)
def test_payload_bytes_equal_what_the_compressors_send(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    cases = {"fp16": ({}, FP16()), "topk": ({"ratio": 0.1}, TopK(0.1)),
             "randomk": ({"ratio": 0.3}, RandomK(0.3)), "sign": ({}, Sign()),
             "qsgd": ({"levels": 4}, QSGD(4))}
    for method, (kw, comp) in cases.items():
        assert cm.compressed_payload_bytes(method, shape, **kw) == comp.compress(g).nbytes, method
    assert cm.compressed_payload_bytes("exact", shape) == 4 * g.numel()
    for r in (1, 2, 3):
        ours = PowerSGD(rank=r)
        assert cm.powersgd_compresses(shape, r) == ours.compresses(shape)
        assert cm.compressed_payload_bytes("powersgd", shape, rank=r) == ours.payload_nbytes(shape)
        if ours.compresses(shape):  # P and Q of the single-process view: the same bytes
            assert cm.compressed_payload_bytes("powersgd", shape, rank=r) == ours.compress(g).nbytes


def test_payload_bytes_by_hand_and_bad_input():
    assert cm.compressed_payload_bytes("topk", (4096, 4096), ratio=0.01) == 8 * math.ceil(0.01 * 4096**2)
    assert cm.compressed_payload_bytes("sign", (4096, 4096)) == 4096**2 // 8 + 4
    assert cm.compressed_payload_bytes("powersgd", (4096, 4096), rank=4) == 4 * 8192 * 4
    # (n + m) r * 2 < n m: a 4096 x 4096 matrix is compressed up to rank 1023
    assert cm.powersgd_compresses((4096, 4096), 1023) and not cm.powersgd_compresses((4096, 4096), 1024)
    assert not cm.powersgd_compresses((4096,), 1)
    with pytest.raises(ValueError, match="unknown method"):
        cm.compressed_payload_bytes("zip", (3, 3))
    with pytest.raises(ValueError, match="ratio"):
        cm.compressed_payload_bytes("topk", (3, 3), ratio=0)
    with pytest.raises(ValueError, match="levels"):
        cm.compressed_payload_bytes("qsgd", (3, 3), levels=200)


def test_reduce_time_is_the_ring_model():
    alpha, beta = cm.LINKS["Ethernet 100 Gb/s"]
    shapes, n = [(64, 32), (32,), (8, 64)], 8
    d = sum(math.prod(s) for s in shapes)
    exact = cm.compressed_reduce_time("exact", shapes, n, alpha, beta)
    assert exact == cm.allreduce_time(4 * d, n, alpha, beta)
    p = sum(cm.compressed_payload_bytes("sign", s) for s in shapes)
    sign = cm.compressed_reduce_time("sign", shapes, n, alpha, beta)
    assert sign == cm.all_gather_time(n * p, n, alpha, beta)
    # PowerSGD: three all-reduces, the 1-D bias, all Ps (64 + 8 rows), all Qs (32 + 64 columns)
    want = sum(cm.allreduce_time(b, n, alpha, beta) for b in (4 * 32, 4 * (64 + 8) * 2, 4 * (32 + 64) * 2))
    assert cm.compressed_reduce_time("powersgd", shapes, n, alpha, beta, rank=2) == pytest.approx(want)
    # compression by c pays against the exact all-reduce only while c > n / 2 (bandwidth terms):
    # QSGD's c is a hair under 4, so it stops paying at 8 ranks
    big = [(4096, 4096)]
    for ranks in (2, 4, 7, 8, 16, 64):
        exact = cm.compressed_reduce_time("exact", big, ranks, 0.0, beta)
        qsgd = cm.compressed_reduce_time("qsgd", big, ranks, 0.0, beta)
        assert (qsgd < exact) == (ranks < 8), ranks
