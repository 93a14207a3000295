"""Chapter 11 — FlashAttention-2's algorithm in plain PyTorch, one tile at a time (the teaching version).

Dao 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning",
Algorithm 1 (forward) and Algorithm 2 (backward); the idea is Dao et al. 2022, "FlashAttention:
Fast and Memory-Efficient Exact Attention with IO-Awareness". Read it next to the paper: the loops
below are the paper's loops, and the Triton kernels of :mod:`.flash_attention` run the same loops
with a tile held in a program's registers (the outer loop becomes the grid).

Standard attention of queries Q (Sq × d) to keys K and values V (Sk × d) materialises the scores::

    S = Q Kᵀ · scale,   P = softmax(S) (row-wise),   O = P V

— an Sq × Sk matrix written to memory and read back (three times in the forward, more in the
backward). FlashAttention never forms it. Cut Q into row tiles Q_i (B_r rows) and K, V into tiles
K_j, V_j (B_c rows). For one query tile, sweep the key tiles, keeping per row a running max m, a
running sum ℓ and an unnormalised output Õ (the online softmax of Milakov & Gimelshein 2018)::

    S_ij = Q_i K_jᵀ · scale
    m_new = max(m, rowmax(S_ij))
    P̃_ij = exp(S_ij − m_new)
    ℓ = exp(m − m_new) ℓ + rowsum(P̃_ij)
    Õ = exp(m − m_new) Õ + P̃_ij V_j
    m = m_new

and at the end O_i = Õ / ℓ and L_i = m + log ℓ (the row's log-sum-exp, the only extra thing saved).
FA2's changes to FA1: Õ is divided by ℓ once at the end rather than at every step, only L (not
m and ℓ) is saved, and the outer loop runs over query tiles so that each can be its own program.

Backward (Algorithm 2) recomputes each tile's probabilities from the saved L instead of storing P::

    P_ij = exp(S_ij − L_i)                        (exactly softmax(S) restricted to the tile)
    dV_j += P_ijᵀ dO_i
    dP_ij = dO_i V_jᵀ
    dS_ij = P_ij ∘ (dP_ij − D_i),   D_i = rowsum(dO_i ∘ O_i)
    dQ_i += dS_ij K_j · scale,      dK_j += dS_ijᵀ Q_i · scale

D = rowsum(dO ∘ O) equals rowsum(P ∘ dP), the softmax Jacobian's correction term, from two (Sq × d)
tensors instead of the (Sq × Sk) ones. Recomputing S costs one more matmul per tile; reading a
stored P would cost Sq·Sk memory traffic, which is what the whole algorithm avoids.

Causal attention uses the top-left alignment of ``F.scaled_dot_product_attention(is_causal=True)``:
query i sees key j iff j ≤ i. Key tiles entirely to the right of a query tile are skipped, not
masked (half the work); only the tiles crossing the diagonal are masked. A row that sees no key
keeps ℓ = 0: its output is 0 and its L = −inf.

Grouped-query attention: k and v may have fewer heads (H_kv dividing H); query head h uses kv head
h // (H / H_kv), and a kv head's gradient sums over its group. Half inputs accumulate in float32
(as on chip); float64 stays float64 (the tests' exact references).
"""
from __future__ import annotations

import torch

__all__ = ["tiled_attention_forward", "tiled_attention_delta", "tiled_attention_backward",
           "tiled_attention"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _check(q, k, v, block_q: int, block_k: int) -> int:
    """Validate shapes; return the group size H / H_kv."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be (batch, heads, seq, head_dim); got shape {tuple(x.shape)}")
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating tensor, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"n_head {q.shape[1]} is not divisible by n_kv_head {k.shape[1]}: each kv head "
                         f"serves a whole group of query heads")
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise TypeError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one")
    if block_q < 1 or block_k < 1:
        raise ValueError(f"tile sizes must be positive, got block_q={block_q}, block_k={block_k}")
    return q.shape[1] // k.shape[1]


def _grouped(x: torch.Tensor, n_kv: int) -> torch.Tensor:
    """(B, H, S, d) -> (B, H_kv, G, S, d): the query heads of one kv head side by side."""
    B, H, S, d = x.shape
    return x.reshape(B, n_kv, H // n_kv, S, d)


def _key_stop(i0: int, bq: int, sk: int, causal: bool) -> int:
    """Key index where the sweep for query tile [i0, i0+bq) stops: causally, past its last query."""
    return min(sk, i0 + bq) if causal else sk


def _masked_scores(qi, kj, scale, i0: int, j0: int, causal: bool):
    """S_ij = Q_i K_jᵀ · scale, with −inf where key j0+c is after query i0+r (causal, top-left)."""
    s = (qi @ kj.transpose(-2, -1)) * scale  # (..., bq, bk): the only scores that ever exist
    if causal and j0 + kj.shape[-2] - 1 > i0:  # the tile crosses the diagonal
        rows = torch.arange(i0, i0 + qi.shape[-2], device=s.device)[:, None]
        cols = torch.arange(j0, j0 + kj.shape[-2], device=s.device)[None, :]
        s = s.masked_fill(cols > rows, float("-inf"))
    return s


def _finite(x: torch.Tensor) -> torch.Tensor:
    """−inf replaced by 0 (a row that has seen no key yet), so x − x is never −inf − −inf = NaN."""
    return torch.where(torch.isneginf(x), torch.zeros_like(x), x)


def _forward_tile(qi, k, v, scale, i0: int, causal: bool, block_k: int):
    """One query tile against every key tile it can see (Algorithm 1, lines 6–12): (O_i, L_i)."""
    shape = qi.shape[:-1]  # (B, H_kv, G, bq)
    m = torch.full(shape, float("-inf"), dtype=qi.dtype, device=qi.device)  # running row max
    ell = torch.zeros(shape, dtype=qi.dtype, device=qi.device)  # running row sum of exp
    acc = torch.zeros_like(qi)  # Õ, not yet divided by ℓ
    for j0 in range(0, _key_stop(i0, qi.shape[-2], k.shape[-2], causal), block_k):
        kj, vj = k[..., j0:j0 + block_k, :], v[..., j0:j0 + block_k, :]  # (B, H_kv, 1, bk, d)
        s = _masked_scores(qi, kj, scale, i0, j0, causal)  # (B, H_kv, G, bq, bk)
        m_new = torch.maximum(m, s.amax(dim=-1))
        p = torch.exp(s - _finite(m_new)[..., None])  # exp(−inf) = 0 where masked
        alpha = torch.exp(m - _finite(m_new))  # rescales what was summed under the old max
        ell = alpha * ell + p.sum(dim=-1)
        acc = alpha[..., None] * acc + p @ vj
        m = m_new
    seen = ell > 0
    out = torch.where(seen[..., None], acc / torch.where(seen, ell, 1.0)[..., None], 0.0)
    lse = torch.where(seen, m + torch.log(torch.where(seen, ell, 1.0)), float("-inf"))
    return out, lse


def tiled_attention_forward(q, k, v, causal: bool = False, scale: float | None = None,
                            block_q: int = 64, block_k: int = 64):
    """Attention of q (B, H, Sq, d) to k, v (B, H_kv, Sk, d), tile by tile: ``(o, lse)``.

    ``o`` (B, H, Sq, d) in q's dtype; ``lse`` (B, H, Sq) the row log-sum-exp of the scaled scores
    (float32 for half inputs). No tensor larger than one (block_q × block_k) tile of scores per head
    is created.
    """
    _check(q, k, v, block_q, block_k)
    acc_t, n_kv = _acc(q.dtype), k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    qg = _grouped(q, n_kv).to(acc_t)  # (B, H_kv, G, Sq, d)
    kg, vg = k.to(acc_t).unsqueeze(2), v.to(acc_t).unsqueeze(2)  # (B, H_kv, 1, Sk, d)
    outs, lses = [], []
    for i0 in range(0, q.shape[-2], block_q):  # FA2's outer loop: one program per query tile
        o_i, l_i = _forward_tile(qg[..., i0:i0 + block_q, :], kg, vg, scale, i0, causal, block_k)
        outs.append(o_i)
        lses.append(l_i)
    B, H, Sq, d = q.shape
    if not outs:  # Sq = 0
        return q.new_zeros(q.shape), torch.zeros(B, H, 0, dtype=acc_t, device=q.device)
    out = torch.cat(outs, dim=-2).reshape(B, H, Sq, d)
    return out.to(q.dtype), torch.cat(lses, dim=-1).reshape(B, H, Sq)


def tiled_attention_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO ∘ O), (B, H, Sq), accumulated in float32 for half inputs."""
    return (do.to(_acc(o.dtype)) * o.to(_acc(o.dtype))).sum(dim=-1)


def _backward_key_tile(qg, dog, kj, vj, lse, delta, scale, j0: int, causal: bool, block_q: int, dq):
    """One key tile against every query tile that sees it (Algorithm 2, lines 7–20): (dK_j, dV_j);
    adds each query tile's share of dQ into ``dq`` in place."""
    dk = torch.zeros_like(kj.expand(*qg.shape[:3], *kj.shape[-2:]))  # per query head, summed below
    dv = torch.zeros_like(dk)
    first = (j0 // block_q) * block_q if causal else 0  # earlier queries never see these keys
    for i0 in range(first, qg.shape[-2], block_q):
        qi, doi = qg[..., i0:i0 + block_q, :], dog[..., i0:i0 + block_q, :]
        s = _masked_scores(qi, kj, scale, i0, j0, causal)  # recomputed, never stored
        p = torch.exp(s - _finite(lse[..., i0:i0 + block_q])[..., None])  # P_ij from the saved L
        dv += p.transpose(-2, -1) @ doi
        dp = doi @ vj.transpose(-2, -1)
        ds = p * (dp - delta[..., i0:i0 + block_q, None])
        dq[..., i0:i0 + block_q, :] += (ds @ kj) * scale
        dk += (ds.transpose(-2, -1) @ qi) * scale
    return dk.sum(dim=2), dv.sum(dim=2)  # a kv head's gradient sums over its query heads


def tiled_attention_backward(q, k, v, do, lse, delta, causal: bool = False, scale: float | None = None,
                             block_q: int = 64, block_k: int = 64):
    """Gradients ``(dq, dk, dv)`` from the saved ``lse`` and ``delta`` (Algorithm 2).

    ``lse`` and ``delta`` may belong to a larger attention than these keys (ring attention passes the
    final ones over all key blocks): then P_ij is this block's slice of the full softmax and the
    gradients are this block's share.
    """
    n_group = _check(q, k, v, block_q, block_k)
    B, H, Sq, d = q.shape
    if lse.shape != (B, H, Sq) or delta.shape != (B, H, Sq):
        raise ValueError(f"lse {tuple(lse.shape)} and delta {tuple(delta.shape)} must be (B, H, Sq) = "
                         f"{(B, H, Sq)}: the forward's lse and tiled_attention_delta(o, do)")
    acc_t, n_kv = _acc(q.dtype), k.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    qg, dog = _grouped(q, n_kv).to(acc_t), _grouped(do, n_kv).to(acc_t)  # (B, H_kv, G, Sq, d)
    lg = lse.to(acc_t).reshape(B, n_kv, n_group, Sq)
    dg = delta.to(acc_t).reshape(B, n_kv, n_group, Sq)
    kg, vg = k.to(acc_t).unsqueeze(2), v.to(acc_t).unsqueeze(2)
    dq = torch.zeros_like(qg)
    dks, dvs = [], []
    for j0 in range(0, k.shape[-2], block_k):  # FA2's outer loop of the backward: one program per key tile
        dk_j, dv_j = _backward_key_tile(qg, dog, kg[..., j0:j0 + block_k, :], vg[..., j0:j0 + block_k, :],
                                        lg, dg, scale, j0, causal, block_q, dq)
        dks.append(dk_j)
        dvs.append(dv_j)
    dk = torch.cat(dks, dim=-2) if dks else torch.zeros(k.shape, dtype=acc_t, device=k.device)
    dv = torch.cat(dvs, dim=-2) if dvs else torch.zeros(v.shape, dtype=acc_t, device=v.device)
    return dq.reshape(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _TiledAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, block_q, block_k):
        out, lse = tiled_attention_forward(q, k, v, causal, scale, block_q, block_k)
        ctx.save_for_backward(q, k, v, out, lse)  # O(S·d) saved: no S × S tensor
        ctx.args = (causal, scale, block_q, block_k)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, block_q, block_k = ctx.args
        delta = tiled_attention_delta(out, dout)
        dq, dk, dv = tiled_attention_backward(q, k, v, dout, lse, delta, causal, scale, block_q, block_k)
        return dq, dk, dv, None, None, None, None


def tiled_attention(q, k, v, causal: bool = False, scale: float | None = None,
                    block_q: int = 64, block_k: int = 64) -> torch.Tensor:
    """Differentiable ``F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)``
    (with ``enable_gqa`` when k, v have fewer heads), computed tile by tile."""
    return _TiledAttention.apply(q, k, v, causal, scale, block_q, block_k)
