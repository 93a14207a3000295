"""Chapter 00 — model FLOPs per token (6N + 12Lhs) against torch's own FLOP counter, and MFU on the
papers' rows.

``torch.utils.flop_counter.FlopCounterMode`` counts mm / addmm / bmm (2 FLOPs per multiply-add)
and the fused attention kernels it has formulas for, all with the full s x s score matrix. On CPU
(torch 2.13) the fused ``_scaled_dot_product_flash_attention_for_cpu`` has no formula and would
count 0, so the model runs with the math SDPA backend: it computes QK^T and AV as bmm's of the
full s x s matrix (the causal mask is applied after), which is the convention of the formula.

Tolerances. FLOP counts are integers: exact (the rel 1e-2 beside it states the formula's headline
claim). Formula against formula in float64: rel 1e-12 >> k·u. Papers' percentages to their printed
precision: 52% to half a unit (abs 5e-3), 46.2% by rounding to three digits. The model-FLOPs MFU
against 3/4 of the hardware rate: 6N + 12Lhs is 3/4 of eq. 3's count but for their different logits
and attention terms, 1.3e-4 apart on the 1T row; the printed 163 TF/s carries ±0.5 of it, ±1.2e-3 of
the MFU: abs 2e-3.
"""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from minitorch_dist import costmodel
from minitorch_dist.models.gpt import GPT, GPTConfig

pytestmark = [pytest.mark.ch00, pytest.mark.timeout(120)]

LARGER = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)


def counted_training_flops(cfg: GPTConfig, B: int, T: int) -> int:
    """FLOPs FlopCounterMode counts for one forward + backward of GPT(cfg) on a (B, T) batch."""
    torch.manual_seed(0)
    model = GPT(cfg)
    x = torch.randint(0, cfg.vocab_size, (B, T))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("cfg, B, T", [
    (GPTConfig.tiny(), 2, 64),
    (LARGER, 2, 128),
    (GPTConfig.tiny(tie_embeddings=False, bias=False, mlp_ratio=3), 3, 64),  # untied head, f = 3h
    (GPTConfig.tiny(), 4, 32),  # s shorter than block_size
], ids=["tiny", "larger", "untied-r3", "short-seq"])
def test_formula_matches_flop_counter(cfg, B, T):
    predicted = costmodel.model_flops_per_token(cfg, seq=T) * B * T
    counted = counted_training_flops(cfg, B, T)
    assert predicted == pytest.approx(counted, rel=1e-2)
    assert predicted == counted  # in fact exact: every counted FLOP is a matmul of the formula


def test_seq_defaults_to_block_size_and_attention_grows_with_it():
    cfg = GPTConfig.tiny()
    assert costmodel.model_flops_per_token(cfg) == costmodel.model_flops_per_token(cfg, seq=cfg.block_size)
    longer = costmodel.model_flops_per_token(cfg, seq=2 * cfg.block_size)
    assert longer - costmodel.model_flops_per_token(cfg) == 12 * cfg.n_layer * cfg.n_embd * cfg.block_size


def test_N_is_the_matmul_weights_of_the_model():
    """6N with N = every 2-D weight the model multiplies by (Linear weights and the LM head once),
    i.e. the parameters minus wte/wpe lookups, biases and LayerNorms."""
    for cfg in (GPTConfig.tiny(), GPTConfig.tiny(tie_embeddings=False), LARGER):
        model = GPT(cfg)
        n = sum(p.numel() for name, p in model.named_parameters()
                if p.dim() == 2 and name not in ("wpe.weight", "wte.weight"))
        n += 0 if not cfg.tie_embeddings else cfg.vocab_size * cfg.n_embd  # the tied head lives in wte
        attention = 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
        assert costmodel.model_flops_per_token(cfg) == 6 * n + attention


def test_agrees_with_megatron_step_flops_on_the_1T_row():
    """Narayanan et al. 2021 Table 1, 1T model: l=128, h=25600, V=51200, s=2048, B=3072."""
    cfg = SimpleNamespace(n_layer=128, n_embd=25600, vocab_size=51200, block_size=2048)
    B, s = 3072, 2048
    step = costmodel.megatron_flops_per_step(B, s, 128, 25600, 51200, recompute=False)
    assert costmodel.model_flops_per_token(cfg) * B * s == pytest.approx(step, rel=1e-12)


def test_mfu_worked_examples():
    # Narayanan et al. 2021 Table 1, 1T row: 163 TF/s per A100 (peak 312) on 3072 GPUs -> 52%.
    # Their FLOPs include the recomputed forward (eq. 3), so this is hardware-FLOPs utilisation.
    n_gpus = 3072
    hfu = costmodel.model_flops_utilization(163e12 * n_gpus, 1.0, 312e12, n_gpus)
    assert hfu == pytest.approx(0.52, abs=5e-3)
    # The same run in *model* FLOPs: tokens/s from the hardware rate, then 6N + 12Lhs per token.
    cfg = SimpleNamespace(n_layer=128, n_embd=25600, vocab_size=51200, block_size=2048)
    B, s = 3072, 2048
    hw_per_token = costmodel.megatron_flops_per_step(B, s, 128, 25600, 51200, recompute=True) / (B * s)
    tokens_per_s = 163e12 * n_gpus / hw_per_token
    mfu = costmodel.model_flops_utilization(costmodel.model_flops_per_token(cfg) * tokens_per_s, 1.0,
                                            312e12, n_gpus)
    assert mfu == pytest.approx(0.75 * 163 / 312, abs=2e-3)  # 3 of 4 forward-equivalents are progress
    # Chowdhery et al. 2022 (PaLM) Table 3: 540B (N = 540.35e9, L=118, H=48, Q=256, T=2048) at
    # 238.3K tokens/s on 6144 TPU v4 chips of 275 TFLOP/s -> MFU 46.2%.
    per_token = 6 * 540.35e9 + 12 * 118 * 48 * 256 * 2048
    palm = costmodel.model_flops_utilization(per_token * 238.3e3, 1.0, 275e12, 6144)
    assert round(palm, 3) == 0.462


@pytest.mark.parametrize("seq", [0, -1, -128, 0.0, math.nan, math.inf, True, "64"])
def test_bad_seq_is_a_clear_error(seq):
    with pytest.raises(ValueError, match="seq must be a positive"):
        costmodel.model_flops_per_token(GPTConfig.tiny(), seq=seq)
