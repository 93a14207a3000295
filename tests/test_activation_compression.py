"""Activation compression (Gist, Jain et al. 2018): saved bytes equal each encoding's size formula,
lossless encodings leave gradients bitwise unchanged, lossy ones move the loss by a stated amount.

The bytes are measured by the context's own counter (hooks do not nest, so an outer MemoryMeter sees
nothing) and compared with ``encoded_nbytes`` applied to the list of tensors an independent, plain
``saved_tensors_hooks`` pass records for the same forward.

Tolerances (tests/_support.py's model). Lossless encodings (masks, "none") are bitwise: exact
comparisons. int8's decoding error is at most half a step s = max|x| / 127 in exact arithmetic;
float32 adds the rounding of s, of x / s and of q · s (|q| <= 127), and of the difference: at most
``(1 + 4 · 128 · u_32)`` times half a step (~3e-5 relative). The sin/cos check bounds the decoded
input's error by the format (fp16: 2^-11 relative, 2^-25 for subnormals; int8: half a step plus
float32's rounding of x / s and q · s) plus two fp32 cos evaluations. Lossy training: a plain
``saved_tensors_hooks`` pass doing the same casts (``.half()``, ``quantize_int8``) in the same places
gives bitwise the same losses and gradients (the same operations in the same order); and the
loss moves, against training without encoding, by less than the format's own relative precision
(fp16 u = 2^-11; int8 half a step of max|x|, 1/254): the forward (and so each loss) is exact,
only the updates see the rounded activations, and 15 steps of lr 0.5 move the weights by a small
fraction of that. A wrong encoding of one tensor breaks the bitwise comparison.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.communication.activation_compression import (
    GistReLU,
    compress_activations,
    dequantize_int8,
    encoded_nbytes,
    gist_relu,
    pack_bits,
    quantize_int8,
    unpack_bits,
)

from _support import roundoff

pytestmark = pytest.mark.ch09


def _mlp(relu=GistReLU, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), relu(), torch.nn.Linear(64, 48), relu(),
                               torch.nn.Linear(48, 4))


def _data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(96, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).tanh()
    return x, y


def _saved_tensors(fn):
    """(numel, dtype, is_parameter) of every tensor autograd saves while ``fn()`` runs: a plain hook."""
    seen = []

    def pack(t):
        base = t._base if t._base is not None else t
        seen.append((t.numel(), t.dtype, isinstance(base, torch.nn.Parameter)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return seen


def _predicted(saved, encoding):
    raw = enc = 0
    for n, dtype, is_param in saved:
        if is_param:
            continue
        size = torch.empty((), dtype=dtype).element_size()
        raw += n * size
        if dtype == torch.bool:
            enc += encoded_nbytes(n, "mask")
        elif dtype.is_floating_point:
            enc += encoded_nbytes(n, encoding, size)
        else:
            enc += n * size
    return raw, enc


# --- the encodings on their own ----------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 1001])
def test_pack_bits_round_trips_and_takes_n_over_8_bytes(n):
    g = torch.Generator().manual_seed(n)
    mask = torch.rand(n, generator=g) < 0.4
    packed = pack_bits(mask.view(1, n))
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 8)
    assert torch.equal(unpack_bits(packed, (1, n)), mask.view(1, n))
    # the layout: flag i is bit i % 8 of byte i // 8 (computed here with Python integers)
    flags = mask.tolist() + [False] * ((-n) % 8)
    want = [sum(int(f) << i for i, f in enumerate(flags[b:b + 8])) for b in range(0, len(flags), 8)]
    assert packed.tolist() == want


def test_pack_bits_rejects_non_bool():
    with pytest.raises(TypeError, match="bool"):
        pack_bits(torch.ones(4))


def test_int8_error_is_at_most_half_a_step():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(3)) * 5
    q, scale = quantize_int8(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and q.abs().max() == 127
    err = (dequantize_int8(q, scale) - x).abs().max().item()
    step = x.abs().max().item() / 127
    # float32: s, x / s (|x / s| <= 127) and q · s (|q| <= 127) rounded, and the difference: 4 · 128 u
    slack = 4 * 128 * roundoff(torch.float32)
    assert err <= step / 2 * (1 + slack), f"int8 error {err} above half a step {step / 2}"
    q0, s0 = quantize_int8(torch.zeros(5))
    assert torch.equal(dequantize_int8(q0, s0), torch.zeros(5))


def test_gist_relu_equals_torch_relu():
    x = torch.randn(40, 30, generator=torch.Generator().manual_seed(4), requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(40, 30)
    y, y2 = gist_relu(x), torch.relu(x2)
    assert torch.equal(y, y2)
    y.backward(g)
    y2.backward(g)
    assert torch.equal(x.grad, x2.grad)
    # what it saves: a bool mask only (torch.relu saves its float output)
    saved = _saved_tensors(lambda: gist_relu(x))
    assert saved == [(1200, torch.bool, False)]


# --- saved bytes equal the encoding's size ------------------------------------------------------------

@pytest.mark.parametrize("encoding,per_element", [("fp16", 2), ("int8", 1), ("none", 4)])
def test_one_saved_tensor_takes_the_formula_bytes(encoding, per_element):
    n = 1003
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), requires_grad=True)
    gist = compress_activations(encoding)
    with gist:
        y = torch.sin(x)  # saves x: n floats
    assert gist.tensors == 1 and gist.raw_bytes == 4 * n
    assert gist.encoded_bytes == n * per_element + (4 if encoding == "int8" else 0)
    y.sum().backward()
    # backward computes cos(x') at the decoded x'; cos is 1-Lipschitz, so |cos x' - cos x| <= |x' - x|,
    # plus the rounding of the two fp32 cos evaluations (2^-20: 8 ulps of 1 each). The decoding error:
    #   fp16: round to nearest, |x' - x| <= |x| * 2^-11 (normal numbers), <= 2^-25 (subnormals, |x| < 2^-14);
    #   int8: q = round(x / s), s = max|x| / 127: |x' - x| <= s / 2, plus fp32 rounding of x / s and q * s.
    xa = x.detach().abs()
    err = (x.grad - torch.cos(x.detach())).abs()
    if encoding == "none":
        assert torch.equal(x.grad, torch.cos(x.detach()))
        return
    if encoding == "fp16":
        bound = xa * 2**-11 + 2**-25 + 2**-20
    else:
        bound = xa.max() / 127 / 2 + xa.max() * 2**-22 + 2**-20
    assert (err <= bound).all(), (err - bound).max().item()


def test_relu_mask_takes_n_over_8_bytes():
    x = torch.randn(37, 11, requires_grad=True)
    gist = compress_activations("fp16")
    with gist:
        gist_relu(x)
    assert gist.by_encoding["mask"] == [1, 37 * 11, math.ceil(37 * 11 / 8)]
    assert gist.encoded_bytes == math.ceil(407 / 8)


@pytest.mark.parametrize("encoding", ["none", "fp16", "int8"])
def test_mlp_saved_bytes_equal_the_sum_of_the_formulas(encoding):
    model, (x, y) = _mlp(), _data()
    fwd = lambda: F.mse_loss(model(x), y)
    saved = _saved_tensors(fwd)
    # sanity: the independent record holds the two ReLU masks, the activations and parameter views
    assert sum(d == torch.bool for _, d, _ in saved) == 2 and any(p for *_, p in saved)
    raw, enc = _predicted(saved, encoding)
    gist = compress_activations(encoding)
    with gist:
        fwd()
    assert (gist.raw_bytes, gist.encoded_bytes) == (raw, enc)
    assert gist.parameters_skipped == sum(p for *_, p in saved)
    assert gist.by_encoding["mask"] == [2, 96 * 64 + 96 * 48, math.ceil(96 * 64 / 8) + math.ceil(96 * 48 / 8)]


def test_outer_memory_meter_sees_nothing_inside():
    """Why the context counts for itself: only the innermost saved_tensors_hooks fires."""
    model, (x, y) = _mlp(), _data()
    meter = MemoryMeter()
    gist = compress_activations("fp16")
    with meter.track(), gist:
        F.mse_loss(model(x), y)
    assert meter.peak["activations"] == 0 and gist.encoded_bytes > 0


# --- gradients and loss --------------------------------------------------------------------------------

def _same_casts(encoding):
    """A plain ``saved_tensors_hooks`` pass that rounds every saved floating tensor that is not a
    parameter (or a view of one) as ``encoding`` does, and keeps it decoded: the reference for the
    lossy encodings, written here apart from the library's hooks."""
    def pack(t):
        base = t._base if t._base is not None else t
        if isinstance(base, torch.nn.Parameter) or not t.is_floating_point():
            return t
        if encoding == "fp16":
            return t.detach().to(torch.float16).to(t.dtype)
        return dequantize_int8(*quantize_int8(t.detach()), dtype=t.dtype)

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def _train(encoding, steps=15, relu=GistReLU, reference=False):
    model, (x, y) = _mlp(relu), _data()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], None
    for step in range(steps):
        if reference:
            ctx = _same_casts(encoding)
        else:
            ctx = compress_activations(encoding) if encoding else torch.enable_grad()
        with ctx:
            loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
        losses.append(loss.item())
    return torch.tensor(losses, dtype=torch.float64), grads


def test_lossless_masks_give_bitwise_identical_gradients_and_training():
    ref_losses, ref_grads = _train(None)
    torch_losses, torch_grads = _train(None, relu=torch.nn.ReLU)
    losses, grads = _train("none")
    for a, b, c in zip(grads, ref_grads, torch_grads):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert torch.equal(losses, ref_losses) and torch.equal(ref_losses, torch_losses)
    assert ref_losses[-1] < 0.7 * ref_losses[0], "sanity: the model trains"


@pytest.mark.parametrize("encoding,tol", [("fp16", roundoff(torch.float16)), ("int8", 1 / 254)])
def test_lossy_encodings_move_the_loss_by_a_small_stated_amount(encoding, tol):
    """tol: the format's relative precision (module docstring); the same casts done by plain hooks give
    bitwise the same training."""
    ref_losses, ref_grads = _train(None)
    losses, grads = _train(encoding)
    same_losses, same_grads = _train(encoding, reference=True)
    assert torch.equal(losses, same_losses), f"{encoding}: not the losses of the same casts"
    for a, b in zip(grads, same_grads):
        assert torch.equal(a, b), f"{encoding}: not the gradients of the same casts"
    rel = ((losses - ref_losses).abs() / ref_losses).max().item()
    assert rel <= tol, f"{encoding}: loss moved by {rel:.2e} (relative) over 15 steps, more than {tol}"
    assert not all(torch.equal(a, b) for a, b in zip(grads, ref_grads)), "a lossy encoding changes something"


def test_bad_encoding_is_named():
    with pytest.raises(ValueError, match="'int4' is not one of"):
        compress_activations("int4")
    with pytest.raises(ValueError, match="is not one of"):
        encoded_nbytes(10, "bf8")
