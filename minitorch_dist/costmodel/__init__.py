"""Chapter 00 — the formulas the course quotes, each once, each with its source.

Every notebook plots these (theory) next to a meter (measured). A chapter that needs a new
formula adds it to the submodule of its kind, with the paper and equation in its docstring;
this package re-exports every formula, so ``costmodel.allreduce_time`` is the one name to use.

Submodules: :mod:`.collectives` (alpha-beta ring model and its latency-optimal rivals) · :mod:`.compute`
(model size and FLOPs) · :mod:`.memory` (model states, ZeRO, Adam vs Adafactor states, activations) ·
:mod:`.zero` (ZeRO's bytes on the wire per stage, its Table 1, offload traffic) · :mod:`.pipeline` (bubbles
and stashed activations of each schedule) · :mod:`.data_parallel` (DDP buckets and overlap) ·
:mod:`.parameter_server` (PS push/pull bytes and time vs all-reduce, BytePS's optimum, HOGWILD!'s sparsity Ω,
Δ, ρ) · :mod:`.tensor_parallel` (Megatron's all-reduces, bytes and shards) · :mod:`.sequence_parallel`
(Megatron-SP, Ulysses and ring attention bytes) · :mod:`.checkpointing` (saved bytes with k checkpoints, the
√n optimum, recompute FLOPs, offload bytes) · :mod:`.moe` (expert capacity, expected dropped tokens, total vs
active parameters and FLOPs, all-to-all bytes) · :mod:`.kernels` (bytes moved eager vs fused for softmax,
LayerNorm, AdamW, cross-entropy; roofline, ridge point, device specs) · :mod:`.step_time` (a step's seconds
from a machine profile: ops, collectives, the ranks replayed) · :mod:`.three_d` (per-stage parameters,
ZeRO bytes with microbatches, pipeline messages and activations of 3D parallelism) · :mod:`.precision` (fp32 /
fp16 / bf16 / fp8 ranges from their bit layout, underflow, loss scale, lost updates) · :mod:`.compression`
(bytes each gradient compressor sends, all-reduce vs all-gather time) · :mod:`.resilience`
(checkpoint bytes and seconds, Young's and Daly's optimal checkpoint interval, expected run time).
Units: bytes, seconds, FLOPs; ``GB`` = 1e9 bytes as the papers print, ``GiB`` = 2**30.
"""
from __future__ import annotations

GB = 1e9  #: decimal gigabyte: the unit of the ZeRO and Megatron papers
GiB = 2**30  #: binary gibibyte: what torch.cuda.memory_allocated() / 2**30 prints

from .attention import (  # noqa: E402
    attention_flops,
    attention_pairs,
    flash_attention_bytes,
    flash_block_rows,
    standard_attention_bytes,
)
from .checkpointing import (  # noqa: E402
    activation_offload_bytes,
    checkpoint_saved_bytes,
    log_checkpoint_forwards,
    log_checkpoint_saved_bytes,
    optimal_segments,
    recompute_overhead,
    segment_peak_bytes,
    segment_sizes,
)
from .collectives import (  # noqa: E402
    BUS_FACTORS,
    LINKS,
    all_gather_time,
    all_to_all_time,
    allreduce_crossover_bytes,
    allreduce_time,
    broadcast_time,
    bus_bytes,
    collective_time,
    fit_alpha_beta,
    naive_allreduce_time,
    p2p_time,
    recursive_doubling_allreduce_time,
    reduce_scatter_time,
    ring_latency_bandwidth_crossover,
    tree_allreduce_time,
)
from .compression import (  # noqa: E402
    COMPRESSION_METHODS,
    SUMMABLE,
    compressed_payload_bytes,
    compressed_reduce_time,
    powersgd_compresses,
)
from .compute import (  # noqa: E402
    megatron_flops_per_step,
    model_flops_per_token,
    model_flops_utilization,
    training_flops,
    transformer_params,
    transformer_params_approx,
)
from .data_parallel import bucket_assignment, bucket_sizes, ddp_allreduce_schedule, ddp_step_time  # noqa: E402
from .kernels import (  # noqa: E402
    DEVICES,
    DeviceSpec,
    adamw_bytes,
    arithmetic_intensity,
    cross_entropy_bytes,
    device_spec,
    layernorm_bytes,
    layernorm_flops,
    ridge_point,
    roofline_time,
    softmax_bytes,
    softmax_flops,
)
from .llama import (  # noqa: E402
    llama_activation_bytes,
    llama_flops_per_step,
    llama_flops_per_token,
    llama_kv_heads_per_rank,
    llama_kv_replica_allreduce_elements,
    llama_layer_elementwise_bytes,
    llama_layer_gemm_flops,
    llama_microbatch_seconds,
    llama_params,
    llama_params_per_rank,
    llama_stage_params,
    ulysses_bytes_per_layer_gqa,
    ulysses_max_degree_gqa,
)
from .memory import (  # noqa: E402
    MAIN_GRAD_BYTES,
    OPTIMIZER_STATE_BYTES,
    PRECISIONS,
    RECOMPUTE,
    activation_memory_bytes,
    adafactor_state_bytes,
    adam_state_bytes,
    gradient_bytes_per_param,
    model_state_bytes,
    optimizer_bytes_per_param,
    zero_memory_bytes,
)
from .moe import (  # noqa: E402
    all_to_all_bytes_moe,
    aux_free_steps_to_shift,
    aux_free_sync_bytes,
    capacity_expert_flops,
    chunked_moe_exposed_comm,
    chunked_moe_layer_time,
    dropless_expert_flops,
    dropped_tokens,
    expected_dropped_tokens,
    expert_choice_capacity,
    expert_parallel_send_matrix,
    expert_params,
    load_imbalance,
    moe_all_to_all_time,
    moe_capacity,
    moe_counts_exchange_bytes,
    moe_flops_per_token,
    moe_params,
    moe_params_per_token,
)
from .parameter_server import (  # noqa: E402
    byteps_optimal_bytes,
    hogwild_conflict_probability,
    hogwild_sparsity,
    ps_bytes_per_step,
    ps_step_time,
)
from .pipeline import (  # noqa: E402
    SCHEDULES,
    V_SCHEDULES,
    dualpipe_idle_time,
    dualpipev_idle_time,
    pipeline_bubble_fraction,
    pipeline_bubble_ratio,
    pipeline_p2p_bytes,
    pipeline_parameter_copies,
    pipeline_stashed_microbatches,
    v_min_microbatches,
    v_pipeline_p2p_bytes,
    v_shape_min_idle,
    zb_h1_idle_time,
    zbv_idle_time,
)
from .planner_time import (  # noqa: E402
    BACKWARD_BYTES_FACTOR,
    layer_elementwise_bytes,
    layer_gemm_flops,
    lm_head_flops,
    microbatch_seconds,
    optimizer_step_bytes,
    step_seconds,
    zero_dp_seconds,
)
from .precision import (  # noqa: E402
    FORMATS,
    NumberFormat,
    all_gather_buffer_bytes,
    bytes_per_element,
    format_info,
    format_name,
    loss_scale_needed,
    loss_scale_range,
    quantized_bytes,
    round_to_format,
    ulp,
    underflow_fractions,
    update_lost,
    weight_bytes_per_param,
)
from .resilience import (  # noqa: E402
    LLAMA3_DAYS,
    LLAMA3_INTERRUPTIONS,
    LLAMA3_STORAGE_BYTES_PER_S,
    STATE_BYTES,
    checkpoint_bytes,
    checkpoint_seconds,
    daly_interval,
    expected_lost_work,
    expected_runtime,
    first_order_waste,
    mtbf_seconds,
    save_stall_seconds,
    young_interval,
)
from .sequence_parallel import (  # noqa: E402
    naive_attention_activation_bytes,
    ring_attention_activation_bytes,
    ring_attention_bytes_per_layer,
    ring_attention_min_block_tokens,
    sequence_parallel_bytes_per_layer,
    sequence_parallel_collectives_per_layer,
    sequence_parallel_comparison,
    ulysses_all_to_alls_per_layer,
    ulysses_bytes_per_layer,
    ulysses_max_degree,
)
from .step_time import comm_seconds, op_seconds, replay_step  # noqa: E402
from .tensor_parallel import (  # noqa: E402
    tensor_parallel_allreduces_per_layer,
    tensor_parallel_bytes_per_layer,
    tensor_parallel_comm_time_per_layer,
    tensor_parallel_params_per_rank,
    vocab_parallel_logits_bytes,
)
from .three_d import (  # noqa: E402
    pipeline_activation_bytes,
    pipeline_p2p_message_bytes,
    pipeline_stage_params,
    zero_dp_bytes_per_step,
    zero_dp_collectives,
    zero_dp_time_per_step,
    zero_stage_under_pipeline,
)
from .zero import (  # noqa: E402
    OFFLOAD_TIERS,
    TABLE1_DP,
    TABLE1_MODELS,
    TABLE1_PRINTED,
    fsdp_unit_elements,
    offload_bytes_per_step,
    zero_comm_bytes,
    zero_table1,
)

__all__ = [
    "GB", "GiB", "comm_seconds", "op_seconds", "replay_step",
    "BUS_FACTORS", "LINKS", "all_gather_time", "all_to_all_time", "allreduce_crossover_bytes",
    "allreduce_time", "broadcast_time",
    "bus_bytes", "collective_time", "fit_alpha_beta", "naive_allreduce_time", "p2p_time",
    "recursive_doubling_allreduce_time", "reduce_scatter_time", "ring_latency_bandwidth_crossover",
    "tree_allreduce_time",
    "megatron_flops_per_step", "model_flops_per_token", "model_flops_utilization", "training_flops",
    "transformer_params", "transformer_params_approx",
    "attention_flops", "attention_pairs", "flash_attention_bytes", "flash_block_rows",
    "standard_attention_bytes",
    "bucket_assignment", "bucket_sizes", "ddp_allreduce_schedule", "ddp_step_time",
    "byteps_optimal_bytes", "hogwild_conflict_probability", "hogwild_sparsity", "ps_bytes_per_step",
    "ps_step_time",
    "llama_activation_bytes", "llama_flops_per_step", "llama_flops_per_token", "llama_kv_heads_per_rank",
    "llama_kv_replica_allreduce_elements", "llama_layer_elementwise_bytes", "llama_layer_gemm_flops",
    "llama_microbatch_seconds", "llama_params", "llama_params_per_rank", "llama_stage_params",
    "ulysses_bytes_per_layer_gqa", "ulysses_max_degree_gqa",
    "MAIN_GRAD_BYTES", "OPTIMIZER_STATE_BYTES", "PRECISIONS", "RECOMPUTE", "activation_memory_bytes",
    "adafactor_state_bytes", "adam_state_bytes", "gradient_bytes_per_param", "model_state_bytes",
    "optimizer_bytes_per_param", "zero_memory_bytes",
    "OFFLOAD_TIERS", "TABLE1_DP", "TABLE1_MODELS", "TABLE1_PRINTED", "fsdp_unit_elements",
    "offload_bytes_per_step", "zero_comm_bytes", "zero_table1",
    "V_SCHEDULES", "dualpipe_idle_time", "dualpipev_idle_time", "pipeline_parameter_copies",
    "v_min_microbatches", "v_pipeline_p2p_bytes", "v_shape_min_idle", "zbv_idle_time",
    "SCHEDULES", "pipeline_bubble_fraction", "pipeline_bubble_ratio", "pipeline_p2p_bytes",
    "pipeline_stashed_microbatches", "zb_h1_idle_time",
    "BACKWARD_BYTES_FACTOR", "layer_elementwise_bytes", "layer_gemm_flops", "lm_head_flops",
    "microbatch_seconds", "optimizer_step_bytes", "step_seconds", "zero_dp_seconds",
    "tensor_parallel_allreduces_per_layer", "tensor_parallel_bytes_per_layer",
    "tensor_parallel_comm_time_per_layer", "tensor_parallel_params_per_rank", "vocab_parallel_logits_bytes",
    "naive_attention_activation_bytes", "ring_attention_activation_bytes", "ring_attention_bytes_per_layer",
    "sequence_parallel_bytes_per_layer", "sequence_parallel_collectives_per_layer",
    "sequence_parallel_comparison", "ulysses_all_to_alls_per_layer", "ulysses_bytes_per_layer",
    "ulysses_max_degree", "ring_attention_min_block_tokens",
    "activation_offload_bytes", "checkpoint_saved_bytes", "log_checkpoint_forwards",
    "log_checkpoint_saved_bytes", "optimal_segments", "recompute_overhead", "segment_peak_bytes",
    "segment_sizes",
    "FORMATS", "NumberFormat", "format_info", "format_name", "loss_scale_needed", "loss_scale_range",
    "round_to_format", "ulp", "underflow_fractions", "update_lost", "all_gather_buffer_bytes",
    "bytes_per_element",
    "quantized_bytes",
    "weight_bytes_per_param",
    "aux_free_steps_to_shift", "aux_free_sync_bytes", "capacity_expert_flops", "chunked_moe_exposed_comm",
    "chunked_moe_layer_time", "dropless_expert_flops", "load_imbalance",
    "all_to_all_bytes_moe", "dropped_tokens", "expected_dropped_tokens", "expert_choice_capacity",
    "expert_parallel_send_matrix", "expert_params", "moe_all_to_all_time", "moe_capacity",
    "moe_counts_exchange_bytes", "moe_flops_per_token", "moe_params", "moe_params_per_token",
    "DEVICES", "DeviceSpec", "adamw_bytes", "arithmetic_intensity", "cross_entropy_bytes", "device_spec",
    "layernorm_bytes", "layernorm_flops", "ridge_point", "roofline_time", "softmax_bytes", "softmax_flops",
    "pipeline_activation_bytes", "pipeline_p2p_message_bytes", "pipeline_stage_params",
    "zero_dp_bytes_per_step", "zero_dp_collectives", "zero_dp_time_per_step", "zero_stage_under_pipeline",
    "COMPRESSION_METHODS", "SUMMABLE", "compressed_payload_bytes", "compressed_reduce_time",
    "powersgd_compresses",
    "LLAMA3_DAYS", "LLAMA3_INTERRUPTIONS", "LLAMA3_STORAGE_BYTES_PER_S", "STATE_BYTES", "checkpoint_bytes",
    "checkpoint_seconds", "daly_interval", "expected_lost_work", "expected_runtime", "first_order_waste",
    "mtbf_seconds", "save_stall_seconds", "young_interval",
]
