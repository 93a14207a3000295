"""Chapter 12 — 3D parallelism (data x tensor x pipeline): what one GPU holds and sends when the three
combine.

The planner (``analysis/planner.py``, chapter 12) composes the formulas of the other submodules;
the few it needs that only exist once the axes are combined live here:

* the parameters of each pipeline stage's rank in Megatron's layout (Narayanan et al. 2021, §2.2
  and §3; Shoeybi et al. 2019, §3 for the tensor-parallel split);
* ZeRO's bytes per step when a step is several microbatches (Rajbhandari et al. 2020, §5.2, §7.2),
  and what a ZeRO stage costs under a pipeline (:func:`zero_stage_under_pipeline`);
* the pipeline's point-to-point message with the scatter/gather optimisation (Narayanan §4.1);
* the first pipeline stage's activation memory (Korthikanti et al. 2022, §4.2).
"""
from __future__ import annotations

from types import SimpleNamespace

from .collectives import bus_bytes, collective_time
from .memory import RECOMPUTE, activation_memory_bytes
from .pipeline import pipeline_stashed_microbatches
from .tensor_parallel import tensor_parallel_params_per_rank

_FIELDS = ("n_layer", "n_embd", "n_head", "vocab_size", "block_size", "mlp_ratio", "bias", "tie_embeddings")


def _variant(cfg, **changes):
    """A duck-typed copy of ``cfg`` with some fields changed (n_layer=0 etc. are fine for counting)."""
    base = {k: getattr(cfg, k) for k in _FIELDS if hasattr(cfg, k)}
    return SimpleNamespace(**{**base, **changes})


def pipeline_stage_params(cfg, tp: int = 1, pp: int = 1) -> list[int]:
    """Parameters one rank of each pipeline stage holds: ``pp`` stages of ``n_layer/pp`` blocks,
    each block split ``tp`` ways as in :func:`~.tensor_parallel.tensor_parallel_params_per_rank`.

    Megatron's layout (Narayanan et al. 2021, §2.2): the first stage also holds the word embedding
    (``V*h/t``) and position embedding (``T*h``); the last stage the final LayerNorm and the output
    layer (``V*h/t``). With tied embeddings and ``pp > 1`` the output layer is a *copy* of the word
    embedding on the last stage, kept equal by an all-reduce of the two gradients (Megatron-LM's
    embedding group; ``pipeline/executor.py`` does the same), so it is counted there too::

        first  = k*layer + wte + wpe        middle = k*layer        last = k*layer + ln_f + head
        k = n_layer / pp                    (pp = 1: all of it, the tied head counted once)

    Every piece is read off :func:`~.tensor_parallel.tensor_parallel_params_per_rank` of a model
    with fewer parts (no layers, no vocabulary...), so there is one parameter formula, not two.
    """
    if pp < 1 or tp < 1:
        raise ValueError(f"need tp >= 1 and pp >= 1, got tp={tp}, pp={pp}")
    if cfg.n_layer % pp:
        raise ValueError(f"n_layer {cfg.n_layer} is not divisible by pp={pp}; choose pp among the divisors "
                         f"of {cfg.n_layer}")
    count = lambda **kw: tensor_parallel_params_per_rank(_variant(cfg, **kw), tp)
    if pp == 1:
        return [count()]
    ln_f = count(n_layer=0, vocab_size=0, block_size=0)
    wte = count(n_layer=0, block_size=0, tie_embeddings=True) - ln_f
    wpe = count(n_layer=0, vocab_size=0) - ln_f
    layer = count(n_layer=1, vocab_size=0, block_size=0) - ln_f
    k = cfg.n_layer // pp
    return [k * layer + wte + wpe] + [k * layer] * (pp - 2) + [k * layer + ln_f + wte]


def zero_dp_collectives(stage, microbatches=1) -> list:
    """The data-parallel collectives of one step under ZeRO ``stage`` with ``m = microbatches``
    gradient-accumulation microbatches, as ``[(op, count)]`` over the rank's whole parameter buffer.

    * stages 0 and 1: gradients accumulate locally; after the last microbatch one all-reduce
      (stage 0), or a reduce-scatter and an all-gather of the updated parameters (stage 1), which
      move the same bytes (ZeRO §7.2.1);
    * stage 2: the full gradient is never kept (§5.2), so every microbatch's gradient is
      reduce-scattered as backward produces it; one all-gather after the step;
    * stage 3: every microbatch all-gathers the parameters for its forward and again for its
      backward, and reduce-scatters its gradient (§7.2.2).

    Stages 2 and 3 thus communicate per microbatch. Under a pipeline, where a step is many
    microbatches, an implementation may instead keep a part whole for the step and communicate once:
    :func:`zero_stage_under_pipeline` says which stage's collectives (and memory) that costs.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    m = microbatches
    return {0: [("all_reduce", 1)], 1: [("reduce_scatter", 1), ("all_gather", 1)],
            2: [("reduce_scatter", m), ("all_gather", 1)],
            3: [("all_gather", 2 * m), ("reduce_scatter", m)]}[stage]


def zero_stage_under_pipeline(stage, pp=1, keep_gathered=False) -> int:
    """The ZeRO stage whose memory (``memory.zero_memory_bytes``) and collectives
    (:func:`zero_dp_collectives`) a data-parallel ``stage`` costs on ranks that also run a pipeline of
    ``pp`` stages: the planner scores that stage instead.

    A pipeline step is m microbatches whose forwards and backwards interleave. Whatever ZeRO shards
    must either be gathered (parameters) or reduced (gradients) once per microbatch, or be kept
    whole for the step and communicated once, which gives the memory back::

        stage   under a pipeline (pp > 1)                                     costs stage
        0, 1    one reduction after the last microbatch anyway                  0, 1
        2       gradients accumulated whole over the m microbatches and          1
                reduce-scattered once after the last (the library's Model3D,
                after the tied embedding's all-reduce): stage 1's bytes, and
                the whole gradient is held until then, stage 1's peak
        3       parameters re-gathered for every microbatch's forward and        3
                backward, every microbatch's gradient reduce-scattered: 3m
                collectives a step, sharded memory
        3, keep_gathered: parameters gathered at the first forward and kept      1
                until the last backward, gradients accumulated whole and
                reduce-scattered once (torch.distributed.pipelining with FSDP2
                does this): stage 1's bytes and peak

    Llama 3 405B was trained with FSDP over the data-parallel axis together with tensor, context and
    pipeline parallelism (Dubey et al. 2024, "The Llama 3 Herd of Models", §3.3.2): its FSDP shards
    the optimizer states and gradients but does not reshard the parameters after the forward, to
    avoid an all-gather in the backward, and accumulates the microbatches' gradients in fp32 before
    reduce-scattering them in fp32. Between steps the states stay sharded either way; what this
    function gives is the cost at the step's peak.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"pp must be an int >= 1, got {pp!r}")
    if pp == 1:
        return stage
    return 1 if stage == 2 or (stage == 3 and keep_gathered) else stage


def _collective_bytes(op, num_params, param_e, grad_e) -> float:
    """The buffer of ``op`` over ``num_params``: parameters are gathered at ``param_e`` bytes an element,
    gradients reduced (all-reduce, reduce-scatter) at ``grad_e``."""
    return num_params * (param_e if op == "all_gather" else grad_e)


def zero_dp_bytes_per_step(num_params, dp, stage, microbatches=1, bytes_per_element=2,
                           grad_bytes_per_element=None) -> float:
    """Bytes one rank sends per step for data parallelism, the collectives of
    :func:`zero_dp_collectives` on ``Psi = num_params`` elements of ``e`` bytes, ring model::

        stages 0, 1:  2 Psi (n-1)/n e
        stage 2:      (m + 1) Psi (n-1)/n e
        stage 3:      3 m Psi (n-1)/n e

    With ``m = 1`` this is :func:`~.zero.zero_comm_bytes` (ZeRO §7.2). ``grad_bytes_per_element``
    (default ``e``): the bytes of a gradient element in the reductions when they differ from the
    parameters' in the all-gathers, e.g. 4 for an fp32 gradient buffer (Megatron-LM's ``main_grad``
    with bf16, ``memory.MAIN_GRAD_BYTES``; Llama 3's fp32 reduce-scatter) next to 2 for bf16 weights.
    """
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    g = bytes_per_element if grad_bytes_per_element is None else grad_bytes_per_element
    return sum(k * bus_bytes(op, _collective_bytes(op, num_params, bytes_per_element, g), dp)
               for op, k in zero_dp_collectives(stage, microbatches))


def zero_dp_time_per_step(num_params, dp, stage, alpha, beta, microbatches=1, bytes_per_element=2,
                          grad_bytes_per_element=None) -> float:
    """Seconds of the collectives of :func:`zero_dp_collectives`, each under the alpha-beta ring
    model of :func:`~.collectives.collective_time` (none of it overlapped: see the planner);
    ``grad_bytes_per_element`` as in :func:`zero_dp_bytes_per_step`."""
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    g = bytes_per_element if grad_bytes_per_element is None else grad_bytes_per_element
    return sum(k * collective_time(op, _collective_bytes(op, num_params, bytes_per_element, g), dp, alpha,
                                   beta) for op, k in zero_dp_collectives(stage, microbatches))


def pipeline_p2p_message_bytes(batch, seq, hidden, tp=1, bytes_per_element=2, scatter_gather=True) -> float:
    """Bytes one rank sends across a pipeline-stage boundary per microbatch and direction.

    The activation is ``b*s*h`` elements, and every one of the ``t`` tensor-parallel ranks of a
    stage holds all of it. Narayanan et al. 2021, §4.1 (scatter/gather optimisation): each rank
    sends only its ``1/t`` slice over the (slow) inter-node link and the next stage all-gathers
    the slices over NVLink, so ``b*s*h*e/t`` per rank; without it, ``b*s*h*e``.
    """
    if min(batch, seq, hidden, tp) < 1:
        raise ValueError(f"need positive batch, seq, hidden and tp; got b={batch}, "
                         f"s={seq}, h={hidden}, t={tp}")
    full = batch * seq * hidden * bytes_per_element
    return full / tp if scatter_gather else full


def pipeline_activation_bytes(seq, micro_batch, hidden, heads, layers, tp=1, pp=1, microbatches=1,
                              sequence_parallel=False, recompute="none", schedule="1f1b", v=1) -> float:
    """Peak activation bytes on the busiest GPU, the first pipeline stage (16-bit activations).

    Korthikanti et al. 2022, §4.2: a stage holds ``L/p`` layers, and under 1F1B the first stage
    keeps the activations of ``min(p, m)`` microbatches (:func:`~.pipeline.pipeline_stashed_microbatches`;
    ``p(1 + (p-1)/(pv))``-ish for the interleaved schedule), so with ``m >= p``::

        peak = min(p, m) * activation_memory_bytes(s, b, h, a, L/p, t, sp, recompute)
             = activation_memory_bytes(s, b, h, a, L, t, sp, recompute)       -- independent of p

    With ``recompute="full"`` the stash is only each layer's input (2sbh); backward then rebuilds
    one layer at a time, whose full activations (``recompute="none"``, one layer) are added as the
    working set. Embeddings and the output layer are not included (Korthikanti §4.3: small next
    to the layers for large models).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    if layers % pp:
        raise ValueError(f"layers {layers} is not divisible by pp={pp}")
    per_stage = activation_memory_bytes(seq, micro_batch, hidden, heads, layers // pp, tp, sequence_parallel,
                                        recompute)
    stashed = pipeline_stashed_microbatches(schedule, pp, microbatches, stage=0, v=v)
    peak = stashed * per_stage
    if recompute == "full":
        peak += activation_memory_bytes(seq, micro_batch, hidden, heads, 1, tp, sequence_parallel, "none")
    return peak
