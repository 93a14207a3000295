"""Chapter 12 — the dry run of a Llama-shaped preset: one rank of a data x tensor (x pipeline) grid.

``python -m minitorch_dist dryrun --model llama3-8b --dp 8 --tp 8 --sequence-parallel`` plays one rank
as :mod:`.dryrun` does for the GPT: chapter 12's ``Model3D`` step, which takes a ``LlamaConfig`` (the
Llama of :mod:`..models.llama` on ``meta`` tensors under torch's fake process group, sliced over its TP
group by :mod:`..parallelism.tensor_parallel_llama` with kv heads split or replicated, cut into pipeline
stages when pp > 1). This module holds what differs: :func:`check_llama_grid` and :func:`llama_predicted`,
which counts this rank's stage (its layers, the microbatches the schedule stashes, the sends). The prediction
beside each measurement is ``costmodel.llama`` (parameters per rank, Korthikanti-style
activations with fused RMSNorm and SwiGLU) and the TP / SP / ZeRO byte formulas the GPT's dry run uses.
"""
from __future__ import annotations

from .. import costmodel
from ..costmodel import llama as llama_cost

__all__ = ["check_llama_grid", "llama_predicted"]


def check_llama_grid(cfg, tp: int, pp: int, recompute: str) -> None:
    """A ``ValueError`` naming the fix unless this dry run can play the Llama ``cfg`` at these degrees."""
    from ..parallelism.tensor_parallel_llama import kv_layout

    if cfg.n_layer % pp:
        raise ValueError(f"--pp {pp} does not divide the {cfg.n_layer} layers into equal stages; choose --pp "
                         f"among the divisors of {cfg.n_layer}")
    if recompute not in ("none", "full"):
        raise ValueError(f"--recompute {recompute}: the Llama dry run recomputes whole blocks (full) or "
                         f"nothing; use --recompute none or full")
    kv_layout(cfg.n_head, cfg.n_kv_head, tp)
    for what, n in (("vocab_size", cfg.vocab_size), ("ffn_hidden", cfg.ffn_hidden)):
        if n % tp:
            raise ValueError(f"{what} {n} is not divisible by --tp {tp}; choose a degree that divides it")


def llama_predicted(run, e: int, precision: str, stage: int = 0) -> dict:
    """``costmodel``'s value for each measured key of this rank, at pipeline stage ``stage`` (``e`` bytes
    an element); None where there is no formula."""
    cfg, m = run.cfg, run.microbatches
    local = llama_cost.llama_stage_params(cfg, run.tp, run.pp)[stage]
    layers = cfg.n_layer // run.pp
    states = costmodel.model_state_bytes(local, precision, "adamw")
    b, s, h = run.micro_batch_size, cfg.block_size, cfg.n_embd
    shape = (s, b, h, cfg.n_head, cfg.n_kv_head, cfg.ffn_hidden)
    sp = run.sequence_parallel and run.tp > 1
    kind = "full" if run.recompute == "full" else ("selective" if run.attention == "flash" else "none")
    act = llama_cost.llama_activation_bytes(*shape, layers, run.tp, sp, kind, e)
    act *= costmodel.pipeline_stashed_microbatches(run.schedule, run.pp, m, stage=stage)  # 1 when pp = 1
    if run.recompute == "full":  # one block rebuilt at a time in backward
        one = "selective" if run.attention == "flash" else "none"
        act += llama_cost.llama_activation_bytes(*shape, 1, run.tp, sp, one, e)
    mem = {"parameters": local * e, "gradients": local * e,
           "optimizer_states": states["optimizer"] / (run.dp if run.zero >= 1 else 1),
           "activations": act, "temporaries": None}
    mem["peak"] = sum(v for v in mem.values() if v is not None)
    redo = 6 / 4 if run.recompute == "full" else 1  # the recomputed forward repeats its 2 all-reduces
    tp_bytes = m * layers * costmodel.tensor_parallel_bytes_per_layer(b, s, h, run.tp, e) * redo
    kv = llama_cost.llama_kv_replica_allreduce_elements(cfg, run.tp) * e
    tp_bytes += m * layers * costmodel.bus_bytes("all_reduce", kv, run.tp) if kv else 0.0
    gather = scatter = 0.0
    if sp:  # the layers' all-reduces become all-gathers and reduce-scatters
        counts = costmodel.sequence_parallel_collectives_per_layer(regather=True,
                                                                   recompute=run.recompute == "full")
        full = b * s * h * e
        gather, scatter = (m * layers * sum(phase[op] for phase in counts.values())
                           * costmodel.bus_bytes(op, full, run.tp) for op in ("all_gather", "reduce_scatter"))
        tp_bytes = m * layers * costmodel.bus_bytes("all_reduce", kv, run.tp) if kv else 0.0
    dp_op = costmodel.zero_dp_bytes_per_step(local, run.dp, run.zero, 1 if run.zero == 2 else m, e)
    comm = {"all_reduce": tp_bytes + (dp_op if run.zero == 0 else 0.0),
            "all_gather": gather + (dp_op / 2 if run.zero >= 1 else 0.0),
            "reduce_scatter": scatter + (dp_op / 2 if run.zero >= 1 else 0.0),
            "all_to_all": 0.0, "send": 0.0, "broadcast": 0.0}
    if run.pp > 1:  # activations forward, their gradients back: one message per microbatch and cut
        first, last = stage == 0, stage == run.pp - 1
        msg = costmodel.pipeline_p2p_message_bytes(b, s, h, run.tp, e, scatter_gather=sp)
        comm["send"] = m * ((not last) + (not first)) * msg
    return {"memory_bytes": mem, "comm_bytes": comm}
