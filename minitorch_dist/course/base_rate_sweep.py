"""Chapter 01 — the sweep behind the large-batch experiment's base rates: ``python -m
minitorch_dist.course.base_rate_sweep`` (about 2 minutes on 2 cores; ``--steps 6`` for a smoke run).

Notebook 01's large-batch section trains the tiny GPT on a first-order Markov chain at batch 8 and
batch 64 for the same number of steps, each optimizer at a *base* rate tuned at batch 8. This is that
tuning: batch 8, 100 steps, seed 0, the warm-up schedule and held-out data of the notebook, over rates
a factor of about 2 apart. It prints the held-out loss of each rate and the best one per optimizer
(AdamW 0.01 and LAMB 0.06 on the machine that chose them). A rate at the edge of the grid is reported
as such: the best may lie outside it.
"""
from __future__ import annotations

import argparse
import sys

import torch

from ..models import GPT, GPTConfig, MarkovCorpus
from ..parallelism.large_batch import LAMB, warmup_schedule
from ..runtime.env import hardware_summary

#: the rates tried per optimizer: factors of about 2 around the chosen ones
GRID = {"AdamW": (2.5e-3, 5e-3, 1e-2, 2e-2, 4e-2), "LAMB": (1.5e-2, 3e-2, 6e-2, 1.2e-1, 2.4e-1)}
SEQ, BATCH = 16, 8


def held_out_loss(opt_name: str, lr: float, steps: int, seed: int = 0) -> float:
    """The held-out loss of the tiny GPT after ``steps`` steps at batch 8 (the notebook's recipe)."""
    cfg = GPTConfig.tiny()
    corpus = MarkovCorpus(cfg.vocab_size, seed=0)
    x_eval, y_eval = corpus.batch(10**7, 256, SEQ)
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = (torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01) if opt_name == "AdamW"
           else LAMB(model.parameters(), lr=lr, weight_decay=0.01))
    sched = warmup_schedule(opt, warmup_steps=max(steps // 10, 1), total_steps=steps)
    for step in range(steps):
        x, y = corpus.batch(seed * 10**5 + step, BATCH, SEQ)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        return float(model(x_eval, y_eval)[1])


def sweep(steps: int = 100, grid: dict = GRID) -> dict[str, dict[float, float]]:
    """``{optimizer: {rate: held-out loss}}`` over ``grid``."""
    return {name: {lr: held_out_loss(name, lr, steps) for lr in rates} for name, rates in grid.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps per run (default 100, as the notebook)")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    print(hardware_summary())
    for name, losses in sweep(args.steps, GRID).items():
        best = min(losses, key=losses.__getitem__)
        row = "  ".join(f"lr {lr:g}: {loss:.3f}" for lr, loss in losses.items())
        edge = " (at the grid's edge: widen it)" if best in (min(losses), max(losses)) else ""
        print(f"{name:<6} batch {BATCH}, {args.steps} steps, seed 0: {row}\n       best: lr {best:g}{edge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
