"""Chapter 12 — the Llama's sizes, FLOPs, activations and step time: GPT's formulas
redone for grouped-query attention and the SwiGLU MLP.

Touvron et al. 2023, "LLaMA", §2.2 (RMSNorm, SwiGLU with three h x f matrices, RoPE, no biases);
Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3 (8B / 70B / 405B: 8 kv heads, f = 14336 /
28672 / 53248, vocabulary 128,256 rows in the released weights) and §3.3 (parallelism); Ainslie et al.
2023, "GQA", §2 (k and v projections of g·d rows, not h); Narayanan et al. 2021 §5.1 and Chowdhery
et al. 2022 App. B (matmul FLOPs, 6N + 12·L·h·s per token); Korthikanti et al. 2022 §4 (which tensors
a layer keeps for backward). ``cfg`` is duck-typed: ``n_layer``, ``n_embd`` (h), ``n_head`` (a),
``n_kv_head`` (g), ``ffn_hidden`` (f), ``vocab_size`` (V), ``tie_embeddings``; d = h/a.

Where the GPT formulas of :mod:`.compute`, :mod:`.memory` and :mod:`.planner_time` go wrong for it:

=====================  ===============================  ===========================================
per layer              GPT (4h GELU MLP, a = g)         Llama (SwiGLU, g kv heads)
=====================  ===============================  ===========================================
parameters             12h² + 13h (with biases)         2h² + 2·h·g·d + 3·h·f + 2h
matmul FLOPs / token   2·(12h²) forward                 2·(2h² + 2·h·g·d + 3·h·f) forward
activations (16-bit)   sbh·(34 + 5as/h)                 2·[sbh·(4 + 2/t) + 2·sb·g_t·d + 4·sbf/t] + 2as²b/t
=====================  ===============================  ===========================================

Llama 3 8B: g·d = 1024 = h/4, f = 3.5h, so its k, v projections are 1/4 of GPT's and its MLP 10.5h²
instead of 8h². Attention's FLOPs are not reduced by GQA: every query head still scores every key.
Under tensor parallelism ``g_t`` kv heads sit on a rank: g/t when t | g, one replicated head when
g | t (:mod:`..parallelism.tensor_parallel_llama`), whose weight gradients cost one more all-reduce of
2·g·d·h elements per layer and step (:func:`llama_kv_replica_allreduce_elements`).
"""
from __future__ import annotations

from .kernels import layernorm_bytes, softmax_bytes
from .memory import RECOMPUTE
from .planner_time import layers_seconds
from .sequence_parallel import ulysses_bytes_per_layer

__all__ = ["llama_params", "llama_params_per_rank", "llama_stage_params", "llama_flops_per_token",
           "llama_flops_per_step", "llama_layer_gemm_flops", "llama_layer_elementwise_bytes",
           "llama_microbatch_seconds", "llama_activation_bytes", "llama_kv_heads_per_rank",
           "llama_kv_replica_allreduce_elements", "ulysses_max_degree_gqa", "ulysses_bytes_per_layer_gqa"]


def _shape(cfg):
    h, a = cfg.n_embd, cfg.n_head
    return h, a, getattr(cfg, "n_kv_head", a), h // a, cfg.ffn_hidden


def llama_kv_heads_per_rank(n_head: int, n_kv_head: int, t: int) -> float:
    """kv heads one of t tensor-parallel ranks holds: g/t when t | g, 1 (a replica) when g | t; a
    ``ValueError`` otherwise (``parallelism.tensor_parallel_llama.kv_layout``: why)."""
    if n_head % t or (n_kv_head % t and t % n_kv_head):
        raise ValueError(f"tp={t} must divide n_head {n_head}, and divide n_kv_head {n_kv_head} or be a "
                         f"multiple of it")
    return n_kv_head / t if n_kv_head % t == 0 else 1


def llama_params(cfg) -> int:
    """Exact parameter count: L·(2h + h·h + 2·h·g·d + h·h + 3·h·f) + h + V·h (+ V·h untied).
    Llama 3 8B: 8,030,261,248 (Dubey et al. 2024 print 8B)."""
    return llama_params_per_rank(cfg, 1)


def llama_params_per_rank(cfg, t: int) -> int:
    """Parameters one of t tensor-parallel ranks holds: q, o, SwiGLU, the vocabulary-parallel
    embedding and output layer split t ways; k, v: ``llama_kv_heads_per_rank`` heads; RMSNorm gains
    replicated."""
    h, a, g, d, f = _shape(cfg)
    L, V = cfg.n_layer, cfg.vocab_size
    for what, n in (("vocab_size", V), ("ffn_hidden", f)):
        if n % t:
            raise ValueError(f"{what} {n} is not divisible by tp={t}")
    kv = llama_kv_heads_per_rank(a, g, t)
    block = (2 * h * h + 3 * h * f) // t + int(2 * h * kv * d) + 2 * h
    head = 0 if getattr(cfg, "tie_embeddings", False) else V * h // t
    return L * block + h + V * h // t + head


def llama_stage_params(cfg, tp: int = 1, pp: int = 1) -> list[int]:
    """Parameters one rank of each of ``pp`` pipeline stages holds (Narayanan et al. 2021 §2.2 layout,
    as :func:`.three_d.pipeline_stage_params` for the GPT): the first stage has the embedding, the last
    the final norm and the output layer (a copy of the embedding when tied)."""
    if tp < 1 or pp < 1 or cfg.n_layer % pp:
        raise ValueError(f"need tp, pp >= 1 and pp dividing n_layer {cfg.n_layer}, got tp={tp}, pp={pp}")
    total = llama_params_per_rank(cfg, tp)
    if pp == 1:
        return [total]
    h, V, k = cfg.n_embd, cfg.vocab_size, cfg.n_layer // pp
    emb = V * h // tp
    layer = (total - h - emb - (0 if getattr(cfg, "tie_embeddings", False) else emb)) // cfg.n_layer
    return [k * layer + emb] + [k * layer] * (pp - 2) + [k * layer + h + emb]


def llama_flops_per_token(cfg, seq: int) -> float:
    """Model FLOPs per token of a training step: 6·N + 12·L·h·s (Chowdhery et al. 2022, App. B), N the
    weights that multiply an activation, L·(2h² + 2·h·g·d + 3·h·f) + V·h; attention 12·L·h·s whatever g."""
    h, a, g, d, f = _shape(cfg)
    n = cfg.n_layer * (2 * h * h + 2 * h * g * d + 3 * h * f) + cfg.vocab_size * h
    return float(6 * n + 12 * cfg.n_layer * h * seq)


def llama_layer_gemm_flops(b, s, h, heads, kv_heads, ffn, t=1) -> dict:
    """Forward FLOPs of each GEMM of one Llama layer on one of t tensor-parallel ranks:
    q|k|v 2bs·h·(h/t + 2·g_t·d), scores and context 2bs²h/t each, o 2bsh²/t, gate|up 4bshf/t, down 2bshf/t."""
    d, kv = h // heads, llama_kv_heads_per_rank(heads, kv_heads, t)
    return {"qkv": 2 * b * s * h * (h / t + 2 * kv * d), "scores": 2 * b * s * s * h / t,
            "context": 2 * b * s * s * h / t, "attn_out": 2 * b * s * h * h / t,
            "gate_up": 4 * b * s * h * ffn / t, "down": 2 * b * s * ffn * h / t}


def llama_layer_elementwise_bytes(b, s, h, heads, kv_heads, ffn, t=1, bytes_per_element=2,
                                  sequence_parallel=False) -> dict:
    """Forward bytes of the memory-bound ops of one layer, fused kernels, no dropout: two RMSNorms
    (``kernels.layernorm_bytes``), RoPE on q and k (read and write), the softmax of the scores, SiLU(gate)
    ∘ up (read two, write one b·s·f/t) and two residual adds (read two, write one r·h), r = b·s (b·s/t
    with SP)."""
    e, d = bytes_per_element, h // heads
    rows = b * s // t if sequence_parallel else b * s
    norm = layernorm_bytes(rows, h, e, fused=True)
    softmax = softmax_bytes(max(1, b * heads * s // t), s, e, fused=True)
    q_k = b * s * (h / t + llama_kv_heads_per_rank(heads, kv_heads, t) * d)
    return {"rmsnorm": 2 * (norm["read"] + norm["written"]), "rope": 2 * e * q_k,
            "softmax": softmax["read"] + softmax["written"], "swiglu": 3 * e * b * s * ffn / t,
            "residual_add": 2 * 3 * e * rows * h}


def llama_microbatch_seconds(profile, b, s, h, heads, kv_heads, ffn, vocab, layers, t=1, precision="mixed",
                             recompute="none", sequence_parallel=False, lm_head=True) -> dict:
    """One microbatch's forward and backward through ``layers`` Llama layers (and the LM head) on one
    tensor-parallel rank at the profile's rates: :func:`.planner_time.microbatch_seconds` with the
    Llama's GEMMs and elementwise ops. ``{"forward", "backward", "gemm", "elementwise", "total"}``."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    e = 2 if precision == "mixed" else 4
    elementwise = llama_layer_elementwise_bytes(b, s, h, heads, kv_heads, ffn, t, e, sequence_parallel)
    return layers_seconds(profile, llama_layer_gemm_flops(b, s, h, heads, kv_heads, ffn, t), elementwise,
                          ("scores", "context", "softmax"), layers, recompute, precision,
                          (b, s, h, vocab, t) if lm_head else None)


def llama_flops_per_step(cfg, batch: int, seq: int, recompute: str = "none") -> float:
    """FLOPs executed in one step: the model FLOPs (:func:`llama_flops_per_token` x batch x seq) plus
    what recomputation runs again: one more forward of every layer ("full"), or of the attention
    scores and context ("selective", Korthikanti §5). The output layer is never recomputed."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    h, a, g, d, f = _shape(cfg)
    model = llama_flops_per_token(cfg, seq) * batch * seq
    per_layer = llama_layer_gemm_flops(batch, seq, h, a, g, f)
    redo = {"none": (), "selective": ("scores", "context"), "full": tuple(per_layer)}[recompute]
    return model + cfg.n_layer * sum(v for k, v in per_layer.items() if k in redo)


def llama_activation_bytes(seq, batch, hidden, heads, kv_heads, ffn, layers=1, tp=1, sequence_parallel=False,
                           recompute="none", bytes_per_element=2) -> float:
    """Bytes ``layers`` Llama layers keep for backward (Korthikanti et al. 2022 §4's accounting, fused
    RMSNorm and SwiGLU inputs, no dropout), in elements per layer::

        two RMSNorm inputs + the q|k|v and gate|up GEMM inputs   4·sbh     (SP: /t)
        q after RoPE, the attention output (o_proj's input)       2·sbh/t
        k, v after RoPE                                           2·sb·g_t·d
        gate, SiLU(gate), up, their product (down_proj's input)   4·sbf/t
        softmax probabilities (recompute "none": no flash)        a·s²b/t

    ``"selective"`` drops the last line (flash attention keeps only a log-sum-exp per row); ``"full"``
    keeps each layer's input, sbh (SP: sbh/t). Times ``bytes_per_element`` (2 in 16-bit)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return layers * bytes_per_element * (sbh / t if sequence_parallel else sbh)
    kv = llama_kv_heads_per_rank(a, kv_heads, t)
    elements = (4 * sbh / t if sequence_parallel else 4 * sbh) + 2 * sbh / t + 2 * s * b * kv * (h // a) \
        + 4 * s * b * ffn / t + (a * s * s * b / t if recompute == "none" else 0)
    return layers * bytes_per_element * elements


def llama_kv_replica_allreduce_elements(cfg, t: int) -> int:
    """Elements of the extra all-reduce per layer and step when kv heads are replicated (g | t, g < t):
    the k and v weight gradients of every kv head, 2·g·d·h (0 when t | g: nothing is replicated)."""
    h, a, g, d, _ = _shape(cfg)
    return 0 if g % t == 0 else 2 * g * d * h


def ulysses_max_degree_gqa(n_head: int, n_kv_head: int) -> int:
    """The largest Ulysses degree with grouped-query attention: the all-to-all of k and v hands out whole
    kv heads, so t <= n_kv_head and t | n_kv_head (Jacobs et al. 2023 §3 with Ainslie et al. 2023)."""
    if n_head < 1 or n_kv_head < 1 or n_head % n_kv_head:
        raise ValueError(f"need n_kv_head dividing n_head, got n_head={n_head}, n_kv_head={n_kv_head}")
    return n_kv_head


def ulysses_bytes_per_layer_gqa(batch, seq, heads, kv_heads, head_dim, t, bytes_per_element=2) -> float:
    """Bytes one rank sends per layer and step with Ulysses and grouped-query attention: the GPT's
    ``ulysses_bytes_per_layer`` (eight all-to-alls of a (b, s/t, h) shard) with k, v and their
    gradients g·d wide instead of a·d: (2a + 2g)/(4a) of it. Ring attention's K/V blocks shrink alike:
    ``ring_attention_bytes_per_layer(b, s, g·d, t)``."""
    if kv_heads % t:
        raise ValueError(f"Ulysses needs t dividing n_kv_head: t={t}, n_kv_head={kv_heads} "
                         f"(t <= {ulysses_max_degree_gqa(heads, kv_heads)})")
    mha = ulysses_bytes_per_layer(batch, seq, heads * head_dim, t, bytes_per_element=bytes_per_element)
    return mha * (2 * heads + 2 * kv_heads) / (4 * heads)
