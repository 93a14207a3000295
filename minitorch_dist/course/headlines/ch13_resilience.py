"""Chapter 13 — the tour's rows: a ZeRO-3 checkpoint resumed under TP 2 x DP 2, replicas written once,
a rank killed and the job resumed on fewer ranks, and Daly's optimal interval against a simulation."""
from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from ... import costmodel
from ...models.gpt import GPTConfig
from ...resilience import load, save
from ...resilience.elastic import Failure, run_elastic
from ...resilience.failures_sim import sweep_intervals
from ...resilience.trainers import Trainer
from ...runtime.env import single_thread
from ...runtime.launch import launch

CFG = GPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
B, T = 8, 16


def _save(layout, path, steps):
    trainer = Trainer(layout, CFG, B, T)
    for s in range(steps):
        trainer.step(s)
    return save(trainer.state(step=steps), path).bytes_written


def _resume(layout, path, stop):
    trainer = Trainer(layout, CFG, B, T)
    state = trainer.state(step=0)
    load(state, path)
    return [trainer.step(s) for s in range(state["step"], stop)]


def _reshard_rows(root: Path) -> list[dict]:
    with single_thread():
        ref = Trainer("single", CFG, B, T)
        want = [ref.step(s) for s in range(5)]
        n_params = sum(p.numel() for p in ref.model.parameters())
    launch(_save, 4, "zero3", str(root / "zero3"), 3)
    got = launch(_resume, 4, "dp2-tp2", str(root / "zero3"), 5)[0]
    diff = max(abs(a - b) for a, b in zip(got, want[3:]))
    written = sum(launch(_save, 2, "ddp", str(root / "ddp"), 1))
    once = costmodel.checkpoint_bytes(n_params, "fp32-adam")
    return [
        {"chapter": "ch13", "experiment": "saved by ZeRO-3 on 4 ranks, resumed by TP 2 x DP 2: max |Δloss| "
                                          "of the next 2 steps vs never stopping",
         "theory": 0.0, "measured": diff, "ok": diff <= 2e-6},
        {"chapter": "ch13", "experiment": "DDP on 2 ranks saves weights + AdamW state once (bytes)",
         "theory": once, "measured": written, "ok": abs(written - once) <= 0.01 * once},
    ]


def _drill_row(root: Path, smoke: bool) -> dict:
    steps, every, fail = (6, 2, 3) if smoke else (9, 3, 7)
    run = run_elastic(lambda n: "zero3", [4, 3], CFG, 12, T, steps, every, root / "drill",
                      fail=Failure(2, fail))
    lost = run.lost_work()[0]
    what = f"rank 2 of 4 killed in step {fail}, saving every {every}: steps redone on 3 ranks"
    return {"chapter": "ch13", "experiment": what,
            "theory": fail % every + 1, "measured": lost["steps_redone"],
            "ok": lost["steps_redone"] == fail % every + 1 and len(run.attempts) == 2}


def _interval_row(smoke: bool) -> dict:
    M, C, R = 6 * 3600.0, 300.0, 600.0  # Daly 2006, Fig. 4: M = 6 h, C = 5 min, R = 10 min
    taus = np.linspace(0.5, 2.0, 7) * costmodel.daly_interval(M, C)
    sweep = sweep_intervals(200 * 3600.0, taus, M, C, R, jobs=100 if smoke else 400)
    best = min(sweep, key=lambda s: s["mean_s"])["interval_s"]
    want = costmodel.daly_interval(M, C)
    return {"chapter": "ch13", "experiment": "best checkpoint interval (min), M = 6 h, C = 5 min: Daly vs "
                                             "simulated failures",
            "theory": want / 60, "measured": best / 60, "ok": abs(best - want) <= 0.26 * want}


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 13's rows for the tour."""
    with tempfile.TemporaryDirectory(prefix="mtd-ch13-") as tmp:
        root = Path(tmp)
        return _reshard_rows(root) + [_drill_row(root, smoke), _interval_row(smoke)]
