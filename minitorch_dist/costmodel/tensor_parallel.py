"""Chapter 04 — tensor (intra-layer) model parallelism: the communication of Megatron-LM's layers.

Shoeybi et al. 2019, "Megatron-LM", §3 (the f / g operators: one all-reduce in the forward and
one in the backward per MLP and per attention block); Narayanan et al. 2021, "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", §3.2.
"""
from __future__ import annotations

from .collectives import allreduce_time, bus_bytes


def tensor_parallel_allreduces_per_layer() -> dict:
    """All-reduces of b·s·h activations per transformer layer: g after attention's row-parallel
    projection and after the MLP's in the forward, f before both column-parallel inputs in the
    backward (Shoeybi et al. 2019, §3, Fig. 3 and 4)."""
    return {"forward": 2, "backward": 2}


def tensor_parallel_bytes_per_layer(batch, seq, hidden, t, bytes_per_element=2) -> float:
    """Bytes each rank sends per transformer layer per step, forward and backward, under the ring
    model: four all-reduces of b·s·h elements, each 2(t-1)/t of its buffer, i.e.
    ``8 b s h (t-1)/t`` elements (Narayanan et al. 2021, §3.2)."""
    if t < 1 or min(batch, seq, hidden) < 1:
        raise ValueError(f"need t >= 1 and positive batch, seq, hidden; got t={t}, "
                         f"b={batch}, s={seq}, h={hidden}")
    n_allreduce = sum(tensor_parallel_allreduces_per_layer().values())
    return n_allreduce * bus_bytes("all_reduce", batch * seq * hidden * bytes_per_element, t)


def tensor_parallel_comm_time_per_layer(batch, seq, hidden, t, alpha, beta, bytes_per_element=2) -> float:
    """Seconds of tensor-parallel communication per transformer layer per step (forward and
    backward): four ring all-reduces of b·s·h elements, ``4 * [2(t-1) α + 2(t-1)/t · n β]``
    with n = b·s·h·bytes (β in seconds per byte, as in :func:`allreduce_time`). They sit on the critical path:
    each one's output is the next op's input, so none of it overlaps with compute (unlike DDP's bucketed
    gradient all-reduces)."""
    if t < 1:
        raise ValueError(f"need t >= 1, got t={t}")
    if t == 1:
        return 0.0
    n_allreduce = sum(tensor_parallel_allreduces_per_layer().values())
    return n_allreduce * allreduce_time(batch * seq * hidden * bytes_per_element, t, alpha, beta)


def tensor_parallel_params_per_rank(cfg, t) -> int:
    """Parameters one rank holds in Megatron's layout (Shoeybi et al. 2019, §3), ``cfg`` as in
    :func:`transformer_params`: the column-parallel qkv and fc (weights and biases), the
    row-parallel projections' weights and the vocab-parallel embedding (and untied output layer)
    are split t ways; LayerNorms, the row-parallel biases (added once, after g) and the position
    embedding are replicated::

        L * [(3h^2 + b*3h + h^2 + h*f + b*f + f*h) / t + 2(h + b*h) + 2*b*h] + V*h/t + T*h + (h + b*h)

    (plus V*h/t for an untied output layer). At t = 1 this is :func:`transformer_params`.
    """
    h, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    b = 1 if getattr(cfg, "bias", True) else 0
    f = int(getattr(cfg, "mlp_ratio", 4) * h)
    sharded = L * (3 * h * h + b * 3 * h + h * h + h * f + b * f + f * h) + V * h
    if not getattr(cfg, "tie_embeddings", True):
        sharded += V * h
    for what, n in (("n_head", cfg.n_head), ("vocab_size", V), ("MLP width", f)):
        if n % t:
            raise ValueError(f"{what} {n} is not divisible by tp={t}")
    replicated = L * (2 * (h + b * h) + 2 * b * h) + T * h + (h + b * h)
    return sharded // t + replicated


def vocab_parallel_logits_bytes(batch, seq, vocab, t, bytes_per_element=4) -> dict:
    """Logits one rank keeps for the loss's backward: ``b·s·V`` elements if the vocabulary shards
    are gathered first (the log-softmax of the full logits is saved), ``b·s·V/t`` with the
    vocab-parallel cross-entropy (its softmax shard), which communicates 3·b·s numbers instead
    (Shoeybi et al. 2019, §3, last paragraph)."""
    if vocab % t:
        raise ValueError(f"vocab_size {vocab} is not divisible by tp={t}")
    full = batch * seq * vocab * bytes_per_element
    return {"gathered": full, "vocab_parallel": full // t, "saved": full - full // t}
