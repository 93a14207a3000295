"""Chapter 10, held-out: top-2 gating with batch-prioritised capacity on a hand-worked batch (a first choice
dropped while the token's second choice is kept, a tie between second choices) and on seeded random
batches against the library's router; the expert-parallel layer on 2 ranks with E/n = 3 experts per rank
and a different number of tokens on each rank; the aux loss of a top-2 dispatch given as int32 ids; the
bias step with an expert exactly at the mean load.

Expected values: worked by hand (the aux loss, its gradient and the bias step in binary-exact numbers:
compared exactly); the library's ``top_k_routing``, which serves the assignments in token order, run on
the tokens sorted by priority (stable, most confident first), so that its token order is the priority
order; the library's single-process ``MoELayer`` on each rank's tokens alone. Tolerances as in the
visible tests: a normalised gate is a softmax of E terms and a ratio, rel 1e-12 >> (2E + 10)·u of
float64; the expert-parallel layer runs in float64 against the single-process layer, its longest
reduction an expert's weight gradient over every rank's rows (at most EP_N = 14), at most EP_DEPTH = 8
reductions chained: ``model_bound``.
"""
import random
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist

from minitorch_dist import costmodel as cm
from minitorch_dist.course.exercises import load, resolve_impl
from minitorch_dist.sparsity.moe import ExpertChoiceRouter, MoELayer, Top2Router
from minitorch_dist.sparsity.routers import top_k_routing

from _support import case, close, float64, model_bound, run_cases

pytestmark = [pytest.mark.ch10, pytest.mark.timeout(120)]

if __name__ in sys.modules:
    cloudpickle.register_pickle_by_value(sys.modules[__name__])


# --- 1. top2_gating_prioritized --------------------------------------------------------------------------


def _kept(combine, dispatch):
    return {(t, e): (c, combine[t, e, c].item()) for t, e, c in dispatch.nonzero().tolist()}


def test_top2_gating_prioritized_held_out_hand_worked(ex):
    # priority (largest probability): token 2 (0.70), 1 (0.60), 3 (0.50), 0 (0.40); C = ceil(2·4/4) = 2.
    # Firsts: 2 -> e0 slot 0, 1 -> e1 slot 0, 3 -> e0 slot 1, 0 -> e0 full (dropped).
    # Seconds: 2 -> e2 slot 0, 1 -> e2 slot 1, 3 -> e2 full (dropped), 0 -> e1 slot 1 (token 0's second
    # choice is a tie between e1 and e2: the lower index wins), with its own gate 0.25/0.65, not 1.
    probs = torch.tensor([[0.40, 0.25, 0.25, 0.10],
                          [0.10, 0.60, 0.20, 0.10],
                          [0.70, 0.05, 0.15, 0.10],
                          [0.50, 0.10, 0.25, 0.15]], dtype=torch.float64)
    combine, dispatch, dropped = ex.top2_gating_prioritized(probs.log(), 1.0)
    assert dispatch.shape == (4, 4, 2) and dropped == 2
    want = {(0, 1): (1, 5 / 13), (1, 1): (0, 0.75), (1, 2): (1, 0.25),
            (2, 0): (0, 14 / 17), (2, 2): (0, 3 / 17), (3, 0): (1, 2 / 3)}
    got = _kept(combine, dispatch)
    assert set(got) == set(want), "a different set of (token, expert) assignments was kept"
    for key, (slot, gate) in want.items():
        assert got[key][0] == slot, f"assignment {key}: slot {got[key][0]}, want {slot}"
        assert got[key][1] == pytest.approx(gate, rel=1e-12), f"assignment {key}: gate"
    assert torch.equal(combine != 0, dispatch)


def _library_top2(logits, cf):
    """{(t, e): (slot, gate)}, C and the drops: the library's top-2 routing (first choices before second,
    each in token order) of the tokens sorted by priority, mapped back to their places."""
    T, E = logits.shape
    C = cm.moe_capacity(T, E, 2, cf)
    order = torch.sort(logits.softmax(-1).amax(-1), descending=True, stable=True).indices
    routing = top_k_routing(logits[order], k=2, capacity=C, normalize=True)
    kept, fill = {}, [0] * E  # the routing is sorted by expert, priority order inside: slots fill in order
    for t, e, w in zip(routing.tokens.tolist(), routing.experts.tolist(), routing.weights.tolist()):
        kept[(int(order[t]), e)] = (fill[e], w)
        fill[e] += 1
    return kept, C, routing.dropped


def test_top2_gating_prioritized_held_out_against_the_library_on_random_batches(ex):
    rng = random.Random(1010)
    for i in range(20):
        T, E = rng.randint(1, 60), rng.randint(2, 12)
        cf, scale = rng.uniform(0.1, 3.0), rng.choice([0.5, 3.0, 10.0])
        g = torch.Generator().manual_seed(rng.randrange(2 ** 31))
        logits = scale * torch.randn(T, E, generator=g, dtype=torch.float64)
        combine, dispatch, dropped = ex.top2_gating_prioritized(logits, cf)
        want, C, want_dropped = _library_top2(logits, cf)
        where = f"draw {i}: T={T}, E={E}, cf={cf:.3f}"
        assert dispatch.shape == (T, E, C) and combine.dtype == torch.float64, where
        got = _kept(combine, dispatch)
        assert set(got) == set(want), f"{where}: a different set of assignments was kept"
        for key, (slot, gate) in want.items():
            assert got[key][0] == slot, f"{where}: assignment {key}: slot {got[key][0]}, want {slot}"
            assert got[key][1] == pytest.approx(gate, rel=1e-12), f"{where}: assignment {key}: gate"
        assert dropped == want_dropped, where


# --- 2 and 4: the aux loss and the bias step, by hand ------------------------------------------------------


def test_switch_aux_loss_held_out_top2_int32(ex):
    # P = column means = [11/32, 1/4, 1/4, 5/32]; 8 assignments: f = [3, 2, 2, 1]/8;
    # loss = α·N·Σ f·P = 0.5·4·(35/128) = 35/64; d loss / d probs[t, i] = α·N·f_i/T = f_i/2 on every row
    probs = torch.tensor([[0.5, 0.25, 0.125, 0.125],
                          [0.25, 0.5, 0.125, 0.125],
                          [0.125, 0.125, 0.5, 0.25],
                          [0.5, 0.125, 0.25, 0.125]], dtype=torch.float64, requires_grad=True)
    index = torch.tensor([[0, 1], [1, 0], [2, 3], [0, 2]], dtype=torch.int32)
    loss = ex.switch_aux_loss(probs, index, alpha=0.5)
    assert loss.dim() == 0 and loss.item() == 35 / 64
    loss.backward()
    assert torch.equal(probs.grad, torch.tensor([[0.1875, 0.125, 0.125, 0.0625]] * 4, dtype=torch.float64))


def test_aux_free_bias_step_held_out_at_the_mean_and_top2_int32(ex):
    bias = torch.tensor([1.0, 1.0, 1.0])
    # loads [3, 1, 2], mean 2: the overloaded expert's bias falls, the underloaded one's rises, the one
    # exactly at the mean keeps its own
    new = ex.aux_free_bias_step(bias, torch.tensor([0, 0, 0, 1, 2, 2]), rate=0.25)
    assert torch.equal(new, torch.tensor([0.75, 1.25, 1.0])) and torch.equal(bias, torch.ones(3))
    # top-2 ids as int32, an expert nobody chose: loads [3, 2, 1, 0], mean 1.5
    bias = torch.tensor([0.5, -0.25, 0.0, 1.0])
    new = ex.aux_free_bias_step(bias, torch.tensor([[0, 1], [0, 2], [0, 1]], dtype=torch.int32), rate=0.25)
    assert new.dtype == torch.float32 and torch.equal(new, torch.tensor([0.25, -0.5, 0.25, 1.25]))


# --- 5. ep_moe_forward_strided: 2 ranks, 3 experts each, unequal token counts ---------------------------

H, D_FF, N_EXP, SEED = 6, 10, 6, 11
TOKENS = (5, 9)  # rank 0 routes 5 tokens, rank 1 routes 9: each rank's capacity is its own
EP_N, EP_DEPTH = sum(TOKENS), 8
ROUTINGS = ("top2", "expert_choice")


def _layer(name):
    torch.manual_seed(SEED)
    router = {"top2": lambda: Top2Router(H, N_EXP, capacity_factor=0.75),
              "expert_choice": lambda: ExpertChoiceRouter(H, N_EXP, capacity_factor=1.5)}[name]()
    return MoELayer(H, D_FF, N_EXP, router)


def _data():
    g = torch.Generator().manual_seed(SEED + 1)
    return [(torch.randn(t, H, generator=g), torch.randn(t, H, generator=g)) for t in TOKENS]


def _strided(ex, name):
    r, n = dist.get_rank(), dist.get_world_size()
    with float64():
        layer = _layer(name)
        x, G = _data()[r]
        x = x.clone().requires_grad_(True)
        y = ex.ep_moe_forward_strided(x, layer.router, layer.experts[r::n])
        (y * G).sum().backward()
        return {"y": y.detach(), "dx": x.grad, "router": layer.router.w_gate.grad,
                "experts": [[None if p.grad is None else p.grad.clone() for p in e.parameters()]
                            for e in layer.experts[r::n]]}


def _on_ranks(impl):
    ex = load("ch10", impl)
    return run_cases({name: (lambda name=name: _strided(ex, name)) for name in ROUTINGS})


@pytest.fixture(scope="module")
def ranks(ex, launches):
    return launches(_on_ranks, resolve_impl(), timeout_s=90)


def _close(got, want, where):
    close(got, want, model_bound(n=EP_N, depth=EP_DEPTH, scale=max(1.0, want.abs().max().item())), where)


@pytest.mark.parametrize("name", ROUTINGS)
def test_ep_moe_forward_strided_held_out_three_experts_per_rank_unequal_tokens(ranks, name):
    results = ranks(2)
    with float64():
        layer = _layer(name)
        total, ref = 0.0, []
        for x, G in _data():
            x = x.clone().requires_grad_(True)
            y = layer(x)
            total = total + (y * G).sum()
            ref.append((x, y.detach()))
        total.backward()
    router_grad = 0
    for r in range(2):
        got = case(results[r], name, r)
        _close(got["y"], ref[r][1], f"{name}, rank {r} ({TOKENS[r]} tokens): outputs")
        _close(got["dx"], ref[r][0].grad, f"{name}, rank {r}: input gradients")
        for i, grads in enumerate(got["experts"]):
            for a, b in zip(grads, (p.grad for p in layer.experts[r + 2 * i].parameters())):
                a = torch.zeros_like(b) if a is None else a
                _close(a, b, f"{name}, rank {r}: expert {r + 2 * i}'s gradient (rank r holds r, r+2, r+4)")
        router_grad = router_grad + got["router"]
    _close(router_grad, layer.router.w_gate.grad, f"{name}: the router gradient, summed over ranks")
