"""Chapter 00 — a few optimizer steps of the shared GPT on the Markov corpus: the loop every chapter
runs twice, once on the dense model in one process and once on its parallel version, to compare them.

The last step stops after ``backward``: its gradients stay in the parameters (no update), so a
test compares the parallel model's gradients, weights and losses with the dense model's.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime import comm
from .data import MarkovCorpus


@dataclass
class TrainResult:
    losses: list = field(default_factory=list)  # every step's loss, as floats
    logits: torch.Tensor | None = None  # the last step's logits (this rank's), detached
    meters: tuple = ()  # the comm meters of the last step's (forward, backward)


def train_steps(model, steps: int, batch: int, seq: int, *, optimizer=None, lr: float = 0.1,
                momentum: float = 0.0, after_backward=None, data: MarkovCorpus | None = None,
                rank: int = 0, world_size: int = 1) -> TrainResult:
    """``steps`` steps of ``model(x, y) -> (logits, loss)`` on ``data.batch(step, batch, seq, rank,
    world_size)`` (default: the corpus of ``model.cfg.vocab_size``, seed 0).

    ``optimizer``: a function of the parameters returning an optimizer (default SGD with ``lr``
    and ``momentum``). ``after_backward()`` runs after every backward (e.g. the all-reduce of
    sequence-parallel LayerNorm gradients). No update follows the last backward.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    params = list(model.parameters())
    opt = optimizer(params) if optimizer else torch.optim.SGD(params, lr=lr, momentum=momentum)
    if data is None:
        # a wrapper's model: .module.cfg
        cfg = getattr(model, "cfg", None) or getattr(getattr(model, "module", None), "cfg", None)
        if cfg is None:
            raise ValueError(f"{type(model).__name__} has no .cfg "
                             "(nor .module.cfg) to size the corpus: pass data=")
        data = MarkovCorpus(cfg.vocab_size, seed=0)
    out = TrainResult()
    for step in range(steps):
        opt.zero_grad()
        x, y = data.batch(step, batch, seq, rank, world_size)
        with comm.meter() as fwd:
            logits, loss = model(x, y)
        with comm.meter() as bwd:
            loss.backward()
        if after_backward is not None:
            after_backward()
        out.losses.append(loss.item())
        if step < steps - 1:
            opt.step()
    out.logits, out.meters = logits.detach(), (fwd, bwd)
    return out
