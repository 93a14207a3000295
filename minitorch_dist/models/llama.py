"""Chapter 00 — a Llama-shaped decoder: the 2026 shape of the model every chapter trains.

Touvron et al. 2023, "LLaMA: Open and Efficient Foundation Language Models", §2.2: GPT's decoder with
three changes, pre-normalisation by RMSNorm (Zhang & Sennrich 2019, "Root Mean Square Layer
Normalization", eq. 4), the SwiGLU feed-forward (Shazeer 2020, "GLU Variants Improve Transformer",
eq. 6) and rotary position embeddings instead of a position table (Su et al. 2021, "RoFormer", §3.4,
eq. 34). Dubey et al. 2024, "The Llama 3 Herd of Models", §3.2 and Table 3 add grouped-query
attention with 8 key/value heads (Ainslie et al. 2023, "GQA", §2), RoPE base θ = 500,000 and a
128K vocabulary; the output layer is not tied to the embedding::

    h = wte[idx]                        # (B, T, h): no position table, positions enter through RoPE
    for block in blocks: h = block(h)   # h + attn(ln_1(h)); h + mlp(ln_2(h))
    logits = lm_head(ln_f(h))           # (B, T, V), untied

The pieces, with Meta's reference names and Hugging Face's beside ours (ours keep the course GPT's
``wte`` / ``blocks`` / ``ln_*`` / ``lm_head``, so the wrappers, FSDP units and pipeline stages that
walk a GPT find the same attributes)::

    ours                     Meta (llama-models)        Hugging Face
    wte                      tok_embeddings             embed_tokens
    blocks.i.ln_1 / ln_2     attention_norm / ffn_norm  input_layernorm / post_attention_layernorm
    attn.q_proj k_ v_ o_     attention.wq wk wv wo      self_attn.q_proj k_proj v_proj o_proj
    mlp.gate_proj up_ down_  feed_forward.w1 w3 w2      mlp.gate_proj up_proj down_proj
    ln_f, lm_head            norm, output               norm, lm_head

RMSNorm:   y = x / sqrt(mean_j x_j² + ε) · g            (no mean subtracted, no bias)
SwiGLU:    y = W_down (SiLU(W_gate x) ∘ W_up x)          (three h x f matrices, f ≈ 8h/3)
RoPE:      the pair (x_2i, x_2i+1) of a query or key at position m is turned by the angle m·θ_i,
           θ_i = base^(-2i/d), so q_m · k_n depends on m - n only (a rotation R_m satisfies
           R_mᵀ R_n = R_(n-m)).
GQA:       n_kv_head < n_head key/value heads; query head j uses kv head j // (n_head / n_kv_head).

Parameters (h = n_embd, d = h / n_head, g = n_kv_head, f = ffn_hidden, V = vocab_size)::

    per block   2h (two RMSNorm gains) + h·h (q) + 2·h·g·d (k, v) + h·h (o) + 3·h·f (SwiGLU)
    final norm  h;   wte V·h;   lm_head V·h (untied)

Initialisation as Hugging Face's ``LlamaPreTrainedModel``: every Linear and the embedding
~ N(0, 0.02²), RMSNorm gains 1 -- the rule :func:`..models.init.init_dense` applies by name, so a
model built on ``meta`` and materialised shard by shard holds the same weights.

Cutting into pipeline stages: :meth:`Llama.embed`, :meth:`Llama.head` and :meth:`Llama.loss_fn` use
only ``wte`` / ``ln_f`` / ``lm_head`` and every block computes its own positions (0..T-1) from its
input, so a stage holding some blocks runs them unchanged, as ``GPTStage`` does for the GPT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .gpt import GPT

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "LlamaAttention", "SwiGLU", "RMSNorm", "llama_ffn_hidden",
           "rope_cos_sin", "apply_rope", "causal_attention", "split_heads", "init_llama_"]


def llama_ffn_hidden(n_embd: int, multiple_of: int = 256, ffn_dim_multiplier: float | None = None) -> int:
    """The SwiGLU width of Meta's reference code: 2/3 of GPT's 4h (three matrices instead of two keep
    the parameters of a 4h MLP; Touvron et al. 2023 §2.2), times an optional multiplier, rounded up to
    a multiple of ``multiple_of``. Llama 3 8B: ``llama_ffn_hidden(4096, 1024, 1.3) = 14336``."""
    f = int(2 * 4 * n_embd / 3)
    if ffn_dim_multiplier is not None:
        f = int(ffn_dim_multiplier * f)
    return multiple_of * math.ceil(f / multiple_of)


@dataclass
class LlamaConfig:
    """Shape of a Llama. ``LlamaConfig.tiny()`` trains in seconds on one CPU core; ``ffn_hidden=None``
    takes :func:`llama_ffn_hidden` (n_embd, ``multiple_of``)."""

    vocab_size: int = 64
    block_size: int = 64  # longest sequence the model accepts (RoPE itself has no table)
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # key/value heads (Ainslie et al. 2023): n_head for MHA, 1 for MQA
    n_embd: int = 64
    ffn_hidden: int | None = None  # SwiGLU width f
    multiple_of: int = 32  # rounding of the default ffn_hidden (Meta: 256 to 4096)
    rope_theta: float = 500000.0  # RoPE base (Llama 1 and 2: 10,000; Llama 3: 500,000)
    norm_eps: float = 1e-5
    tie_embeddings: bool = False  # Llama 3: an untied output layer

    def __post_init__(self):
        if self.ffn_hidden is None:
            self.ffn_hidden = llama_ffn_hidden(self.n_embd, self.multiple_of)
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_hidden",
                     "multiple_of"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}; choose n_embd "
                             f"as a multiple of n_head (each head gets n_embd // n_head dims)")
        if self.n_head % self.n_kv_head:
            raise ValueError(f"n_head {self.n_head} is not divisible by n_kv_head {self.n_kv_head}: each key/"
                             f"value head serves a whole group of query heads; choose n_kv_head among the "
                             f"divisors of {self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} is odd: RoPE rotates pairs of dimensions; choose "
                             f"n_embd / n_head even")
        for name in ("rope_theta", "norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive number, got {v!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings must be True or False, got {self.tie_embeddings!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """~0.1 M parameters: V=64, T=64, 2 layers, 4 query heads sharing 2 kv heads, width 64, f=192."""
        return cls(**overrides)


# --- the pieces -------------------------------------------------------------------------------------


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for 16-bit inputs (as Meta's reference), else x's own (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + ε) · g (Zhang & Sennrich 2019, eq. 4); 16-bit inputs are normalised in
    float32 as Meta's reference does, then cast back to x's dtype before the gain."""

    def __init__(self, dim: int, eps: float = 1e-5, *, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(_compute_dtype(x))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight

    def extra_repr(self) -> str:
        return f"{self.weight.numel()}, eps={self.eps}"


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype=torch.float32):
    """cos and sin of the angles m·θ_i, θ_i = theta^(-2i/d): two (T, d/2) tensors of ``dtype`` for
    the token positions ``positions`` (T,), on their device."""
    i = torch.arange(0, head_dim, 2, device=positions.device, dtype=dtype)
    angles = positions.to(dtype)[:, None] * theta ** (-i / head_dim)[None, :]  # (T, d/2)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (x_2i, x_2i+1) of x (B, heads, T, d) by the angle positions[t]·θ_i (Su et al.
    2021, eq. 34): (x_2i cos - x_2i+1 sin, x_2i sin + x_2i+1 cos). 16-bit inputs in float32."""
    if x.size(-2) != positions.numel():
        raise ValueError(f"{positions.numel()} positions for a sequence of {x.size(-2)} tokens")
    dtype = _compute_dtype(x)
    cos, sin = rope_cos_sin(positions, x.size(-1), theta, dtype)
    x0, x1 = x.to(dtype).unflatten(-1, (-1, 2)).unbind(-1)  # (B, heads, T, d/2) each: the pairs
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2).type_as(x)


def causal_attention(q, k, v, positions, theta: float) -> torch.Tensor:
    """RoPE on q (B, n_head, T, d) and k, v (B, n_kv_head, T, d) at ``positions``, then causal
    attention in which query head j reads kv head j // (n_head / n_kv_head): (B, n_head, T, d).
    Every attention layer of the Llama (dense, tensor-, sequence-parallel, Ulysses) calls this."""
    q, k = apply_rope(q, positions, theta), apply_rope(k, positions, theta)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.size(1) != q.size(1))


def split_heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, T, heads·d) -> (B, heads, T, d); the number of heads is read off the width."""
    return x.unflatten(-1, (-1, head_dim)).transpose(1, 2)


class LlamaAttention(nn.Module):
    """Grouped-query causal self-attention with RoPE: separate q, k, v projections (n_head·d,
    n_kv_head·d, n_kv_head·d outputs), no biases. Head counts are read off the projections' widths,
    so a layer whose projections hold a slice of the heads runs that slice."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, d = cfg.n_embd, cfg.head_dim
        self.head_dim, self.rope_theta = d, cfg.rope_theta
        self.q_proj = nn.Linear(h, cfg.n_head * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.n_kv_head * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.n_kv_head * d, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * d, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        T = x.size(1)
        positions = torch.arange(T, device=x.device) if positions is None else positions
        q, k, v = (split_heads(p(x), self.head_dim) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = causal_attention(q, k, v, positions, self.rope_theta)  # (B, n_head, T, d)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class SwiGLU(nn.Module):
    """y = down_proj(SiLU(gate_proj(x)) ∘ up_proj(x)) (Shazeer 2020, eq. 6 with Swish_1 = SiLU)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_hidden, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then x + mlp(ln_2(x)); both norms RMSNorm."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.ln_1 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.ln_2 = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def init_llama_(module: nn.Module, std: float = 0.02) -> nn.Module:
    """Hugging Face's Llama initialisation, in place: Linear and Embedding weights ~ N(0, std²),
    RMSNorm gains 1 (the global torch RNG: same seed, same weights)."""
    for m in module.modules():
        with torch.no_grad():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0.0, std)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
    return module


class Llama(nn.Module):
    """Decoder-only Llama. ``model(idx, targets=None) -> (logits, loss)`` as the course GPT:
    ``idx`` (B, T) token ids, T <= block_size; ``logits`` (B, T, V); ``loss`` the mean cross-entropy
    over the B·T positions (targets equal to -100 ignored), or None without targets.
    Build it on ``meta`` with ``with torch.device("meta"): Llama(cfg)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        init_llama_(self)

    # --- the three stages of forward, separable for pipeline parallelism -------------------
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, n_embd): the token embedding only (positions live in RoPE)."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq_len) token ids, got shape {tuple(idx.shape)}")
        if idx.size(1) > self.cfg.block_size:
            raise ValueError(f"sequence length {idx.size(1)} exceeds block_size {self.cfg.block_size}; "
                             f"shorten the sequences or build the model with LlamaConfig(block_size="
                             f"{idx.size(1)})")
        return self.wte(idx)

    # The rest is the GPT's own code on the same names: ``head`` (final norm — RMSNorm here —, then the
    # output layer), ``loss_fn`` (mean next-token cross-entropy) and ``forward`` (embed, blocks, head).
    head, loss_fn, forward = GPT.head, GPT.loss_fn, GPT.forward

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters; ``exclude_embeddings`` leaves out wte and an untied lm_head."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.wte.weight.numel() + (0 if self.cfg.tie_embeddings else self.lm_head.weight.numel())
        return n
