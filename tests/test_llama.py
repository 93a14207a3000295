"""Chapter 00: the Llama-shaped model computes what the Llama papers describe, checked against a
reference written out here in Meta's reference formulation (RoPE as complex multiplication, k/v heads
repeated as Hugging Face's ``repeat_kv``, an explicit masked softmax), and its pieces behave as the
papers say: RoPE makes q·k depend on the offset only; a kv head serves exactly its group of query
heads; the parameter count is Touvron/Dubey's formula; it builds on ``meta``.

Tolerances (derived in tests/_support.py). The model and the reference run in float64 and compute the
same sums in other orders: at most N = max(h, f, T) = 128 terms each, chained DEPTH = 11·L + 2 deep
in the forward (per block: RMSNorm, q/k/v, the scores, the softmax's sum, p·v, o_proj, RMSNorm,
gate/up, down, and RoPE on q and k counted as one step each: its angle, m·θ^(-i/d) here and complex
polar form in the reference, is off by at most (ln θ + 3)·u·T ≈ 300u, about one reduction's
2γ_N = 256u; then the final RMSNorm and lm_head): ``model_bound``, scaled by the logits' size (at
least 1), ~7e-10. The loss (a log-sum-exp over V, a mean over B·T) moves by at most twice the largest
logit error: two more steps at twice the scale. A wrong pair convention in RoPE, a kv head read by
the wrong group or a missing 1/sqrt(d) moves the logits by O(1e-2) or more at these sizes.

RoPE's own checks are of a few operations, bounded from Higham's model (u = 2^-53): θ_i =
theta^(-i/d) is within (ln theta + 2)·u relatively (the exponent's rounding times ln theta, pow's 1
ulp), the angle m·θ_i within (ln theta + 3)·u·|m|, cos and sin within 1 ulp (2u), so a rotated
component (two products and a sum) is within (|x_2i| + |x_2i+1|)·e(m), e(m) = (ln theta + 3)·u·|m| +
5u; a q·k of d terms adds γ_d (``_rope_score_bound``); a norm of d terms, γ_{d+1} relative. Position 0
turns by nothing, exactly (cos 0 = 1, sin 0 = 0): ``torch.equal``. The initialisation's standard
deviation is a statistic of n draws: its relative standard error is 1/sqrt(2(n - 1)), and we allow 6
of them (a wrong std, 1/sqrt(3·fan_in) = 0.083 as nn.Linear's default, or the GPT's scaled
projections, is off by far more).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from minitorch_dist.models.init import materialize
from minitorch_dist.models.llama import (
    Llama,
    LlamaAttention,
    LlamaConfig,
    apply_rope,
    llama_ffn_hidden,
)

from _support import close, gamma, model_bound, roundoff

pytestmark = [pytest.mark.ch00, pytest.mark.timeout(120)]

CFG = LlamaConfig.tiny(vocab_size=50, block_size=24, n_layer=2, n_head=6, n_kv_head=2, n_embd=48,
                       rope_theta=10000.0)  # groups of 3 query heads; θ small enough that every pair turns
B, T = 3, 24
N = max(CFG.n_embd, CFG.ffn_hidden, T)  # the longest reduction: SwiGLU's down projection sums f inputs
DEPTH = 11 * CFG.n_layer + 2  # chained steps of the forward (module docstring)
U = roundoff(torch.float64)


def _logit_bound(want):
    return model_bound(n=N, depth=DEPTH, scale=max(1.0, want.abs().max().item()))


def _rope_score_bound(q, k, m, n, theta):
    """|computed - exact| of apply_rope(q, m)·apply_rope(k, n), q and k (..., d): module docstring."""
    pairs = (q.abs().unflatten(-1, (-1, 2)).sum(-1) * k.abs().unflatten(-1, (-1, 2)).sum(-1)).sum().item()
    e = (math.log(theta) + 3) * U * (abs(m) + abs(n)) + 10 * U  # both rotations' component errors
    return pairs * (e + 2 * gamma(q.size(-1), torch.float64))


# --- the reference: Meta's formulas, written out --------------------------------------------------------


def _rms(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def _rope_complex(x, theta):
    """Meta's ``apply_rotary_emb``: x (B, T, heads, d) as d/2 complex numbers times e^{i m θ_j}."""
    d, n = x.size(-1), x.size(1)
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(n).double(), freqs)
    cis = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * cis[None, :, None, :]).flatten(3)


def _reference_logits(sd, cfg, idx):
    a, g, d = cfg.n_head, cfg.n_kv_head, cfg.head_dim
    h = sd["wte.weight"][idx]
    n = idx.size(1)
    mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
    for i in range(cfg.n_layer):
        w = {k[len(f"blocks.{i}."):]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        x = _rms(h, w["ln_1.weight"], cfg.norm_eps)
        q = _rope_complex((x @ w["attn.q_proj.weight"].T).view(*idx.shape, a, d), cfg.rope_theta)
        k = _rope_complex((x @ w["attn.k_proj.weight"].T).view(*idx.shape, g, d), cfg.rope_theta)
        v = (x @ w["attn.v_proj.weight"].T).view(*idx.shape, g, d)
        k, v = k.repeat_interleave(a // g, dim=2), v.repeat_interleave(a // g, dim=2)  # HF repeat_kv
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
        p = s.masked_fill(mask, float("-inf")).softmax(-1)
        o = torch.einsum("bhqk,bkhd->bqhd", p, v).reshape(*idx.shape, a * d)
        h = h + o @ w["attn.o_proj.weight"].T
        x = _rms(h, w["ln_2.weight"], cfg.norm_eps)
        gate, up = x @ w["mlp.gate_proj.weight"].T, x @ w["mlp.up_proj.weight"].T
        h = h + (gate * torch.sigmoid(gate) * up) @ w["mlp.down_proj.weight"].T
    return _rms(h, sd["ln_f.weight"], cfg.norm_eps) @ sd["lm_head.weight"].T


def _model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    model = Llama(cfg).double()
    with torch.no_grad():  # gains away from 1, so a norm applied to the wrong tensor shows
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                p.uniform_(0.5, 1.5)
    return model


def _idx(cfg=CFG, seed=1):
    return torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


# --- equal to the reference ----------------------------------------------------------------------------


@pytest.mark.parametrize("n_kv_head", [1, 2, 6])  # MQA, GQA, MHA
def test_forward_and_loss_equal_the_meta_style_reference(n_kv_head):
    cfg = LlamaConfig(**{**CFG.__dict__, "n_kv_head": n_kv_head})
    model, idx = _model(cfg), _idx(cfg)
    logits, loss = model(idx, idx)
    want = _reference_logits({k: v.detach() for k, v in model.state_dict().items()}, cfg, idx)
    bound = _logit_bound(want)
    close(logits, want, bound, "logits")
    close(loss, F.cross_entropy(want.flatten(0, 1), idx.flatten()),
          model_bound(n=N, depth=DEPTH + 2, scale=2 * max(1.0, want.abs().max().item())), "loss")
    assert bound < 1e-6 * logits.std()  # a real comparison, not of zeros


def test_the_reference_sees_a_wrong_pair_convention():
    """The check above can fail: rotating (x_i, x_{i+d/2}) pairs (HF's rotate_half without its weight
    permutation) instead of (x_2i, x_2i+1) gives other logits."""
    model, idx = _model(), _idx()
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    perm = torch.arange(CFG.head_dim).view(2, -1).T.reshape(-1)  # (0, d/2, 1, d/2+1, ...)
    for i in range(CFG.n_layer):
        for name in ("q_proj", "k_proj"):
            key = f"blocks.{i}.attn.{name}.weight"
            sd[key] = sd[key].view(-1, CFG.head_dim, CFG.n_embd)[:, perm].reshape(sd[key].shape)
    assert (_reference_logits(sd, CFG, idx) - model(idx)[0]).abs().max() > 1e-3


def test_gradients_flow_to_every_parameter():
    model, idx = _model(), _idx()
    model(idx, idx)[1].backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_causal_a_token_sees_only_its_past():
    model, idx = _model(), _idx()
    later = idx.clone()
    later[:, T // 2:] = (later[:, T // 2:] + 1) % CFG.vocab_size
    a, b = model(idx)[0], model(later)[0]
    close(a[:, :T // 2], b[:, :T // 2], _logit_bound(a), "the past's logits")  # the same sums, reblocked
    assert (a[:, T // 2:] - b[:, T // 2:]).abs().max() > 1e-3


# --- the pieces --------------------------------------------------------------------------------------------


def test_rope_is_relative_q_dot_k_depends_on_the_offset_only():
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 1, 1, 16, generator=g, dtype=torch.float64), torch.randn(1, 1, 1, 16, generator=g,
                                                                                   dtype=torch.float64)

    def score(m, n):
        return (apply_rope(q, torch.tensor([m]), 10000.0) * apply_rope(k, torch.tensor([n]), 10000.0)).sum()

    for m, n in [(5, 2), (0, 0), (3, 11)]:
        for shift in (1, 7, 1000):  # the exact scores are equal: each computed one within its bound
            bound = (_rope_score_bound(q, k, m + shift, n + shift, 10000.0)
                     + _rope_score_bound(q, k, m, n, 10000.0))
            close(score(m + shift, n + shift), score(m, n), bound, f"m={m} n={n} shift={shift}")
    assert abs(score(5, 2) - score(5, 3)) > 1e-3  # another offset, another score
    x = torch.randn(2, 3, 8, 16, generator=g, dtype=torch.float64)
    y = apply_rope(x, torch.arange(8), 500000.0)
    e = (math.log(500000.0) + 3) * U * 7 + 5 * U  # a component's error at the last position, 7
    norm = x.norm(dim=-1)  # a rotation keeps lengths: |δy| <= 2e|x|, each norm within γ_{d+1}
    assert ((y.norm(dim=-1) - norm).abs() <= norm * (2 * e + 2 * gamma(17, torch.float64))).all()
    assert torch.equal(y[:, :, 0], x[:, :, 0])  # position 0: no turn, exactly


def test_a_kv_head_serves_exactly_its_group_of_query_heads():
    """GQA: with 6 query heads and 2 kv heads, query heads 0-2 read kv head 0 and 3-5 kv head 1."""
    torch.manual_seed(0)
    attn = LlamaAttention(CFG).double()
    x = torch.randn(B, T, CFG.n_embd, dtype=torch.float64)
    heads = {}
    for name in ("before", "after"):
        captured = {}
        hook = attn.o_proj.register_forward_pre_hook(
            lambda m, a, captured=captured: captured.setdefault("y", a[0]))
        attn(x)
        hook.remove()
        heads[name] = captured["y"].view(B, T, CFG.n_head, CFG.head_dim)
        with torch.no_grad():
            attn.v_proj.weight[:CFG.head_dim] += 1.0  # change kv head 0's values only
    moved = (heads["after"] - heads["before"]).abs().amax(dim=(0, 1, 3))
    assert (moved[:3] > 1e-3).all() and (moved[3:] == 0).all(), moved


def test_param_count_is_the_llama_formula():
    for cfg in (CFG, LlamaConfig.tiny(), LlamaConfig.tiny(n_kv_head=1, ffn_hidden=100, tie_embeddings=True)):
        h, d, g, f = cfg.n_embd, cfg.head_dim, cfg.n_kv_head, cfg.ffn_hidden
        V, L = cfg.vocab_size, cfg.n_layer
        block = 2 * h + h * h + 2 * h * g * d + h * h + 3 * h * f
        total = L * block + h + V * h + (0 if cfg.tie_embeddings else V * h)
        model = Llama(cfg)
        assert model.num_params() == total
        assert model.num_params(exclude_embeddings=True) == L * block + h
        assert (model.lm_head.weight is model.wte.weight) == cfg.tie_embeddings


def test_ffn_width_rule_of_the_reference_code():
    assert llama_ffn_hidden(4096, 1024, 1.3) == 14336  # Llama 3 8B (Dubey et al. 2024, Table 3)
    assert llama_ffn_hidden(4096, 256) == 11008  # LLaMA 7B (Touvron et al. 2023): 2/3 of 4h, rounded up
    assert LlamaConfig.tiny().ffn_hidden == 192


def test_builds_and_runs_on_meta_and_materializes_like_its_init():
    with torch.device("meta"):
        model = Llama(CFG)
        logits, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, CFG.vocab_size) and logits.is_meta and loss.is_meta
    materialize(model, "cpu", seed=0)
    assert torch.all(model.ln_f.weight == 1) and torch.all(model.blocks[0].ln_2.weight == 1)
    w = torch.cat([p.flatten() for n, p in model.named_parameters() if p.dim() == 2])
    assert w.std().item() == pytest.approx(0.02, rel=6 / math.sqrt(2 * (w.numel() - 1)))  # 6 standard errors
    assert torch.isfinite(model(_idx(), _idx())[1])


@pytest.mark.parametrize("bad, msg", [
    (dict(n_kv_head=4), "n_head 6 is not divisible by n_kv_head 4"),
    (dict(n_embd=42, n_head=6, n_kv_head=3), "head_dim 7 is odd: RoPE rotates pairs"),
    (dict(n_embd=50), "n_embd 50 is not divisible by n_head 6"),
    (dict(rope_theta=0.0), "rope_theta must be a positive number"),
])
def test_bad_configs_are_clear_errors(bad, msg):
    with pytest.raises(ValueError, match=msg):
        LlamaConfig(**{**CFG.__dict__, **bad})


def test_too_long_a_sequence_is_a_clear_error():
    with pytest.raises(ValueError, match="exceeds block_size 24"):
        _model()(torch.zeros(1, 25, dtype=torch.long))


def test_cuts_into_pipeline_stages_as_the_gpt_does():
    """embed / head / loss_fn use only wte, ln_f, lm_head and every block makes its own positions, so
    stages that hold some of the modules (as ``GPTStage`` holds the GPT's) compute the whole model."""
    model, idx = _model(), _idx()
    first, last = torch.nn.Module(), torch.nn.Module()
    first.cfg, first.wte, first.blocks = CFG, model.wte, model.blocks[:1]
    last.cfg, last.blocks, last.ln_f, last.lm_head = CFG, model.blocks[1:], model.ln_f, model.lm_head
    h = Llama.embed(first, idx)
    for block in first.blocks:
        h = block(h)
    for block in last.blocks:  # the hidden states cross to the next stage: (B, T, n_embd), nothing else
        h = block(h)
    loss = Llama.loss_fn(last, Llama.head(last, h), idx)
    assert torch.equal(loss, model(idx, idx)[1])
