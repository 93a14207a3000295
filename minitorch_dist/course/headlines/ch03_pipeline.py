"""Chapter 03 — the tour's rows: GPipe and 1F1B on 4 ranks == one process; stashes of m and p; the bubble;
ZB-V and DualPipeV (two chunks per rank in a V) on 4 ranks == one process, and their simulated bubbles
against the formulas; and the 1F1B step on 2 ranks predicted from a profile of this machine next to the
measured one."""
from __future__ import annotations

import torch

from ... import costmodel
from ...analysis.pipeline_observers import StashCounter
from ...analysis.predict import tour_row
from ...costmodel import pipeline as pipeline_costs
from ...models.data import MarkovCorpus
from ...models.gpt import GPT, GPTConfig
from ...parallelism.pipeline import local_stages, make_schedule, run_schedule, simulate
from ...runtime import observe
from ...runtime.launch import launch


def _headline_rank(name, p, m, cfg, batch, seq):
    torch.manual_seed(0)
    model = GPT(cfg)
    sched = make_schedule(name, p, m)
    x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, batch, seq)
    stash = StashCounter()
    with observe.watching(stash):
        run_schedule(sched, local_stages(model, sched), x, y)
    return stash.peak, {n: q.grad for n, q in model.named_parameters() if q.grad is not None}


def _reference_grads(cfg, batch, seq) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    x, y = MarkovCorpus(cfg.vocab_size, seed=0).batch(0, batch, seq)
    model(x, y)[1].backward()
    return {n: q.grad for n, q in model.named_parameters()}


def _v_rows(p: int, m: int, batch: int, seq: int) -> list[dict]:
    """ZB-V and DualPipeV on p ranks (2p virtual stages of one block) against one process; their
    simulated bubbles at t_F = t_B = t_W against Qi et al. §6 and DeepSeek-V3 Table 2."""
    cfg = GPTConfig.tiny(n_layer=2 * p, block_size=seq)
    ref = _reference_grads(cfg, batch, seq)
    names = ("zbv", "dualpipev")
    runs = {name: launch(_headline_rank, p, name, p, m, cfg, batch, seq) for name in names}
    diff = max((g[k] - ref[k]).abs().max().item() for out in runs.values() for _, g in out for k in g)
    sim = [simulate(make_schedule(name, p, m)).bubble_fraction for name in names]
    want = [pipeline_costs.pipeline_bubble_fraction(name, p, m) for name in names]
    return [
        {"chapter": "ch03", "experiment": f"ZB-V and DualPipeV (a V of 2 chunks per rank) on p={p} ranks "
                                          f"== 1 process, max |Δgrad|",
         "theory": 1e-6, "measured": diff, "ok": diff < 1e-6},
        {"chapter": "ch03", "experiment": f"simulated bubble p={p}, m={m}, t_F=t_B=t_W: "
                                          f"ZB-V (p-1)/(6m+p-1) / DualPipeV (p-1)/(3m+p-1)",
         "theory": f"{want[0]:.4f} / {want[1]:.4f}", "measured": f"{sim[0]:.4f} / {sim[1]:.4f}",
         "ok": all(abs(a - b) < 1e-12 for a, b in zip(sim, want))},
    ]


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 03's rows for the tour: 1F1B on 4 ranks == one process; its stash stays at p
    while GPipe's is m; the simulated bubble is the formula's; ZB-V and DualPipeV on 4 ranks == one
    process and their simulated bubbles; the 1F1B step on 2 ranks (one per core) predicted from a
    profile calibrated now, then measured (:func:`.predict.tour_row`)."""
    p, m, batch, seq = 4, 8, 16, 32
    cfg = GPTConfig.tiny(n_layer=4, block_size=seq)
    ref = _reference_grads(cfg, batch, seq)
    runs = {name: launch(_headline_rank, p, name, p, m, cfg, batch, seq) for name in ("gpipe", "1f1b")}
    diff = max((g[k] - ref[k]).abs().max().item() for out in runs.values() for _, g in out for k in g)
    stash = {name: max(s for s, _ in out) for name, out in runs.items()}
    want_stash = {name: costmodel.pipeline_stashed_microbatches(name, p, m, stage=0) for name in runs}
    sim = simulate(make_schedule("1f1b", p, m)).bubble_fraction
    want = costmodel.pipeline_bubble_fraction("1f1b", p, m)
    return [
        {"chapter": "ch03", "experiment": f"GPipe and 1F1B on p={p} ranks == 1 process, max |Δgrad|",
         "theory": 1e-6, "measured": diff, "ok": diff < 1e-6},
        {"chapter": "ch03",
         "experiment": f"peak stashed microbatches, m={m}: 1F1B (theory p) / GPipe (theory m)",
         "theory": f"{want_stash['1f1b']:g} / {want_stash['gpipe']:g}",
         "measured": f"{stash['1f1b']:g} / {stash['gpipe']:g}", "ok": stash == want_stash},
        {"chapter": "ch03", "experiment": f"simulated 1F1B bubble, p={p}, m={m} = (p-1)/(m+p-1)",
         "theory": want, "measured": sim, "ok": abs(sim - want) < 1e-12},
        *_v_rows(p, m, batch, seq),
        tour_row("ch03", "pp-1f1b", smoke),
    ]
