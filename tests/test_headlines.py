"""The tour's headline experiments (minitorch_dist.course.headlines) in smoke mode: every row is ok.

Each chapter module's ``headline(smoke=True)`` launches its own ranks and returns the rows the tour
prints; a row's ``ok`` is the check (theory == measured within the chapter's tolerance). The byte
counts are recomputed here from the formula, independently of the headline.
"""
import importlib.util

import pytest

from minitorch_dist import costmodel
from minitorch_dist.models.gpt import GPT, GPTConfig

KEYS = {"chapter", "experiment", "theory", "measured", "ok"}


def _assert_rows(rows, chapter, count):
    """Every exactness row agrees; a timing row (a step time against its prediction) is reported with
    its ratio and the machine's slowdown, and -- as in the tour -- not held to its band here, where
    other tests' ranks may share the cores."""
    assert len(rows) == count
    for row in rows:
        assert set(row) >= KEYS and row["chapter"] == chapter, row
        if row.get("timing"):
            assert row["theory"] > 0 and row["measured"] > 0 and "ratio" in row["note"], row
        else:
            assert row["ok"], row


@pytest.mark.ch00
def test_ch00_smoke_rows_are_ok():
    from minitorch_dist.course.headlines.ch00_foundations import headline

    rows = headline(smoke=True)
    _assert_rows(rows, "ch00", 3)
    assert rows[1]["measured"] == costmodel.bus_bytes("all_reduce", 4 * 2**14, 4)


@pytest.mark.ch01
def test_ch01_smoke_rows_are_ok():
    from minitorch_dist.course.headlines.ch01_data_parallel import headline

    rows = headline(smoke=True)
    _assert_rows(rows, "ch01", 4)
    grad_bytes = sum(p.numel() * 4 for p in GPT(GPTConfig.tiny()).parameters())
    assert rows[1]["measured"] == 2 * 3 / 4 * grad_bytes


@pytest.mark.ch10
def test_ch10_smoke_rows_are_ok():
    from minitorch_dist.course.headlines.ch10_moe import headline

    _assert_rows(headline(smoke=True), "ch10", 11)


@pytest.mark.ch11
@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="chapter 11 needs Triton: pip install triton")
def test_ch11_smoke_rows_are_ok():
    from minitorch_dist.course.headlines.ch11_fused_kernels import headline

    rows = headline(smoke=True)
    assert len(rows) == 8  # five kernels and the softmax bytes; FlashAttention, Triton and tiled; its memory
    for row in rows:
        assert set(row) == KEYS and row["chapter"] == "ch11"
        assert row["ok"], row


@pytest.mark.ch13
@pytest.mark.slow
def test_ch13_smoke_rows_are_ok():
    from minitorch_dist.course.headlines.ch13_resilience import headline

    rows = headline(smoke=True)
    _assert_rows(rows, "ch13", 4)
    n_params = sum(p.numel() for p in GPT(GPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2,
                                                         n_embd=16)).parameters())
    assert rows[1]["theory"] == 12 * n_params  # weights and two AdamW moments, fp32
