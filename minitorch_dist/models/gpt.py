"""Chapter 00 — the one tiny GPT every chapter trains: a GPT-2-style decoder-only transformer.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", §2.3 (GPT-2):
LayerNorm at the *input* of each sub-block (pre-LN), one more LayerNorm after the last block,
and residual-output weights scaled at init by 1/sqrt(N), N = 2·n_layer residual layers.
Attention is Vaswani et al. 2017 ("Attention Is All You Need", §3.2), computed by
``F.scaled_dot_product_attention``. Module names follow nanoGPT / HF GPT-2 (``wte``, ``wpe``,
``c_attn``, ``c_proj``, ``c_fc``, ``ln_1`` ...), so a reader of Megatron-LM or nanoGPT finds
the same pieces, and later chapters can swap them (TP linears, MoE MLPs, recomputed blocks)
or cut ``blocks`` into pipeline stages:

    h = embed(idx)                     # wte[idx] + wpe[0..T-1], then dropout
    for block in blocks: h = block(h)  # h + attn(ln_1(h)); h + mlp(ln_2(h))
    logits = head(h)                   # lm_head(ln_f(h))
    loss = loss_fn(logits, targets)    # mean cross-entropy over all B·T tokens

Parameter count (h = n_embd, r = mlp_ratio, V = vocab_size, b = 1 with bias else 0):
    per block   2·(h + b·h)  +  (3h² + b·3h) + (h² + b·h)  +  (r·h² + b·r·h) + (r·h² + b·h)
    final LN    h + b·h;   wte V·h;   wpe block_size·h;   lm_head V·h only if untied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    """Shape of the model. ``GPTConfig.tiny()`` is the default; it trains in seconds on one CPU core."""

    vocab_size: int = 64
    block_size: int = 64  # longest sequence the model accepts (rows of wpe)
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * n_embd
    bias: bool = True  # biases in every Linear and LayerNorm (GPT-2: True)
    tie_embeddings: bool = True  # lm_head.weight is wte.weight (Press & Wolf 2017)
    dropout: float = 0.0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd {self.n_embd} is not divisible by n_head {self.n_head}; "
                f"choose n_embd as a multiple of n_head (each head gets n_embd // n_head dims)"
            )
        for name in ("bias", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name} must be True or False, got {getattr(self, name)!r}")
        if not (isinstance(self.dropout, (int, float)) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"GPTConfig.dropout must be a probability in [0, 1), got {self.dropout!r}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls, **overrides) -> GPTConfig:
        """~0.1 M parameters: V=64, T=64, 2 layers, 4 heads, width 64. Laptop chapters use this."""
        return cls(**overrides)

    @classmethod
    def small(cls, **overrides) -> GPTConfig:
        """~3.3 M parameters: V=256, T=128, 4 layers, 8 heads, width 256. For GPU runs."""
        return cls(**{**dict(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256), **overrides})


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one fused q|k|v projection, SDPA, output projection.

    The number of heads is read off the width of ``c_attn``'s output (width / head_dim), so a
    column-sharded ``c_attn`` (tensor parallelism, ch04) simply runs its local heads.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        # (B, T, heads·d) -> (B, heads, T, d): SDPA attends over T independently per head.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: c_fc (h -> r·h), GELU, c_proj (r·h -> h).

    GELU uses the tanh approximation (Hendrycks & Gimpel 2016, eq. in §2), as GPT-2 did;
    it differs from the exact erf form by < 1e-3 and is what Megatron's fused kernels compute.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.mlp_ratio * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(cfg.mlp_ratio * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def init_gpt2_(module: nn.Module, n_layer: int, std: float = 0.02) -> nn.Module:
    """GPT-2 initialisation, in place, of ``module`` and everything under it.

    Linear and Embedding weights ~ N(0, 0.02²), biases 0, LayerNorm weight 1 / bias 0.
    Every ``c_proj.weight`` (the two residual-branch outputs of a block) ~ N(0, (0.02/sqrt(2·n_layer))²),
    so the variance the residual stream accumulates over 2·n_layer additions stays O(1).
    Uses the global torch RNG: same ``torch.manual_seed`` -> same weights. Swapped-in blocks
    can call this on themselves to be initialised the way the originals were.
    """
    seen = set()  # a tied weight (wte / lm_head) is drawn once
    for name, m in module.named_modules():
        for pname, p in m.named_parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            with torch.no_grad():
                if isinstance(m, nn.LayerNorm):
                    p.fill_(1.0 if pname == "weight" else 0.0)
                elif pname == "bias":
                    p.zero_()
                elif name.endswith("c_proj") and pname == "weight":
                    p.normal_(0.0, std / math.sqrt(2 * n_layer))
                else:
                    p.normal_(0.0, std)
    return module


class GPT(nn.Module):
    """Decoder-only language model. ``model(idx, targets=None) -> (logits, loss)``.

    ``idx``: (B, T) int64 token ids with T <= block_size. ``logits``: (B, T, vocab_size).
    ``loss``: mean cross-entropy over all B·T positions, or None when ``targets`` is None.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        init_gpt2_(self, cfg.n_layer)

    # --- the three stages of forward, separable for pipeline parallelism -------------------
    def embed(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, T) token ids -> (B, T, n_embd) hidden states: token + position embedding."""
        if idx.dim() != 2:
            raise ValueError(f"idx must be (batch, seq_len) token ids, got shape {tuple(idx.shape)}")
        T = idx.size(1)
        if T > self.cfg.block_size:
            raise ValueError(
                f"sequence length {T} exceeds block_size {self.cfg.block_size}; "
                f"shorten the sequences or build the model with GPTConfig(block_size={T})"
            )
        pos = torch.arange(T, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """(B, T, n_embd) -> (B, T, vocab_size) logits: final LayerNorm, then the unembedding."""
        return self.lm_head(self.ln_f(h))

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy (nats/token) over every position of the batch."""
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h)
        loss = None if targets is None else self.loss_fn(logits, targets)
        return logits, loss

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied wte / lm_head counts once).

        ``exclude_embeddings=True`` leaves out wte, wpe and an untied lm_head: the V·h and
        block_size·h tables, as in Kaplan et al. 2020's "non-embedding" N.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a shared tensor once
        if exclude_embeddings:
            n -= self.wte.weight.numel() + self.wpe.weight.numel()
            if not self.cfg.tie_embeddings:
                n -= self.lm_head.weight.numel()
        return n
