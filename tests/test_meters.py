"""MemoryMeter counts exactly the bytes a hand count predicts; Timer measures a known sleep.

Expected numbers are derived from layer shapes and from what autograd must keep for backward,
never read back from the meter. FP32 throughout: 4 bytes per element.
"""
import gc
import time

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from minitorch_dist.analysis.meters import MemoryMeter, Timer, saved_activation_bytes, tensor_bytes

F32 = 4  # bytes per float32 element


def linear_bytes(d_in, d_out, bias=True):
    return F32 * (d_in * d_out + (d_out if bias else 0))


def mlp(d0, d1, d2, seed=0):
    """y = relu(W2 relu(W1 x + b1) + b2)"""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d0, d1), nn.ReLU(), nn.Linear(d1, d2), nn.ReLU())


def graph_saved_bytes(root: torch.Tensor, params) -> int:
    """Independent count: walk the autograd graph and read every ``_saved_*`` tensor.

    Unique storages, parameters excluded."""
    param_ptrs = {p.untyped_storage().data_ptr() for p in params}
    seen, stack, ptrs = set(), [root.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if attr.startswith("_saved_"):
                v = getattr(node, attr)
                if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() not in param_ptrs:
                    ptrs[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        stack += [fn for fn, _ in node.next_functions]
    return sum(ptrs.values())


# --- model states ---------------------------------------------------------------------------------
def test_parameters_gradients_and_adam_state_are_counted_exactly():
    d0, d1, d2 = 5, 7, 3
    model = mlp(d0, d1, d2)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    meter = MemoryMeter(model, opt)
    P = linear_bytes(d0, d1) + linear_bytes(d1, d2)
    now = meter.current()
    assert (now["parameters"], now["gradients"], now["optimizer_state"], now["activations"]) == (P, 0, 0, 0)

    with meter.track():
        model(torch.randn(4, d0)).sum().backward()
        assert meter.current()["gradients"] == P
        opt.step()
    # Adam keeps exp_avg and exp_avg_sq (2 x params) and one 0-d float32 `step` per parameter tensor.
    n_param_tensors = 4  # W1, b1, W2, b2
    now = meter.current()
    assert now["optimizer_state"] == 2 * P + n_param_tensors * F32
    assert now["total"] == P + P + 2 * P + n_param_tensors * F32
    assert meter.peak["parameters"] == P and meter.peak["gradients"] == P
    assert meter.peak["optimizer_state"] == 2 * P + n_param_tensors * F32


def test_sgd_state_zero_without_momentum_and_one_copy_with_it():
    model = mlp(6, 4, 2)
    P = linear_bytes(6, 4) + linear_bytes(4, 2)
    for momentum, expected in ((0.0, 0), (0.9, P)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
        model(torch.randn(3, 6)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        meter = MemoryMeter(model, opt)
        assert meter.current()["optimizer_state"] == expected
        assert meter.current()["gradients"] == 0


def test_tied_weights_are_counted_once():
    vocab, d = 11, 6
    emb, head = nn.Embedding(vocab, d), nn.Linear(d, vocab, bias=False)
    head.weight = emb.weight  # the usual tie: one Parameter, two modules
    model = nn.Sequential(emb, head)
    assert MemoryMeter(model).current()["parameters"] == F32 * vocab * d

    # Two distinct Parameter objects over one storage (a tie made by aliasing) are one allocation too.
    a = nn.Parameter(torch.randn(vocab, d))
    b = nn.Parameter(a.detach())
    holder = nn.Module()
    holder.a, holder.b = a, b
    assert len(list(holder.parameters())) == 2
    assert MemoryMeter(holder).current()["parameters"] == F32 * vocab * d


def test_tensor_bytes_counts_storages_not_views():
    w = torch.randn(8, 5)
    assert tensor_bytes(w) == F32 * 40
    assert tensor_bytes([w, w.t(), w.view(-1), {"row": w[0]}]) == F32 * 40  # one storage
    assert tensor_bytes(w[:1].clone()) == F32 * 5
    assert tensor_bytes(w[:1]) == F32 * 40  # a view keeps its whole storage alive
    assert tensor_bytes([w, torch.zeros(3, dtype=torch.float64)]) == F32 * 40 + 8 * 3
    assert tensor_bytes([]) == 0


# --- activations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("x_requires_grad", [False, True])
def test_activations_of_a_relu_chain_match_the_hand_count(x_requires_grad):
    B, d0, d1, d2 = 3, 5, 7, 2
    model = mlp(d0, d1, d2)
    x = torch.randn(B, d0, requires_grad=x_requires_grad)
    # What autograd must keep for y = relu(W2 h1 + b2), h1 = relu(W1 x + b1):
    #   x            -- Linear 1 needs it for dW1
    #   h1           -- ReLU 1 needs its output for its mask; Linear 2 needs it for dW2 (same storage)
    #   y            -- ReLU 2 needs its output
    #   W1^T, W2^T   -- parameters, not activations
    # The pre-activations W1 x + b1 and W2 h1 + b2 are not kept: ReLU's backward uses its output.
    expected = F32 * B * (d0 + d1 + d2)
    meter = MemoryMeter(model)
    with meter.track():
        loss = model(x).sum()
        assert meter.live_activation_bytes == expected
        loss.backward()
    assert meter.peak["activations"] == expected
    assert meter.live_activation_bytes == 0  # autograd freed everything it saved
    assert meter.current()["activations"] == 0

    # The same number from a different mechanism: read the graph autograd builds without the meter.
    assert graph_saved_bytes(model(x).sum(), model.parameters()) == expected


def test_gradients_are_unchanged_by_the_hooks_and_retain_graph_works():
    x = torch.randn(4, 5)
    ref = mlp(5, 6, 3)
    ref(x).pow(2).sum().backward()
    model = mlp(5, 6, 3)
    meter = MemoryMeter(model)
    with meter.track():
        loss = model(x).pow(2).sum()
        loss.backward(retain_graph=True)  # every saved tensor is unpacked once ...
        assert meter.live_activation_bytes > 0  # ... and kept for the second pass
        loss.backward()  # ... and unpacked again
    assert meter.live_activation_bytes == 0
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad)


def test_dropping_the_graph_without_backward_releases_activations():
    model = mlp(5, 6, 3)
    meter = MemoryMeter(model)
    with meter.track():
        y = model(torch.randn(2, 5))
        assert meter.live_activation_bytes > 0
        del y
    gc.collect()
    assert meter.live_activation_bytes == 0  # no reference cycle keeps saved tensors alive


def test_no_grad_forward_saves_nothing():
    model = mlp(5, 6, 3)
    meter = MemoryMeter(model)
    with meter.track(), torch.no_grad():
        model(torch.randn(2, 5))
    assert meter.peak["activations"] == 0
    assert meter.peak["parameters"] == linear_bytes(5, 6) + linear_bytes(6, 3)


def test_peak_total_is_reached_during_backward():
    # Sizes chosen so that the worst moment is inside backward: layer 2's gradients (4.2 KiB) exist
    # while layer 1's activations x and h1 (6 KiB) are still alive, and y (3 KiB) is already freed.
    B, d = 24, 32
    model = mlp(d, d, d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    meter = MemoryMeter(model, opt)
    with meter.track():
        model(torch.randn(B, d)).sum().backward()
        opt.step()
    G2 = linear_bytes(d, d)  # grads of W2, b2
    P, A = 2 * G2, F32 * B * 3 * d
    x_h1 = F32 * B * 2 * d
    assert meter.peak["activations"] == A and meter.peak["gradients"] == P
    # Backward of relu2 frees y, backward of Linear 2 produces dW2, db2 -- accumulated at once
    # (autograd runs AccumulateGrad first) -- while ReLU 1 and Linear 1 still hold h1 and x.
    assert meter.peak["total"] == P + G2 + x_h1
    assert meter.peak["total"] > max(P + A, 2 * P)  # more than the end of forward or of backward


def test_saved_activation_bytes_without_a_model():
    B, d0, d1, d2 = 2, 4, 3, 5
    model = mlp(d0, d1, d2)
    x = torch.randn(B, d0)
    # Parameters are recognised as nn.Parameter (or views of one) even without a model.
    assert saved_activation_bytes(lambda: model(x).sum()) == F32 * B * (d0 + d1 + d2)


def test_checkpoint_keeps_only_segment_inputs():
    B, d, n_blocks = 4, 8, 3
    torch.manual_seed(0)
    blocks = nn.ModuleList(mlp(d, d, d) for _ in range(n_blocks))
    x = torch.randn(B, d)

    def run(ckpt):
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False) if ckpt else b(h)
        h.sum().backward()

    plain, ckpt = MemoryMeter(blocks), MemoryMeter(blocks)
    with plain.track():
        run(False)
    with ckpt.track():
        run(True)
    # Each block keeps its input, h1 and its output; a block's output is the next block's input.
    assert plain.peak["activations"] == (1 + 2 * n_blocks) * F32 * B * d
    assert ckpt.peak["activations"] == n_blocks * F32 * B * d  # each block: its input only


def test_track_resets_peaks_and_refuses_nesting():
    model = mlp(5, 6, 3)
    meter = MemoryMeter(model)
    with meter.track():
        model(torch.randn(8, 5)).sum().backward()
    big = meter.peak["activations"]
    with meter.track():
        model(torch.randn(1, 5)).sum().backward()
    assert 0 < meter.peak["activations"] < big
    with meter.track():
        with pytest.raises(RuntimeError, match="already active"):
            with meter.track():
                pass


def test_report_is_a_table_of_the_categories():
    model = mlp(5, 6, 3)
    meter = MemoryMeter(model)
    with meter.track():
        model(torch.randn(2, 5)).sum().backward()
    table = meter.report(unit="B")
    for k in ("parameters", "gradients", "optimizer_state", "activations", "total"):
        assert k in table
    assert repr(table) == str(table)  # a notebook shows the table, not a quoted string
    assert f"{float(linear_bytes(5, 6) + linear_bytes(6, 3)):.3f}" in table
    with pytest.raises(ValueError, match="unit"):
        meter.report(unit="MB")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_peak_is_reported_and_covers_the_counted_bytes():
    model = mlp(64, 256, 64).cuda()
    opt = torch.optim.Adam(model.parameters())
    meter = MemoryMeter(model, opt)
    assert meter.device.type == "cuda"
    with meter.track():
        model(torch.randn(128, 64, device="cuda")).sum().backward()
        opt.step()
    assert meter.peak["activations"] == F32 * 128 * (64 + 256 + 64)
    assert meter.peak["cuda_peak_allocated"] >= meter.peak["total"]


# --- Timer ----------------------------------------------------------------------------------------
@pytest.mark.serial  # held to wall-clock time
def test_timer_measures_a_sleep():
    with Timer() as t:
        time.sleep(0.05)
    assert 0.05 <= t.elapsed < 0.5


def test_timer_measure_runs_warmup_then_repeats():
    calls = []
    stats = Timer.measure(lambda: (calls.append(1), time.sleep(0.01)), repeat=3, warmup=2)
    assert len(calls) == 5 and len(stats["times"]) == 3
    assert 0.01 <= stats["min"] <= stats["median"] <= max(stats["times"]) < 0.5
    assert stats["mean"] == pytest.approx(sum(stats["times"]) / 3)
    with pytest.raises(ValueError, match="repeat"):
        Timer.measure(lambda: None, repeat=0)


def test_byte_counter_counts_reads_writes_and_skips_views():
    """ByteCounter (chapter 11's eager-traffic meter): an out-of-place op reads its inputs and
    writes a new result; an in-place op writes the tensor it mutates; a view moves nothing."""
    from minitorch_dist.analysis.meters import ByteCounter

    x, y = torch.randn(10, 4), torch.randn(10, 4)  # 160 bytes each
    with ByteCounter() as c:
        z = x + y
        z.add_(x)
        x.view(40)
        x[:, 0]
    assert (c.read, c.written) == (4 * 160, 2 * 160)
    assert c.ops == ["add", "add_"]


def test_memory_meter_tells_meta_storages_apart():
    """Every meta storage sits at address 0: keyed by address, a meta model would count as one tensor."""
    from minitorch_dist.models.gpt import GPT, GPTConfig

    with torch.device("meta"):
        meta = GPT(GPTConfig.tiny())
    cpu = GPT(GPTConfig.tiny())
    assert MemoryMeter(meta).current() == MemoryMeter(cpu).current()
    assert MemoryMeter(meta).current()["parameters"] == 4 * cpu.num_params()
