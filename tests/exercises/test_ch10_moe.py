"""Chapter 10 exercises, autograded: top-2 gating with batch-prioritised capacity, the load-balancing loss,
expert choice, auxiliary-loss-free balancing (biased selection, the bias update), expert-parallel
dispatch and combine with the experts dealt round-robin, the traffic and drops of an expert-parallel
step predicted and measured.

Runs the stubs in ``exercises/`` once you have filled them in (or in a student's copy of the
course), the worked solutions while the stubs are untouched; ``MTD_IMPL=exercises|solutions`` forces
one (``python -m minitorch_dist grade`` runs the stubs). Expected values
come from independent sources: routing written as plain Python loops over tokens (slots handed
out one by one, first choices before second, each round most confident token first, on batches
where that order differs from token order, from the order of the normalised gates and from that
of the second gates); the library's ``load_balancing_loss``, ``biased_choice``, ``bias_update`` and
``costmodel`` on seeded random inputs; the aux loss summed term by term from its
definition, on hand-made router outputs whose value is known in closed form (α for a uniform
router, α·N for a collapsed one) and its gradient α·N·f_i/T; each expert's top tokens found by
sorting; the MoE output combined token by token against the einsum over GShard's tensors.

The expert-parallel layer (exercise 5, experts dealt round-robin: rank r holds experts r, r + n, ...)
runs on 2 and 4 ranks and is compared with the library's single-process ``MoELayer`` run on each
rank's tokens alone: outputs, input gradients, each rank's
experts' gradients (which must hold every rank's tokens) and the router's gradient summed over ranks,
for four routings (Switch and top-2 with drops, expert choice, a skewed one with zero-row splits);
its all-to-alls must move the kept rows and no more. The forecast (exercise 6) is compared with the
binomial expectation summed term by term here and with the bytes the comm meter counts and the
drops the library's expert-parallel layer reports over many random batches on the same ranks; the
measurement (exercise 7) must equal, batch by batch and exactly, the same steps metered here (one
launch per world size serves all three).

Checks of bad input first make a valid call, so a stub fails them too.

Tolerances (derived in tests/_support.py). Routings, slots, counts and bytes are exact. The routing
functions take float64 logits: a normalised gate or an aux loss against its definition is a few
float64 operations (a softmax of E terms, a ratio: rel 1e-12 >> (2E + 10)·u); a softmax entry or a
renormalised score, ``reorder_bound`` of its sum's length; the MoE output through GShard's tensors
against the token-by-token layer a chain of the expert's matmul and the combine (at most E·C terms,
zeros included), ``model_bound(depth=2)``; the aux loss's gradient α·N·f/T a few roundings,
``reorder_bound(4)``. A float32 bias step is two roundings of |bias| + rate. The expert-parallel layer
runs in float64 against the single-process layer: its longest reduction is an expert's weight
gradient over every rank's tokens (EP_N = 4·TOK = 48 rows), and at most EP_DEPTH = 8 reductions
are chained (the router, its softmax, the expert's two matmuls, back through them, a weight
gradient's sum over tokens, the sum over ranks): ``model_bound``, ~1e-10 of the values, where a
row sent to the wrong expert or combined with the wrong weight is off by O(1); its all-to-alls move
float64 rows (``ELEM = 8`` bytes). The forecast's binomial sums are float64 formulas (rel 1e-9); its
match with the ranks is judged in standard errors of the sampled mean (5, + 1e-9 where every sample
agrees). The load-balancing run is judged on its own loads: over 2.5 times the mean load before
(collapsed), under 1.25 times after (balanced).
"""
import math
import sys

import cloudpickle
import pytest
import torch
import torch.nn.functional as F

from minitorch_dist import costmodel as cm
from minitorch_dist import launch
from minitorch_dist.runtime import comm
from minitorch_dist.sparsity.aux_free import bias_update, biased_choice
from minitorch_dist.sparsity.expert_parallel import ExpertParallelMoE
from minitorch_dist.sparsity.moe import ExpertChoiceRouter, MoELayer, SwitchRouter, Top2Router
from minitorch_dist.sparsity.routers import load_balancing_loss

from _support import case as _case
from _support import close, float64, gamma, model_bound, refusal, reorder_bound, run_cases

pytestmark = [pytest.mark.ch10, pytest.mark.timeout(120)]

# The rank function below is sent to the ranks by value, so spawned ranks need not import this file.
if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _logits(T, E, seed):
    return torch.randn(T, E, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --- 1. top2_gating_prioritized --------------------------------------------------------------------------

def _top2_by_loops(logits, cf):
    """Batch Prioritized top-2 routing token by token: {(t, e): (slot, normalised gate)} of kept
    assignments. Priority: the token's largest probability, the earlier token first on a tie."""
    T, E = logits.shape
    C = math.ceil(cf * 2 * T / E - 1e-9)
    p = [[math.exp(v) for v in row] for row in logits.tolist()]
    p = [[v / sum(row) for v in row] for row in p]
    choice = []
    for row in p:
        e1 = max(range(E), key=lambda e: (row[e], -e))
        e2 = max((e for e in range(E) if e != e1), key=lambda e: (row[e], -e))
        s = row[e1] + row[e2]
        choice.append(((e1, row[e1] / s), (e2, row[e2] / s)))
    order = sorted(range(T), key=lambda t: (-max(p[t]), t))
    fill, kept = [0] * E, {}
    for rank_of_choice in (0, 1):           # every first choice before any second choice
        for t in order:                     # each round most confident token first
            e, g = choice[t][rank_of_choice]
            if fill[e] < C:
                kept[(t, e)] = (fill[e], g)
                fill[e] += 1
    return kept, C


def _check_top2(ex, logits, cf):
    T, E = logits.shape
    combine, dispatch, dropped = ex.top2_gating_prioritized(logits, cf)
    kept, C = _top2_by_loops(logits, cf)
    assert C == cm.moe_capacity(T, E, 2, cf)
    assert combine.shape == dispatch.shape == (T, E, C) and dispatch.dtype == torch.bool
    assert combine.dtype == logits.dtype
    got = {(t, e): (c, combine[t, e, c].item()) for t, e, c in dispatch.nonzero().tolist()}
    assert set(got) == set(kept), "a different set of (token, expert) assignments was kept"
    for key, (slot, gate) in kept.items():
        assert got[key][0] == slot, f"assignment {key}: slot {got[key][0]}, want {slot}"
        assert got[key][1] == pytest.approx(gate, rel=1e-12)
    assert torch.equal(combine != 0, dispatch), "combine weights must sit exactly on the dispatched slots"
    assert dropped == 2 * T - len(kept)


@pytest.mark.parametrize("T,E,cf", [(16, 4, 1.0), (33, 8, 0.5), (10, 2, 1.25), (20, 5, 2.0)])
def test_top2_gating_prioritized_equals_token_by_token_routing(ex, T, E, cf):
    _check_top2(ex, _logits(T, E, seed=T + E), cf)


@pytest.mark.parametrize("seed", range(6))
def test_top2_gating_prioritized_on_random_batches_with_drops(ex, seed):
    # peaked logits (x3): confidences spread widely, so priority order is far from token order,
    # from the order of the normalised gates and from the order of the second gates
    g = torch.Generator().manual_seed(100 + seed)
    T, E = int(torch.randint(12, 40, (1,), generator=g)), int(torch.randint(3, 9, (1,), generator=g))
    _check_top2(ex, 3 * _logits(T, E, seed=200 + seed), 0.5 + 0.25 * (seed % 3))


def test_top2_gating_prioritized_serves_the_most_confident_token_first(ex):
    # all tokens want expert 0 first, C = 1: the most confident token (here the last) gets the slot
    logits = torch.tensor([[1.0, 0.5, 0.0, -9.0],
                           [2.0, 0.5, 0.0, -9.0],
                           [3.0, 0.5, 0.0, -9.0],
                           [4.0, 0.5, 0.0, -9.0]], dtype=torch.float64)
    _, dispatch, _ = ex.top2_gating_prioritized(logits, 0.5)   # C = ceil(0.5·8/4) = 1
    assert dispatch[:, 0].any(-1).tolist() == [False, False, False, True], \
        "slots go by priority (the largest router probability), not by token order"
    # priority is the raw probability, not the renormalised gate: token 0 has p1 = 0.50 (gate 0.53),
    # token 1 has p1 = 0.45 (gate 0.69); both want expert 0 first, C = 1: token 0 is served
    logits = torch.tensor([[0.50, 0.45, 0.03, 0.02], [0.45, 0.20, 0.18, 0.17]], dtype=torch.float64).log()
    _, dispatch, _ = ex.top2_gating_prioritized(logits, 1.0)   # C = ceil(1·4/4) = 1
    assert dispatch[0, 0].any() and not dispatch[1, 0].any(), \
        "priority is the token's largest router probability, not its renormalised gate"
    _check_top2(ex, logits, 1.0)
    # second choices keep the tokens' priority order, not the order of their own gates
    logits = torch.tensor([[5.0, 4.9, -9.0],                   # very sure of 0, second 1 with a big gate
                           [-9.0, 1.0, 6.0],                   # surer: first 2, second 1, small gate
                           [0.0, -9.0, 6.5]], dtype=torch.float64)
    _check_top2(ex, logits, 0.5)


def test_top2_gating_prioritized_first_choices_have_priority(ex):
    # every token prefers expert 0, then expert 1, all equally sure: the earlier token first
    T, E = 8, 4
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]] * T)
    combine, dispatch, dropped = ex.top2_gating_prioritized(logits, 1.0)
    C = cm.moe_capacity(T, E, 2, 1.0)  # 4
    assert dispatch[:, 0].any(-1).tolist() == [True] * C + [False] * (T - C)
    assert dispatch[:, 1].any(-1).tolist() == [True] * C + [False] * (T - C)
    assert dropped == 2 * (T - C)
    # a token's second choice yields to a less confident token's first choice at the same expert
    logits = torch.tensor([[0.0, 6.0, 4.0, 0.0],    # token 0, most sure: second choice expert 2
                           [0.0, 0.0, 2.0, 1.0],    # token 1, least sure: first choice expert 2
                           [5.0, 0.0, 4.0, 0.0],    # token 2: first choice expert 0, second 2
                           [5.0, 4.0, 0.0, 0.0]])
    _, dispatch, _ = ex.top2_gating_prioritized(logits, 0.5)  # C = 1
    assert dispatch[1, 2].any() and not dispatch[0, 2].any() and not dispatch[2, 2].any()


def test_top2_gating_prioritized_drops_what_capacity_implies(ex):
    T, E, cf = 64, 8, 0.75
    logits = _logits(T, E, seed=5)
    _, dispatch, dropped = ex.top2_gating_prioritized(logits, cf)
    top2 = logits.topk(2, dim=-1).indices
    loads = torch.bincount(top2.flatten(), minlength=E)       # what each expert was asked for
    assert dropped == cm.dropped_tokens(loads, cm.moe_capacity(T, E, 2, cf))
    assert dispatch.sum(dim=(0, 2)).tolist() == loads.clamp(max=cm.moe_capacity(T, E, 2, cf)).tolist()
    assert int(dispatch.sum(dim=0).max()) <= 1, "a slot of an expert's buffer holds one token at most"


def test_top2_gating_prioritized_computes_the_moe_layer(ex):
    # the einsums over GShard's tensors equal the layer written token by token
    T, E, h, cf = 24, 6, 5, 1.0
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, h, generator=g, dtype=torch.float64)
    W = torch.randn(E, h, h, generator=g, dtype=torch.float64)
    logits = _logits(T, E, seed=8).requires_grad_(True)
    combine, dispatch, _ = ex.top2_gating_prioritized(logits, cf)
    expert_in = torch.einsum("tec,th->ech", dispatch.to(x.dtype), x)
    y = torch.einsum("tec,ech->th", combine, torch.tanh(torch.einsum("ech,ehk->eck", expert_in, W)))
    kept, _ = _top2_by_loops(logits.detach(), cf)
    want = torch.zeros(T, h, dtype=torch.float64)
    for (t, e), (_, gate) in kept.items():
        want[t] += gate * torch.tanh(x[t] @ W[e])
    C = combine.shape[-1]  # the expert's matmul (h terms), then the combine (E·C terms, zeros included)
    close(y.detach(), want, model_bound(n=max(h, E * C), depth=2, scale=max(1.0, want.abs().max().item())),
          "the einsums over GShard's tensors")
    y.sum().backward()  # the gates are differentiable: the router learns through them
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_top2_gating_prioritized_no_drops_with_enough_capacity(ex):
    T, E = 30, 4
    combine, dispatch, dropped = ex.top2_gating_prioritized(_logits(T, E, 9), capacity_factor=E / 2)
    assert dropped == 0 and dispatch.sum().item() == 2 * T
    # two gates g_i = p_i / (p_1 + p_2): a sum and a division each, then their sum
    close(combine.sum(dim=(1, 2)), torch.ones(T, dtype=torch.float64), gamma(5, torch.float64), "gates' sum")


def test_top2_gating_prioritized_rejects_bad_input(ex):
    ex.top2_gating_prioritized(_logits(8, 4, 0), 1.0)  # a valid call first
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        ex.top2_gating_prioritized(torch.randn(2, 8, 4), 1.0)
    with pytest.raises(ValueError, match="at least 2 experts"):
        ex.top2_gating_prioritized(torch.randn(8, 1), 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ex.top2_gating_prioritized(torch.randn(8, 4), 0.0)


# --- 2. switch_aux_loss --------------------------------------------------------------------------------

def _aux_by_definition(probs, index, alpha):
    T, N = probs.shape
    assignments = [e for row in index.reshape(T, -1).tolist() for e in row]
    total = 0.0
    for i in range(N):
        f_i = sum(1 for e in assignments if e == i) / len(assignments)
        P_i = sum(probs[t, i].item() for t in range(T)) / T
        total += f_i * P_i
    return alpha * N * total


def test_switch_aux_loss_on_hand_made_router_outputs(ex):
    T, N, alpha = 12, 4, 0.01
    uniform = torch.full((T, N), 1 / N)
    balanced = torch.arange(T) % N
    assert ex.switch_aux_loss(uniform, balanced, alpha).item() == pytest.approx(alpha)      # the minimum
    collapsed = F.one_hot(torch.zeros(T, dtype=torch.long), N).float()
    top1 = torch.zeros(T, dtype=torch.long)
    assert ex.switch_aux_loss(collapsed, top1, alpha).item() == pytest.approx(alpha * N)
    # half the tokens on expert 0 with probability 0.7, the rest spread: the formula by hand
    probs = torch.tensor([[0.7, 0.1, 0.1, 0.1]] * 6 + [[0.1, 0.3, 0.3, 0.3]] * 6)
    index = torch.tensor([0] * 6 + [1, 2, 3, 1, 2, 3])
    f, P = [0.5, 1 / 6, 1 / 6, 1 / 6], [0.4, 0.2, 0.2, 0.2]
    want = alpha * N * sum(a * b for a, b in zip(f, P))
    assert ex.switch_aux_loss(probs, index, alpha).item() == pytest.approx(want)


@pytest.mark.parametrize("k", [1, 2])
def test_switch_aux_loss_equals_the_definition_on_random_routers(ex, k):
    T, N, alpha = 40, 6, 0.03
    probs = torch.softmax(_logits(T, N, seed=10 + k), dim=-1)
    index = probs.topk(k, dim=-1).indices
    index = index[:, 0] if k == 1 else index
    loss = ex.switch_aux_loss(probs, index, alpha)
    assert loss.dim() == 0
    assert loss.item() == pytest.approx(_aux_by_definition(probs, index, alpha), rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_switch_aux_loss_equals_the_library_on_seeded_routers(ex, seed):
    g = torch.Generator().manual_seed(300 + seed)
    T, N = int(torch.randint(5, 50, (1,), generator=g)), int(torch.randint(2, 9, (1,), generator=g))
    k, alpha = 1 + seed % min(N, 3), float(torch.rand(1, generator=g)) * 0.1
    probs = torch.softmax(2 * _logits(T, N, seed=400 + seed), dim=-1)
    index = probs.topk(k, dim=-1).indices
    mask = F.one_hot(index, N).sum(1)              # [T, N] 0/1: the library's form for k experts
    want = load_balancing_loss(probs, mask, N, alpha)
    got = ex.switch_aux_loss(probs, index[:, 0] if k == 1 else index, alpha)
    # both: N products summed, a mean over T, a few scalings (rel 1e-12 >> (N + T + 5)·u)
    assert got.item() == pytest.approx(want.item(), rel=1e-12, abs=1e-300)


def test_switch_aux_loss_gradient_pushes_probability_off_busy_experts(ex):
    T, N, alpha = 20, 5, 0.1
    probs = torch.softmax(_logits(T, N, seed=12), dim=-1).requires_grad_(True)
    index = torch.tensor([0] * 10 + [1] * 5 + [2] * 5)  # experts 3 and 4 get nothing
    ex.switch_aux_loss(probs, index, alpha).backward()
    f = torch.bincount(index, minlength=N).double() / T
    # d loss / d p_i(x) = α·N·f_i / T: f is a count, the gradient flows through P only
    want = (alpha * N * f / T).expand(T, N)
    close(probs.grad, want, reorder_bound(4, want, torch.float64), "the aux loss's gradient")


def test_switch_aux_loss_rejects_bad_input(ex):
    probs, index = torch.full((4, 2), 0.5), torch.tensor([0, 1, 0, 1])
    ex.switch_aux_loss(probs, index, 0.01)  # a valid call first
    with pytest.raises(ValueError, match=r"\[T, N\]"):
        ex.switch_aux_loss(torch.full((4,), 0.5), index)
    with pytest.raises(ValueError, match="expert_index must be"):
        ex.switch_aux_loss(probs, torch.tensor([0, 1, 0]))
    with pytest.raises(ValueError, match="outside"):
        ex.switch_aux_loss(probs, torch.tensor([0, 1, 2, 1]))
    with pytest.raises(TypeError, match="integer"):
        ex.switch_aux_loss(probs, index.float())
    with pytest.raises(ValueError, match="alpha"):
        ex.switch_aux_loss(probs, index, -1.0)


# --- 3. experts_choose_tokens --------------------------------------------------------------------------

@pytest.mark.parametrize("T,E,cf", [(16, 4, 1.0), (30, 4, 2.0), (10, 3, 1.0), (7, 2, 5.0), (25, 6, 1.7),
                                    (40, 8, 0.6)])
def test_experts_choose_tokens_each_expert_takes_its_top_k_tokens(ex, T, E, cf):
    logits = _logits(T, E, seed=T * E)
    gates, token_index = ex.experts_choose_tokens(logits, cf)
    k = min(T, math.ceil(T * cf / E - 1e-9))  # k = n·c/e, at most n
    assert gates.shape == token_index.shape == (E, k), "every expert gets exactly its capacity"
    S = torch.softmax(logits, dim=-1)
    for e in range(E):
        best = sorted(range(T), key=lambda t: -S[t, e].item())[:k]  # no ties in random floats
        assert token_index[e].tolist() == best, f"expert {e}: tokens in a different order or set"
        # a softmax entry: E exps, their sum, a division
        close(gates[e], S[best, e], reorder_bound(E + 3, S[best, e], torch.float64), f"expert {e}'s gates")


def test_experts_choose_tokens_lets_a_token_be_picked_by_many_or_none(ex):
    T, E = 12, 3
    logits = torch.zeros(T, E)   # token 11 stays [0, 0, 0]: a lukewarm 1/3 for every expert
    logits[0] = torch.tensor([1.0, -5.0, 1.0])  # token 0: ~0.5 for experts 0 and 2
    logits[1:4, 0] = 3.0         # tokens 1-3: ~0.91 for expert 0
    logits[4:8, 1] = 3.0         # tokens 4-7: ~0.91 for expert 1
    logits[8:11, 2] = 3.0        # tokens 8-10: ~0.91 for expert 2
    gates, token_index = ex.experts_choose_tokens(logits, 1.0)   # k = 12·1/3 = 4
    assert [set(row) for row in token_index.tolist()] == [{0, 1, 2, 3}, {4, 5, 6, 7}, {0, 8, 9, 10}]
    picks = torch.bincount(token_index.flatten(), minlength=T)
    assert picks[0] == 2 and picks[11] == 0, "token 0 goes to two experts, token 11 to none"
    assert int(picks.sum()) == E * 4, "capacity is always used in full: nothing dropped for capacity"


def test_experts_choose_tokens_gates_are_differentiable_and_combine_token_by_token(ex):
    T, E, h = 18, 3, 4
    g = torch.Generator().manual_seed(3)
    x = torch.randn(T, h, generator=g, dtype=torch.float64)
    W = torch.randn(E, h, h, generator=g, dtype=torch.float64)
    logits = _logits(T, E, seed=4).requires_grad_(True)
    gates, idx = ex.experts_choose_tokens(logits, 1.5)
    out = torch.tanh(torch.einsum("ekh,ehj->ekj", x[idx], W)) * gates[..., None]   # [E, k, h]
    y = torch.zeros(T, h, dtype=torch.float64).index_add(0, idx.flatten(), out.reshape(-1, h))
    S = torch.softmax(logits.detach(), dim=-1)
    want = torch.zeros(T, h, dtype=torch.float64)
    for e in range(E):
        for t in idx[e].tolist():
            want[t] += S[t, e] * torch.tanh(x[t] @ W[e])
    # the expert's matmul (h terms), then up to E gated outputs added per token
    close(y.detach(), want, model_bound(n=max(h, E), depth=2, scale=max(1.0, want.abs().max().item())),
          "the outputs combined token by token")
    y.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0


def test_experts_choose_tokens_rejects_bad_input(ex):
    ex.experts_choose_tokens(torch.randn(8, 4), 1.0)  # a valid call first
    with pytest.raises(ValueError, match=r"\[T, E\]"):
        ex.experts_choose_tokens(torch.randn(8), 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ex.experts_choose_tokens(torch.randn(8, 4), -1.0)
    with pytest.raises(TypeError, match="floating point"):
        ex.experts_choose_tokens(torch.zeros(8, 4, dtype=torch.long), 1.0)


# --- 4. aux_free_select, aux_free_bias_step -----------------------------------------------------------------

def _select_by_sorting(scores, bias, k):
    """Each token's k experts by score + bias (plain Python), and their unbiased, renormalised scores."""
    experts, gates = [], []
    for row in scores.tolist():
        chosen = sorted(range(len(row)), key=lambda e: -(row[e] + bias[e]))[:k]   # no ties in random floats
        total = sum(row[e] for e in chosen) if k > 1 else 1.0
        experts.append(chosen)
        gates.append([row[e] / total for e in chosen])
    return experts, gates


@pytest.mark.parametrize("T,E,k", [(20, 4, 1), (33, 8, 2), (16, 6, 3)])
def test_aux_free_select_chooses_by_biased_score_and_weighs_by_score(ex, T, E, k):
    scores = torch.sigmoid(_logits(T, E, seed=T + k))
    bias = 0.2 * _logits(1, E, seed=99)[0]
    experts, gates = ex.aux_free_select(scores, bias, k)
    want_e, want_g = _select_by_sorting(scores, bias.tolist(), k)
    assert experts.shape == gates.shape == (T, k) and experts.dtype == torch.int64
    assert experts.tolist() == want_e
    want = torch.tensor(want_g, dtype=torch.float64)
    close(gates, want, reorder_bound(k + 1, want, torch.float64), "renormalised scores")  # k terms, a ratio
    plain, _ = ex.aux_free_select(scores, torch.zeros(E, dtype=torch.float64), k)
    assert plain.tolist() != experts.tolist(), "this bias must change some token's choice"


@pytest.mark.parametrize("seed", range(4))
def test_aux_free_select_equals_the_library_on_seeded_scores(ex, seed):
    g = torch.Generator().manual_seed(500 + seed)
    T, E = int(torch.randint(4, 40, (1,), generator=g)), int(torch.randint(2, 10, (1,), generator=g))
    k = 1 + int(torch.randint(0, E, (1,), generator=g))
    logits = _logits(T, E, seed=600 + seed)
    score = ("softmax", "sigmoid")[seed % 2]
    bias = 0.3 * torch.randn(E, generator=g, dtype=torch.float64)
    s, want_e, want_g = biased_choice(logits, bias, k, score)
    experts, gates = ex.aux_free_select(s, bias, k)
    assert experts.tolist() == want_e.tolist()
    assert torch.equal(gates, want_g), "the same score gathered and renormalised: the same operations"


def test_aux_free_select_the_bias_gets_no_gradient_and_changes_no_weight(ex):
    T, E = 12, 4
    logits = _logits(T, E, seed=21).requires_grad_(True)
    scores = torch.softmax(logits, dim=-1)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0], dtype=torch.float64, requires_grad=True)  # expert 2 wins
    experts, gates = ex.aux_free_select(scores, bias, 1)
    assert experts[:, 0].tolist() == [2] * T
    # the weight is the unbiased score (a renormalisation by a sum of one term: two roundings at most)
    close(gates[:, 0], scores[:, 2], reorder_bound(2, scores[:, 2].detach(), torch.float64), "the weights")
    gates.sum().backward()
    assert bias.grad is None or bias.grad.abs().sum() == 0, "the bias must not receive a gradient"
    want = torch.autograd.grad(torch.softmax(logits, -1)[:, 2].sum(), logits)[0]
    # softmax's backward: a sum over E of p·g, then p·(g - that)
    close(logits.grad, want, model_bound(n=E, depth=2, scale=1.0), "the router's gradient")


def test_aux_free_bias_step_on_hand_made_loads(ex):
    bias = torch.tensor([0.5, 0.0, -0.2, 0.1, 0.0])
    index = torch.tensor([0] * 9 + [1] * 1 + [2] * 5 + [3] * 5 + [4] * 5)   # mean 5: over, under, at, at, at
    got = ex.aux_free_bias_step(bias, index, rate=0.01)
    # float32: rate·sign rounded, then added (and the expected literals rounded once)
    close(got, torch.tensor([0.49, 0.01, -0.2, 0.1, 0.0]), reorder_bound(2, bias.abs() + 0.01), "bias step")
    assert torch.equal(bias, torch.tensor([0.5, 0.0, -0.2, 0.1, 0.0])), "a new tensor, not in place"
    top2 = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 2]])   # [T, k]: loads 3, 2, 2, 1 (mean 2)
    close(ex.aux_free_bias_step(torch.zeros(4), top2, 0.1), torch.tensor([-0.1, 0.0, 0.0, 0.1]),
          reorder_bound(2, 0.1), "bias step from zero")


@pytest.mark.parametrize("seed", range(4))
def test_aux_free_bias_step_equals_the_library_on_seeded_loads(ex, seed):
    g = torch.Generator().manual_seed(700 + seed)
    E, T = int(torch.randint(2, 12, (1,), generator=g)), int(torch.randint(1, 60, (1,), generator=g))
    k = 1 + seed % 2
    index = torch.randint(0, E, (T, k), generator=g)
    bias = torch.randn(E, generator=g, dtype=(torch.float64, torch.float32)[seed % 2])
    load = torch.bincount(index.flatten(), minlength=E)
    want = bias_update(bias, load, 0.01 * (seed + 1))
    got = ex.aux_free_bias_step(bias, index if k > 1 else index[:, 0], 0.01 * (seed + 1))
    assert got.dtype == bias.dtype and torch.equal(got, want), "b + γ·sign(mean − load): the same roundings"


def test_aux_free_select_and_bias_step_balance_a_collapsed_router(ex):
    # scores that send every token to expert 0; the bias alone, step by step, spreads the load
    T, E, rate = 128, 4, 0.005
    scores = torch.softmax(_logits(T, E, seed=31) * 0.3 + torch.tensor([1.0, 0.0, 0.0, 0.0]), dim=-1)
    bias = torch.zeros(E, dtype=torch.float64)
    loads = []
    for _ in range(200):
        experts, _ = ex.aux_free_select(scores, bias, 1)
        loads.append(torch.bincount(experts.flatten(), minlength=E))
        bias = ex.aux_free_bias_step(bias, experts, rate)
    assert loads[0].max().item() / (T / E) > 2.5          # collapsed
    late = torch.stack(loads[-20:]).double()
    assert (late.max(1).values / (T / E)).mean() < 1.25    # balanced by the bias alone


def test_aux_free_select_rejects_bad_input(ex):
    scores, bias = torch.rand(6, 4), torch.zeros(4)
    ex.aux_free_select(scores, bias, 2)   # a valid call first
    with pytest.raises(ValueError, match=r"bias must hold one value per expert, shape \(4,\)"):
        ex.aux_free_select(scores, torch.zeros(3), 1)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, E = 4\]"):
        ex.aux_free_select(scores, bias, 5)


def test_aux_free_bias_step_rejects_bad_input(ex):
    bias, experts = torch.zeros(4), torch.tensor([[0, 1], [2, 3], [0, 2]])
    ex.aux_free_bias_step(bias, experts, 0.001)   # a valid call first
    with pytest.raises(ValueError, match=r"rate must be > 0 \(DeepSeek-V3 uses 0.001\)"):
        ex.aux_free_bias_step(bias, experts, 0.0)
    with pytest.raises(ValueError, match="outside"):
        ex.aux_free_bias_step(bias, torch.tensor([0, 4]), 0.001)
    with pytest.raises(TypeError, match="integer"):
        ex.aux_free_bias_step(bias, experts.float(), 0.001)


# --- 5 and 6 on ranks: one launch per world size --------------------------------------------------------

H, D_FF, E, TOK, SEED = 8, 16, 8, 12, 7
ROUTINGS = ("switch", "top2", "expert_choice", "skewed")
# the forecast's measurement: uniform random top-1 routing of T_M tokens per rank, BATCHES batches
T_M, CF_M, BATCHES = 64, 1.0, 24


def _router(case):
    return {"switch": lambda: SwitchRouter(H, E, capacity_factor=1.0),
            "top2": lambda: Top2Router(H, E, capacity_factor=0.75),
            "expert_choice": lambda: ExpertChoiceRouter(H, E, capacity_factor=1.0),
            "skewed": lambda: SwitchRouter(H, E, capacity_factor=None)}[case]()


def _layer(case):
    torch.manual_seed(SEED)
    return MoELayer(H, D_FF, E, _router(case))


def _data(case, n):
    g = torch.Generator().manual_seed(SEED + 1)
    x, G = torch.randn(n * TOK, H, generator=g), torch.randn(n * TOK, H, generator=g)
    if case == "skewed":  # all of a rank's tokens are one token: they all pick the same expert
        x = x[::TOK].repeat_interleave(TOK, 0)
    return x.view(n, TOK, H), G.view(n, TOK, H)


def _uniform_layer():
    """A Switch layer whose router sends tokens x ~ N(0, I) to its experts uniformly at random: w_gate's
    columns are orthonormal, so a token's E logits are independent standard normals."""
    torch.manual_seed(SEED)
    layer = MoELayer(H, D_FF, E, SwitchRouter(H, E, capacity_factor=CF_M))
    q, _ = torch.linalg.qr(torch.randn(H, H, generator=torch.Generator().manual_seed(3)))
    with torch.no_grad():
        layer.router.w_gate.copy_(q[:, :E])
    return layer


def _measure(n, r):
    """Exercise 6's measurement, with the library's expert-parallel layer: per batch, the all-to-all
    bytes the meter counts over a training step and the assignments this rank's capacity drops."""
    ep = ExpertParallelMoE(_uniform_layer(), broadcast_weights=False)
    nbytes, dropped = [], []
    for x in _batches(r):
        with comm.meter() as m:
            ep(x).sum().backward()
        nbytes.append(m.bytes["all_to_all"])
        dropped.append(ep.last_routing.dropped)
    return {"bytes": nbytes, "dropped": dropped}


def _batches(r):
    g = torch.Generator().manual_seed(1000 + r)
    return [torch.randn(T_M, H, generator=g, requires_grad=True) for _ in range(BATCHES)]


def _measure_by_exercise(ex, n, r):
    """Exercise 7 on this rank: the same layer and batches as :func:`_measure`."""
    return ex.ep_step_traffic(ExpertParallelMoE(_uniform_layer(), broadcast_weights=False), _batches(r))


def _build(ex, n, r):
    """Exercise 5 on this rank, per routing, in float64: outputs and gradients, or the error it raised."""
    with float64():
        return _build_64(ex, n, r)


def _build_routing(ex, n, r, case):
    layer = _layer(case)
    xs, Gs = _data(case, n)
    x = xs[r].clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = ex.ep_moe_forward_strided(x, layer.router, layer.experts[r::n])
    (y * Gs[r]).sum().backward()
    return {"y": y.detach(), "dx": x.grad, "router": layer.router.w_gate.grad,
            "experts": [[None if p.grad is None else p.grad.clone() for p in e.parameters()]
                        for e in layer.experts[r::n]],
            "events": [(e.op, e.nbytes) for e in fwd.events],
            "counts": layer.router(xs[r]).counts.tolist()}


def _build_64(ex, n, r):
    """Each routing a case of its own (a stub's NotImplementedError, or a bug, fails only its tests);
    then the two refused calls: the ValueError's message, None if the call ran."""
    per, layer = E // n, _layer("switch")
    cases = {case: (lambda case=case: _build_routing(ex, n, r, case)) for case in ROUTINGS}
    for name, args in (("width", (torch.randn(4, H + 1), layer.router, layer.experts[:per])),
                       ("experts", (torch.randn(4, H), layer.router, layer.experts[:per + 1]))):
        cases["bad", name] = lambda args=args: refusal(lambda: ex.ep_moe_forward_strided(*args))
    return run_cases(cases)


def _rank_run(ex):
    import torch.distributed as dist

    n, r = dist.get_world_size(), dist.get_rank()
    measured = _measure(n, r)  # first: the library's layer, whatever exercise 5 does
    step = run_cases({"step": lambda: _measure_by_exercise(ex, n, r)})
    return {"measure": measured, "build": _build(ex, n, r), "step": step}


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request, ex):
    n = request.param
    return n, launch(_rank_run, n, ex, timeout_s=90)


def _reference(case, n):
    """The single-process layer on each rank's tokens alone (each rank routes its own), losses summed,
    in float64."""
    with float64():
        return _reference_64(case, n)


def _reference_64(case, n):
    layer = _layer(case)
    xs, Gs = _data(case, n)
    out, total = [], 0.0
    for r in range(n):
        x = xs[r].clone().requires_grad_(True)
        y = layer(x)
        total = total + (y * Gs[r]).sum()
        out.append({"x": x, "y": y.detach(), "counts": layer.last_routing.counts.tolist()})
    total.backward()
    return layer, out


def _built(results, r, case):
    """Rank r's value of case ``case`` of exercise 5 (a routing, or ("bad", name))."""
    return _case(results[r]["build"], case, r)


ELEM = 8  # bytes of a float64 element: exercise 5 runs in float64
EP_N = 4 * TOK  # the longest reduction: an expert's weight gradient over every rank's tokens (4 ranks)
EP_DEPTH = 8  # the router, its softmax, the expert's two matmuls, back through them, a weight gradient's
# sum over tokens, and the sum of the ranks' router gradients


def _ep_close(got, want, where):
    """The same rows in other groupings (module docstring)."""
    close(got, want, model_bound(n=EP_N, depth=EP_DEPTH, scale=max(1.0, want.abs().max().item())), where)


# --- 5. ep_moe_forward_strided ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", ROUTINGS)
def test_ep_moe_forward_strided_equals_one_process(ranks, case):
    n, results = ranks
    layer, ref = _reference(case, n)
    router_grad = 0
    for r in range(n):
        got = _built(results, r, case)
        _ep_close(got["y"], ref[r]["y"], f"{n} ranks, rank {r}, {case}: outputs differ")
        _ep_close(got["dx"], ref[r]["x"].grad, f"{n} ranks, rank {r}, {case}: input gradients differ")
        for i, grads in enumerate(got["experts"]):
            want = [p.grad for p in layer.experts[r + i * n].parameters()]  # rank r holds r, r + n, ...
            for a, b in zip(grads, want):
                a = torch.zeros_like(b) if a is None else a  # an expert with no rows: zero or None
                _ep_close(a, b, f"{n} ranks, rank {r}, {case}: expert {r + i * n}'s gradient is not the "
                                f"one every rank's tokens give")
        router_grad = router_grad + got["router"]
    _ep_close(router_grad, layer.router.w_gate.grad, f"{n} ranks, {case}: the router gradient, summed")


@pytest.mark.parametrize("case", ROUTINGS)
def test_ep_moe_forward_strided_sends_the_kept_rows_out_and_back(ranks, case):
    n, results = ranks
    # S[i][j]: rows rank i sends to rank j, which owns experts j, j + n, ...
    S = [[sum(_built(results, i, case)["counts"][j::n]) for j in range(n)] for i in range(n)]
    for r in range(n):
        events = _built(results, r, case)["events"]
        assert {op for op, _ in events} == {"all_to_all"}, \
            f"rank {r}: the forward should move rows by all-to-all only, it ran {[op for op, _ in events]}"
        rows = (sum(S[r]) + sum(S[i][r] for i in range(n))) * H * ELEM  # dispatch out, combine back
        total = sum(b for _, b in events)
        assert rows <= total <= rows + E * 8, (
            f"{n} ranks, rank {r}, {case}: the forward's all-to-alls moved {total} bytes; the kept rows out "
            f"and back are {rows}, plus at most E int64 counts")


def test_ep_moe_forward_strided_rejects_bad_input(ranks):
    n, results = ranks
    _built(results, 0, "switch")  # a valid call first
    for r in range(n):
        width, experts = _built(results, r, ("bad", "width")), _built(results, r, ("bad", "experts"))
        assert width is not None and f"h={H}" in width, f"rank {r}: a width other than h is refused: {width}"
        assert experts is not None and "E/n experts" in experts, \
            f"rank {r}: a number of experts other than E/n must be refused: {experts}"


# --- 6. ep_traffic_forecast -------------------------------------------------------------------------------


def _expected_excess(T, p, C):
    """E[max(0, X - C)] for X ~ Binomial(T, p), term by term."""
    return sum((x - C) * math.comb(T, x) * p ** x * (1 - p) ** (T - x) for x in range(C + 1, T + 1))


def _by_definition(T, h, E, n, cf, e):
    C = math.ceil(cf * T / E - 1e-9)
    dropped = E * _expected_excess(T, 1 / E, C)
    return C, dropped, 4 * (T - dropped) * h * e + E * 8


def test_ep_traffic_forecast_by_hand(ex):
    got = ex.ep_traffic_forecast(10, 8, 1, 1, 0.5)  # one expert takes 5 of the 10 tokens, surely
    assert got["capacity"] == 5 and got["dropped"] == pytest.approx(5.0)
    assert got["bytes"] == pytest.approx(4 * 5 * 8 * 4 + 8), \
        "5 kept rows of 32 bytes, 4 calls (dispatch, combine, and both again backward), plus 1 count"
    got = ex.ep_traffic_forecast(64, 16, 8, 4, 8.0, bytes_per_element=2)  # C = 64: nothing can drop
    assert got["capacity"] == 64 and got["dropped"] == pytest.approx(0.0, abs=1e-12)
    assert got["bytes"] == pytest.approx(4 * 64 * 16 * 2 + 8 * 8)


@pytest.mark.parametrize("T,h,E,n,cf,e", [(64, 8, 8, 2, 1.0, 4), (256, 32, 8, 4, 1.25, 2),
                                          (100, 4, 16, 4, 0.75, 4), (1000, 64, 32, 8, 1.0, 2)])
def test_ep_traffic_forecast_equals_the_definition(ex, T, h, E, n, cf, e):
    got = ex.ep_traffic_forecast(T, h, E, n, cf, e)
    C, dropped, nbytes = _by_definition(T, h, E, n, cf, e)
    assert got["capacity"] == C
    assert got["dropped"] == pytest.approx(dropped, rel=1e-9), "the expected assignments dropped"
    assert got["bytes"] == pytest.approx(nbytes, rel=1e-9), "the expected bytes the meter counts"


@pytest.mark.parametrize("seed", range(5))
def test_ep_traffic_forecast_equals_the_costmodel_on_seeded_configurations(ex, seed):
    g = torch.Generator().manual_seed(800 + seed)
    n = 2 ** int(torch.randint(0, 4, (1,), generator=g))
    E = n * int(torch.randint(1, 5, (1,), generator=g))
    T, h = int(torch.randint(1, 300, (1,), generator=g)), int(torch.randint(1, 64, (1,), generator=g))
    cf, e = 0.25 + 1.75 * float(torch.rand(1, generator=g)), (2, 4, 8)[seed % 3]
    got = ex.ep_traffic_forecast(T, h, E, n, cf, e)
    dropped = cm.expected_dropped_tokens(T, E, 1, cf)
    want = (T - dropped) * cm.all_to_all_bytes_moe(1, h, n, bytes_per_element=e, include_self=True,
                                                    backward=True) \
        + cm.moe_counts_exchange_bytes(E, n, include_self=True)
    assert got["capacity"] == cm.moe_capacity(T, E, 1, cf)
    assert got["dropped"] == pytest.approx(dropped, rel=1e-9, abs=1e-9)
    assert got["bytes"] == pytest.approx(want, rel=1e-9)


def test_ep_traffic_forecast_matches_the_ranks(ex, ranks):
    n, results = ranks
    got = ex.ep_traffic_forecast(T_M, H, E, n, CF_M)
    for key in ("dropped", "bytes"):
        samples = torch.tensor([float(v) for res in results for v in res["measure"][key]],
                               dtype=torch.float64)
        mean, se = samples.mean().item(), samples.std().item() / math.sqrt(len(samples))
        assert abs(got[key] - mean) <= 5 * se + 1e-9, (
            f"{n} ranks: predicted {key} {got[key]:.2f}; measured {mean:.2f} ± {se:.2f} (one standard error) "
            f"over {len(samples)} rank-batches")


def test_ep_traffic_forecast_rejects_bad_input(ex):
    ex.ep_traffic_forecast(64, 8, 8, 2, 1.0)  # a valid call first
    with pytest.raises(ValueError, match="not divisible"):
        ex.ep_traffic_forecast(64, 8, 6, 4, 1.0)
    with pytest.raises(ValueError, match="capacity_factor"):
        ex.ep_traffic_forecast(64, 8, 8, 2, 0.0)
    with pytest.raises(ValueError, match="tokens"):
        ex.ep_traffic_forecast(0, 8, 8, 2, 1.0)


# --- 7. ep_step_traffic -----------------------------------------------------------------------------------


def _stepped(results, r):
    return _case(results[r]["step"], "step", r)


def test_ep_step_traffic_measures_the_steps(ranks):
    n, results = ranks
    for r in range(n):
        got, want = _stepped(results, r), results[r]["measure"]
        assert len(got["bytes"]) == len(got["dropped"]) == BATCHES, "one measured value per batch"
        assert [int(b) for b in got["bytes"]] == want["bytes"], (
            f"{n} ranks, rank {r}: the all-to-all bytes of each step (forward and backward) as the comm "
            f"meter counts them, batch by batch; got {got['bytes'][:4]}..., the meter saw "
            f"{want['bytes'][:4]}...")
        assert [int(d) for d in got["dropped"]] == want["dropped"], (
            f"{n} ranks, rank {r}: the assignments this rank dropped, batch by batch")


def test_ep_step_traffic_predicts_what_it_measures(ranks):
    n, results = ranks
    C, dropped, nbytes = _by_definition(T_M, H, E, n, CF_M, 4)
    for r in range(n):
        pred = _stepped(results, r)["predicted"]
        assert pred["capacity"] == C
        assert pred["dropped"] == pytest.approx(dropped, rel=1e-9)
        assert pred["bytes"] == pytest.approx(nbytes, rel=1e-9), "the forecast for this layer and batch size"
    for key in ("dropped", "bytes"):
        samples = torch.tensor([float(v) for r in range(n) for v in _stepped(results, r)[key]],
                               dtype=torch.float64)
        mean, se = samples.mean().item(), samples.std().item() / math.sqrt(len(samples))
        got = _stepped(results, 0)["predicted"][key]
        assert abs(got - mean) <= 5 * se + 1e-9, (
            f"{n} ranks: predicted {key} {got:.2f}; measured {mean:.2f} ± {se:.2f} over {len(samples)} steps")
