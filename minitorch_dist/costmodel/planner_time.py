"""Chapter 12 — a training step's seconds on a cluster, from a machine profile: the planner's time model.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM" (SC'21): the GEMMs of a transformer layer under tensor parallelism (§3.2; together
they are the ``24bsh² + 4bs²h`` forward FLOPs per layer from which §5.1 builds eq. 3), the fused
elementwise kernels Megatron runs (§4.2: bias + GeLU, bias + dropout + add, scale + mask + softmax),
the 1F1B pipeline and its bubble (§2.2).
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", §4.1: the
tensors a layer's elementwise ops produce (LayerNorm outputs, softmax and dropout of the scores,
GeLU, dropout masks), which are the bytes counted here. Williams et al. 2009 (roofline): a
memory-bound op takes its bytes over the memory bandwidth. Every rate is read from a
:class:`~..profiles.MachineProfile` (measured or cited); nothing here is a free efficiency.

**GEMMs** of one layer, one microbatch of ``b`` sequences of ``s`` tokens, width ``h``, ``a`` heads,
on one of ``t`` tensor-parallel ranks (:func:`layer_gemm_flops`; ``f = mlp_ratio·h``)::

    qkv        (b·s) x h x 3h/t                  6bsh²/t
    scores     b·a/t batches of s x h/a x s      2bs²h/t      (one batched call)
    context    b·a/t batches of s x s x h/a      2bs²h/t
    attn_out   (b·s) x h/t x h                   2bsh²/t
    fc1, fc2   (b·s) x h x f/t, (b·s) x f/t x h  2bshf/t each
    lm_head    (b·s) x h x V/t                   2bshV/t      (last pipeline stage)

Each takes ``profile.matmul_seconds(F, dtype)`` in the forward and twice that in the backward (the
input gradient and the weight gradient are GEMMs of the same FLOPs). The profile's table is indexed
by FLOPs alone: two GEMMs of equal FLOPs but different shapes (a thin attention ``bmm`` with
``K = h/a`` against a square projection) get the same time, which flatters the thin one.

**Elementwise bytes** of one layer's forward (:func:`layer_elementwise_bytes`; ``e`` bytes an
element, 2 in 16-bit; ``r = b·s`` rows, ``b·s/t`` with sequence parallelism, which splits the ops
outside the tensor-parallel region)::

    2 LayerNorms           fused: read and write r·h each (+ fp32 stats)   kernels.layernorm_bytes
    scale + mask + softmax fused: read and write the b·a/t·s² scores       kernels.softmax_bytes
    attention dropout      read and write the probabilities, write a 1-byte mask: (2e + 1)·b·a·s²/t
    bias + GeLU            read and write b·s·f/t: 2e·b·s·f/t
    2 bias + dropout + add read the output and the residual, write the sum and a mask: (3e + 1)·r·h

Each op's backward reads the tensor it saved and the incoming gradient and writes the outgoing
gradient: three tensors where its forward moved two, so :data:`BACKWARD_BYTES_FACTOR` = 1.5. The
time is ``bytes / profile.copy_bytes_per_s``. An eager framework (one kernel per op: chapter 11)
moves several times these bytes; the planner models Megatron's fused kernels.

**Recomputation.** ``"full"`` runs each layer's forward again in the backward; ``"selective"``
(Korthikanti §5) only the attention core: the scores and context GEMMs, the softmax, its dropout.

**The step** (:func:`step_seconds`): the slowest stage's microbatch (the last, with the LM head),
``m`` of them, the 1F1B bubble, the data-parallel collectives less what hides behind the backward,
and the optimizer's pass over its parameters (:func:`optimizer_step_bytes`). Host-side costs (the
profile's ``op_overhead_s``, ``collective_overhead_s``, ``framework_overhead_s``) are left out: with
a large model the host enqueues kernels ahead of the GPU and they hide behind it. On a CPU running a
tiny model they are most of the step; there only a replay of the recorded step
(:mod:`.step_time`) sees them.
"""
from __future__ import annotations

from .collectives import collective_time
from .kernels import adamw_bytes, layernorm_bytes, softmax_bytes
from .memory import OPTIMIZER_STATE_BYTES, PRECISIONS, RECOMPUTE
from .pipeline import pipeline_bubble_ratio
from .three_d import zero_dp_collectives

__all__ = ["BACKWARD_BYTES_FACTOR", "layer_gemm_flops", "lm_head_flops", "layer_elementwise_bytes",
           "optimizer_step_bytes", "microbatch_seconds", "zero_dp_seconds", "step_seconds"]

#: Bytes an elementwise op's backward moves per byte its forward moved: saved input + incoming
#: gradient + outgoing gradient (3 tensors) against input + output (2).
BACKWARD_BYTES_FACTOR = 1.5
_ATTENTION_CORE = ("scores", "context")  # the GEMMs selective recomputation runs again
_ATTENTION_CORE_BYTES = ("softmax", "attention_dropout")


def _check(**dims) -> None:
    for name, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


def layer_gemm_flops(b, s, h, heads, t=1, mlp_ratio=4) -> dict:
    """Forward FLOPs of each GEMM of one transformer layer on one of ``t`` tensor-parallel ranks
    (module docstring); their sum is ``(24bsh² + 4bs²h)/t`` with a 4h MLP (Narayanan §5.1, the per-layer
    forward count behind eq. 3)."""
    _check(b=b, s=s, h=h, heads=heads, t=t)
    f = int(mlp_ratio * h)
    rows = b * s
    return {"qkv": 2 * rows * h * 3 * h / t, "scores": 2 * b * s * s * h / t,
            "context": 2 * b * s * s * h / t, "attn_out": 2 * rows * h * h / t,
            "fc1": 2 * rows * h * f / t, "fc2": 2 * rows * f * h / t}


def lm_head_flops(b, s, h, vocab, t=1) -> float:
    """Forward FLOPs of the output layer (the logits), vocabulary-parallel over ``t`` ranks: 2bshV/t."""
    _check(b=b, s=s, h=h, vocab=vocab, t=t)
    return 2 * b * s * h * vocab / t


def layer_elementwise_bytes(b, s, h, heads, t=1, bytes_per_element=2, sequence_parallel=False,
                            mlp_ratio=4) -> dict:
    """Forward bytes of each memory-bound op of one layer with Megatron's fused kernels (module
    docstring; Korthikanti et al. 2022 §4.1 for which tensors they are)."""
    _check(b=b, s=s, h=h, heads=heads, t=t)
    e, f = bytes_per_element, int(mlp_ratio * h)
    rows = b * s // t if sequence_parallel else b * s  # sequence parallelism splits the ops outside TP
    scores = b * heads * s * s // t  # elements of one rank's attention scores
    layernorm = layernorm_bytes(rows, h, e, fused=True)
    softmax = softmax_bytes(max(1, b * heads * s // t), s, e, fused=True)  # rows of s scores
    return {"layernorm": 2 * (layernorm["read"] + layernorm["written"]),
            "softmax": softmax["read"] + softmax["written"],
            "attention_dropout": (2 * e + 1) * scores,
            "bias_gelu": 2 * e * b * s * f / t,
            "bias_dropout_add": 2 * (3 * e + 1) * rows * h}


def optimizer_step_bytes(n_params, precision="mixed", optimizer="adamw") -> float:
    """Bytes one optimizer step moves over ``n_params`` parameters, one fused pass: AdamW reads the
    fp32 weight (or master copy), gradient and two moments and writes three of them
    (``kernels.adamw_bytes(fused=True)``, 28 bytes a parameter); SGD reads weight and gradient (and
    its momentum) and writes them back. Mixed precision also writes the 16-bit copy of the weight."""
    if precision not in PRECISIONS or optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown precision {precision!r} or optimizer {optimizer!r}; expected one of "
                         f"{sorted(PRECISIONS)} and {sorted(OPTIMIZER_STATE_BYTES)}")
    if n_params <= 0:
        return 0.0
    if optimizer.startswith("adam"):
        rw = adamw_bytes(int(n_params), fused=True, dtype_bytes=4)
        update = rw["read"] + rw["written"]
    else:
        states = OPTIMIZER_STATE_BYTES[optimizer] // 4  # fp32 buffers besides the weight
        update = (2 + 2 * states + 1) * 4 * n_params  # read p, g, states; write p, states
    return update + (PRECISIONS[precision][0] * n_params if precision == "mixed" else 0)


def microbatch_seconds(profile, b, s, h, heads, vocab, layers, t=1, precision="mixed", recompute="none",
                       sequence_parallel=False, lm_head=True, mlp_ratio=4) -> dict:
    """Seconds of one microbatch's forward and backward through ``layers`` layers (and the LM head
    and its loss when ``lm_head``) on one tensor-parallel rank, GEMMs and elementwise ops at the
    profile's rates. Returns ``{"forward", "backward", "gemm", "elementwise", "total"}``; the
    backward includes the recomputed forward."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    e = 2 if precision == "mixed" else 4
    return layers_seconds(profile, layer_gemm_flops(b, s, h, heads, t, mlp_ratio),
                          layer_elementwise_bytes(b, s, h, heads, t, e, sequence_parallel, mlp_ratio),
                          _ATTENTION_CORE + _ATTENTION_CORE_BYTES, layers, recompute, precision,
                          (b, s, h, vocab, t) if lm_head else None)


def layers_seconds(profile, gemm_flops: dict, elementwise_bytes: dict, attention_core, layers: int,
                   recompute: str, precision: str, lm_head=None) -> dict:
    """:func:`microbatch_seconds` for any layer: ``gemm_flops`` and ``elementwise_bytes`` of one layer's
    forward by op, ``attention_core`` the keys selective recomputation redoes, ``lm_head`` None or
    ``(b, s, h, vocab, t)``. Backward = twice the forward GEMMs, ``BACKWARD_BYTES_FACTOR`` times its
    elementwise bytes, plus the recomputed part."""
    dtype, e = ("bf16", 2) if precision == "mixed" else ("fp32", 4)
    gemm = {k: profile.matmul_seconds(f, dtype) for k, f in gemm_flops.items()}
    bw = profile.copy_bytes_per_s
    elem = {k: v / bw for k, v in elementwise_bytes.items()}
    redo = {"none": (), "selective": tuple(attention_core), "full": tuple(gemm) + tuple(elem)}[recompute]
    g_fwd, e_fwd = layers * sum(gemm.values()), layers * sum(elem.values())
    g_redo = layers * sum(v for k, v in gemm.items() if k in redo)
    e_redo = layers * sum(v for k, v in elem.items() if k in redo)
    if lm_head is not None:  # logits GEMM and a fused cross-entropy: read the logits, write their gradient
        b, s, h, vocab, t = lm_head
        g_fwd += profile.matmul_seconds(lm_head_flops(b, s, h, vocab, t), dtype)
        e_fwd += 2 * e * b * s * vocab / t / bw
    forward = g_fwd + e_fwd
    backward = 2 * g_fwd + BACKWARD_BYTES_FACTOR * e_fwd + g_redo + e_redo
    return {"forward": forward, "backward": backward, "gemm": 3 * g_fwd + g_redo,
            "elementwise": (1 + BACKWARD_BYTES_FACTOR) * e_fwd + e_redo, "total": forward + backward}


def zero_dp_seconds(num_params, dp, stage, link, microbatches=1, bytes_per_element=2,
                    grad_bytes_per_element=None) -> float:
    """Seconds of the data-parallel collectives of one step under ZeRO ``stage``
    (:func:`~.three_d.zero_dp_collectives`), each on the ring with the α, β that ``link(op)`` returns;
    parameters all-gathered at ``bytes_per_element``, gradients reduced at ``grad_bytes_per_element``
    (default the same; 4 for an fp32 ``main_grad``)."""
    g = bytes_per_element if grad_bytes_per_element is None else grad_bytes_per_element
    return sum(k * collective_time(op, num_params * (bytes_per_element if op == "all_gather" else g), dp,
                                   *link(op))
               for op, k in zero_dp_collectives(stage, microbatches))


def step_seconds(mb: dict, m, pp, t_tp, t_p2p, t_dp, zero, t_opt, overlap=1.0, schedule="1f1b", v=1,
                 overlap_dp=True) -> dict:
    """One step of the slowest stage, from one microbatch's compute ``mb`` (:func:`microbatch_seconds`),
    its tensor-parallel ``t_tp`` and pipeline ``t_p2p`` communication, ``m`` microbatches::

        busy   = m · (compute + t_tp + t_p2p)
        bubble = pipeline_bubble_ratio(schedule, p, m, v) · busy         (Narayanan §2.2)
        dp     = t_dp − overlap · min(t_dp, window)                      exposed DP collectives
        total  = busy + bubble + dp + t_opt

    The window is the backward the collectives can hide behind: the last microbatch's at ZeRO 0/1
    (the sync waits for the accumulated gradient), every microbatch's at stage 2, the whole step's
    compute at stage 3; ``overlap`` is the profile's fraction of a collective that compute hides.
    """
    busy_mb = mb["total"] + t_tp + t_p2p
    bubble = pipeline_bubble_ratio(schedule, pp, m, v) * m * busy_mb
    window = {0: mb["backward"], 1: mb["backward"], 2: m * mb["backward"], 3: m * mb["total"]}[zero]
    exposed = t_dp - overlap * min(t_dp, window) if overlap_dp else t_dp
    parts = {"gemm": m * mb["gemm"], "elementwise": m * mb["elementwise"], "compute": m * mb["total"],
             "tp_comm": m * t_tp, "pp_comm": m * t_p2p, "bubble": bubble, "dp_comm": exposed,
             "dp_comm_total": t_dp, "optimizer": t_opt}
    parts["total"] = parts["compute"] + parts["tp_comm"] + parts["pp_comm"] + bubble + exposed + t_opt
    return parts
