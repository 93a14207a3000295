"""Chapter 07 — the tour's rows: same gradients with dropout, √n segments' bytes vs Chen, 2 forwards."""
from __future__ import annotations

import torch

from ... import costmodel
from ...analysis.meters import MemoryMeter
from ...memory.checkpointing import apply_recompute, count_forwards, sqrt_segments
from ...models import GPT, GPTConfig, MarkovCorpus


def _run(policy, layers, batch, seq):
    """One forward and backward of a tiny GPT with dropout under recompute ``policy``: its gradients,
    the peak bytes of saved activations, and how many times each block ran forward."""
    cfg = GPTConfig.tiny(n_layer=layers, dropout=0.1, block_size=seq)
    torch.manual_seed(0)
    model = apply_recompute(GPT(cfg), policy)
    x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, batch, seq)
    torch.manual_seed(1)
    meter = MemoryMeter(model)
    with count_forwards(model.blocks) as runs, meter.track():
        model(x, y)[1].backward()
    return {k: q.grad for k, q in model.named_parameters()}, meter.peak["activations"], runs


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 07's rows: same gradients with dropout, √n segments' bytes vs Chen's formula, 2 forwards."""
    n, batch, seq = (9 if smoke else 16), 4, 32
    plain, none_bytes, _ = _run("none", n, batch, seq)
    full, _, runs = _run("full", n, batch, seq)
    _, sqrt_bytes, _ = _run("sqrt", n, batch, seq)
    per_layer = none_bytes - _run("none", n - 1, batch, seq)[1]
    rest = none_bytes - n * per_layer
    want = rest + costmodel.checkpoint_saved_bytes(n, per_layer, batch * seq * GPTConfig.tiny().n_embd * 4,
                                                   sqrt_segments(n), checkpoint_last=False)
    diff = max((full[k] - plain[k]).abs().max().item() for k in plain)
    return [
        {"chapter": "ch07",
         "experiment": f"every block checkpointed, dropout 0.1, {n} layers: max |Δgrad| vs plain",
         "theory": 0.0, "measured": diff, "ok": diff == 0.0},
        {"chapter": "ch07",
         "experiment": f"saved bytes, √n = {sqrt_segments(n)} segments of {n} layers (Chen et al.)",
         "theory": want, "measured": sqrt_bytes, "ok": abs(sqrt_bytes - want) <= 0.05 * want},
        {"chapter": "ch07", "experiment": "forward runs per checkpointed block per step",
         "theory": 2, "measured": max(runs.values()), "ok": set(runs.values()) == {2}},
    ]
