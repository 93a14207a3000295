"""Chapter 04 — the tour's rows: TP GPT == dense, 2 + 2 all-reduces per layer, the bytes per layer, the
Llama-shaped model's TP with kv heads split and replicated == dense, and the TP step time predicted from a
profile of this machine next to the measured one."""
from __future__ import annotations

import torch

from ... import costmodel
from ...analysis.predict import tour_row
from ...models.gpt import GPT, GPTConfig
from ...models.llama import Llama, LlamaConfig
from ...models.train import train_steps
from ...parallelism.tensor_parallel import parallelize_gpt, shard_dense_tensors
from ...parallelism.tensor_parallel_llama import kv_layout, parallelize_llama, shard_dense_llama_tensors
from ...runtime import comm
from ...runtime.env import single_thread
from ...runtime.launch import launch


def _headline_rank(cfg, steps, batch, seq, ref_grads):
    torch.manual_seed(0)
    model = parallelize_gpt(GPT(cfg))
    fwd, bwd = train_steps(model, steps, batch, seq).meters
    want = shard_dense_tensors(ref_grads, cfg)  # this rank's slices of the dense gradients
    diff = max((q.grad - want[k]).abs().max().item() for k, q in model.named_parameters())
    bsh = batch * seq * cfg.n_embd * 4
    counts = [sum(e.op == "all_reduce" and e.nbytes == bsh for e in m.events) for m in (fwd, bwd)]
    with comm.meter() as one:  # one transformer layer alone, forward and backward
        model.blocks[0](torch.randn(batch, seq, cfg.n_embd, requires_grad=True)).sum().backward()
    return {"diff": diff, "counts": counts, "layer_wire": one.total_wire_bytes}


def _llama_rank(cfg, batch, seq, ref_grads):
    """One step of the Llama under TP on this rank: the largest difference from the dense gradients."""
    torch.manual_seed(0)
    model = parallelize_llama(Llama(cfg))
    train_steps(model, 1, batch, seq)
    want = shard_dense_llama_tensors(ref_grads, cfg)
    return max((q.grad - want[k]).abs().max().item() for k, q in model.named_parameters())


def _llama_rows(batch: int, seq: int) -> list[dict]:
    """Llama-shaped TP, n_kv_head = 2: t = 2 splits the kv heads, t = 4 replicates them (gradients summed)."""
    cfg = LlamaConfig.tiny(block_size=seq, n_head=4, n_kv_head=2)
    with single_thread():
        torch.manual_seed(0)
        dense = Llama(cfg)
        train_steps(dense, 1, batch, seq)
    ref = {k: q.grad for k, q in dense.named_parameters()}
    rows = []
    for t in (2, 4):
        diff = max(launch(_llama_rank, t, cfg, batch, seq, ref))
        rows.append({"chapter": "ch04", "experiment": f"Llama TP on t={t} ranks, 4 heads / 2 kv heads "
                     f"({kv_layout(4, 2, t)}) == dense, max |Δgrad|", "theory": 1e-5, "measured": diff,
                     "ok": diff < 1e-5})
    return rows


def headline(smoke: bool = False) -> list[dict]:
    """Chapter 04's rows for the tour: TP GPT == dense, 2 + 2 all-reduces per layer, the bytes, and the
    TP step on 2 ranks (one per core) predicted from a profile calibrated now, then measured."""
    t, batch, seq = 4, 8, 32
    steps = 2 if smoke else 4
    cfg = GPTConfig.tiny(block_size=seq)
    with single_thread():  # the dense reference, one thread like a rank
        torch.manual_seed(0)
        dense = GPT(cfg)
        train_steps(dense, steps, batch, seq)
    ref_grads = {k: q.grad for k, q in dense.named_parameters()}
    per_rank = launch(_headline_rank, t, cfg, steps, batch, seq, ref_grads)
    diff = max(p["diff"] for p in per_rank)
    # whole model: the embedding adds one forward all-reduce of b·s·h, the output layer's f one backward
    fwd = [(p["counts"][0] - 1) / cfg.n_layer for p in per_rank]
    bwd = [(p["counts"][1] - 1) / cfg.n_layer for p in per_rank]
    want = costmodel.tensor_parallel_allreduces_per_layer()
    want_bytes = costmodel.tensor_parallel_bytes_per_layer(batch, seq, cfg.n_embd, t, bytes_per_element=4)
    wire = max(p["layer_wire"] for p in per_rank)
    return [
        {"chapter": "ch04",
         "experiment": f"TP GPT on t={t} ranks == dense after {steps} SGD steps, max |Δgrad|",
         "theory": 1e-5, "measured": diff, "ok": diff < 1e-5},
        {"chapter": "ch04", "experiment": "all-reduces of b·s·h per layer, forward / backward",
         "theory": f"{want['forward']} / {want['backward']}", "measured": f"{max(fwd):g} / {max(bwd):g}",
         "ok": set(fwd) == {want["forward"]} and set(bwd) == {want["backward"]}},
        {"chapter": "ch04",
         "experiment": f"wire bytes per layer = 8·b·s·h·(t-1)/t x 4 B (b={batch}, s={seq})",
         "theory": want_bytes, "measured": wire, "ok": abs(wire - want_bytes) <= 1e-9 * want_bytes},
        *_llama_rows(batch, seq),
        tour_row("ch04", "tp", smoke),  # predicted first (a replay of the recorded step), then timed
    ]
