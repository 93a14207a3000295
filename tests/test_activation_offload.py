"""Activation offloading (Rhu et al. 2016, vDNN §3) through saved-tensor hooks.

Checked against independent computations: gradients bitwise equal to a run without hooks and to
``torch.autograd.graph.save_on_cpu``; bytes moved equal to a plain counting pass over the same
saved tensors (parameters recognised by storage address, not by type) and to the cost model.
Every comparison is exact: offloading copies (exactly) and changes no arithmetic; bytes are counts.
"""
import pytest
import torch

from minitorch_dist import costmodel as cm
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.activation_offload import offload_activations
from minitorch_dist.models.gpt import GPT, GPTConfig

pytestmark = pytest.mark.ch07

B, T = 4, 32


def _model(dropout=0.0, device="cpu"):
    torch.manual_seed(0)
    return GPT(GPTConfig.tiny(dropout=dropout)).to(device)


def _batch(device="cpu"):
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (B, T), generator=g)
    return x.to(device), torch.roll(x, -1, dims=1).to(device)


def _grads(model, ctx=None, seed=123):
    """One forward (under ``ctx`` if given) and backward; the gradients by name."""
    model.zero_grad(set_to_none=True)
    x, y = _batch(next(model.parameters()).device)
    torch.manual_seed(seed)  # same dropout masks in every run
    if ctx is None:
        loss = model(x, y)[1]
    else:
        with ctx:
            loss = model(x, y)[1]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_bitwise(a, b):
    (la, ga), (lb, gb) = a, b
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"gradient of {n} differs"


def _saved_tensor_bytes(model, min_bytes=0):
    """Independent count: a pass-through hook that sums the bytes of every saved tensor that does
    not live inside a parameter's storage (address range test), split at ``min_bytes``."""
    ranges = [(p.untyped_storage().data_ptr(), p.untyped_storage().nbytes()) for p in model.parameters()]

    def in_param(t):
        ptr = t.untyped_storage().data_ptr()
        return any(lo <= ptr < lo + n for lo, n in ranges)

    big, small = [], []

    def pack(t):
        if not in_param(t):
            nb = t.numel() * t.element_size()
            (big if nb >= min_bytes else small).append(nb)
        return t

    x, y = _batch(next(model.parameters()).device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)[1].backward()
    model.zero_grad(set_to_none=True)
    return big, small


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_gradients_bitwise_equal_without_offload_and_save_on_cpu(dropout):
    model = _model(dropout)
    plain = _grads(model)
    off = offload_activations()
    _assert_bitwise(plain, _grads(model, off))
    _assert_bitwise(plain, _grads(model, torch.autograd.graph.save_on_cpu()))
    assert off.tensors_to_host > 0 and off.host_bytes == 0  # every host copy freed after backward
    if dropout:  # the masks matter: another seed gives other gradients, so the equality above is not vacuous
        assert not torch.equal(plain[0], _grads(model, seed=7)[0])


def test_bytes_moved_equal_saved_bytes_counted_independently():
    model = _model()
    big, small = _saved_tensor_bytes(model)
    assert not small and len(big) > 10
    off = offload_activations()
    _grads(model, off)
    assert off.bytes_to_host == sum(big) == off.bytes_to_device
    assert off.tensors_to_host == len(big) == off.tensors_to_device
    assert off.bytes_kept == 0 and off.parameters_skipped > 0
    assert 0 < off.peak_host_bytes <= off.bytes_to_host and off.host_bytes == 0
    assert cm.activation_offload_bytes(sum(big)) == {"to_host": off.bytes_to_host,
                                                     "to_device": off.bytes_to_device,
                                                     "total": off.bytes_to_host + off.bytes_to_device}
    # a second backward through the same graph fetches everything again; nothing more goes out
    off.reset()
    x, y = _batch()
    with off:
        loss = model(x, y)[1]
    loss.backward(retain_graph=True)
    loss.backward()
    assert off.bytes_to_device == 2 * off.bytes_to_host == 2 * sum(big)


def test_min_bytes_keeps_small_tensors_on_the_device():
    model = _model()
    sizes = sorted(set(_saved_tensor_bytes(model)[0]))
    threshold = sizes[len(sizes) // 2]  # a real size: tensors of exactly this many bytes go to the host
    big, small = _saved_tensor_bytes(model, threshold)
    assert big and small
    off = offload_activations(min_bytes=threshold)
    _assert_bitwise(_grads(model), _grads(model, off))
    assert off.bytes_to_host == sum(big) == off.bytes_to_device and off.tensors_to_host == len(big)
    assert off.bytes_kept == sum(small) and off.tensors_kept == len(small)
    assert 0 < off.peak_device_bytes <= sum(small) and off.device_bytes == 0


def test_the_host_copy_is_a_snapshot_not_an_alias():
    """A copy, not the device tensor itself: changing the original after the forward (behind
    autograd's back) changes the gradient without offload and not with it."""
    def grad(offload):
        x = torch.linspace(0.1, 1.0, 1000, requires_grad=True)
        off = offload_activations()
        with (off if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)):
            y = x.sin()  # saves x
        x.data.add_(1.0)
        y.sum().backward()
        return x.grad, off

    g_plain, _ = grad(False)
    g_off, off = grad(True)
    expected = torch.linspace(0.1, 1.0, 1000).cos()
    torch.testing.assert_close(g_off, expected, rtol=0, atol=0)
    # without offload backward reads the changed x: the gradient at x + 1, bit for bit (the same ops)
    torch.testing.assert_close(g_plain, (torch.linspace(0.1, 1.0, 1000) + 1.0).cos(), rtol=0, atol=0)
    assert off.bytes_to_host == off.bytes_to_device == 1000 * 4


def test_memory_meter_outside_sees_nothing_the_offload_counts_it():
    """Only the innermost saved_tensors_hooks fire: an outer MemoryMeter sees no activations."""
    model = _model()
    x, y = _batch()
    meter = MemoryMeter(model)
    with meter.track():
        model(x, y)[1].backward()
    assert meter.peak["activations"] > 0
    off = offload_activations()
    with meter.track():
        with off:
            loss = model(x, y)[1]
        loss.backward()
    assert meter.peak["activations"] == 0
    assert off.peak_host_bytes > 0
    # kept on the device by min_bytes: counted by the offload's device pool, still not by the meter
    off2 = offload_activations(min_bytes=2**40)
    with meter.track():
        with off2:
            loss = model(x, y)[1]
        loss.backward()
    assert meter.peak["activations"] == 0 and off2.bytes_to_host == 0
    assert off2.peak_device_bytes == off.peak_host_bytes  # same tensors, same times, other pool


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="min_bytes"):
        offload_activations(min_bytes=-1)
    with pytest.raises(ValueError, match="pin_memory"):
        offload_activations(pin_memory="yes")


@pytest.mark.gpu
def test_cuda_offload_to_pinned_host_memory_lowers_the_device_peak():
    model = _model(0.1, "cuda")
    plain = _grads(model)
    off = offload_activations()  # pins automatically for CUDA tensors
    _assert_bitwise(plain, _grads(model, off))
    big, _ = _saved_tensor_bytes(model)
    assert off.bytes_to_host == sum(big) == off.bytes_to_device

    seen = []
    probe = offload_activations()
    orig_pack = probe._pack
    probe.pack_hook = lambda t: seen.append(orig_pack(t)) or seen[-1]
    x, y = _batch("cuda")
    with probe:
        loss = model(x, y)[1]
    assert all(h.tensor.is_pinned() and h.tensor.device.type == "cpu" for h in seen if hasattr(h, "tensor"))
    loss.backward()
    seen.clear()  # drop the probe's host copies before measuring peaks

    def peak(ctx):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _grads(model, ctx)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    assert peak(offload_activations()) < peak(None)
