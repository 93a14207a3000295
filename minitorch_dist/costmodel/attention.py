"""Chapter 11 — attention's FLOPs and memory traffic, standard against FlashAttention.

Dao, Fu, Ermon, Rudra & Ré 2022, "FlashAttention: Fast and Memory-Efficient Exact Attention with
IO-Awareness", §3.2, Theorem 2: with sequence length N, head dimension d and on-chip memory (SRAM)
of M elements (d ≤ M ≤ Nd), standard attention (their Algorithm 0) makes Θ(Nd + N²) accesses to
HBM, FlashAttention Θ(N²d²M⁻¹). Dao 2023 ("FlashAttention-2", §3.1) keeps the count and swaps the
loops: one query tile of B_r rows stays on chip while every key/value tile streams past it.

Per (batch, head), with Sq queries, Sk keys, elements of e bytes:

- *Standard* (Algorithm 0): write S = QKᵀ (Sq·Sk), read it and write P = softmax(S), read P and V,
  write O::

      read  Sq·d + Sk·d (Q, K)  + Sq·Sk (S)  + Sq·Sk + Sk·d (P, V)  = (Sq + 2Sk)·d + 2·Sq·Sk
      write Sq·Sk (S) + Sq·Sk (P) + Sq·d (O)                       = 2·Sq·Sk + Sq·d

  The Sq·Sk terms dominate: memory grows with N² (and the activations saved for backward too).
- *FlashAttention-2 forward*: each of the ⌈Sq / B_r⌉ query tiles reads all of K and V once; Q is
  read and O and the row log-sum-exp L written once::

      read  Sq·d + ⌈Sq / B_r⌉ · 2·Sk·d,    write Sq·d + Sq (L, fp32)

  With B_r set by the on-chip memory, B_r = ⌊M / 4d⌋ (a query tile, its output accumulator and one
  key and one value tile of d columns each: Dao et al. 2022, Algorithm 1, line 1, B_c = ⌈M / 4d⌉),
  the K/V traffic is 2·Sk·d · 4d·Sq / M = 8·Sq·Sk·d² / M: Theorem 2's Θ(N²d²/M).

FLOPs (a multiply-add counts 2): the forward is two matmuls, QKᵀ and PV, 4·Sq·Sk·d; standard
backward four (dV = PᵀdO, dP = dO Vᵀ, dQ = dS K, dK = dSᵀQ), 8·Sq·Sk·d; FlashAttention's backward
recomputes QKᵀ first, 10·Sq·Sk·d. Causal attention (top-left aligned) does only the visible
(query, key) pairs: Σ_i min(i + 1, Sk) of them. The softmax's elementwise work is left out.
"""
from __future__ import annotations

from .kernels import check_dims, element_size, read_written

__all__ = ["attention_pairs", "attention_flops", "standard_attention_bytes", "flash_attention_bytes",
           "flash_block_rows"]


def attention_pairs(seq_q: int, seq_k: int, causal: bool = False) -> int:
    """(query, key) pairs whose score is computed: Sq·Sk, or causally (query i sees keys 0..i)
    Σ_i min(i + 1, Sk)."""
    check_dims(seq_q=seq_q, seq_k=seq_k)
    if not causal:
        return seq_q * seq_k
    full = max(0, seq_q - seq_k)  # rows that see every key
    ramp = seq_q - full  # rows 0 .. min(Sq, Sk) - 1 see i + 1 keys
    return ramp * (ramp + 1) // 2 + full * seq_k


def attention_flops(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, causal: bool = False,
                    backward: bool = False, flash: bool = False) -> int:
    """Matmul FLOPs of attention: forward 4·pairs·d; backward 8·pairs·d, or 10·pairs·d for
    FlashAttention, which recomputes the scores (Dao 2023, §3.1.2)."""
    check_dims(batch=batch, heads=heads, head_dim=head_dim)
    per_pair = (10 if flash else 8) if backward else 4
    return per_pair * batch * heads * attention_pairs(seq_q, seq_k, causal) * head_dim


def standard_attention_bytes(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                             dtype_bytes=2) -> dict:
    """HBM bytes ``{"read", "written"}`` of standard attention's forward (Dao et al. 2022,
    Algorithm 0: S and P written to and read back from HBM); see the module docstring."""
    check_dims(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim)
    e, bh, n_s = element_size(dtype_bytes), batch * heads, seq_q * seq_k
    read = (seq_q + 2 * seq_k) * head_dim + 2 * n_s
    written = 2 * n_s + seq_q * head_dim
    return read_written(bh * read * e, bh * written * e)


def flash_block_rows(sram_bytes: int, head_dim: int, dtype_bytes=2) -> int:
    """Rows per tile that fit on chip: ⌊M / 4d⌋ with M = sram_bytes / element size (Dao et al. 2022,
    Algorithm 1, line 1: a query tile, its output, one key and one value tile of d columns)."""
    check_dims(sram_bytes=sram_bytes, head_dim=head_dim)
    rows = sram_bytes // element_size(dtype_bytes) // (4 * head_dim)
    if rows < 1:
        raise ValueError(f"{sram_bytes} B of on-chip memory cannot hold four rows of head_dim {head_dim}")
    return rows


def flash_attention_bytes(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int, dtype_bytes=2,
                          block_q: int | None = None, sram_bytes: int | None = None) -> dict:
    """HBM bytes ``{"read", "written"}`` of FlashAttention-2's forward: Q once, K and V once per query
    tile of ``block_q`` rows (or of :func:`flash_block_rows` for ``sram_bytes``), O once and the fp32
    row log-sum-exp L; see the module docstring."""
    check_dims(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim)
    if (block_q is None) == (sram_bytes is None):
        raise ValueError("give exactly one of block_q (rows of a query tile) and sram_bytes (on-chip memory)")
    rows = block_q if block_q is not None else flash_block_rows(sram_bytes, head_dim, dtype_bytes)
    check_dims(block_q=rows)
    e, bh = element_size(dtype_bytes), batch * heads
    tiles = -(-seq_q // rows)
    read = (seq_q * head_dim + tiles * 2 * seq_k * head_dim) * e
    written = seq_q * head_dim * e + seq_q * 4
    return read_written(bh * read, bh * written)
