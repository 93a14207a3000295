"""Activation checkpointing computes the same gradients, keeps the bytes the formulas predict.

References are independent: the same model without checkpointing, ``torch.utils.checkpoint``
(non-reentrant), per-layer bytes measured on one block, brute force over every segmentation.
The byte tests are FP32 (4 bytes per element).

Tolerances (tests/_support.py). Recomputation repeats the same operations in the same order with the
same dropout masks, so gradients are compared bitwise (ours against torch's checkpoint too). The
explicit attention core against SDPA is other arithmetic: that comparison runs in float64, the GPT's
loss within ``model_bound(n=B·T, depth=6·4 + 2, scale=max(1, |loss|))`` (a mean of B·T = 128 token
losses; c_proj sums 4·32 = 128); fresh dropout masks must move the gradients by more than that same
bound could explain (scaled by the gradients). A Linear's weight gradient under a sum is a 3-row sum
(float32): ``reorder_bound(3, Σ|x|)``. Byte and FLOP formulas against counts: a handful of float64
operations on integers, k·u far below rel 1e-12 (1e-9 for ratios of FLOP counts).
"""
import contextlib
import itertools
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch.utils.flop_counter import FlopCounterMode

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter, saved_activation_bytes
from minitorch_dist.memory.checkpointing import (
    ExplicitAttention,
    apply_recompute,
    checkpoint,
    checkpoint_sequential,
    count_forwards,
    plan_segments,
    segment_bounds,
    segment_peak_bytes,
)
from minitorch_dist.models.gpt import GPT, GPTConfig

from _support import float64, model_bound, reorder_bound

pytestmark = pytest.mark.ch07

F32 = 4
B, T = 4, 32
CFG = dict(vocab_size=64, block_size=T, n_head=4, n_embd=32, dropout=0.1)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from threads; on a busy 2-core machine they cost 5x the time."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_gpt(n_layer=3, **kw):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=n_layer, **{**CFG, **kw}))


def batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (B, T), generator=g), torch.randint(0, 64, (B, T), generator=g)


def step(model, forward=None, seed=123, metered=True):
    """One forward+backward from a fixed RNG state: (loss, grads, activation peak, bytes after forward,
    runs)."""
    x, y = batch()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # dropout masks
    meter = MemoryMeter(model)
    with count_forwards(model.blocks) as runs, meter.track() if metered else contextlib.nullcontext():
        loss = (forward or model)(x, y)[1]
        after_forward = meter.live_activation_bytes
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), grads, meter.peak["activations"], after_forward, dict(runs)


def assert_same_grads(a, b, atol=0.0):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], rtol=0, atol=atol, msg=lambda m, n=n: f"{n}: {m}")


# --- checkpoint itself ------------------------------------------------------------------------------
def test_checkpoint_multiple_inputs_non_tensor_args_tuple_outputs_and_parameters():
    torch.manual_seed(0)
    lin = nn.Linear(5, 5)

    def fn(a, b, scale, mode):
        h = F.dropout(torch.tanh(lin(a)) * scale + b, 0.3, training=True)
        return (h.sum(-1), h * 2) if mode == "pair" else h

    a, b = torch.randn(3, 5, requires_grad=True), torch.randn(3, 5, requires_grad=True)
    results = []
    for use_ckpt in (False, True):
        lin.zero_grad(set_to_none=True)
        a.grad = b.grad = None
        torch.manual_seed(7)
        s, h = checkpoint(fn, a, b, 1.5, "pair") if use_ckpt else fn(a, b, 1.5, "pair")
        (s.pow(2).sum() + h.sum()).backward()
        results.append([t.clone() for t in (a.grad, b.grad, lin.weight.grad, lin.bias.grad, torch.rand(3))])
    for ref, got in zip(*results):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the last: the RNG stream goes on unchanged


def test_parameters_get_gradients_even_when_no_input_requires_grad():
    torch.manual_seed(0)
    lin = nn.Linear(4, 2)
    x = torch.randn(3, 4)
    checkpoint(lin, x).sum().backward()
    bound = reorder_bound(3, x.abs().sum(0), torch.float32)  # a sum of 3 rows, in two orders
    torch.testing.assert_close(lin.weight.grad, x.sum(0).expand(2, 4), rtol=0, atol=bound)


def test_checkpoint_under_no_grad_runs_once_and_autograd_grad_is_refused():
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with count_forwards([lin]) as runs, torch.no_grad():
        checkpoint(lin, x)
    assert runs == {0: 1}
    with pytest.raises(RuntimeError, match="loss.backward"):
        torch.autograd.grad(checkpoint(lin, x).sum(), x)


# --- the GPT with dropout: equal gradients because the RNG state is restored ----------------------
def _loss_bound(loss, n_layer):
    """The GPT's loss computed with its reductions in another order (module docstring)."""
    return model_bound(n=B * T, depth=6 * n_layer + 2, scale=max(1.0, abs(float(loss))))


@float64()
def test_every_policy_gives_the_gradients_of_no_checkpointing_with_dropout():
    model = make_gpt(n_layer=4)
    loss0, g0, *_ = step(model)
    for policy in ("full", "sqrt"):
        loss, g, *_ = step(apply_recompute(model, policy))
        assert torch.equal(loss, loss0)
        assert_same_grads(g, g0)  # bitwise: same masks, same arithmetic
    # selective swaps SDPA for the explicit core (different arithmetic): compare with the explicit core
    loss_e, g_e, *_ = step(apply_recompute(model, "explicit"))
    assert loss0.dtype == torch.float64
    torch.testing.assert_close(loss_e, loss0, rtol=0, atol=_loss_bound(loss0, 4))
    loss_s, g_s, *_ = step(apply_recompute(model, "selective"))
    assert torch.equal(loss_s, loss_e)
    assert_same_grads(g_s, g_e)
    assert isinstance(model.blocks[0].attn, ExplicitAttention)
    # switching back restores the original modules and the original forward
    loss_n, g_n, *_ = step(apply_recompute(model, "none"))
    assert type(model.blocks[0].attn).__name__ == "CausalSelfAttention" and "forward" not in vars(model)
    assert_same_grads(g_n, g0)
    assert set(model.state_dict()) == set(make_gpt(n_layer=4).state_dict())


@float64()
def test_without_rng_restore_the_recomputed_dropout_masks_differ():
    model = make_gpt(n_layer=2)
    _, g0, *_ = step(model)

    def forward(no_restore):
        def f(idx, targets):
            h = model.embed(idx)
            for block in model.blocks:
                h = checkpoint(block, h, preserve_rng_state=not no_restore)
            logits = model.head(h)
            return logits, model.loss_fn(logits, targets)
        return f

    _, g_keep, *_ = step(model, forward(False))
    assert_same_grads(g_keep, g0)
    _, g_lost, *_ = step(model, forward(True))
    diff = max((g_lost[n] - g0[n]).abs().max().item() for n in g0)
    gmax = max(g.abs().max().item() for g in g0.values())
    rounding = model_bound(n=B * T, depth=6 * 2 + 2, scale=max(1.0, gmax))  # what reordering could explain
    assert diff > rounding, "recomputing with fresh dropout masks should change the gradients"


def test_equals_torch_utils_checkpoint_non_reentrant():
    model = make_gpt(n_layer=3)

    def torch_full(idx, targets):
        h = model.embed(idx)
        for block in model.blocks:
            h = tuc.checkpoint(block, h, use_reentrant=False)
        logits = model.head(h)
        return logits, model.loss_fn(logits, targets)

    _, g_torch, *_ = step(model, torch_full)
    _, g_ours, *_ = step(apply_recompute(model, "full"))
    assert_same_grads(g_ours, g_torch)


@pytest.mark.parametrize("n, segments", [(6, 2), (7, 3), (5, 5), (4, 1)])
def test_checkpoint_sequential_equals_torch(n, segments):
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.2), nn.GELU()) for _ in range(n)])
    x = torch.randn(5, 8, requires_grad=True)
    out = {}
    for name, run in (("torch", lambda: tuc.checkpoint_sequential(blocks, segments, x, use_reentrant=False)),
                      ("ours", lambda: checkpoint_sequential(blocks, segments, x))):
        blocks.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(3)
        run().pow(2).sum().backward()
        out[name] = [x.grad.clone()] + [p.grad.clone() for p in blocks.parameters()]
    for a, b in zip(out["ours"], out["torch"]):  # bitwise: the same masks, the same operations in order
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_checkpointed_blocks_run_forward_exactly_twice_per_step():
    n = 9
    model = make_gpt(n_layer=n)
    runs = lambda policy, segments=None: step(apply_recompute(model, policy, segments), metered=False)[4]
    assert runs("none") == dict.fromkeys(range(n), 1)
    assert runs("full") == dict.fromkeys(range(n), 2)
    # sqrt(9) = 3 segments; the last one is not checkpointed (as in torch)
    assert runs("sqrt") == {i: 2 if i < 6 else 1 for i in range(n)}
    assert runs("sqrt", [0, 1, 5, 9]) == {i: 2 if i < 5 else 1 for i in range(n)}
    # selective recomputes inside attention only: the blocks run once
    assert runs("selective") == dict.fromkeys(range(n), 1)


# --- bytes: full < sqrt < none, and the formulas -----------------------------------------------------
def test_saved_bytes_full_lt_sqrt_lt_none_and_sqrt_matches_chen_formula():
    n, k = 9, 3
    model = make_gpt(n_layer=n)
    # per-layer bytes L measured on one block alone; the boundary b is one (B, T, h) fp32 tensor
    h = torch.randn(B, T, CFG["n_embd"], requires_grad=True)
    model.train()
    L = saved_activation_bytes(lambda: model.blocks[0](h))
    b = h.numel() * F32
    none_peak = step(model)[2]
    rest = none_peak - n * L  # embedding, final norm, logits and loss: outside the chain
    full_peak, full_after = step(apply_recompute(model, "full"))[2:4]
    sqrt_peak, sqrt_after = step(apply_recompute(model, "sqrt"))[2:4]
    assert full_peak < sqrt_peak < none_peak

    # sqrt(n): costmodel (Chen §4.3) with the last segment run normally: (k-1)·b + (n/k)·L, plus the rest.
    # Tolerance: one boundary b (the formula's k·b form, and storage-shared block inputs), ~1% here.
    predicted = costmodel.checkpoint_saved_bytes(n, L, b, k, checkpoint_last=False) + rest
    chen = k * b + n // k * L + rest
    assert abs(sqrt_peak - predicted) <= b and abs(sqrt_peak - chen) <= b
    assert sqrt_after == sqrt_peak  # the peak is at the end of the forward: last segment's internals
    # every block: after forward only the n block inputs are kept (the meter sees checkpoint's inputs) ...
    assert full_after == rest + n * b
    # ... and backward adds one block's recomputed activations (the meter sees the bump; its input is shared)
    assert full_peak >= n * b + L - b
    assert full_peak <= costmodel.checkpoint_saved_bytes(n, L, b, n) + rest


def dropout_mask_bytes_per_element():
    """What autograd keeps for F.dropout, per element (a float mask on CPU, a bool one on CUDA)."""
    x = torch.randn(1000, requires_grad=True)
    return saved_activation_bytes(lambda: F.dropout(x, 0.1, training=True)) / 1000


def test_selective_recompute_drops_the_score_term_at_small_flop_cost():
    n = 3
    model = make_gpt(n_layer=n)
    a, s, hdim = CFG["n_head"], T, CFG["n_embd"]
    _, _, e_peak, e_after, _ = step(apply_recompute(model, "explicit"))
    _, _, s_peak, s_after, _ = step(apply_recompute(model, "selective"))
    # Kept per score: softmax output (4 B) + dropout mask + dropout output (4 B): Korthikanti's
    # 5as²b is 2+1+2 bytes.
    per_score = F32 + dropout_mask_bytes_per_element() + F32
    assert e_after - s_after == n * per_score * a * s * s * B
    korthikanti = (costmodel.activation_memory_bytes(s, B, hdim, a, n, recompute="none")
                   - costmodel.activation_memory_bytes(s, B, hdim, a, n, recompute="selective"))
    assert e_after - s_after == pytest.approx(korthikanti / 5 * per_score, rel=1e-12)
    assert s_peak < e_peak

    def flops(policy):
        apply_recompute(model, policy)
        x, y = batch()
        with FlopCounterMode(display=False) as fc:
            model(x, y)[1].backward()
        return fc.get_total_flops()

    base, sel, full = flops("explicit"), flops("selective"), flops("full")
    # the extra FLOPs are exactly QKᵀ and att·V once more: 2 matmuls of 2·b·s²·h each, per layer
    assert sel - base == n * 2 * 2 * B * s * s * hdim
    assert (sel - base) / base == pytest.approx(
        costmodel.recompute_overhead("selective", s, hdim, n, CFG["vocab_size"]), rel=1e-9)
    assert (full - base) / base == pytest.approx(
        costmodel.recompute_overhead("full", s, hdim, n, CFG["vocab_size"]), rel=1e-9)
    assert sel - base < 0.2 * (full - base)


# --- errors ---------------------------------------------------------------------------------------------
def test_bad_segments_and_policies_are_refused_with_the_fix():
    blocks = [nn.Identity()] * 4
    x = torch.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="between 1 and the number of layers 4, got 5"):
        checkpoint_sequential(blocks, 5, x)
    with pytest.raises(ValueError, match="got 0"):
        checkpoint_sequential(blocks, 0, x)
    with pytest.raises(ValueError, match="rise strictly from 0 to 4"):
        checkpoint_sequential(blocks, [0, 2, 2, 4], x)
    assert segment_bounds(10, None) == [0, 4, 7, 10]  # round(√10) = 3 segments, the longer first
    assert segment_bounds(16, None) == [0, 4, 8, 12, 16]
    model = make_gpt(n_layer=2)
    with pytest.raises(ValueError, match="unknown recompute policy 'half'"):
        apply_recompute(model, "half")
    with pytest.raises(ValueError, match="between 1 and the number of layers 2, got 3"):
        apply_recompute(model, "sqrt", segments=3)


# --- the planner ------------------------------------------------------------------------------------------
def brute_force(layer_bytes, boundary_bytes, budget):
    """Try every set of interior boundaries: (recompute layers, peak) of the best plan within
    ``budget``, and the lowest peak of any plan."""
    n, found, lowest = len(layer_bytes), [], None
    for r in range(n):
        for cuts in itertools.combinations(range(1, n), r):
            bounds = [0, *cuts, n]
            segs = list(zip(bounds, bounds[1:]))
            recompute = sum(b - a for a, b in segs[:-1])
            peak = sum(boundary_bytes[a] for a, _ in segs[:-1]) + max(sum(layer_bytes[a:b]) for a, b in segs)
            lowest = peak if lowest is None else min(lowest, peak)
            if peak <= budget:
                found.append((recompute, peak))
    return (min(found) if found else None), lowest


def test_planner_matches_brute_force_on_uneven_layers():
    rng = random.Random(0)
    for _ in range(30):
        n = rng.randint(1, 7)
        layer_bytes = [rng.randint(1, 40) * 1000 for _ in range(n)]
        boundary_bytes = [rng.randint(1, 10) * 1000 for _ in range(n)]
        _, lowest = brute_force(layer_bytes, boundary_bytes, float("inf"))
        for budget in (lowest, (lowest + sum(layer_bytes)) / 2, sum(layer_bytes), lowest - 1):
            best, _ = brute_force(layer_bytes, boundary_bytes, budget)
            if best is None:
                with pytest.raises(ValueError, match="is below the smallest possible peak"):
                    plan_segments(layer_bytes, boundary_bytes, budget)
                continue
            bounds = plan_segments(layer_bytes, boundary_bytes, budget)
            assert bounds[0] == 0 and bounds[-1] == n
            peak = segment_peak_bytes(layer_bytes, boundary_bytes, bounds)
            assert (bounds[-2], peak) == best, (layer_bytes, boundary_bytes, budget, bounds)


def test_planner_error_names_budget_and_smallest_peak():
    with pytest.raises(ValueError, match=r"budget 1.2 MiB is below the smallest possible peak 1.5 MiB"):
        plan_segments([2**20, 2**20], [2**19, 2**19], 1.2 * 2**20)  # best: [0,1,2] keeps 0.5 + 1 MiB
    assert plan_segments([2**20, 2**20], [2**19, 2**19], 2 * 2**20) == [0, 2]  # fits without checkpointing


def test_a_planned_split_runs_on_the_gpt_within_its_predicted_peak():
    n = 6
    model = make_gpt(n_layer=n)
    h = torch.randn(B, T, CFG["n_embd"], requires_grad=True)
    L = saved_activation_bytes(lambda: model.blocks[0](h))
    b = h.numel() * F32
    rest = step(model)[2] - n * L
    budget = 2 * b + 2 * L  # forces checkpointing: the whole chain is 6 L
    bounds = plan_segments([L] * n, [b] * n, budget)
    peak, _, runs = step(apply_recompute(model, "sqrt", segments=bounds))[2:]
    assert peak - rest <= segment_peak_bytes([L] * n, [b] * n, bounds) <= budget
    assert runs == {i: 2 if i < bounds[-2] else 1 for i in range(n)}
