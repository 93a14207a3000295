"""Chapter 08 — the tour's rows: our scaler == GradScaler; fp16 + scaling == fp32; master weights help."""
from __future__ import annotations

import torch
from torch import nn

from ...memory.mixed_precision import DynamicLossScaler, MixedPrecisionTrainer, fp32_cross_entropy
from ...models import GPT, GPTConfig, MarkovCorpus

# each step's gradient: fine, or poisoned with an inf or a nan
_SCRIPT = ["ok", "inf", "ok", "ok", "ok", "nan", "ok", "ok", "ok", "ok"]


def _scale_trace(scaler) -> list[float]:
    """The loss scale after each step of :data:`_SCRIPT` on a two-weight toy problem."""
    p = nn.Parameter(torch.ones(2))
    opt, trace = torch.optim.SGD([p], lr=0.1), []
    for kind in _SCRIPT:
        opt.zero_grad()
        scaler.scale((p * p).sum()).backward()
        if kind != "ok":
            p.grad[0] = float(kind)
        scaler.step(opt)
        scaler.update()
        trace.append(scaler.get_scale())
    return trace


def _loss_gap(steps: int) -> float:
    """Max |loss| difference between fp32 AdamW and the fp16 trainer on the same tiny GPT and batches."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    data = MarkovCorpus(32, seed=0)
    adamw = lambda ps: torch.optim.AdamW(ps, lr=3e-3)  # noqa: E731
    torch.manual_seed(0)
    model = GPT(cfg)
    trainer = MixedPrecisionTrainer(model, adamw, torch.float16)
    opt, gap = adamw(model.parameters()), 0.0
    for s in range(steps):
        x, y = data.batch(s, 16, 16)
        opt.zero_grad()
        loss = fp32_cross_entropy(model, x, y)
        loss.backward()
        opt.step()
        gap = max(gap, abs(trainer.train_step([(x, y)]) - loss.item()))
    return gap


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 08's rows: our scaler = torch.amp.GradScaler; fp16+scaler = fp32; master weights keep
    tiny updates."""
    scales = {"ours": _scale_trace(DynamicLossScaler(growth_interval=3)),
              "torch": _scale_trace(torch.amp.GradScaler("cpu", growth_interval=3))}
    steps = 10 if smoke else 30
    gap = _loss_gap(steps)
    w = torch.ones(1, dtype=torch.float16)
    master = w.float()
    for _ in range(50):  # an update of 1e-4: below half of fp16's gap at 1.0
        w -= 1e-4
        master -= 1e-4
    return [
        {"chapter": "ch08",
         "experiment": "loss scale after ok/inf/ok.../nan/... (growth 3): ours == torch.amp.GradScaler",
         "theory": scales["torch"][-1], "measured": scales["ours"][-1],
         "ok": scales["ours"] == scales["torch"]},
        {"chapter": "ch08",
         "experiment": f"fp16 + dynamic loss scaling vs fp32, tiny GPT, {steps} AdamW steps: max |Δloss|",
         "theory": 2e-3, "measured": gap, "ok": gap < 2e-3},
        {"chapter": "ch08", "experiment": "50 updates of -1e-4 to 1.0: fp16 weight / fp32 master",
         "theory": "1.0 / 0.995", "measured": f"{w.item():g} / {master.item():.4g}",
         "ok": w.item() == 1.0 and abs(master.item() - 0.995) < 1e-6},
    ]
