"""Chapter 06's formulas, each derived again here from what it counts: ZeRO per-device memory with any
precision (Rajbhandari et al. 2020 §5), ZeRO's Table 1 against the numbers the paper prints, bytes on
the wire per stage (§7), offload traffic (ZeRO-Offload §3, ZeRO-Infinity §4), and Adam vs Adafactor
state (Shazeer & Stern 2018 §3). The measured side is in test_zero*.py, test_fsdp.py, test_adafactor.py.

Tolerances: formulas against the same counts summed here, a handful of float64 operations: rel 1e-12
>> k·u; the paper's Table 1 to the digits it prints."""
import math

import pytest

from minitorch_dist import costmodel as cm

pytestmark = pytest.mark.ch06


# --- zero_memory_bytes: the precision arguments ------------------------------------------------------

def _per_device(psi, n, stage, p, g, k):
    """Count what one device keeps: each part whole or its 1/n shard, stage by stage."""
    sharded = {0: set(), 1: {"os"}, 2: {"os", "g"}, 3: {"os", "g", "p"}}[stage]
    part = lambda name, b: b * psi / n if name in sharded else b * psi
    return part("p", p) + part("g", g) + part("os", k)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 4, 64])
@pytest.mark.parametrize("p,g,k", [(2, 2, 12), (4, 4, 8), (4, 4, 4), (2, 4, 12)])
def test_zero_memory_bytes_any_precision(stage, n, p, g, k):
    psi = 1_234_567
    got = cm.zero_memory_bytes(psi, n, stage, k=k, param_bytes=p, grad_bytes=g)
    assert got == pytest.approx(_per_device(psi, n, stage, p, g, k), rel=1e-12)


def test_zero_memory_bytes_defaults_unchanged_and_fp32_adamw_is_16_bytes():
    psi = 1e9
    for stage in range(4):
        assert cm.zero_memory_bytes(psi, 8, stage) == cm.zero_memory_bytes(psi, 8, stage, 12, 2, 2)
    fp32 = cm.model_state_bytes(psi, "fp32", "adamw")
    assert cm.zero_memory_bytes(psi, 1, 0, k=8, param_bytes=4, grad_bytes=4) == fp32["total"] == 16 * psi
    # stage 3 at n ranks is exactly 1/n of everything
    assert cm.zero_memory_bytes(psi, 4, 3, k=8, param_bytes=4, grad_bytes=4) == fp32["total"] / 4


# --- Table 1 of the ZeRO paper ------------------------------------------------------------------------

#: Rajbhandari et al. 2020, Table 1, as printed: per-device GB for P_os, P_os+g, P_os+g+p.
PAPER_TABLE1 = cm.TABLE1_PRINTED  # the paper's printed values (costmodel keeps them, cited)


def _last_digit(printed: str) -> float:
    return 10.0 ** -len(printed.split(".")[1]) if "." in printed else 1.0


def test_zero_table1_matches_the_paper_to_its_printed_digits():
    table = cm.zero_table1()
    assert sorted(table) == sorted(PAPER_TABLE1)
    for dp, row in PAPER_TABLE1.items():
        assert sorted(table[dp]) == sorted(row)
        for psi, printed in row.items():
            for stage, (ours, paper) in enumerate(zip(table[dp][psi], printed), start=1):
                # independent: 16-bit params and grads, K = 12, what each stage keeps whole
                assert ours == pytest.approx(_per_device(psi, dp, stage, 2, 2, 12) / 1e9, rel=1e-12)
                assert abs(ours - float(paper)) < _last_digit(paper), (dp, psi, stage, ours, paper)


def test_figure1_example():
    """ZeRO Figure 1: 7.5B parameters, N_d = 64: 120, 31.4, 16.6 and 1.9 GB for stages 0-3."""
    gb = [cm.zero_memory_bytes(7.5e9, 64, s) / cm.GB for s in range(4)]
    assert [round(gb[0]), round(gb[1], 1), round(gb[2], 1), round(gb[3], 1)] == [120, 31.4, 16.6, 1.9]


def test_zero_table1_takes_other_sizes():
    t = cm.zero_table1(models=(1e9,), dps=(8,), k=8)
    assert t[8][1e9] == pytest.approx(tuple(_per_device(1e9, 8, s, 2, 2, 8) / 1e9 for s in (1, 2, 3)))


# --- communication per stage --------------------------------------------------------------------------

def _ring_sent(elems, n):
    """Elements one rank sends in a ring reduce-scatter or all-gather: n-1 chunks of elems/n."""
    return sum(elems / n for _ in range(n - 1))


@pytest.mark.parametrize("n", [1, 2, 4, 8, 64])
@pytest.mark.parametrize("e", [2, 4])
def test_zero_comm_bytes_counts_the_collectives(n, e):
    psi = 3_000_000
    all_reduce = 2 * _ring_sent(psi, n)  # = reduce-scatter + all-gather
    expected = {
        0: all_reduce,                                           # DDP: all-reduce the gradients
        1: _ring_sent(psi, n) + _ring_sent(psi, n),              # reduce-scatter grads, all-gather params
        2: _ring_sent(psi, n) + _ring_sent(psi, n),
        3: 2 * _ring_sent(psi, n) + _ring_sent(psi, n),          # all-gather fwd + bwd, reduce-scatter
    }
    for stage, elems in expected.items():
        assert cm.zero_comm_bytes(psi, n, stage, bytes_per_element=e) == pytest.approx(elems * e, rel=1e-12)
    # and through the collectives cost model: stage 3 = 2 all-gathers + 1 reduce-scatter
    s3 = 2 * cm.bus_bytes("all_gather", psi * e, n) + cm.bus_bytes("reduce_scatter", psi * e, n)
    assert cm.zero_comm_bytes(psi, n, 3, e) == pytest.approx(s3, rel=1e-12)
    assert cm.zero_comm_bytes(psi, n, 0, e) == pytest.approx(cm.bus_bytes("all_reduce", psi * e, n),
                                                             rel=1e-12)


def test_stage3_moves_one_and_a_half_times_the_bytes():
    for n in (2, 4, 1024):
        base = cm.zero_comm_bytes(1e9, n, 1)
        assert cm.zero_comm_bytes(1e9, n, 2) == base == cm.zero_comm_bytes(1e9, n, 0)
        assert cm.zero_comm_bytes(1e9, n, 3) == pytest.approx(1.5 * base)
    assert cm.zero_comm_bytes(1e9, 1, 3) == 0


def test_bad_stage_or_degree_names_the_choices():
    with pytest.raises(ValueError, match="0, 1, 2 or 3"):
        cm.zero_comm_bytes(1e9, 4, 4)
    with pytest.raises(ValueError, match=">= 1"):
        cm.zero_comm_bytes(1e9, 0, 1)
    with pytest.raises(ValueError, match="cpu"):
        cm.offload_bytes_per_step(10, "nvme")


# --- offload traffic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("S", [0, 1, 1000, 12_345])
def test_offload_bytes_per_step(S):
    cpu = cm.offload_bytes_per_step(S, "cpu")
    # fp32: the gradient shard down, the updated parameter shard up; nothing touches the disk
    assert cpu == {"device_to_host": 4 * S, "host_to_device": 4 * S, "disk_read": 0, "disk_write": 0}
    disk = cm.offload_bytes_per_step(S, "disk")
    master, m, v = 4 * S, 4 * S, 4 * S  # AdamW's fp32 master copy, first and second moments
    assert disk == {"device_to_host": 4 * S, "host_to_device": 4 * S,
                    "disk_read": master + m + v, "disk_write": master + m + v}
    sgd = cm.offload_bytes_per_step(S, "disk", k_bytes=4)  # SGD with momentum: one buffer
    assert sgd["disk_read"] == sgd["disk_write"] == 8 * S


def test_offload_mixed_precision_is_zero_offloads_4m():
    """ZeRO-Offload §3: fp16 gradients down (2M) and fp16 parameters up (2M): 4M bytes per step."""
    M = 1_000_000
    b = cm.offload_bytes_per_step(M, "cpu", param_bytes=2, grad_bytes=2)
    assert b["device_to_host"] + b["host_to_device"] == 4 * M


# --- Adam vs Adafactor state ------------------------------------------------------------------------------

SHAPES = [(64, 256), (256, 64), (256,), (3, 16, 32), (7,), ()]


def test_adam_state_is_two_copies_of_the_model():
    numel = sum(math.prod(s) for s in SHAPES)
    assert cm.adam_state_bytes(SHAPES) == 2 * 4 * numel
    assert cm.adam_state_bytes(SHAPES, bytes_per_element=2, step_bytes=4) == 2 * 2 * numel + 4 * len(SHAPES)


def test_adafactor_state_is_rows_plus_columns():
    want = (64 + 256) + (256 + 64) + 256 + 3 * (16 + 32) + 7 + 1
    assert cm.adafactor_state_bytes(SHAPES) == 4 * want
    assert cm.adafactor_state_bytes(SHAPES, bytes_per_element=2, step_bytes=4) == 2 * want + 4 * len(SHAPES)
    # sublinear: a d x d matrix keeps 2d floats, Adam 2d^2
    for d in (16, 1024, 8192):
        assert cm.adam_state_bytes([(d, d)]) / cm.adafactor_state_bytes([(d, d)]) == d


def test_state_bytes_reject_negative_sizes():
    with pytest.raises(ValueError, match="negative"):
        cm.adafactor_state_bytes([(4, -1)])
