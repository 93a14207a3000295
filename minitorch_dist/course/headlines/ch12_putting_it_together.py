"""Chapter 12 — the tour's rows: 3D parallelism, 2 x 2 x 2 on 8 ranks == one process; traffic == formulas;
the 3D step's time predicted from the calibrated profile next to the clock."""
from __future__ import annotations

from ... import costmodel
from ...analysis.predict import tour_row
from ...models.gpt import GPTConfig
from ...parallelism.three_d import merge_full_params, reference_run, train_3d
from ...runtime.launch import launch


def _traffic(results, cfg, p, m, act):
    """Over one pipeline: DP all-reduce bytes and PP send bytes; over all ranks: the set of TP
    all-reduces of b·s·h per layer and microbatch."""
    one_pipeline = [r for r in results if r.coords.dp == 0 and r.coords.tp == 0]
    dp_bytes = sum(e.nbytes for r in one_pipeline for e in r.events["dp"]  # the gradients, not the
                   if e.op == "all_reduce" and e.dtype != "torch.uint8")  # 1-byte has-grad mask (ch06)
    p2p = sum(e.nbytes for r in one_pipeline for e in r.events["pipeline"] if e.op == "send")
    per_layer = set()
    for r in results:  # TP all-reduces of b·s·h per layer and microbatch, less the embedding's and lm_head's
        n = sum(e.op == "all_reduce" and e.nbytes == act for e in r.events["pipeline"])
        ends = (r.coords.pp == 0) + (r.coords.pp == p - 1)
        per_layer.add((n - m * ends) / (m * cfg.n_layer // p))
    return dp_bytes, p2p, per_layer


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 12's rows for the tour: d x t x p = 2 x 2 x 2 on 8 ranks == one process; the DP,
    TP and PP traffic the meter counted is the formulas'; the predicted 3D step is within 25% of the
    measured one."""
    d = t = p = 2
    m, batch, seq = 2, 16, 16
    steps = 2 if smoke else 4
    cfg = GPTConfig(vocab_size=64, block_size=seq, n_layer=4, n_head=4, n_embd=32)
    results = launch(train_3d, d * t * p, cfg, d, t, p, steps, batch, seq, m, timeout_s=600)
    _, ref = reference_run(cfg, steps, batch, seq)
    full, spread = merge_full_params(results, cfg)
    diff = max(max((full[k] - ref[k]).abs().max().item() for k in ref), spread)
    act = batch // d // m * seq * cfg.n_embd * 4  # one microbatch's b·s·h activation, fp32
    dp_bytes, p2p, per_layer = _traffic(results, cfg, p, m, act)
    want_dp = 4 * (costmodel.tensor_parallel_params_per_rank(cfg, t) + cfg.vocab_size * cfg.n_embd // t)
    want_p2p = costmodel.pipeline_p2p_bytes(p, m, act)
    want_tp = sum(costmodel.tensor_parallel_allreduces_per_layer().values())
    return [
        {"chapter": "ch12",
         "experiment": f"d×t×p = {d}×{t}×{p} on 8 ranks == 1 process after {steps} SGD steps, max |Δw|",
         "theory": 1e-6, "measured": diff, "ok": diff < 1e-6},
        {"chapter": "ch12",
         "experiment": "DP all-reduce bytes over one pipeline = 4 B × (Ψ per TP rank + tied copy)",
         "theory": want_dp, "measured": dp_bytes,
         "ok": abs(dp_bytes - want_dp) <= 4 * (d - 1) * p},  # the flat buffer's padding
        {"chapter": "ch12", "experiment": "TP all-reduces of b·s·h per layer per microbatch (fwd + bwd)",
         "theory": want_tp, "measured": max(per_layer), "ok": per_layer == {want_tp}},
        {"chapter": "ch12", "experiment": f"PP bytes sent per pipeline per step = 2·m·(p-1)·b·s·h·4 (m={m})",
         "theory": want_p2p, "measured": p2p, "ok": p2p == want_p2p},
        tour_row("ch12", "3d", smoke, size="10x"),
    ]
