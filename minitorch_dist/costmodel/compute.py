"""Chapter 00 — model size and compute: parameter counts, training FLOPs, model FLOPs utilisation.

Kaplan et al. 2020 (6N FLOPs per token); Narayanan et al. 2021, Megatron-LM, §5.1 (FLOPs per
step with and without recomputation); Chowdhery et al. 2022, PaLM, App. B (MFU).
"""
from __future__ import annotations

import math
import numbers

# --- model size and compute -----------------------------------------------------------------

def transformer_params(cfg) -> int:
    """Exact parameter count of a GPT-2 style decoder (Radford et al. 2019), ``cfg`` duck-typed.

    Reads ``n_layer``, ``n_embd`` (h), ``vocab_size`` (V), ``block_size`` (T) and optionally
    ``mlp_ratio`` (r, default 4; MLP width ``int(r*h)``), ``bias`` (default True: every Linear
    and LayerNorm has a bias), ``tie_embeddings`` (default True: lm_head shares the token embedding).

    Per block (b = 1 with bias, else 0; f = int(r*h))::

        ln_1  h + b*h     attn.qkv  3h^2 + b*3h     attn.proj  h^2 + b*h
        ln_2  h + b*h     mlp.fc    h*f + b*f       mlp.proj   f*h + b*h

    plus ``ln_f (h + b*h) + wte V*h + wpe T*h + (lm_head V*h, no bias, if untied)``.
    """
    h, L, V, T = cfg.n_embd, cfg.n_layer, cfg.vocab_size, cfg.block_size
    b = 1 if getattr(cfg, "bias", True) else 0
    f = int(getattr(cfg, "mlp_ratio", 4) * h)
    ln = h + b * h
    block = 2 * ln + (3 * h * h + b * 3 * h) + (h * h + b * h) + (h * f + b * f) + (f * h + b * h)
    total = L * block + ln + V * h + T * h
    if not getattr(cfg, "tie_embeddings", True):
        total += V * h
    return int(total)


def transformer_params_approx(n_layer, hidden) -> float:
    """``12 * L * h^2``: the non-embedding parameters with a 4h MLP, biases and norms dropped
    (Kaplan et al. 2020 §2.1, N = 2*d_model*n_layer*(2*d_attn + d_ff); Narayanan et al. 2021 §5.1)."""
    return 12 * n_layer * hidden**2


def training_flops(params, tokens) -> float:
    """``C = 6 * N * D`` training FLOPs (Kaplan et al. 2020 §2.1; Hoffmann et al. 2022 §3):
    2 FLOPs per parameter per token forward (multiply + add), 4 backward; attention ignored."""
    return 6 * params * tokens


def megatron_flops_per_step(batch, seq, layers, hidden, vocab, recompute=False) -> float:
    """FLOPs of one training step of a GPT (Narayanan et al. 2021, §5.1 and Appendix).

    Counting only matmuls (2 FLOPs per multiply-add), one layer's forward is
    ``24*B*s*h^2 + 4*B*s^2*h`` (QKV 6Bsh^2, scores 2Bs^2h, attn*V 2Bs^2h, proj 2Bsh^2, MLP 16Bsh^2)
    and the logit layer's is ``2*B*s*h*V``. Backward costs twice forward. Per step:

    * ``recompute=True``: Narayanan et al.'s eq. 3, which counts full activation recomputation --
      4 forward-equivalents per layer (1 forward + 2 backward + 1 recomputed forward), hence the
      96 = 4 x 24: ``F = 96*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))``. These are the FLOPs their
      Table 1 throughputs ("teraFLOP/s per GPU") count: hardware FLOPs, recomputation included;
    * ``recompute=False`` (the default): the same count without the recomputed forward, 3
      forward-equivalents per layer, ``F = 72*B*s*l*h^2 * (1 + s/(6h) + V/(12*l*h))`` -- not eq. 3
      itself, but eq. 3's derivation with 3 in place of 4.

    The logit layer is never recomputed (6BshV in both), hence 16 vs 12 in the vocab term.
    ``recompute=False`` is the *model* FLOPs used for MFU.
    """
    B, s, l, h, V = batch, seq, layers, hidden, vocab
    if recompute:
        return 96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))
    return 72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h))


def model_flops_utilization(flops_per_step, step_time_s, peak_flops_per_device, n_devices=1) -> float:
    """MFU (Chowdhery et al. 2022, PaLM, Appendix B): achieved model FLOP/s over peak FLOP/s,
    ``flops_per_step / (step_time_s * peak_flops_per_device * n_devices)``. Pass *model* FLOPs
    (e.g. ``megatron_flops_per_step(..., recompute=False)`` or ``training_flops``): recomputation
    is work the hardware does but not progress, so it is left out.

    From a throughput instead of a step time, one second is one step:
    ``model_flops_utilization(model_flops_per_token(cfg) * tokens_per_s, 1.0, peak, n_devices)``."""
    if step_time_s <= 0 or peak_flops_per_device <= 0 or n_devices < 1:
        raise ValueError("step_time_s and peak_flops_per_device must be > 0 and n_devices >= 1")
    return flops_per_step / (step_time_s * peak_flops_per_device * n_devices)


def model_flops_per_token(cfg, seq=None) -> float:
    """Model FLOPs per token of one training step (forward + backward, no recomputation):
    ``6*N + 12*L*h*s`` (Chowdhery et al. 2022, PaLM, App. B; Narayanan et al. 2021 §5.1's count without
    recomputation -- 72, not eq. 3's 96 -- divided by B*s).

    A matmul-only count of the course GPT (``cfg`` duck-typed like :func:`transformer_params`:
    h = ``n_embd``, L = ``n_layer``, V = ``vocab_size``, f = ``int(mlp_ratio*h)``, s = ``seq``,
    default ``block_size``), 2 FLOPs per multiply-add, backward = 2x forward:

    * **N = the parameters that multiply an activation**: per layer the weights of ``c_attn``
      (3h^2), attention ``c_proj`` (h^2), ``c_fc`` (h*f) and MLP ``c_proj`` (f*h), i.e. 12h^2 with
      f = 4h, plus the LM head's V*h, counted once whether tied to ``wte`` or not (6*V*h per
      token; PaLM shares it too, and its 46.2% MFU comes out only with it in N). Left out: the
      embedding lookups ``wte``/``wpe`` (an index, 0 FLOPs), biases and LayerNorms (elementwise,
      not matmuls). So ``N = L*(4h^2 + 2hf) + V*h``, not ``transformer_params(cfg)``.
    * **Attention**: scores QK^T and the weighted sum AV, 2 matmuls x 2 FLOPs x s*h per token
      forward, x3 for forward + backward = ``12*L*h*s``. The full s x s score matrix is counted,
      as both papers and ``torch.utils.flop_counter`` do; a causal kernel that skips the masked
      half does about half of this, so the convention flatters it slightly.

    With f = 4h this is ``megatron_flops_per_step(B, s, L, h, V) / (B*s)`` exactly. Softmax,
    GELU, norms and the loss are not counted: MFU is about matmuls. Times B*s it equals, FLOP for
    FLOP, what ``torch.utils.flop_counter.FlopCounterMode`` counts for a forward + backward of
    ``GPT(cfg)`` run with the math SDPA backend (tests/test_mfu.py).
    """
    s = cfg.block_size if seq is None else seq
    if isinstance(s, bool) or not isinstance(s, numbers.Real) or not math.isfinite(s) or s <= 0:
        raise ValueError(f"seq must be a positive number of tokens, got {s!r} "
                         f"(leave it out to use cfg.block_size)")
    h, L, V = cfg.n_embd, cfg.n_layer, cfg.vocab_size
    f = int(getattr(cfg, "mlp_ratio", 4) * h)
    n_matmul = L * (4 * h * h + 2 * h * f) + V * h
    return float(6 * n_matmul + 12 * L * h * s)
