"""The sweep behind chapter 01's base rates runs, reports the best rate per optimizer and refuses a
run of no steps."""
import pytest

from minitorch_dist.course import base_rate_sweep as S

pytestmark = [pytest.mark.ch01, pytest.mark.timeout(120)]


def test_the_sweep_reports_each_rate_and_the_best(capsys, monkeypatch):
    monkeypatch.setattr(S, "GRID", {"AdamW": (1e-3, 1e-2), "LAMB": (1e-2,)})
    assert S.main(["--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "AdamW  batch 8, 2 steps" in out and "lr 0.001:" in out and "lr 0.01:" in out
    assert out.count("best: lr") == 2


def test_a_run_is_deterministic_and_learns():
    first, again = S.held_out_loss("AdamW", 1e-2, 2), S.held_out_loss("AdamW", 1e-2, 2)
    assert first == again  # one seed, one data stream: the same run twice is the same number
    assert S.held_out_loss("AdamW", 1e-2, 8) < S.held_out_loss("AdamW", 0.0, 8)  # rate 0 learns nothing


def test_no_steps_is_refused():
    with pytest.raises(SystemExit):
        S.main(["--steps", "0"])
