"""Chapter 10, modern MoE training: aux-loss-free balancing, the dropless MoE, chunked expert parallelism.

Independent references:
- aux-free routing: each token's experts found by sorting ``s + b`` in plain Python, the gates read
  off the unbiased scores; the bias update b ± γ on hand-made loads; a router that collapsed on
  one expert balanced by the update alone (and not balanced without it).
- dropless: every token run through its chosen experts one by one, in fp64 (outputs and every
  gradient to 1e-12); ``torch._grouped_mm`` against one matmul per expert; matmul FLOPs counted by
  ``FlopCounterMode`` against ``costmodel.dropless_expert_flops``; what capacity drops on the same
  routing against ``costmodel.dropped_tokens``.
- chunked expert parallelism (2 and 4 ranks): the same layer in one process on each rank's tokens
  (outputs and gradients: the experts see the same rows in smaller matmuls); the meter's calls
  (1 + 2m all-to-alls forward, 2m backward, launched asynchronously) and bytes (the unchunked
  layer's); the timeline's spans. The MoE GPT with aux-free, dropless, chunked expert-parallel
  layers trained 2 steps against one process, biases included (their loads all-reduced once per step).
- the cost model's chunked-pipeline time against a generic list-scheduling simulation.

Tolerances (derived in tests/_support.py). Gates read off the same scores, the bias that moves by the
same rule, the same gradient computed the same way: bitwise. Formulas in float64 against formulas
(the gates renormalised over k <= 3 terms, a chunked-pipeline time against the simulation's few
dozen float64 adds and maxes): rel 1e-12 and 1e-6 are far above k·u = 1e-15. A bias b ± rate in
float32 against the same written as a float32 literal: γ_2 relative. The dropless layer against the
token-by-token loop, the chunked expert-parallel layer against one process, and the GPT trained 2
SGD steps against one process run in float64: the same sums in other orders, at most N = 48 rows
(every rank's tokens) in a weight gradient, chained 10 deep in a layer (logits, softmax, two expert
layers, the combine, as many back) and 6 per block + 2 + 3 per MoE block in the GPT:
``model_bound`` scaled by the values, and ``sgd_bound`` for the weights; all ~1e-11, while a wrong
expert, gate or missing all-reduce moves values by O(0.1) (lr·grad ~ 1e-3 for weights). Bytes are
counted for float64 rows there (8 bytes an element; counts and loads are int64). ``torch._grouped_mm``
takes no float64: it and the per-expert loop are each one fp32 expert MLP (c_fc, tanh-GELU, c_proj
and their backward), and their difference is bounded by two evaluations' first-order errors carried
through |W| (``_expert_bounds``: γ_{K+1} of each product's Σ|terms|, GELU's slope <= 1.13 and
curvature <= 0.8, its evaluation within γ_10 of |h|). Load balance after the bias update: within
15% of the mean on average over the last 50 steps (the collapsed start is 4x).
"""
import math
import random

import pytest
import torch
import torch.distributed as dist
from torch.utils.flop_counter import FlopCounterMode

from minitorch_dist.costmodel import moe as cm
from minitorch_dist.models.data import MarkovCorpus
from minitorch_dist.runtime import comm, observe
from minitorch_dist.runtime.launch import launch
from minitorch_dist.runtime.timeline import Timeline
from minitorch_dist.sparsity.aux_free import (
    AuxFreeRouter,
    bias_update,
    biased_top_k_routing,
)
from minitorch_dist.sparsity.dropless import DroplessMoELayer, grouped_experts, grouped_mm_supported
from minitorch_dist.sparsity.ep_overlap import chunk_sizes, split_blocks
from minitorch_dist.sparsity.expert_parallel import ExpertParallelMoE, expert_parallel, sync_replicated_grads
from minitorch_dist.sparsity.moe import MoELayer, SwitchRouter, Top2Router, run_experts
from minitorch_dist.sparsity.moe_gpt import MoEGPT, MoEGPTConfig

from _support import case, close, float64, gamma, model_bound, roundoff, run_cases, sgd_bound

pytestmark = [pytest.mark.ch10, pytest.mark.timeout(240)]

LAYER_DEPTH = 10  # an MoE layer's chain of reductions: logits, softmax, two expert layers, combine; and back


# --- aux-free: biased selection, unbiased gates -------------------------------------------------------

def _by_sorting(s, b, k, normalize):
    """{(t, e): gate}: token t's k experts by s + b (ties: lowest index), gates from s."""
    out = {}
    for t, row in enumerate(s.tolist()):
        chosen = sorted(range(len(row)), key=lambda e: (-(row[e] + b[e]), e))[:k]
        total = sum(row[e] for e in chosen) if normalize else 1.0
        out.update({(t, e): row[e] / total for e in chosen})
    return out


@pytest.mark.parametrize("k,score", [(1, "softmax"), (2, "softmax"), (2, "sigmoid"), (3, "sigmoid")])
def test_biased_routing_selects_by_score_plus_bias_and_weighs_by_score(k, score):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(40, 6, generator=g, dtype=torch.float64)
    bias = 0.3 * torch.randn(6, generator=g, dtype=torch.float64)
    r = biased_top_k_routing(logits, bias, k, score=score)
    s = logits.softmax(-1) if score == "softmax" else logits.sigmoid()
    want = _by_sorting(s, bias.tolist(), k, normalize=k > 1)
    got = {(t, e): w for t, e, w in zip(r.tokens.tolist(), r.experts.tolist(), r.weights.tolist())}
    assert got.keys() == want.keys()
    assert all(got[key] == pytest.approx(want[key], rel=1e-12) for key in want)
    assert r.aux_loss.item() == 0.0 and r.dropped == 0 and r.counts.sum().item() == 40 * k
    unbiased = _by_sorting(s, [0.0] * 6, k, normalize=k > 1)
    assert unbiased.keys() != want.keys(), "the bias must change some selections in this case"


def test_the_bias_steers_selection_but_gets_no_gradient():
    torch.manual_seed(0)
    router = AuxFreeRouter(8, 4, k=1)
    x = torch.randn(16, 8)
    router.expert_bias[3] = 10.0  # every token now picks expert 3 ...
    r = router(x)
    assert r.experts.tolist() == [3] * 16
    s = (x @ router.w_gate).softmax(-1)
    assert torch.equal(r.weights, s[:, 3])  # ... weighted by its unbiased score (the same scores)
    r.weights.sum().backward()
    w = router.w_gate.detach().clone().requires_grad_(True)
    (x @ w).softmax(-1)[:, 3].sum().backward()
    assert torch.equal(router.w_gate.grad, w.grad)  # the gradient ignores the bias (computed the same way)
    assert "expert_bias" not in dict(router.named_parameters()) and not router.expert_bias.requires_grad
    assert set(router.state_dict()) == {"w_gate", "expert_bias", "step_load"}


def test_bias_update_rule_on_hand_made_loads():
    b = torch.tensor([0.5, 0.0, -0.2, 0.1])
    got = bias_update(b, torch.tensor([10, 2, 6, 6]), rate=0.01)  # mean 6: overloaded, under, at, at
    want = torch.tensor([0.49, 0.01, -0.2, 0.1])
    torch.testing.assert_close(got, want, rtol=gamma(2, torch.float32), atol=0)
    router = AuxFreeRouter(4, 4, k=2, bias_update_rate=0.25)
    x1, x2 = torch.randn(5, 4), torch.randn(7, 4)
    c1 = torch.bincount(router(x1).experts, minlength=4)
    c2 = torch.bincount(router(x2).experts, minlength=4)  # micro-batches accumulate
    router.eval()
    router(torch.randn(9, 4))  # evaluation does not count
    assert router.step_load.tolist() == (c1 + c2).tolist()
    load = router.update_bias()
    assert load.tolist() == (c1 + c2).tolist() and router.step_load.tolist() == [0] * 4
    mean = (c1 + c2).double().mean()
    want = [0.25 * (1 if mean > c else -1 if mean < c else 0) for c in (c1 + c2).tolist()]
    assert router.expert_bias.tolist() == want  # 0 ± 0.25: exact


def _collapsed_router(rate):
    torch.manual_seed(0)
    router = AuxFreeRouter(8, 4, k=1, bias_update_rate=rate)
    x = torch.randn(256, 8)
    x[:, 0] = 1.0  # a constant feature ...
    with torch.no_grad():
        router.w_gate[0] = torch.tensor([1.5, 0.0, 0.0, 0.0])  # ... that pulls every token to expert 0
    return router, x


@pytest.mark.parametrize("update", [True, False])
def test_the_bias_update_alone_balances_a_collapsed_router(update):
    rate = 0.003
    router, x = _collapsed_router(rate)
    with torch.no_grad():
        s = (x @ router.w_gate).softmax(-1)
    gap = (s[:, 0] - s[:, 1:].max(-1).values).min().item()  # the closest call among the tokens
    first_move, imbalance = None, []
    for step in range(250):
        counts = router(x).counts
        imbalance.append(cm.load_imbalance(counts))
        if first_move is None and counts[0] < 256:
            first_move = step
        if update:
            router.update_bias()
        router.step_load.zero_()
    assert imbalance[0] == 4.0  # every token on expert 0
    if not update:
        assert imbalance == [4.0] * 250 and first_move is None
        return
    # expert 0's bias falls by γ a step, the idle experts' rise by γ: the closest token leaves after
    # ceil(gap / 2γ) steps (+1 for float32 sums of γ)
    assert first_move - cm.aux_free_steps_to_shift(gap, rate) in (0, 1)
    assert sum(imbalance[-50:]) / 50 < 1.15  # balanced (module docstring)


def test_the_bias_stays_fp32_in_a_bf16_model():
    torch.manual_seed(0)
    router = AuxFreeRouter(8, 4, k=1, bias_update_rate=0.001)
    router.expert_bias.fill_(0.5)
    router.bfloat16()
    assert router.w_gate.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    router(torch.randn(16, 8, dtype=torch.bfloat16))
    load = router.update_bias()
    assert load.tolist() != [4, 4, 4, 4]  # uneven: some biases must move
    assert torch.equal(router.expert_bias, bias_update(torch.full((4,), 0.5), load, 0.001))  # the same rule
    assert torch.tensor(0.5, dtype=torch.bfloat16) + 0.001 == 0.5
    assert router.double().expert_bias.dtype == torch.float64


def test_aux_free_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"bias_update_rate must be > 0 \(DeepSeek-V3 uses 0.001\)"):
        AuxFreeRouter(8, 4, bias_update_rate=0.0)
    with pytest.raises(ValueError, match="bias_update_rate must be > 0"):
        bias_update(torch.zeros(4), torch.ones(4), -1e-3)
    with pytest.raises(ValueError, match="score must be one of"):
        AuxFreeRouter(8, 4, score="relu")
    with pytest.raises(ValueError, match=r"k must be an int in \[1, n_experts = 4\]"):
        AuxFreeRouter(8, 4, k=5)
    with pytest.raises(ValueError, match=r"bias must hold one value per expert, shape \(4,\)"):
        biased_top_k_routing(torch.randn(3, 4), torch.zeros(5))
    with pytest.raises(ValueError, match="or None for no capacity"):
        AuxFreeRouter(8, 4, capacity_factor=0)


def test_aux_free_gpt_has_no_aux_loss_and_updates_every_layer():
    cfg = MoEGPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, moe_every=1,
                            router="aux_free", top_k=2, capacity_factor=None)
    m = MoEGPT(cfg)
    x, y = MarkovCorpus(32).batch(0, 4, 16)
    _, loss = m(x, y)
    assert m.aux_loss.item() == 0.0 and loss.item() == m.lm_loss.item()
    loads = m.update_expert_biases()  # one process: no all-reduce
    assert [ld.tolist() for ld in loads] == [c.tolist() for c in m.expert_load()]
    one_step = pytest.approx(0.001, rel=roundoff(torch.float32))  # 0 ± the float32 0.001
    assert all(layer.router.expert_bias.abs().max().item() == one_step for layer in m.moe_layers())
    assert MoEGPT(MoEGPTConfig.tiny(**{**cfg.__dict__, "router": "switch"})).update_expert_biases() == []


# --- dropless ---------------------------------------------------------------------------------------------

ROUTERS = {
    "switch": lambda h, e: SwitchRouter(h, e, capacity_factor=None),
    "top2": lambda h, e: Top2Router(h, e, capacity_factor=None),
    "aux_free": lambda h, e: AuxFreeRouter(h, e, k=2),
}


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_dropless_equals_every_token_through_its_chosen_experts_fp64(router):
    torch.manual_seed(1)
    h, E, T = 8, 4, 30
    layer = DroplessMoELayer(h, 12, E, ROUTERS[router](h, E)).double()
    if router == "aux_free":
        layer.router.expert_bias.copy_(torch.tensor([0.2, 0.0, -0.1, 0.05]))
    x = torch.randn(T, h, dtype=torch.float64)
    x[:5] = x[0]  # a few identical tokens: a heavy expert
    x.requires_grad_(True)
    G = torch.randn(T, h, dtype=torch.float64)
    (layer(x) * G).sum().backward()
    got = [p.grad.clone() for p in layer.parameters()] + [x.grad.clone()]
    # the reference: token by token, its experts by s (+ bias), gates by hand
    layer.zero_grad()
    x.grad = None
    s = x @ layer.router.w_gate
    k = 1 if router == "switch" else 2
    probs = s.softmax(-1)
    bias = layer.router.expert_bias if router == "aux_free" else torch.zeros(E, dtype=torch.float64)
    y = []
    for t in range(T):
        chosen = sorted(range(E), key=lambda e: (-(probs[t, e].item() + bias[e].item()), e))[:k]
        total = probs[t, chosen].sum() if k > 1 else 1.0
        y.append(sum(probs[t, e] / total * layer.experts[e](x[t]) for e in chosen))
    (torch.stack(y) * G).sum().backward()
    want = [p.grad for p in layer.parameters()] + [x.grad]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        close(a, b, model_bound(n=T, depth=LAYER_DEPTH, scale=max(1.0, b.abs().max().item())), "gradient")
    assert layer.last_routing.dropped == 0 and layer.last_routing.counts.sum().item() == T * k


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_mm_equals_one_matmul_per_expert():
    torch.manual_seed(2)
    layer = DroplessMoELayer(16, 32, 4, "switch")
    packed = torch.randn(20, 16, requires_grad=True)
    counts = [7, 0, 9, 4]  # an expert with no rows
    assert grouped_mm_supported(packed, 16, 32)
    out = {}
    for impl in ("grouped_mm", "loop"):
        packed.grad = None
        layer.zero_grad()
        y = grouped_experts(layer.experts, packed, counts, impl)
        y.sum().backward()  # a broadcast gradient: grouped_mm's backward needs it made contiguous
        out[impl] = [y.detach(), packed.grad.clone()] + [p.grad.clone() for p in layer.experts.parameters()]
    ref = run_experts(layer.experts, packed.detach(), counts)
    bound = _expert_bounds(layer.experts, packed, counts)
    _within(out["loop"][0], ref, bound[0], "y, loop vs run_experts")
    for i, (a, b) in enumerate(zip(out["grouped_mm"], out["loop"])):
        _within(a, b, bound[i], f"grouped_mm vs loop, output {i}")
    assert out["grouped_mm"][3].abs().sum() > 0 and layer.experts[1].c_fc.weight.grad.abs().sum() == 0


GELU_SLOPE, GELU_CURVE = 1.13, 0.8  # max |GELU'| and |GELU''| (tanh approximation: 1.129, 0.798)


def _within(got, want, bound, where):
    diff = (got.detach().double() - want.detach().double()).abs()
    bad = ~(diff <= bound)
    assert not bad.any(), f"{where}: {int(bad.sum())} beyond the bound, by {(diff - bound)[bad].max():.3g}"


def _expert_bounds(experts, packed, counts):
    """How far two fp32 evaluations of the expert MLPs on ``packed`` (rows per expert ``counts``), and of
    their backward for ``y.sum()``, can be apart: [y, d packed, then each expert's dW1, db1, dW2, db2],
    element by element, first order (module docstring)."""
    g = lambda n: gamma(n, torch.float32)
    bounds_y, bounds_dx, bounds_p = [], [], []
    for expert, x in zip(experts, packed.detach().double().split(counts)):
        w1, b1 = expert.c_fc.weight.detach().double(), expert.c_fc.bias.detach().double()
        w2, b2 = expert.c_proj.weight.detach().double(), expert.c_proj.bias.detach().double()
        h = x @ w1.t() + b1
        e_h = g(w1.shape[1] + 1) * (x.abs() @ w1.abs().t() + b1.abs())
        a = torch.nn.functional.gelu(h, approximate="tanh")
        e_a = GELU_SLOPE * e_h + g(10) * h.abs()
        e_y = e_a @ w2.abs().t() + g(w2.shape[1] + 1) * (a.abs() @ w2.abs().t() + b2.abs())
        dy = torch.ones(x.shape[0], w2.shape[0], dtype=torch.float64)
        da = dy @ w2
        e_da = g(w2.shape[0]) * (dy.abs() @ w2.abs())
        slope = (torch.autograd.functional.jacobian(
            lambda t: torch.nn.functional.gelu(t, approximate="tanh").sum(), h) if h.numel() else h)
        dh = da * slope
        e_dh = e_da * slope.abs() + da.abs() * (GELU_CURVE * e_h + g(12) * (slope.abs() + 1))
        e_dx = e_dh @ w1.abs() + g(w1.shape[0]) * (dh.abs() @ w1.abs())
        rows = max(x.shape[0], 1)
        e_dw1 = e_dh.t() @ x.abs() + g(rows) * (dh.abs().t() @ x.abs())
        e_db1 = e_dh.sum(0) + g(rows) * dh.abs().sum(0)
        e_dw2 = dy.abs().t() @ e_a + g(rows) * (dy.abs().t() @ a.abs())
        e_db2 = g(rows) * dy.abs().sum(0)
        bounds_y.append(e_y)
        bounds_dx.append(e_dx)
        bounds_p += [e_dw1, e_db1, e_dw2, e_db2]
    return [2 * torch.cat(bounds_y), 2 * torch.cat(bounds_dx)] + [2 * b for b in bounds_p]


def test_dropless_computes_the_routed_load_where_capacity_drops():
    torch.manual_seed(3)
    h, d_ff, E, T = 8, 16, 4, 64
    capped = MoELayer(h, d_ff, E, SwitchRouter(h, E, capacity_factor=1.0))
    dropless = DroplessMoELayer(h, d_ff, E, SwitchRouter(h, E, capacity_factor=None), impl="loop")
    dropless.load_state_dict(capped.state_dict())
    x = torch.randn(T, h)
    x[:24] = x[0]  # 24 tokens ask for one expert; C = 16
    with torch.no_grad():
        capped(x)
        with FlopCounterMode(display=False) as fc:
            dropless(x)
    loads = torch.bincount(capped.last_routing.logits.argmax(-1), minlength=E)
    C = cm.moe_capacity(T, E, 1, 1.0)
    assert capped.last_routing.dropped == cm.dropped_tokens(loads, C) > 0
    assert dropless.last_routing.dropped == 0 and dropless.last_routing.counts.tolist() == loads.tolist()
    router_flops = 2 * T * h * E
    assert fc.get_total_flops() == cm.dropless_expert_flops(loads, h, d_ff) + router_flops
    assert cm.dropless_expert_flops(loads, h, d_ff) == 4 * h * d_ff * T
    assert cm.capacity_expert_flops(E, C, h, d_ff) == 4 * h * d_ff * E * C


def test_dropless_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match="build its router with capacity_factor=None"):
        DroplessMoELayer(8, 16, 4, SwitchRouter(8, 4, capacity_factor=1.25))
    with pytest.raises(ValueError, match="expert choice"):
        DroplessMoELayer(8, 16, 4, "expert_choice")
    with pytest.raises(ValueError, match="impl must be one of"):
        DroplessMoELayer(8, 16, 4, "switch", impl="cuda")
    layer = DroplessMoELayer(8, 16, 4, "switch", impl="grouped_mm").double()
    with pytest.raises(ValueError, match="use impl='loop' or 'auto'"):
        layer(torch.randn(5, 8, dtype=torch.float64))
    layer.impl = "auto"
    assert layer(torch.randn(5, 8, dtype=torch.float64)).shape == (5, 8)  # auto falls back to the loop
    with pytest.raises(ValueError, match=r"dropless=True\) processes every token: set capacity_factor=None"):
        MoEGPTConfig.tiny(dropless=True, capacity_factor=1.25)


# --- the cost model: chunks, balance -------------------------------------------------------------------

def _simulate(D, P, Cb, m, alpha):
    """A generic list scheduler: tasks on two resources (the link, in launch order; the compute unit),
    each starting when its resource is free and its dependencies are done."""
    d, p, c = D / m + alpha, P / m, Cb / m + alpha
    tasks = {("d", 0): ("link", d, [])}
    order = [("d", 0)]
    for i in range(m):
        if i + 1 < m:  # launched after the wait for dispatch i and after chunk i-1's combine launch
            tasks[("d", i + 1)] = ("link", d, [("d", i)] + ([("p", i - 1)] if i else []))
            order.append(("d", i + 1))
        tasks[("p", i)] = ("cpu", p, [("d", i)] + ([("p", i - 1)] if i else []))
        tasks[("c", i)] = ("link", c, [("p", i)])
        order += [("p", i), ("c", i)]
    free, end = {"link": 0.0, "cpu": 0.0}, {}
    for key in order:  # launch order is a topological order here
        res, dur, deps = tasks[key]
        start = max([free[res]] + [end[x] for x in deps])
        end[key] = free[res] = start + dur
    return max(end.values())


def test_chunked_time_equals_a_list_scheduling_simulation():
    rng = random.Random(0)
    for _ in range(300):
        D, P, Cb, alpha = (rng.uniform(0, 10) for _ in range(4))
        m = rng.randint(1, 9)
        assert cm.chunked_moe_layer_time(D, P, Cb, m, alpha) == pytest.approx(_simulate(D, P, Cb, m, alpha))
    assert cm.chunked_moe_layer_time(4, 30, 2, 1) == 36  # m = 1: nothing hidden
    assert cm.chunked_moe_layer_time(4, 40, 4, 4) == pytest.approx(1 + 40 + 1)  # compute-bound: d + m·p + c
    assert cm.chunked_moe_exposed_comm(4, 40, 4, 4) == pytest.approx(2)
    with pytest.raises(ValueError, match="chunks must be an int >= 1"):
        cm.chunked_moe_layer_time(1, 1, 1, 0)


def test_balance_formulas():
    assert cm.load_imbalance([8, 8, 8, 8]) == 1.0 and cm.load_imbalance([32, 0, 0, 0]) == 4.0
    assert cm.load_imbalance([10, 2, 6, 6]) == pytest.approx(10 / 6)
    assert cm.aux_free_steps_to_shift(0.05, 0.001) == 25 and cm.aux_free_steps_to_shift(0.0) == 0
    assert cm.aux_free_sync_bytes(8, 2, 4) == 2 * 3 / 4 * 2 * 8 * 8
    with pytest.raises(ValueError, match="DeepSeek-V3 uses 0.001"):
        cm.aux_free_steps_to_shift(0.1, 0)
    assert chunk_sizes(10, 4) == [3, 3, 2, 2] and split_blocks([5, 0, 2], 2) == [[3, 0, 1], [2, 0, 1]]
    assert [len(x) for x in torch.arange(10).tensor_split(4)] == chunk_sizes(10, 4)


# --- chunked expert parallelism, and the modern MoE GPT on ranks --------------------------------------------

H, D_FF, E, TOK, SEED = 8, 16, 8, 12, 5
EP_N = 4 * TOK  # every rank's rows in one weight gradient
GPT_N, GPT_DEPTH = 8 * 16, 6 * 2 + 2 + 3 * 2  # the GPT's rows per step and its chain (module docstring)
ELEM = 8  # bytes of a float64 element: the expert-parallel cases run in float64
CHUNKS = (2, 5)  # 5 > the rows some (source, destination) blocks hold: empty pieces
CASES = {"top2": lambda: Top2Router(H, E, capacity_factor=0.75),
         "skewed": lambda: SwitchRouter(H, E, capacity_factor=None)}


def _layer(case):
    torch.manual_seed(SEED)
    return MoELayer(H, D_FF, E, CASES[case]())


def _data(case, n):
    g = torch.Generator().manual_seed(SEED + 1)
    x, G = torch.randn(n * TOK, H, generator=g), torch.randn(n * TOK, H, generator=g)
    if case == "skewed":  # all of a rank's tokens pick one expert: zero-row blocks
        x = x[::TOK].repeat_interleave(TOK, 0)
    return x.view(n, TOK, H), G.view(n, TOK, H)


def _gpt():
    torch.manual_seed(3)
    return MoEGPT(MoEGPTConfig.tiny(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16,
                                    mlp_ratio=2, moe_every=1, n_experts=4, router="aux_free", top_k=2,
                                    capacity_factor=None, dropless=True, bias_update_rate=0.05))


def _sgd(model):
    with torch.no_grad():
        for p in model.parameters():
            p -= 0.1 * p.grad
            p.grad = None


def _chunked(name, m):
    n, r = dist.get_world_size(), dist.get_rank()
    ep = ExpertParallelMoE(_layer(name), chunks=m)
    xs, Gs = _data(name, n)
    x = xs[r].clone().requires_grad_(True)
    tl = Timeline()
    with comm.meter() as fwd, observe.watching(tl):  # the timeline records the spans the layer announces
        y = ep(x)
    with comm.meter() as bwd:
        ((y * Gs[r]).sum() + ep.aux_loss).backward()
    sync_replicated_grads(ep)
    return {"y": y.detach(), "dx": x.grad, "router": ep.router.w_gate.grad,
            "experts": [p.grad for p in ep.experts.parameters()],
            "fwd": [(e.op, e.nbytes, e.async_op) for e in fwd.events],
            "bwd": [(e.op, e.nbytes, e.async_op) for e in bwd.events],
            "spans": [(e.name, e.category) for e in tl.events]}


def _gpt_run():
    n, r = dist.get_world_size(), dist.get_rank()
    model, corpus, syncs = expert_parallel(_gpt(), chunks=2), MarkovCorpus(32), []
    for step in range(2):
        xb, yb = corpus.batch(step, 8, 16, rank=r, world_size=n)
        _, loss = model(xb, yb)
        (loss / n).backward()
        sync_replicated_grads(model)
        _sgd(model)
        with comm.meter() as m_sync:
            model.update_expert_biases()
        syncs.append([(e.op, e.nbytes) for e in m_sync.events])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, syncs


def _rank_run():
    cases = {(name, m): (lambda name=name, m=m: _chunked(name, m)) for name in CASES for m in CHUNKS}
    with float64():
        return run_cases({**cases, "gpt": _gpt_run})


@pytest.fixture(scope="module", params=[2, 4])
def ranks(request):
    n = request.param
    return n, launch(_rank_run, n, timeout_s=180)


@float64()
def _reference(case, n):
    layer = _layer(case)
    xs, Gs = _data(case, n)
    out, total = [], 0.0
    for r in range(n):
        x = xs[r].clone().requires_grad_(True)
        y = layer(x)
        total = total + (y * Gs[r]).sum() + layer.aux_loss
        out.append({"x": x, "y": y.detach(), "counts": layer.last_routing.counts.tolist()})
    total.backward()
    return layer, out


def _close_layer(got, want, where):
    close(got, want, model_bound(n=EP_N, depth=LAYER_DEPTH, scale=max(1.0, want.abs().max().item())), where)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("m", CHUNKS)
def test_chunked_expert_parallel_equals_one_process(ranks, name, m):
    n, results = ranks
    layer, ref = _reference(name, n)
    per = E // n
    for r in range(n):
        got = case(results[r], (name, m), r)
        assert got["y"].dtype == torch.float64
        _close_layer(got["y"], ref[r]["y"], f"y r={r}")
        _close_layer(got["dx"], ref[r]["x"].grad, f"dx r={r}")
        want = [p.grad for p in layer.experts[r * per:(r + 1) * per].parameters()]
        for a, b in zip(got["experts"], want):
            _close_layer(a, b, f"expert gradient r={r}")
        _close_layer(got["router"], layer.router.w_gate.grad, f"router gradient r={r}")


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("m", CHUNKS)
def test_chunked_all_to_alls_are_async_and_move_the_unchunked_bytes(ranks, name, m):
    n, results = ranks
    _, ref = _reference(name, n)
    S = cm.expert_parallel_send_matrix([c["counts"] for c in ref], n)
    for r in range(n):
        got = case(results[r], (name, m), r)
        fwd, bwd = got["fwd"], got["bwd"]
        assert fwd[0] == ("all_to_all", E * 8, False)  # the int64 counts, synchronous
        assert len(fwd) == 1 + 2 * m and len(bwd) == 2 * m
        assert all(op == "all_to_all" and is_async for op, _, is_async in fwd[1:] + bwd)
        A, R = sum(S[r]) * H * ELEM, sum(S[i][r] for i in range(n)) * H * ELEM
        assert sum(b for _, b, _ in fwd[1:]) == A + R  # dispatch + combine, as unchunked
        assert sum(b for _, b, _ in bwd) == A + R
        # launch order: dispatch 0, dispatch 1, combine 0, dispatch 2, combine 1, ..., combine m-1;
        # dispatch c sends this rank's chunk-c rows, combine c returns the chunk-c rows it received
        sent = [sum(x) * H * ELEM for x in split_blocks(S[r], m)]
        back = [sum(x) * H * ELEM for x in split_blocks([S[i][r] for i in range(n)], m)]
        order = [sent[0]] + [b for i in range(m) for b in ([sent[i + 1]] if i + 1 < m else []) + [back[i]]]
        assert [b for _, b, _ in fwd[1:]] == order
        spans = got["spans"]
        assert [name for name, cat in spans if cat == "experts"] == [f"experts {i}" for i in range(m)]
        assert sorted(name for name, cat in spans if cat == "a2a wait") == sorted(
            [f"wait dispatch {i}" for i in range(m)] + [f"wait combine {i}" for i in range(m)])
        assert spans[:2] == [("route", "routing"), ("counts", "counts")]
        assert [name for name, cat in spans if cat == "a2a launch"] == [
            f"launch {kind} {i}" for kind, i in [("dispatch", 0)] + [
                x for i in range(m) for x in ([("dispatch", i + 1)] if i + 1 < m else []) + [("combine", i)]]]


def _global_name(name, r, per):
    parts = name.split(".")
    if "experts" in parts:
        i = parts.index("experts") + 1
        parts[i] = str(r * per + int(parts[i]))
    return ".".join(parts)


def test_aux_free_dropless_chunked_gpt_trains_like_one_process(ranks):
    n, results = ranks
    grad_size, moved = 0.0, False
    with float64():
        model, corpus = _gpt(), MarkovCorpus(32)
        for step in range(2):
            for r in range(n):  # each rank's rows routed alone; the router counts every micro-batch's load
                xb, yb = corpus.batch(step, 8, 16, rank=r, world_size=n)
                (model(xb, yb)[1] / n).backward()
            grad_size = max([grad_size] + [p.grad.abs().max().item() for p in model.parameters()])
            _sgd(model)
            model.update_expert_biases()
            moved |= any(layer.router.expert_bias.abs().max() > 0 for layer in model.moe_layers())
    want = model.state_dict()
    assert moved  # the biases steered the routing of a step (here they move by ±γ and may come back to 0)
    grad_err = model_bound(n=GPT_N, depth=GPT_DEPTH, scale=max(1.0, grad_size))
    per = 4 // n
    for r in range(n):
        state, syncs = case(results[r], "gpt", r)
        for name, value in state.items():
            if name.endswith("expert_bias") or name.endswith("step_load"):  # moved by integer loads: exact
                assert torch.equal(value, want[_global_name(name, r, per)]), f"rank {r} {name}"
                continue
            close(value, want[_global_name(name, r, per)], sgd_bound(steps=2, lr=0.1, grad_err=grad_err),
                  f"rank {r} {name}")
        # one all-reduce per step of every layer's E int64 loads
        assert syncs == [[("all_reduce", 2 * 4 * 8)]] * 2
        assert math.isclose(cm.aux_free_sync_bytes(4, 2, n), 2 * (n - 1) / n * 2 * 4 * 8)
