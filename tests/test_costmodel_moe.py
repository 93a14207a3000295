"""Chapter 10's formulas (costmodel.moe), each checked against an independent computation:
expert capacity against Switch Transformers' Figure 3 and the definition "smallest C with
C·E >= cf·T·k"; dropped tokens against routing simulated token by token; the expected drops
against exhaustive enumeration of every routing of a small batch (and a Monte Carlo at a larger
one); parameters against torch modules; FLOPs against torch's FlopCounterMode on a real forward;
all-to-all bytes against element-by-element counting and, on 2 and 4 ranks, the comm meter.

Tolerances: counts and bytes are integers, compared exactly. The exhaustive expectation is a float64
sum of at most a few thousand probability-weighted terms (rounding ~1e-13 of it): rel 1e-9. The
Monte Carlo mean is held to 4 of its standard errors, computed from the draws. Times are a few float64
operations (pytest.approx's default rel 1e-6).
"""
import itertools
import math
import random
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from minitorch_dist import costmodel as cm
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.launch import launch

pytestmark = pytest.mark.ch10


# --- capacity ----------------------------------------------------------------------------------------

def test_capacity_reproduces_switch_figure_3():
    # Switch Transformers Fig. 3: 6 tokens, 3 experts; capacity factor 1.0 -> 2, 1.5 -> 3
    assert cm.moe_capacity(6, 3, 1, 1.0) == 2
    assert cm.moe_capacity(6, 3, 1, 1.5) == 3
    # GShard Algorithm 1: top-2 with capacity 2N/E
    assert cm.moe_capacity(64, 8, 2, 1.0) == 2 * 64 // 8


@pytest.mark.parametrize("cf", ["0.5", "1", "1.1", "1.25", "1.3", "2", "0.7"])
def test_capacity_is_the_smallest_c_that_holds_cf_times_the_even_share(cf):
    for T, E, k in itertools.product([1, 7, 10, 64, 100, 257], [1, 2, 3, 8, 16], [1, 2]):
        if k > E:
            continue
        need = Fraction(cf) * T * k  # C·E >= cf·T·k, in exact arithmetic
        c = next(c for c in itertools.count() if c * E >= need)
        assert cm.moe_capacity(T, E, k, float(cf)) == c, (T, E, k, cf)


def test_capacity_is_exact_where_floating_point_is_not():
    assert math.ceil(1.1 * 50) == 56  # the trap: 1.1 * 50 = 55.00000000000001 in binary
    assert cm.moe_capacity(50, 1, 1, 1.1) == 55


def test_expert_choice_capacity_is_k_equals_n_c_over_e_capped_at_n():
    assert cm.expert_choice_capacity(16, 4, 1.0) == 4
    assert cm.expert_choice_capacity(16, 4, 2.0) == 8
    assert cm.expert_choice_capacity(16, 4, 8.0) == 16  # 32 > 16 tokens: an expert takes them all


def test_capacity_rejects_bad_input():
    with pytest.raises(ValueError, match="capacity_factor"):
        cm.moe_capacity(8, 4, 1, 0.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        cm.moe_capacity(8, 4, 1, float("nan"))
    with pytest.raises(ValueError, match="exceeds n_experts"):
        cm.moe_capacity(8, 4, 5)
    with pytest.raises(ValueError, match="n_experts"):
        cm.moe_capacity(8, 0)
    with pytest.raises(ValueError, match="tokens"):
        cm.moe_capacity(-1, 4)


# --- dropped tokens ----------------------------------------------------------------------------------

def _simulate_drops(choices, E, C):
    """Route token by token, first choices of every token before second choices (GShard's
    priority); an expert that is full drops the assignment."""
    fill, dropped = [0] * E, 0
    for rank_of_choice in range(len(choices[0])):
        for token in choices:
            e = token[rank_of_choice]
            if fill[e] < C:
                fill[e] += 1
            else:
                dropped += 1
    return dropped


def test_dropped_tokens_equals_simulated_routing():
    rng = random.Random(0)
    for _ in range(50):
        T, E, k = rng.randint(1, 40), rng.randint(2, 8), rng.randint(1, 2)
        C = rng.randint(0, T)
        choices = [rng.sample(range(E), k) for _ in range(T)]
        loads = [sum(e in c for c in choices) for e in range(E)]
        assert cm.dropped_tokens(loads, C) == _simulate_drops(choices, E, C)
    assert cm.dropped_tokens(torch.tensor([5, 0, 3]), 2) == 4  # tensors are accepted


def _exhaustive_expected_drops(T, E, k, cf, probs=None):
    """Average of the simulated drops over every routing of T tokens, weighted by its probability."""
    C = cm.moe_capacity(T, E, k, cf)
    subsets = list(itertools.combinations(range(E), k))
    if probs is None:
        weight = {s: 1 / len(subsets) for s in subsets}
    else:  # k = 1: a token picks expert e with probability probs[e]
        weight = {s: probs[s[0]] for s in subsets}
    total = 0.0
    for routing in itertools.product(subsets, repeat=T):
        w = math.prod(weight[s] for s in routing)
        total += w * _simulate_drops([list(s) for s in routing], E, C)
    return total


@pytest.mark.parametrize("T,E,k,cf", [(6, 3, 1, 1.0), (7, 3, 1, 1.25), (5, 4, 2, 1.0), (6, 4, 2, 0.75),
                                      (8, 2, 1, 1.0)])
def test_expected_drops_equals_exhaustive_enumeration(T, E, k, cf):
    want = _exhaustive_expected_drops(T, E, k, cf)
    assert cm.expected_dropped_tokens(T, E, k, cf) == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_expected_drops_under_a_skewed_router_equals_exhaustive_enumeration():
    probs = [0.5, 0.3, 0.15, 0.05]
    want = _exhaustive_expected_drops(6, 4, 1, 1.0, probs)
    got = cm.expected_dropped_tokens(6, 4, 1, 1.0, probs=probs)
    assert got == pytest.approx(want, rel=1e-9)
    assert got > cm.expected_dropped_tokens(6, 4, 1, 1.0), "an imbalanced router must drop more"


def test_expected_drops_matches_monte_carlo_at_a_realistic_size():
    T, E, k, cf, trials = 512, 8, 2, 1.0, 400
    C = cm.moe_capacity(T, E, k, cf)
    g = torch.Generator().manual_seed(0)
    # k distinct experts per token: the first k of a random permutation
    choices = torch.rand(trials, T, E, generator=g).argsort(-1)[..., :k]
    loads = F.one_hot(choices, E).sum(dim=(1, 2))  # [trials, E]
    drops = (loads - C).clamp(min=0).sum(-1).double()
    se = drops.std() / math.sqrt(trials)
    assert abs(drops.mean().item() - cm.expected_dropped_tokens(T, E, k, cf)) < 4 * se.item()


def test_expected_drops_vanish_with_a_large_capacity_factor_and_reject_bad_probs():
    assert cm.expected_dropped_tokens(64, 8, 1, 8.0) == 0.0  # C = T: nothing can overflow
    assert cm.expected_dropped_tokens(64, 8, 1, 1.0, probs=[1.0] + [0.0] * 7) == 64 - 8  # all on one expert
    with pytest.raises(ValueError, match="sum to 1"):
        cm.expected_dropped_tokens(8, 2, 1, 1.0, probs=[0.5, 0.6])
    with pytest.raises(ValueError, match="n_experts"):
        cm.expected_dropped_tokens(8, 2, 1, 1.0, probs=[1.0])
    with pytest.raises(ValueError, match="at most once"):
        cm.expected_dropped_tokens(8, 2, 2, 1.0, probs=[0.9, 0.1])


# --- parameters and FLOPs ---------------------------------------------------------------------------

class _Expert(nn.Module):
    def __init__(self, h, f, bias):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(h, f, bias=bias), nn.Linear(f, h, bias=bias)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


def _n(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("bias,noisy", [(True, False), (False, False), (True, True)])
def test_params_count_torch_modules(bias, noisy):
    h, f, E, k, L_moe, L_dense = 12, 40, 6, 2, 3, 2
    expert, router = _Expert(h, f, bias), nn.Linear(h, E, bias=False)
    router_n = (2 if noisy else 1) * _n(router)
    total = L_moe * (E * _n(expert) + router_n) + L_dense * _n(expert) + 1000
    active = L_moe * (k * _n(expert) + router_n) + L_dense * _n(expert) + 1000
    assert cm.expert_params(h, f, bias) == _n(expert)
    assert cm.moe_params(h, f, E, L_moe, L_dense, bias, noisy, shared_params=1000) == total
    assert cm.moe_params_per_token(h, f, E, L_moe, k, L_dense, bias, noisy, shared_params=1000) == active


def test_params_grow_with_experts_but_active_params_do_not():
    h, f = 64, 256
    totals = [cm.moe_params(h, f, E, 4) for E in (1, 2, 4, 8, 16)]
    actives = [cm.moe_params_per_token(h, f, E, 4, k=1) for E in (1, 2, 4, 8, 16)]
    assert all(b > a for a, b in zip(totals, totals[1:]))
    assert max(actives) - min(actives) == 4 * h * (16 - 1)  # only the router widens


def test_flops_per_token_equal_flop_counter_on_a_real_forward():
    from torch.utils.flop_counter import FlopCounterMode
    h, f, E, k, n_moe, n_dense = 16, 48, 8, 2, 2, 1
    experts = [_Expert(h, f, True) for _ in range(E)]
    w_gate = torch.randn(h, E)
    x = torch.randn(1, h)  # one token
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        for _ in range(n_dense):
            x = x + experts[0](x)
        for _ in range(n_moe):
            top = (x @ w_gate).topk(k).indices[0]
            x = x + sum(experts[int(e)](x) for e in top)
    assert cm.moe_flops_per_token(h, f, E, n_moe, k, n_dense) == fc.get_total_flops()
    # dense model: n_moe_layers = 0; and shared parameters cost 2 FLOPs each
    assert cm.moe_flops_per_token(h, f, E, 0, 1, 3, shared_params=10) == 3 * 4 * h * f + 20


# --- expert parallelism: all-to-all bytes ------------------------------------------------------------

def test_send_matrix_sums_each_ranks_experts():
    counts = [[1, 2, 3, 4, 5, 6], [0, 1, 0, 1, 0, 1], [7, 0, 0, 0, 0, 2]]
    S = cm.expert_parallel_send_matrix(counts, 3)
    for i in range(3):
        for j in range(3):
            assert S[i][j] == sum(counts[i][e] for e in range(6) if e // 2 == j)
    with pytest.raises(ValueError, match="n_experts 6 is not divisible by 4 ranks"):
        cm.expert_parallel_send_matrix([[0] * 6] * 4, 4)


def test_all_to_all_bytes_count_every_row_that_leaves_a_rank():
    rng = random.Random(1)
    n, h, e = 4, 10, 2
    S = [[rng.randint(0, 9) for _ in range(n)] for _ in range(n)]
    # element by element: every row of a dispatch or combine message whose ends differ
    want = [0] * n
    for src, dst in itertools.product(range(n), repeat=2):
        if src != dst:
            want[src] += S[src][dst] * h * e   # dispatch: src's tokens to dst's experts
            want[dst] += S[src][dst] * h * e   # combine: dst returns the outputs
    assert cm.all_to_all_bytes_moe(S, h, bytes_per_element=e) == want
    assert cm.all_to_all_bytes_moe(S, h, bytes_per_element=e, backward=True) == [2 * w for w in want]
    selfish = cm.all_to_all_bytes_moe(S, h, bytes_per_element=e, include_self=True)
    assert selfish == [(sum(S[i]) + sum(row[i] for row in S)) * h * e for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_uniform_all_to_all_bytes_equal_an_even_send_matrix(n):
    T, k, h = 8 * n, 2, 6  # T·k divisible by n: every rank gets the same share
    even = [[T * k // n] * n for _ in range(n)]
    assert cm.all_to_all_bytes_moe(T, h, n, k) == pytest.approx(cm.all_to_all_bytes_moe(even, h)[0])
    assert cm.all_to_all_bytes_moe(T, h, n, k) == pytest.approx(2 * T * k * h * 4 * (n - 1) / n)
    alpha, beta = 1e-5, 1e-9
    S = T * k * h * 4
    assert cm.moe_all_to_all_time(T, h, n, alpha, beta, k) == pytest.approx(
        2 * ((n - 1) * alpha + (n - 1) / n * S * beta))


def test_all_to_all_bytes_reject_bad_input():
    with pytest.raises(ValueError, match="square"):
        cm.all_to_all_bytes_moe([[1, 2]], 4)
    with pytest.raises(ValueError, match="leave k at 1"):
        cm.all_to_all_bytes_moe([[1]], 4, k=2)
    with pytest.raises(ValueError, match="n .the expert-parallel degree"):
        cm.all_to_all_bytes_moe(16, 4)


def _dispatch_combine(E, T, h):
    """Each rank routes T tokens at random to E experts (uneven), exchanges per-expert counts,
    dispatches rows with uneven splits and sends them back, all under the comm meter."""
    import torch.distributed as dist
    r, n = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + r)
    experts = torch.randint(0, E, (T,), generator=g).sort().values  # sorted by expert: rank-major
    counts = torch.bincount(experts, minlength=E)
    x = torch.randn(T, h, generator=g)
    with comm.meter() as m:
        recv_counts = torch.empty_like(counts)
        comm.all_to_all(recv_counts, counts)
        in_splits = counts.view(n, E // n).sum(1).tolist()
        out_splits = recv_counts.view(n, E // n).sum(1).tolist()
        got = x.new_empty(sum(out_splits), h)
        comm.all_to_all(got, x, out_splits, in_splits)          # dispatch
        back = x.new_empty(T, h)
        comm.all_to_all(back, got, in_splits, out_splits)       # combine (identity experts)
    assert torch.equal(back, x)
    return {"counts": counts.tolist(), "bytes": m.bytes["all_to_all"]}


@pytest.mark.parametrize("n", [2, 4])
def test_all_to_all_bytes_equal_the_comm_meter(n):
    E, T, h = 2 * n, 24, 5
    out = launch(_dispatch_combine, n, E, T, h, timeout_s=120)
    S = cm.expert_parallel_send_matrix([o["counts"] for o in out], n)
    want = cm.all_to_all_bytes_moe(S, h, include_self=True)
    for r in range(n):
        assert out[r]["bytes"] == want[r] + cm.moe_counts_exchange_bytes(E, n, include_self=True), f"rank {r}"
