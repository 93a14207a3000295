"""costmodel reproduces the papers' own numbers and agrees with independent counts.

Every expected value below is either a number printed in a paper (with its precision) or an
independent computation (a torch.nn model's parameter count, a hand-expanded sum); none is the
function's own output.

Tolerances. Formula against formula is a few dozen float64 operations on numbers far from overflow:
pytest.approx's default rel 1e-6 (and the crossover's 1e-9) is far above k·u ~ 1e-14, and far below
any wrong factor. A number printed in a paper is compared to its printed precision: half a unit of
its last digit (120 / 31.4 / 16.6 / 1.88 GB: abs 0.5, 0.05, 0.05, 0.005; 173.9e9: rel 1e-3). 6ND
against Chinchilla's own FLOP count differs by the terms 6ND leaves out: 6·70e9·1.4e12 = 5.88e23 is
2.1% above 5.76e23 (rel 0.03). The α-β fit to synthetic times with 1% relative noise (seeded) is held
to 5 of its standard errors, computed from the fit's design (``_fit_standard_errors``).
"""

import numpy as np
import pytest
from torch import nn

from minitorch_dist import costmodel as cm
from minitorch_dist.models.gpt import GPT, GPTConfig

# --- collectives ------------------------------------------------------------------------------

def test_bus_bytes_factors_at_2_and_4():
    S = 1000
    assert cm.bus_bytes("all_reduce", S, 2) == pytest.approx(S)          # 2*(1)/2
    assert cm.bus_bytes("all_reduce", S, 4) == pytest.approx(1500)       # 2*3/4
    for op in ("reduce_scatter", "all_gather", "all_to_all"):
        assert cm.bus_bytes(op, S, 2) == pytest.approx(500)              # 1/2
        assert cm.bus_bytes(op, S, 4) == pytest.approx(750)              # 3/4
    assert cm.bus_bytes("broadcast", S, 4) == S
    assert cm.bus_bytes("all_reduce", S, 1) == 0.0


def test_ring_times_match_step_by_step_sum():
    # Build the ring all-reduce from its messages: 2(n-1) steps of S/n bytes each.
    S, a, b = 8e6, 5e-6, 1e-10
    for n in (2, 4, 8):
        msg = cm.p2p_time(S / n, a, b)
        assert cm.allreduce_time(S, n, a, b) == pytest.approx(2 * (n - 1) * msg)
        assert cm.reduce_scatter_time(S, n, a, b) == pytest.approx((n - 1) * msg)
        assert cm.all_gather_time(S, n, a, b) == pytest.approx((n - 1) * msg)
        assert cm.all_to_all_time(S, n, a, b) == pytest.approx((n - 1) * msg)
        assert cm.broadcast_time(S, n, a, b) == pytest.approx((n - 1) * a + S * b)
    assert cm.allreduce_time(S, 1, a, b) == 0.0


def test_latency_optimal_variants_and_crossover():
    a, b = 1e-5, 1e-9
    assert cm.recursive_doubling_allreduce_time(100, 8, a, b) == pytest.approx(3 * (a + 100 * b))
    assert cm.tree_allreduce_time(100, 8, a, b) == pytest.approx(6 * (a + 100 * b))
    assert cm.naive_allreduce_time(100, 8, a, b) == pytest.approx(14 * (a + 100 * b))
    # small messages: log-latency wins; large messages: the ring's bandwidth term wins
    n = 64
    assert cm.recursive_doubling_allreduce_time(8, n, a, b) < cm.allreduce_time(8, n, a, b)
    assert cm.allreduce_time(1e9, n, a, b) < cm.recursive_doubling_allreduce_time(1e9, n, a, b)
    assert cm.allreduce_time(1e9, n, a, b) < cm.naive_allreduce_time(1e9, n, a, b)


@pytest.mark.parametrize("op,n", [("all_reduce", 4), ("all_gather", 2), ("all_to_all", 8)])
def test_fit_alpha_beta_recovers_synthetic(op, n):
    alpha, beta = 2.5e-5, 1 / 12e9
    sizes = np.logspace(3, 9, 25)
    steps = {"all_reduce": 2 * (n - 1)}.get(op, n - 1)
    factor = {"all_reduce": 2 * (n - 1) / n}.get(op, (n - 1) / n)
    rng = np.random.default_rng(0)
    times = (steps * alpha + factor * sizes * beta) * (1 + 0.01 * rng.standard_normal(sizes.size))
    a_fit, b_fit = cm.fit_alpha_beta(sizes, times, n, op=op)
    se_a, se_b = _fit_standard_errors(sizes, steps * alpha + factor * sizes * beta, steps, factor, 0.01)
    assert abs(a_fit - alpha) <= 5 * se_a, (a_fit, alpha, se_a)
    assert abs(b_fit - beta) <= 5 * se_b, (b_fit, beta, se_b)
    assert 5 * se_a < 0.05 * alpha and 5 * se_b < 0.02 * beta  # the fit pins both to a few percent


def _fit_standard_errors(sizes, times, steps, factor, noise):
    """The standard errors of (alpha, beta) fitted by least squares on relative residuals (as
    ``fit_alpha_beta``) to ``times`` with relative noise of standard deviation ``noise``: the rows
    [steps, factor·S] / t, covariance noise^2 (A^T A)^-1 (to first order in the noise)."""
    a = np.stack([np.full_like(sizes, steps), factor * sizes], axis=1) / times[:, None]
    return np.sqrt(np.diag(noise ** 2 * np.linalg.inv(a.T @ a)))


def test_fit_alpha_beta_clips_to_nonnegative():
    # pure-bandwidth data with a negative offset: unconstrained alpha < 0, NNLS gives alpha = 0
    sizes = np.array([1e6, 2e6, 4e6, 8e6])
    times = sizes * 1e-9 - 1e-4
    assert np.all(times > 0)
    a_fit, b_fit = cm.fit_alpha_beta(sizes, times, 2)
    assert a_fit == 0.0 and b_fit > 0
    with pytest.raises(ValueError, match="distinct"):
        cm.fit_alpha_beta([1e6, 1e6], [1.0, 1.0], 4)
    with pytest.raises(ValueError, match="n >= 2"):
        cm.fit_alpha_beta([1, 2], [1, 2], 1)


# --- parameters and FLOPs ---------------------------------------------------------------------

class _Block(nn.Module):
    def __init__(self, h, f, bias):
        super().__init__()
        self.ln_1 = nn.LayerNorm(h, bias=bias)
        self.qkv = nn.Linear(h, 3 * h, bias=bias)
        self.proj = nn.Linear(h, h, bias=bias)
        self.ln_2 = nn.LayerNorm(h, bias=bias)
        self.fc = nn.Linear(h, f, bias=bias)
        self.mlp_proj = nn.Linear(f, h, bias=bias)


class _GPT2(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        h = cfg.n_embd
        self.wte = nn.Embedding(cfg.vocab_size, h)
        self.wpe = nn.Embedding(cfg.block_size, h)
        self.blocks = nn.ModuleList(_Block(h, int(cfg.mlp_ratio * h), cfg.bias) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(h, bias=cfg.bias)
        self.lm_head = nn.Linear(h, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight


class _Cfg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("mlp_ratio", [4, 2])
def test_transformer_params_equals_nn_module(bias, tie, mlp_ratio):
    cfg = _Cfg(n_layer=3, n_embd=48, vocab_size=101, block_size=17, mlp_ratio=mlp_ratio,
               bias=bias, tie_embeddings=tie)
    model = _GPT2(cfg)
    expected = sum(p.numel() for p in model.parameters())  # parameters() counts a tied one once
    assert cm.transformer_params(cfg) == expected


def test_transformer_params_defaults_and_gpt2_small():
    # GPT-2 small (124M; nanoGPT's count 124,439,808 with V=50257, T=1024, tied, biases)
    cfg = _Cfg(n_layer=12, n_embd=768, vocab_size=50257, block_size=1024)
    assert cm.transformer_params(cfg) == 124_439_808


def test_transformer_params_matches_library_gpt():
    gpt = pytest.importorskip("minitorch_dist.models.gpt")
    for bias in (True, False):
        for tie in (True, False):
            cfg = gpt.GPTConfig(vocab_size=61, block_size=16, n_layer=2, n_head=4, n_embd=32,
                                bias=bias, tie_embeddings=tie)
            model = gpt.GPT(cfg)
            assert cm.transformer_params(cfg) == sum(p.numel() for p in model.parameters())


def test_approx_params_and_flops():
    assert cm.transformer_params_approx(96, 12288) == pytest.approx(173.9e9, rel=1e-3)  # GPT-3 ~175B
    assert cm.training_flops(175e9, 300e9) == pytest.approx(3.15e23)  # GPT-3: 6*175e9*300e9
    # Chinchilla: 70B params on 1.4T tokens, 5.76e23 FLOPs by the paper's detailed count
    # (Hoffmann et al. 2022, Table 3); 6ND lands within 3% of it
    assert cm.training_flops(70e9, 1.4e12) == pytest.approx(5.76e23, rel=0.03)


def test_megatron_flops_expand_layer_by_layer():
    B, s, l, h, V = 8, 2048, 24, 2048, 51200
    layer_fwd = (6 * B * s * h * h      # Q, K, V projections
                 + 2 * B * s * s * h    # Q K^T
                 + 2 * B * s * s * h    # scores @ V
                 + 2 * B * s * h * h    # output projection
                 + 16 * B * s * h * h)  # MLP h -> 4h -> h
    logits = 2 * B * s * h * V
    assert cm.megatron_flops_per_step(B, s, l, h, V, recompute=True) == pytest.approx(
        4 * l * layer_fwd + 3 * logits)
    assert cm.megatron_flops_per_step(B, s, l, h, V) == pytest.approx(3 * l * layer_fwd + 3 * logits)
    # without recompute the dominant term is 6 * (12 l h^2) * (B s) tokens: the 6PD rule
    dominant = 72 * B * s * l * h * h
    assert dominant == pytest.approx(cm.training_flops(cm.transformer_params_approx(l, h), B * s))


def test_mfu():
    assert cm.model_flops_utilization(1.5e15, 2.0, 312e12, 4) == pytest.approx(1.5e15 / (2 * 312e12 * 4))
    with pytest.raises(ValueError):
        cm.model_flops_utilization(1.0, 0.0, 1.0)


# --- model-state memory -------------------------------------------------------------------------

def test_zero_table1_7p5b():
    # Rajbhandari et al. 2020, Table 1 (and Figure 1): Psi = 7.5B, K = 12, N_d = 64, GB = 1e9
    P, N = 7.5e9, 64
    gb = lambda stage: cm.zero_memory_bytes(P, N, stage, k=12) / cm.GB
    assert gb(0) == pytest.approx(120, abs=0.5)
    assert gb(1) == pytest.approx(31.4, abs=0.05)
    assert gb(2) == pytest.approx(16.6, abs=0.05)
    assert gb(3) == pytest.approx(1.88, abs=0.005)


def test_zero_section_3_1_gpt2_1p5b():
    # ZeRO §3.1: a 1.5B-parameter GPT-2 needs at least 24 GB with mixed-precision Adam (16 B/param)
    parts = cm.model_state_bytes(1.5e9, "mixed", "adamw")
    assert parts["total"] / cm.GB == pytest.approx(24.0)
    assert parts["weights"] == 3e9 and parts["gradients"] == 3e9
    assert parts["optimizer"] == 18e9 and parts["master_weights"] == 6e9
    # the optimizer's share is the paper's K = 12, and ZeRO stage 0 agrees with it
    assert cm.optimizer_bytes_per_param("mixed", "adamw") == 12
    assert cm.zero_memory_bytes(1.5e9, 1, 0) == parts["total"]


def test_model_state_bytes_per_param():
    per = lambda prec, opt: cm.model_state_bytes(1, prec, opt)["total"]
    assert per("fp32", "adamw") == 4 + 4 + 8
    assert per("fp32", "adam") == 16
    assert per("mixed", "adamw") == 2 + 2 + 4 + 4 + 4
    assert per("fp32", "sgd") == 4 + 4 + 4
    assert per("fp32", "sgd_nomomentum") == 8
    assert per("mixed", "sgd") == 2 + 2 + 4 + 4  # Transformer Math 101: 8 B optimizer for SGD+momentum


def test_memory_errors_name_the_choices():
    with pytest.raises(ValueError, match="fp32"):
        cm.model_state_bytes(1e9, "fp8")
    with pytest.raises(ValueError, match="adamw"):
        cm.model_state_bytes(1e9, "mixed", "lion")
    with pytest.raises(ValueError, match="stage"):
        cm.zero_memory_bytes(1e9, 8, 4)
    with pytest.raises(ValueError, match=">= 1"):
        cm.zero_memory_bytes(1e9, 0, 1)


# --- activation memory ---------------------------------------------------------------------------

GPT3 = dict(seq=2048, batch=1, hidden=12288, heads=96)


def test_korthikanti_eq1_and_attention_term():
    s, b, h, a = GPT3["seq"], GPT3["batch"], GPT3["hidden"], GPT3["heads"]
    # eq. 1 per layer: 34 sbh + 5 a s^2 b bytes
    assert cm.activation_memory_bytes(**GPT3) == pytest.approx(34 * s * b * h + 5 * a * s * s * b)
    # §4: for GPT-3 the attention term 5as/h = 80 (vs 34), for MT-NLG (a=128, h=20480) it is 64;
    # so selective recomputation saves ~70% and ~65% of activation memory
    saved = 1 - cm.activation_memory_bytes(**GPT3, recompute="selective") / cm.activation_memory_bytes(**GPT3)
    assert saved == pytest.approx(80 / 114) and round(saved, 2) == 0.70
    mtnlg = dict(seq=2048, batch=1, hidden=20480, heads=128)
    saved = (1 - cm.activation_memory_bytes(**mtnlg, recompute="selective")
             / cm.activation_memory_bytes(**mtnlg))
    assert saved == pytest.approx(64 / 98) and round(saved, 2) == 0.65


def test_korthikanti_table2_identities_t8():
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    sbh = s * b * h
    act = lambda **kw: cm.activation_memory_bytes(**GPT3, tp=t, **kw)
    assert act(sequence_parallel=True, recompute="selective") == pytest.approx(34 * sbh / t)
    assert act(recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert act() == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    # SP shards exactly the 10 sbh (norms and dropouts) that TP alone replicates
    assert act() - act(sequence_parallel=True) == pytest.approx(10 * sbh * (1 - 1 / t))
    assert act(sequence_parallel=True) == pytest.approx(cm.activation_memory_bytes(**GPT3) / t)
    assert act(recompute="full") == pytest.approx(2 * sbh)
    assert act(recompute="full", sequence_parallel=True) == pytest.approx(2 * sbh / t)
    # the abstract's "5x": TP-only with no recompute vs TP + SP + selective recompute
    assert act() / act(sequence_parallel=True, recompute="selective") == pytest.approx(23 / 4.25)
    assert (cm.activation_memory_bytes(**GPT3, layers=96)
            == pytest.approx(96 * cm.activation_memory_bytes(**GPT3)))


def test_activation_errors():
    with pytest.raises(ValueError, match="selective"):
        cm.activation_memory_bytes(**GPT3, recompute="partial")
    with pytest.raises(ValueError, match="tp"):
        cm.activation_memory_bytes(**GPT3, tp=0)


# --- pipeline bubbles ------------------------------------------------------------------------------

def test_bubble_gpipe_and_1f1b():
    from fractions import Fraction
    for sched in ("gpipe", "1f1b"):
        assert cm.pipeline_bubble_fraction(sched, 4, 8) == pytest.approx(float(Fraction(3, 11)))
        assert cm.pipeline_bubble_ratio(sched, 4, 8) == pytest.approx(3 / 8)
    assert cm.pipeline_bubble_fraction("gpipe", 1, 5) == 0.0


def test_bubble_fraction_counts_a_simulated_gpipe_schedule():
    # Independent check: simulate GPipe with unit-time F and B; idle slots / total slots per stage.
    p, m = 4, 6
    fwd_done = [[0] * m for _ in range(p)]
    for i in range(p):
        for j in range(m):
            fwd_done[i][j] = max(fwd_done[i - 1][j] if i else 0, fwd_done[i][j - 1] if j else 0) + 1
    bwd_done = [[0] * m for _ in range(p)]
    for i in reversed(range(p)):
        for j in range(m):
            prev = bwd_done[i + 1][j] if i < p - 1 else fwd_done[p - 1][m - 1]
            bwd_done[i][j] = max(prev, bwd_done[i][j - 1] if j else fwd_done[i][m - 1]) + 1
    makespan = max(max(r) for r in bwd_done)
    assert cm.pipeline_bubble_fraction("gpipe", p, m) == pytest.approx(1 - 2 * m / makespan)


def test_bubble_interleaved_and_zero_bubble():
    p, m, v = 4, 8, 2
    assert cm.pipeline_bubble_ratio("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m))
    assert cm.pipeline_bubble_fraction("interleaved", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    # ZB-H1: one third of 1F1B's bubble at equal t_F = t_B = t_W
    assert cm.zb_h1_idle_time(p, 1.0, 1.0, 1.0) == pytest.approx((p - 1) * (1 + 1 + 1) / 3)
    assert (cm.pipeline_bubble_ratio("zb-h1", p, m)
            == pytest.approx(cm.pipeline_bubble_ratio("1f1b", p, m) / 3))
    assert cm.pipeline_bubble_fraction("zb-h1", p, m) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert cm.zb_h1_idle_time(p, 2.0, 3.0, 1.5) == pytest.approx((p - 1) * 3.5)


def test_bubble_errors():
    with pytest.raises(ValueError, match="1f1b"):
        cm.pipeline_bubble_fraction("pipedream", 4, 8)
    with pytest.raises(ValueError, match="m >= 1"):
        cm.pipeline_bubble_fraction("gpipe", 4, 0)
    with pytest.raises(ValueError, match="interleaved"):
        cm.pipeline_bubble_ratio("gpipe", 4, 8, v=2)
    with pytest.raises(ValueError, match="t_w"):
        cm.zb_h1_idle_time(4, 1.0, 1.0, 3.0)
    with pytest.raises(ValueError, match="all_reduce"):
        cm.collective_time("allreduce", 1, 2, 1.0, 1.0)


def test_ring_crossover_is_where_latency_equals_bandwidth_term():
    n, alpha, beta = 8, 20e-6, 1 / 10e9
    S = cm.ring_latency_bandwidth_crossover(n, alpha, beta)
    latency = cm.allreduce_time(0, n, alpha, beta)
    assert cm.allreduce_time(S, n, alpha, beta) == pytest.approx(2 * latency)


# --- data parallelism (ch01) ---------------------------------------------------------------------

def test_bucket_assignment_worked_examples():
    # caps: first 4 bytes, then 8; a bucket closes before the parameter that would overflow it
    assert cm.bucket_assignment([4, 4, 4, 4], 8, 4) == [[0], [1, 2], [3]]
    assert cm.bucket_sizes([4, 4, 4, 4], 8, 4) == [4, 8, 4]
    # a parameter bigger than the cap gets a bucket of its own, wherever it falls
    assert cm.bucket_assignment([2, 100, 3, 3, 100], 8) == [[0], [1], [2, 3], [4]]
    assert cm.bucket_sizes([2, 100, 3, 3, 100], 8) == [2, 100, 6, 100]
    # the first cap defaults to the cap; a tiny cap: one parameter per bucket; a huge one: one bucket
    assert cm.bucket_assignment([1, 1, 1], 2) == [[0, 1], [2]]
    assert cm.bucket_assignment([5, 6, 7], 1) == [[0], [1], [2]]
    assert cm.bucket_assignment([5, 6, 7], 10**9, 10**9) == [[0, 1, 2]]
    # a change of key (dtype) closes the bucket even with room left
    assert cm.bucket_assignment([4, 4, 2, 2], 100, keys=["f32", "f32", "bf16", "f32"]) == [[0, 1], [2], [3]]
    assert cm.bucket_assignment([], 8) == []


def test_bucket_assignment_is_greedy_and_respects_caps():
    rng = np.random.default_rng(1)
    for _ in range(50):
        sizes = [int(s) for s in rng.integers(1, 40, size=rng.integers(1, 30))]
        cap, first = int(rng.integers(1, 60)), int(rng.integers(1, 60))
        buckets = cm.bucket_assignment(sizes, cap, first)
        assert [i for b in buckets for i in b] == list(range(len(sizes)))  # order kept, nothing lost
        for j, b in enumerate(buckets):
            limit = first if j == 0 else cap
            total = sum(sizes[i] for i in b)
            assert len(b) == 1 or total <= limit
            if j + 1 < len(buckets):  # closed only because the next parameter did not fit
                assert total + sizes[buckets[j + 1][0]] > limit


def test_bucket_assignment_errors():
    with pytest.raises(ValueError, match="cap must be > 0"):
        cm.bucket_assignment([1], 0)
    with pytest.raises(ValueError, match="first bucket cap"):
        cm.bucket_assignment([1], 8, 0)
    with pytest.raises(ValueError, match="one key per parameter"):
        cm.bucket_assignment([1, 2], 8, keys=["a"])


def test_ddp_step_time_hand_worked():
    # alpha-beta with n = 2: allreduce_time(S) = 2*alpha + S*beta; take alpha = 0.5, beta = 1 per byte
    n, alpha, beta = 2, 0.5, 1.0
    ar = lambda S: 2 * alpha + S * beta  # independent of cm.allreduce_time
    tf, tb = 1.0, 4.0
    # two equal buckets: ready at 1 + 4*1/2 = 3 and at 5; each all-reduce takes 1 + 1 = 2 s
    sched = cm.ddp_allreduce_schedule(tf, tb, [1, 1], n, alpha, beta)
    assert sched == [(3.0, 3.0, 5.0), (5.0, 5.0, 7.0)]
    assert cm.ddp_step_time(tf, tb, [1, 1], n, alpha, beta) == 7.0
    assert cm.ddp_step_time(tf, tb, [1, 1], n, alpha, beta, overlap=False) == tf + tb + 2 * ar(1)
    # communication longer than backward: the second bucket queues behind the first
    sched = cm.ddp_allreduce_schedule(tf, tb, [3, 1], n, alpha, beta)  # ready at 4 and 5
    assert sched == [(4.0, 4.0, 8.0), (5.0, 8.0, 10.0)]
    assert cm.ddp_step_time(tf, tb, [3, 1], n, alpha, beta) == 10.0
    # communication that hides entirely: tiny buckets, free links -> forward + backward
    assert cm.ddp_step_time(tf, tb, [1, 1, 1], n, 0.0, 0.0) == tf + tb
    # one rank: nothing to send
    assert cm.ddp_step_time(tf, tb, [100], 1, alpha, beta) == tf + tb


def test_ddp_step_time_overlap_bounds():
    # overlapped is never slower than serial, never faster than compute or than the last bucket's
    # all-reduce started at the end of backward
    n, alpha, beta = 8, 20e-6, 1 / 10e9
    rng = np.random.default_rng(2)
    for _ in range(20):
        buckets = [float(b) for b in rng.integers(1, 50_000_000, size=rng.integers(1, 12))]
        tf, tb = float(rng.uniform(0.01, 0.1)), float(rng.uniform(0.02, 0.2))
        t_overlap = cm.ddp_step_time(tf, tb, buckets, n, alpha, beta)
        t_serial = cm.ddp_step_time(tf, tb, buckets, n, alpha, beta, overlap=False)
        assert t_overlap <= t_serial + 1e-12
        assert t_overlap >= tf + tb + cm.allreduce_time(buckets[-1], n, alpha, beta) - 1e-12
        assert t_overlap >= tf + sum(cm.allreduce_time(b, n, alpha, beta) for b in buckets) - 1e-12


def test_tensor_parallel_bytes_per_layer_is_four_ring_allreduces():
    b, s, h = 2, 16, 32
    for t in (1, 2, 4, 8):
        want = 8 * b * s * h * (t - 1) / t * 2  # Narayanan et al. 2021 §3.2, fp16 elements
        assert cm.tensor_parallel_bytes_per_layer(b, s, h, t) == pytest.approx(want)
    assert cm.tensor_parallel_allreduces_per_layer() == {"forward": 2, "backward": 2}
    with pytest.raises(ValueError, match="t >= 1"):
        cm.tensor_parallel_bytes_per_layer(b, s, h, 0)


def test_tensor_parallel_comm_time_is_four_ring_allreduces_on_the_critical_path():
    b, s, h, alpha, beta = 1, 2048, 12288, 5e-6, 1 / 100e9  # a GPT-3 layer, fp16; beta in s/byte
    n = b * s * h * 2
    for t in (2, 4, 8):
        ring = 2 * (t - 1) * alpha + 2 * (t - 1) / t * n * beta  # Patarasuk & Yuan 2009
        assert cm.tensor_parallel_comm_time_per_layer(b, s, h, t, alpha, beta) == pytest.approx(4 * ring)
    assert cm.tensor_parallel_comm_time_per_layer(b, s, h, 1, alpha, beta) == 0.0


@pytest.mark.parametrize("tied,bias", [(True, True), (False, False)])
def test_tensor_parallel_params_per_rank_counts_the_gpt_shards(tied, bias):
    cfg = GPTConfig.tiny(vocab_size=64, block_size=16, n_layer=3, n_head=4, n_embd=32, tie_embeddings=tied,
                         bias=bias)
    model = GPT(cfg)
    assert cm.tensor_parallel_params_per_rank(cfg, 1) == sum(q.numel() for q in model.parameters())
    # by hand from the model: 2-D weights of attn/mlp and the embedding tables split, the rest replicated
    for t in (2, 4):
        want = 0
        for name, q in model.named_parameters():
            split = ("c_attn" in name or "c_fc" in name or name.endswith("c_proj.weight")
                     or name in ("wte.weight", "lm_head.weight"))
            want += q.numel() // t if split else q.numel()
        assert cm.tensor_parallel_params_per_rank(cfg, t) == want
    with pytest.raises(ValueError, match="n_head 4 is not divisible by tp=3"):
        cm.tensor_parallel_params_per_rank(cfg, 3)


def test_vocab_parallel_logits_bytes():
    got = cm.vocab_parallel_logits_bytes(8, 1024, 50304, 4)
    assert got["gathered"] == 8 * 1024 * 50304 * 4
    assert got["vocab_parallel"] * 4 == got["gathered"]
    assert got["saved"] == got["gathered"] - got["vocab_parallel"]
    with pytest.raises(ValueError, match="vocab_size 50257 is not divisible by tp=4"):
        cm.vocab_parallel_logits_bytes(8, 1024, 50257, 4)


@pytest.mark.parametrize("n", [2, 3, 4, 8, 16, 64])
def test_allreduce_crossover_is_where_the_algorithms_take_equal_time(n):
    alpha, beta = 5e-6, 1 / 50e9
    ring = lambda S: cm.allreduce_time(S, n, alpha, beta)
    for algo, time in (("recursive_doubling", cm.recursive_doubling_allreduce_time),
                       ("tree", cm.tree_allreduce_time), ("naive", cm.naive_allreduce_time)):
        S = cm.allreduce_crossover_bytes(n, alpha, beta, algo)
        if S == float("inf"):  # faster at every size
            assert all(time(x, n, alpha, beta) < ring(x) for x in (0, 1e3, 1e9)), (n, algo)
        elif S == 0.0:  # never faster
            assert all(time(x, n, alpha, beta) >= ring(x) for x in (0, 1e3, 1e9)), (n, algo)
        else:
            assert time(S, n, alpha, beta) == pytest.approx(ring(S), rel=1e-9), (n, algo)
            assert time(0.5 * S, n, alpha, beta) < ring(0.5 * S) and time(2 * S, n, alpha, beta) > ring(2 * S)
    # it is not the ring's own latency = bandwidth point n*alpha/beta
    assert cm.allreduce_crossover_bytes(8, alpha, beta) == pytest.approx(8.8 * alpha / beta)
    with pytest.raises(ValueError, match="recursive_doubling"):
        cm.allreduce_crossover_bytes(4, alpha, beta, "ring")
