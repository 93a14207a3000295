"""Chapter 01 — the tour's rows: DDP == one process, 2(n-1)/n bytes per step, overlap happened, and the
step time predicted from a profile of this machine next to the measured one."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ... import costmodel
from ...analysis.observers import Recorder, launches_during_backward
from ...analysis.predict import tour_row
from ...models.data import MarkovCorpus
from ...models.gpt import GPT, GPTConfig
from ...parallelism.data_parallel import DistributedDataParallel
from ...runtime import comm, observe
from ...runtime.env import single_thread
from ...runtime.launch import launch


def _train_gpt(cfg, steps, batch, seq, wrap):
    """SGD with momentum on the tiny GPT, each rank on its rows of the global batch of each step.
    ``wrap(model)`` returns the model to call (a data-parallel wrapper, or the model itself)."""
    r = dist.get_rank() if dist.is_initialized() else 0
    n = dist.get_world_size() if dist.is_initialized() else 1
    torch.manual_seed(r)  # replicas start different: the broadcast must make them rank 0's
    model = wrap(GPT(cfg))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = MarkovCorpus(cfg.vocab_size, seed=0)
    wire, during = [], []
    for step in range(steps):
        x, y = data.batch(step, batch, seq, r, n)
        with comm.meter() as m, observe.watching(Recorder()) as seen:
            _, loss = model(x, y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        wire.append(m.wire_bytes["all_reduce"])
        during.append(launches_during_backward(seen))
    inner = getattr(model, "module", model)
    return {"params": {k: v.detach().clone() for k, v in inner.state_dict().items()},
            "wire": wire, "during": during, "buckets": len(getattr(model, "buckets", []))}


def _headline_rank(cfg, steps, batch, seq, cap_mb):
    return _train_gpt(cfg, steps, batch, seq,
                      lambda m: DistributedDataParallel(m, bucket_cap_mb=cap_mb, first_bucket_mb=cap_mb / 4))


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 01's rows for the tour: DDP == one process, 2(n-1)/n bytes, overlap happened, and the
    DDP step on 2 ranks (one per core) predicted from a profile calibrated now, then measured."""
    n, batch, seq = 4, 16, 32
    steps = 3 if smoke else 10
    cfg = GPTConfig.tiny()
    cap_mb = 0.1  # ~100 KiB: the ~0.4 MB tiny GPT splits into several buckets
    # The single-process reference first, on one thread like a rank: it also imports what the
    # optimizer pulls in lazily (torch._dynamo, ~2 s), so the forked ranks inherit it.
    with single_thread():
        ref = _train_gpt(cfg, steps, batch, seq, lambda m: m)["params"]
    per_rank = launch(_headline_rank, n, cfg, steps, batch, seq, cap_mb)
    diff = max((per_rank[r]["params"][k] - ref[k]).abs().max().item() for r in range(n) for k in ref)
    grad_bytes = sum(p.numel() * p.element_size() for p in GPT(cfg).parameters() if p.requires_grad)
    want = costmodel.bus_bytes("all_reduce", grad_bytes, n)
    wire = [w for p in per_rank for w in p["wire"]]
    during = min(d for p in per_rank for d in p["during"])
    nb = per_rank[0]["buckets"]
    return [
        {"chapter": "ch01", "experiment": f"DDP == 1 process after {steps} SGD steps (n={n}), max |Δparam|",
         "theory": 1e-5, "measured": diff, "ok": diff < 1e-5},
        {"chapter": "ch01", "experiment": f"all-reduce wire bytes per step = 2(n-1)/n x {grad_bytes:,} B",
         "theory": want, "measured": float(max(wire)), "ok": all(w == want for w in wire)},
        {"chapter": "ch01", "experiment": f"bucket all-reduces launched during backward (of {nb})",
         "theory": ">= 1", "measured": during, "ok": nb >= 2 and during >= 1},
        tour_row("ch01", "ddp", smoke),  # predicted first (a replay of the recorded step), then timed
    ]
