"""Chapter 10: the routers and the MoE layer in one process.

Every expected value is computed here another way: routing by plain Python loops over tokens (the
priority rule written out: token order for top-1, first choices before second choices for top-2,
each expert's best tokens for expert choice), the load-balancing loss by summing over a hand-made
router output, capacity by exact integer arithmetic, the layer's output token by token, and the
expected number of dropped tokens against ``costmodel.expected_dropped_tokens`` with a stated
sampling error.

Tolerances (derived in tests/_support.py). The routers' probabilities are computed here exactly as
the routers do (``(x @ w_gate).softmax(-1)``), so whatever is gathered from them -- Switch's and
expert choice's weights, the aux loss -- is equal bitwise. Top-2's renormalised weights g / (g_1 + g_2)
are computed here in float64 from the same float32 probabilities: two float32 roundings apart
(γ_3). Shazeer's softmax(KeepTopK) against the router's renormalised top-k probabilities: two
softmaxes of E and k terms (γ_{E+6} each, and u per unit of the logits' range R for x - max) and the
renormalisation (γ_2): ``3 (γ_{E+6} + u R) + γ_2`` relative. The load-balancing loss in float32
against the formula in float64: T + N + 7 roundings of positive terms (the inputs' own, the means,
the products, the sum, α·N), γ_{T+N+7} relative; its gradient α N f_i / T, γ_6. Combining the inputs
with weights summing to 1: γ_4 of |x|. The layer (router, experts, combine; forward and backward):
float64, the dispatch and dense paths and a token-by-token loop adding the same terms in other
orders: ``model_bound(n=18, depth=10)`` (18 tokens in a weight gradient, 16 hidden; logits, softmax,
two expert layers and the combine forward, as many back), ~1e-11; a wrong row or weight moves an
output by O(0.1).
"""
import math

import pytest
import torch
import torch.nn.functional as F

from minitorch_dist import costmodel
from minitorch_dist.runtime.env import single_thread
from minitorch_dist.sparsity.moe import (
    ExpertChoiceRouter,
    MoELayer,
    NoisyTopKRouter,
    SwitchRouter,
    Top2Router,
    capacity,
    combine,
    dispatch,
    expert_choice_routing,
    load_balancing_loss,
    make_router,
    top_k_routing,
)

from _support import close, float64, gamma, model_bound, roundoff

pytestmark = pytest.mark.ch10

H, E = 8, 4
LAYER_N, LAYER_DEPTH = 18, 10  # the MoE layer's longest reduction (tokens) and its chain (see docstring)


def _g(k):
    return gamma(k, torch.float32)


def _x(T, seed=0):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed))


# --- the formulas --------------------------------------------------------------------------------


@pytest.mark.parametrize("T,E_,k,cf",
                         [(12, 4, 1, 1.0), (10, 4, 1, 1.25), (10, 1, 1, 1.1), (7, 3, 2, 0.5),
                          (16, 8, 2, 2.0)])
def test_capacity_is_ceil_of_cf_T_k_over_E(T, E_, k, cf):
    num, den = (int(round(cf * 100)) * T * k), 100 * E_  # cf as an exact fraction
    assert capacity(T, E_, k, cf) == -(-num // den) == costmodel.moe_capacity(T, E_, k, cf)


def test_load_balancing_loss_equals_formula_on_hand_made_router_outputs():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.8, 0.1], [0.6, 0.3, 0.1], [0.2, 0.2, 0.6]],
                         requires_grad=True)
    top1 = torch.tensor([0, 1, 0, 2])
    alpha, N, T = 0.01, 3, 4
    f = [2 / 4, 1 / 4, 1 / 4]  # counted by hand from top1
    P = [(0.7 + 0.1 + 0.6 + 0.2) / 4, (0.2 + 0.8 + 0.3 + 0.2) / 4, (0.1 + 0.1 + 0.1 + 0.6) / 4]
    want = alpha * N * sum(fi * Pi for fi, Pi in zip(f, P))
    loss = load_balancing_loss(probs, top1, N, alpha)
    assert loss.item() == pytest.approx(want, rel=_g(T + N + 7))
    loss.backward()  # d/dp[t, i] = α·N·f_i / T: the gradient flows through P only
    torch.testing.assert_close(probs.grad, torch.tensor([[alpha * N * fi / T for fi in f]] * T), rtol=_g(6),
                               atol=0)
    # A mask of several assignments per token: f_i = share of all assignments.
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 0], [0, 0, 1]])
    f2 = [2 / 6, 2 / 6, 2 / 6]
    want2 = alpha * N * sum(fi * Pi for fi, Pi in zip(f2, P))
    got2 = load_balancing_loss(probs.detach(), mask, N, alpha).item()
    assert got2 == pytest.approx(want2, rel=_g(T + N + 7))


def test_load_balancing_loss_is_alpha_when_balanced_and_larger_when_collapsed():
    T, N = 8, 4
    uniform = torch.full((T, N), 1 / N)
    balanced = torch.arange(T) % N
    assert load_balancing_loss(uniform, balanced, N, 0.1).item() == pytest.approx(0.1, rel=_g(T + N + 7))
    collapsed_p = F.one_hot(torch.zeros(T, dtype=torch.long), N).float()
    collapsed = torch.zeros(T, dtype=torch.long)
    got = load_balancing_loss(collapsed_p, collapsed, N, 0.1).item()
    assert got == pytest.approx(0.1 * N, rel=_g(T + N + 7))


def test_load_balancing_loss_bad_input():
    p = torch.full((4, 3), 1 / 3)
    with pytest.raises(ValueError, match="n_experts=4"):
        load_balancing_loss(p, torch.zeros(4, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="expert ids"):
        load_balancing_loss(p, torch.tensor([0, 1, 2, 3]), 3)
    with pytest.raises(ValueError, match="3 entries"):
        load_balancing_loss(p, torch.tensor([0, 1, 2]), 3)
    with pytest.raises(ValueError, match="routes no token"):
        load_balancing_loss(p, torch.zeros(4, 3), 3)


# --- routing by loops: the independent references ----------------------------------------------


def _token_choice_by_loops(probs, k, C, normalize):
    """Assignments (token, expert, weight) kept, by going through choices then tokens in order."""
    T, E_ = probs.shape
    load, kept, tried = [0] * E_, [], 0
    ranked = [sorted(range(E_), key=lambda e: -probs[t, e].item())[:k] for t in range(T)]
    for choice in range(k):
        for t in range(T):
            e = ranked[t][choice]
            tried += 1
            if C is None or load[e] < C:
                load[e] += 1
                g = probs[t, e].item()
                if normalize:
                    g /= sum(probs[t, j].item() for j in ranked[t])
                kept.append((e, len(kept), t, g))  # position in priority order breaks ties in the sort
    kept.sort()
    return ([t for _, _, t, _ in kept], [e for e, _, _, _ in kept], [g for _, _, _, g in kept],
            tried - len(kept), load)


@pytest.mark.parametrize("cf", [None, 0.5, 1.0, 2.0])
def test_switch_routing_matches_the_token_order_rule(cf):
    router = SwitchRouter(H, E, capacity_factor=cf, aux_alpha=0.01)
    x = _x(24)
    r = router(x)
    probs = (x @ router.w_gate).softmax(-1)
    C = None if cf is None else math.ceil(cf * 24 / E)
    tokens, experts, weights, dropped, load = _token_choice_by_loops(probs, 1, C, normalize=False)
    assert r.tokens.tolist() == tokens and r.experts.tolist() == experts
    assert torch.equal(r.weights, torch.tensor(weights))  # the same probabilities, gathered
    assert r.capacity == C and r.dropped == dropped and r.counts.tolist() == load
    # dropped = what capacity implies from the pre-capacity loads, Σ_i max(0, N_i - C)
    top1_load = torch.bincount(probs.argmax(-1), minlength=E).tolist()
    assert r.dropped == (0 if C is None else sum(max(0, n - C) for n in top1_load))
    assert r.dropped == (0 if C is None else costmodel.dropped_tokens(top1_load, C))
    assert torch.equal(r.aux_loss, load_balancing_loss(probs, probs.argmax(-1), E, 0.01))  # same inputs


@pytest.mark.parametrize("cf", [None, 0.5, 1.0])
def test_top2_routing_serves_first_choices_before_second_choices(cf):
    router = Top2Router(H, E, capacity_factor=cf)
    x = _x(20, seed=1)
    r = router(x)
    probs = (x @ router.w_gate).softmax(-1)
    C = None if cf is None else math.ceil(cf * 20 * 2 / E)
    tokens, experts, weights, dropped, load = _token_choice_by_loops(probs, 2, C, normalize=True)
    assert r.tokens.tolist() == tokens and r.experts.tolist() == experts
    torch.testing.assert_close(r.weights, torch.tensor(weights), rtol=_g(3), atol=0)  # renormalised here
    assert r.dropped == dropped and r.counts.tolist() == load
    if cf == 0.5:
        assert dropped > 0  # the case exercises the rule


def _two_softmaxes(logits):
    """Relative bound between softmax(KeepTopK(logits)) and the renormalised top-k of softmax(logits),
    both in float32 (module docstring)."""
    spread = (logits.max() - logits.min()).item()
    return 3 * (_g(logits.shape[-1] + 6) + roundoff(torch.float32) * spread) + _g(2)


def test_noisy_top_k_is_shazeer_softmax_of_keep_top_k_and_noise_only_in_training():
    gen = torch.Generator().manual_seed(3)
    router = NoisyTopKRouter(H, E, k=2, generator=gen)
    with torch.no_grad():
        router.w_noise.normal_(0, 1.0)
    x = _x(16, seed=2)
    router.eval()
    r = router(x)
    H_ = x @ router.w_gate
    keep = H_.topk(2, -1).indices
    G = torch.full_like(H_, -math.inf).scatter(1, keep, H_.gather(1, keep)).softmax(-1)  # eq. (3), (5)
    torch.testing.assert_close(r.combine_weights(), G.detach(), rtol=_two_softmaxes(H_), atol=0)
    assert r.capacity is None and r.dropped == 0 and r.counts.sum() == 32
    assert torch.equal(router(x).combine_weights(), r.combine_weights())  # eval: deterministic
    router.train()
    gen.manual_seed(5)
    noisy = router(x)
    gen.manual_seed(5)
    noise = torch.randn(H_.shape, generator=gen)
    Hn = H_ + noise * F.softplus(x @ router.w_noise)  # eq. (4)
    keep = Hn.topk(2, -1).indices
    Gn = torch.full_like(Hn, -math.inf).scatter(1, keep, Hn.gather(1, keep)).softmax(-1)
    torch.testing.assert_close(noisy.combine_weights(), Gn.detach(), rtol=_two_softmaxes(Hn), atol=0)
    assert not torch.equal(noisy.combine_weights(), r.combine_weights())
    noisy.weights.sum().backward()
    assert router.w_noise.grad.abs().sum() > 0  # the noise scale is learned


@pytest.mark.parametrize("T,cf", [(16, 1.0), (16, 2.0), (10, 0.5), (6, 8.0)])
def test_expert_choice_gives_every_expert_exactly_its_capacity(T, cf):
    router = ExpertChoiceRouter(H, E, capacity_factor=cf)
    x = _x(T, seed=4)
    r = router(x)
    C = min(T, math.ceil(cf * T / E))
    assert r.capacity == C and r.counts.tolist() == [C] * E
    assert torch.bincount(r.experts, minlength=E).tolist() == [C] * E
    S = (x @ router.w_gate).softmax(-1)
    for e in range(E):  # each expert's tokens are its C best by S[:, e], with weight S[t, e]
        mine = r.tokens[r.experts == e].tolist()
        assert len(set(mine)) == C
        best = sorted(range(T), key=lambda t: -S[t, e].item())[:C]
        assert sorted(mine) == sorted(best)
        assert torch.equal(r.weights[r.experts == e], S[mine, e].detach())  # the same scores, gathered
    assert r.dropped == T - len(set(r.tokens.tolist()))
    assert r.aux_loss.item() == 0.0


def test_random_second_expert_is_seeded_and_not_counted_as_dropped():
    gen = torch.Generator()
    router = Top2Router(H, E, capacity_factor=None, random_second=True, generator=gen)
    x = _x(200, seed=5)
    gen.manual_seed(0)
    a = router(x)
    gen.manual_seed(0)
    assert torch.equal(a.tokens, router(x).tokens)
    g = (x @ router.w_gate).softmax(-1).topk(2, -1).values
    expected_seconds = (2 * g[:, 1] / g.sum(-1)).clamp(max=1).sum().item()
    seconds = len(a.tokens) - 200
    assert a.dropped == 0 and abs(seconds - expected_seconds) < 4 * math.sqrt(200 / 4)  # binomial spread
    router.eval()
    assert len(router(x).tokens) == 400  # no random routing at eval


def test_dropped_tokens_match_the_expected_number_under_random_routing():
    """Uniform random routing (i.i.d. Gaussian logits): the mean number of dropped tokens over many
    batches equals costmodel.expected_dropped_tokens within 4 standard errors."""
    T, E_, batches = 32, 8, 600
    gen = torch.Generator().manual_seed(0)
    for cf in (1.0, 1.5):
        C = capacity(T, E_, 1, cf)
        with single_thread():  # tiny ops: threads only add overhead
            drops = torch.tensor([float(top_k_routing(torch.randn(T, E_, generator=gen), 1, C).dropped)
                                  for _ in range(batches)])
        want = costmodel.expected_dropped_tokens(T, E_, 1, cf)
        assert abs(drops.mean().item() - want) < 4 * drops.std().item() / math.sqrt(batches) + 1e-9


# --- the layer -----------------------------------------------------------------------------------


ROUTER_CASES = {
    "switch": lambda: SwitchRouter(H, E, capacity_factor=0.75),
    "top2": lambda: Top2Router(H, E, capacity_factor=0.75),
    "topk": lambda: NoisyTopKRouter(H, E, k=3, noisy=False),
    "expert_choice": lambda: ExpertChoiceRouter(H, E, capacity_factor=0.75),  # 4 x 4 picks < 18 tokens
}


def _layer_bound(values):
    return model_bound(n=LAYER_N, depth=LAYER_DEPTH, scale=max(1.0, values.abs().max().item()))


@pytest.mark.parametrize("name", sorted(ROUTER_CASES))
def test_dispatch_path_equals_dense_reference_and_a_token_by_token_loop(name):
    with float64():
        _dispatch_dense_and_loop(name)


def _dispatch_dense_and_loop(name):
    torch.manual_seed(0)
    layer = MoELayer(H, 16, E, ROUTER_CASES[name]())
    x = torch.randn(2, 9, H)
    G = torch.randn(2, 9, H)
    grads, outs = {}, {}
    for path in ("dispatch", "dense"):
        layer.zero_grad()
        xp = x.clone().requires_grad_(True)
        y = layer(xp, path=path)
        ((y * G).sum() + layer.aux_loss).backward()
        outs[path] = y.detach()
        grads[path] = [xp.grad] + [p.grad.clone() for p in layer.parameters() if p.grad is not None]
    assert outs["dispatch"].dtype == torch.float64
    close(outs["dispatch"], outs["dense"], _layer_bound(outs["dense"]), "dispatch vs dense")
    for a, b in zip(grads["dispatch"], grads["dense"]):
        close(a, b, _layer_bound(b), "gradient, dispatch vs dense")
    # independently: y[t] = Σ over t's assignments of weight · expert(x[t]); a dropped token gives 0
    r, flat = layer.last_routing, x.reshape(-1, H)
    want = torch.zeros_like(flat)
    for t, e, w in zip(r.tokens.tolist(), r.experts.tolist(), r.weights.tolist()):
        want[t] += w * layer.experts[e](flat[t]).detach()
    close(outs["dispatch"].reshape(-1, H), want, _layer_bound(want), "dispatch vs the loop")
    unrouted = sorted(set(range(18)) - set(r.tokens.tolist()))
    assert len(grads["dispatch"]) == len(grads["dense"]) >= 1 + 4 * E + 1  # x, every expert, the router
    # cf 0.75: switch and expert choice have 4 x 4 slots for 18 tokens; top-2 drops second choices
    assert bool(unrouted) == (name in ("switch", "expert_choice"))
    assert (r.dropped > 0) == (name in ("switch", "top2", "expert_choice"))
    assert torch.all(outs["dispatch"].reshape(-1, H)[unrouted] == 0)


def test_dispatch_and_combine_are_inverse_layouts():
    router = Top2Router(H, E, capacity_factor=None)
    x = _x(10, seed=6)
    r = router(x)
    packed, counts = dispatch(x, r)
    assert counts == r.counts.tolist() and packed.shape == (20, H)
    assert torch.equal(packed, x[r.tokens])
    # combining the inputs themselves with weights that sum to 1 per token gives back x (the weights'
    # renormalisation and the weighted sum of two: γ_4 of |x|)
    torch.testing.assert_close(combine(packed, r, 10), x.detach(), rtol=_g(4), atol=0)


def test_moe_layer_bad_input():
    with pytest.raises(ValueError, match=r"build the router with \(8, 4\)"):
        MoELayer(H, 16, E, SwitchRouter(H, 3))
    with pytest.raises(ValueError, match="unknown router"):
        MoELayer(H, 16, E, "soft")
    layer = MoELayer(H, 16, E, "switch")
    with pytest.raises(ValueError, match="h=8"):
        layer(torch.randn(3, 5))
    with pytest.raises(ValueError, match="path must be"):
        layer(torch.randn(3, H), path="sparse")
    with pytest.raises(ValueError, match="k = 5 experts per token exceeds n_experts = 4"):
        NoisyTopKRouter(H, E, k=5)
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        SwitchRouter(H, E, capacity_factor=0)
    with pytest.raises(ValueError, match="capacity_factor must be a number > 0"):
        ExpertChoiceRouter(H, E, capacity_factor=None)
    with pytest.raises(ValueError, match=r"must be in \[1, tokens = 3\]"):
        expert_choice_routing(torch.randn(3, E), 4)
    with pytest.raises(ValueError, match=r"logits must be \[tokens, n_experts\]"):
        top_k_routing(torch.randn(2, 3, E), 1)
    assert type(make_router("top2", H, E)) is Top2Router
    assert layer.aux_loss.item() == 0.0  # before any forward
