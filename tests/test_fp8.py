"""Chapter 08, FP8: the casts, the two scaling recipes, the fp8 GEMM, the bytes of the cost model, and
FSDP all-gathering fp8 weights (``FP8Linear`` and fp8 training: ``tests/test_fp8_linear.py``).

Expected values come from elsewhere than the module under test: the rounding of
``costmodel.round_to_format`` (float64, no fp8 dtype involved), scales and windows computed by hand
in Python loops, float64 matmuls of the dequantised operands, and, for FSDP, one process computing the
dense model with each rank's shard quantised by hand.

Tolerances (derived in tests/_support.py). A round trip through a format with m mantissa bits errs
by at most half an ulp, a relative 2^-(m+1) (1/16 in E4M3, 1/8 in E5M2), or half the smallest
subnormal divided by the scale below the normal range; float32 adds its rounding of x·s and of the
dequantising division, each u_32 of the value, i.e. at most ``2^(m+1) · γ_3`` of the bound. A scale
is one float32 division (``fp8_max / amax``): within u_32 of the float64 quotient; a dequantised
value ``q / s`` two roundings from ``fp8_max / scale``. Emulated fp8 GEMMs run in fp32 (K-block
products, the division by s_a·s_b, the promotion's additions: K + 4 operations): against float64 on
the same dequantised values, ``reorder_bound(K + 4, |A| @ |B|^T)``. The limited-precision accumulator
is elementwise float32 arithmetic (the same on every CPU); its promoted error is a sum of
round-to-nearest errors, each uniform within half an ulp of the partial sum: computed here, the
standard deviation sigma of that sum, and we allow 5 sigma.

FSDP with fp8 weights against one process with the same quantised weights runs in float64 (the
scales and fp8 casts are float32 by design, in the library and in the reference alike): the forward
(3 Linear layers), the loss and the backward chain 7 reductions of at most D = 64 terms:
``model_bound(n=64, depth=7)`` scaled by the values, and one SGD step of lr LR on gradients within
that (``sgd_bound``), ~1e-10; a shard quantised with another rank's scale moves a weight by up to
2^-4 of itself. The bytes are metered on a float32 run (the chapter's point: fp8 is half of bf16
and a quarter of fp32). fp8 weights computed in bf16 (``param_dtype``): against one process doing the
same casts (weights and input to bf16) on the same rows, on one thread like the rank: the same
operations in the same order, bitwise. A GPT trained with fp8 weights against fp32 (the chapter's
claim): the losses agree, relatively, to E4M3's precision 2^-4; a stale or mis-scaled weight stops
the loss from falling.
"""
import collections
import functools
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from minitorch_dist.costmodel.precision import (
    all_gather_buffer_bytes,
    format_info,
    quantized_bytes,
    round_to_format,
    weight_bytes_per_param,
)
from minitorch_dist.memory import (
    DelayedScaler,
    cast_to_fp8,
    fp8_gemm,
    fp8_max,
    quantize_blockwise,
    quantize_per_tensor,
)
from minitorch_dist.memory.fp8 import accumulate_with_limited_precision, fp8_format
from minitorch_dist.memory.zero import FlatParams, MixedPrecisionPolicy, full_state_dict, fully_shard
from minitorch_dist.models import GPT, GPTConfig
from minitorch_dist.models.train import train_steps
from minitorch_dist.runtime import comm
from minitorch_dist.runtime.launch import launch

from _support import (
    case,
    close,
    float64,
    gamma,
    model_bound,
    refusal,
    reorder_bound,
    roundoff,
    run_cases,
    sgd_bound,
)

pytestmark = [pytest.mark.ch08, pytest.mark.timeout(120)]

FORMATS = ("e4m3", "e5m2")
U32 = roundoff(torch.float32)


# --- formats and casts ----------------------------------------------------------------------------

def test_format_names_and_maxima():
    assert fp8_format("e4m3") == fp8_format(torch.float8_e4m3fn) == fp8_format("fp8_e4m3") == "e4m3"
    assert fp8_format(torch.float8_e5m2) == "e5m2"
    assert fp8_max("e4m3") == 448.0 and fp8_max("e5m2") == 57344.0
    with pytest.raises(ValueError, match=r"unknown fp8 format 'e3m4': use 'e4m3' or 'e5m2'"):
        fp8_format("e3m4")
    with pytest.raises(ValueError, match="unknown fp8 format"):
        quantize_per_tensor(torch.ones(3), "fp16")


def _spread(n, seed=0):
    """Values of both signs spread over 16 binades (2^-12 .. 2^4)."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.rand(n, generator=g) * 16 - 12)
    return torch.where(torch.rand(n, generator=g) < 0.5, -mag, mag)


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_is_rounding_to_nearest_within_half_an_ulp(fmt):
    x = _spread(20000)
    q = quantize_per_tensor(x, fmt)
    info = format_info("fp8_" + fmt)
    s = q.scale.item()
    assert s == pytest.approx(info["max"] / x.abs().max().item(), rel=U32)  # amax lands on the max
    scaled = (x * q.scale).double()  # the fp32 product the cast rounds
    assert torch.equal(q.data.double(), round_to_format(scaled, "fp8_" + fmt))
    err = (q.dequantize().double() - x.double()).abs()
    bound = torch.maximum(x.double().abs() * 2.0 ** -(info["mantissa_bits"] + 1),
                          torch.full_like(err, info["min_subnormal"] / 2 / s))
    assert (err <= bound * (1 + 2 ** (info["mantissa_bits"] + 1) * gamma(3, torch.float32))).all()
    normal = x.abs() * s >= info["min_normal"]
    worst = (err / x.double().abs())[normal].max().item()
    assert worst > 0.85 * 2.0 ** -(info["mantissa_bits"] + 1)  # the bound is reached: m bits, no more


@pytest.mark.parametrize("fmt", FORMATS)
def test_cast_saturates_at_the_format_max(fmt):
    top = fp8_max(fmt)
    x = torch.tensor([1e9, -1e9, math.inf, -math.inf, top * 1.2, top, 1.0, math.nan])
    y = cast_to_fp8(x, torch.tensor(1.0), fmt).float()
    assert y[:5].tolist() == [top, -top, top, -top, top] and y[5] == top and y[6] == 1.0
    assert math.isnan(y[7])
    if fmt == "e5m2":  # torch's own cast overflows E5M2 to inf: saturation is a choice we make
        assert torch.isinf(torch.tensor([1e9]).to(torch.float8_e5m2).float()).all()


# --- delayed scaling ------------------------------------------------------------------------------

def _tensor_with_amax(a, n=6):
    return torch.linspace(-a, a / 3, n)  # amax = a, at the first element


def test_delayed_scaling_follows_its_amax_history():
    L, amaxes = 3, [2.0, 4.0, 1.0, 1.0, 1.0, 8.0, 0.0, 1.0, 1.0]
    sc = DelayedScaler("e4m3", history_len=L, calibrate=False)
    window, scale = collections.deque(maxlen=L), 1.0  # the hand computation: TE starts from scale 1
    for k, a in enumerate(amaxes):
        x = _tensor_with_amax(a)
        q = sc.quantize(x)
        assert q.scale.item() == pytest.approx(scale, rel=U32), f"step {k}: cast with the delayed scale"
        saturated = a * scale > 448.0
        got = q.dequantize().abs().max().item()
        if saturated:  # a new peak, larger than any in the window: clamped to 448 / scale
            assert got == pytest.approx(448.0 / scale, rel=gamma(2, torch.float32)), f"step {k}: saturate"
        elif a > 0:  # half an E4M3 ulp, and float32's a·s and q / s
            assert got == pytest.approx(a, rel=2 ** -4 + gamma(3, torch.float32)), f"step {k}"
        window.append(a)
        if max(window) > 0:  # an all-zero window keeps the old scale
            scale = 448.0 / max(window)
        assert sc.scale.item() == pytest.approx(scale, rel=U32), f"scale after step {k}"
        kept = list(window)[-(L - 1):]  # rolled: the last L-1 amaxes, and slot 0 cleared for the next step
        assert sorted(sc.amax_history.tolist()) == sorted(kept + [0.0] * (L - len(kept)))
        assert sc.amax_history[0] == 0
    assert sc.steps == len(amaxes)


def test_delayed_scaling_options():
    x = _tensor_with_amax(4.0)
    recent = DelayedScaler("e4m3", history_len=4, algo="most_recent", calibrate=False)
    maximum = DelayedScaler("e4m3", history_len=4, calibrate=False)
    for a in (8.0, 2.0):
        recent.quantize(_tensor_with_amax(a))
        maximum.quantize(_tensor_with_amax(a))
    assert recent.scale.item() == 448 / 2 and maximum.scale.item() == 448 / 8
    margin = DelayedScaler("e4m3", margin=2)
    q = margin.quantize(x)  # calibrated on itself, then divided by 2^margin
    assert q.scale.item() == 448 / 4 / 4 and q.data.float().abs().max() == 112
    grad = DelayedScaler("e5m2")
    assert grad.quantize(x).scale.item() == 57344 / 4 and grad.quantize(x).data.dtype == torch.float8_e5m2
    for bad, msg in ((dict(history_len=0), "history_len"), (dict(margin=-1), "margin"),
                     (dict(algo="mean"), "algo"), (dict(fmt="e3m4"), "unknown fp8 format")):
        with pytest.raises(ValueError, match=msg):
            DelayedScaler(**bad)


# --- fine-grained scaling -------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(1, 3), (2, 3), (4, 4), (1, 128)])
def test_tile_and_block_scales_equal_a_hand_computation(block):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 7, generator=g) * torch.exp2(torch.randint(-6, 6, (5, 7), generator=g).float())
    x[4, 6] = 0.0
    q = quantize_blockwise(x, block)
    br, bc = block
    nr, nc = math.ceil(5 / br), math.ceil(7 / bc)
    assert q.scale.shape == (nr, nc) and q.block == block
    for i in range(nr):
        for j in range(nc):
            tile = x[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            amax = tile.abs().max().item()
            s = 448.0 / amax if amax > 0 else 1.0  # an all-zero tile keeps scale 1
            assert q.scale[i, j].item() == pytest.approx(s, rel=U32), (i, j)
            want = (tile * torch.tensor(s, dtype=torch.float32)).to(torch.float8_e4m3fn)
            assert torch.equal(q.data[i * br:(i + 1) * br, j * bc:(j + 1) * bc].float(), want.float())
    zero = quantize_blockwise(torch.zeros(2, 4), (1, 2))
    assert torch.equal(zero.scale, torch.ones(2, 2))  # an all-zero tile keeps scale 1, no NaN


def test_fine_grained_beats_per_tensor_on_a_tensor_with_one_outlier():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 512, generator=g) * 1e-2  # activations around 1e-2 ...
    clean = x.clone()
    x[7, 300] = 1e3  # ... and one outlier 1e5 times larger: E4M3's normal range spans only 448 / 2^-6
    rest = torch.ones_like(x, dtype=torch.bool)
    rest[7, 300] = False

    def rel(q, ref, mask):
        return ((q.dequantize() - ref).norm() if mask is None else (q.dequantize() - ref)[mask].norm()) \
            / (ref.norm() if mask is None else ref[mask].norm())

    per_tensor, tiles = quantize_per_tensor(x), quantize_blockwise(x, (1, 128))
    e_tensor, e_tiles = rel(per_tensor, x, rest), rel(tiles, x, rest)
    assert e_tensor > 4 * e_tiles, (e_tensor, e_tiles)  # one scale for all: the small values drown
    assert e_tensor > 0.1  # pushed into the subnormals (3 bits or fewer) and to zero
    # the outlier spoils only its own tile: every other tile is quantised as without it
    other = torch.ones_like(rest)
    other[7, 256:384] = False
    assert torch.equal(tiles.dequantize()[other], quantize_blockwise(clean, (1, 128)).dequantize()[other])
    # without the outlier the two recipes are alike: the gap above is the outlier's doing
    tiles_clean = quantize_blockwise(clean, (1, 128))
    assert rel(quantize_per_tensor(clean), clean, None) < 2 * rel(tiles_clean, clean, None)


def _gemm_bound(u, v):
    """Two fp32 evaluations of ``u @ v.T`` (K-block products, the division by s_a·s_b, the promotion's
    additions, the dequantising division: at most K + 4 operations), scaled by ``|u| @ |v|^T``."""
    scale = u.dequantize().double().abs() @ v.dequantize().double().abs().t()
    return reorder_bound(u.data.shape[1] + 4, scale, torch.float32)


def test_fp8_gemm_promotes_each_k_block_to_fp32():
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 300, generator=g), torch.randn(24, 300, generator=g) * 0.05
    qa, qb = quantize_blockwise(a, (1, 128)), quantize_blockwise(b, (128, 128))
    ref = qa.dequantize().double() @ qb.dequantize().double().t()
    close(fp8_gemm(qa, qb).double(), ref, _gemm_bound(qa, qb), "blockwise")
    close(fp8_gemm(qb, qa), fp8_gemm(qa, qb).t(), _gemm_bound(qa, qb), "transposed")
    ta, tb = quantize_per_tensor(a), quantize_per_tensor(b)
    for u, v in ((ta, tb), (ta, qb)):  # per tensor, and per tensor times blocks
        want = u.dequantize().double() @ v.dequantize().double().t()
        close(fp8_gemm(u, v).double(), want, _gemm_bound(u, v), "per tensor")
    # a transposed 128x128-block weight is the same bytes read the other way
    assert torch.equal(qb.t().dequantize(), qb.dequantize().t())
    with pytest.raises(ValueError, match="share the K-block size"):
        fp8_gemm(qa, quantize_blockwise(b, (64, 64)))
    with pytest.raises(ValueError, match="2-D tensor"):
        quantize_blockwise(torch.ones(2, 3, 4))
    with pytest.raises(ValueError, match="block must be"):
        quantize_blockwise(torch.ones(2, 3), (0, 128))


def test_limited_precision_accumulation_needs_promotion():
    g = torch.Generator().manual_seed(3)
    a, b = torch.rand(4, 4096, generator=g), torch.rand(6, 4096, generator=g)  # positive: the sum grows
    ref = a.double() @ b.double().t()
    err = {p: ((accumulate_with_limited_precision(a, b, 13, p) - ref).abs() / ref).max().item()
           for p in (None, 128)}
    assert err[None] > 4 * err[128], err
    # promoted: 5 standard deviations of the accumulator's rounding, and float32's promotion sums
    bound = 5 * _rounding_sigma(a, b, 13, 128).max().item() + gamma(a.shape[1] // 128, torch.float32)
    assert err[128] < bound, (err, bound)


def _rounding_sigma(a, b, mantissa_bits, every):
    """The standard deviation of the relative error of ``accumulate_with_limited_precision``: each
    addition rounds the partial sum p to mantissa_bits bits after the leading one, an error uniform
    within half an ulp, ulp = 2^(floor(log2 p) - mantissa_bits), variance ulp^2 / 12; independent."""
    prods = a.double()[:, None, :] * b.double()[None, :, :]  # (M, N, K), positive
    var = 0
    for block in prods.split(every, dim=-1):
        partial = block.cumsum(-1)
        var = var + (torch.exp2(torch.floor(torch.log2(partial)) - mantissa_bits) ** 2 / 12).sum(-1)
    return var.sqrt() / prods.sum(-1)


# --- the cost model ---------------------------------------------------------------------------------

def test_costmodel_bytes_of_fp8():
    assert quantized_bytes((256, 512), "fp8_e4m3", (1, 128)) == 256 * 512 + 256 * 4 * 4
    assert quantized_bytes((300, 200), "e4m3", (128, 128)) == 60000 + 3 * 2 * 4
    assert quantized_bytes((300, 200), "bf16") == 120000
    assert quantized_bytes((300, 200), "e5m2") == 60004
    assert torch.equal(torch.tensor(quantize_blockwise(torch.randn(300, 200), (128, 128)).nbytes),
                       torch.tensor(quantized_bytes((300, 200), "e4m3", (128, 128))))
    assert weight_bytes_per_param("fp32") == 4 and weight_bytes_per_param("bf16") == 2
    assert weight_bytes_per_param("fp8_e4m3", (1, 128)) == 1 + 4 / 128
    for n, numel in ((2, 1000), (4, 1001)):
        S = math.ceil(numel / n)
        assert all_gather_buffer_bytes(numel, n, "fp32") == 4 * n * S
        assert all_gather_buffer_bytes(numel, n, "bf16") == 2 * n * S
        assert all_gather_buffer_bytes(numel, n, "fp8_e4m3", 4) == n * (S + 4)


# --- FSDP all-gathering fp8 weights -----------------------------------------------------------------

D_IN, D, D_OUT, B, SEED, LR = 13, 64, 5, 8, 5, 0.5
MODES = {"fp32": {}, "bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                   reduce_dtype=torch.float32)},
         "fp8": {"fp8_all_gather": True}}
MODES["fp8+bf16"] = {**MODES["fp8"], **MODES["bf16"]}  # fp8 on the wire, dequantised into bf16 to compute


def _mlp():
    torch.manual_seed(SEED)
    return nn.Sequential(nn.Linear(D_IN, D), nn.GELU(), nn.Linear(D, D), nn.GELU(), nn.Linear(D, D_OUT))


def _batch():
    g = torch.Generator().manual_seed(SEED)
    return torch.randn(B, D_IN, generator=g), torch.randn(B, D_OUT, generator=g)


def _one_step(mode):
    """One SGD step of the MLP under ``fully_shard`` in ``mode`` on this rank's rows: its prediction, the
    all-gathered bytes, whether every parameter got a gradient, the weights after the step."""
    r, n = dist.get_rank(), dist.get_world_size()
    x, y = _batch()
    rows = slice(r * B // n, (r + 1) * B // n)
    kw = MODES[mode]
    model = _mlp()
    for i in (0, 2, 4):
        fully_shard(model[i], **kw)
    fully_shard(model, **kw)
    with comm.meter() as fwd:
        pred = model(x[rows])
    loss = nn.functional.mse_loss(pred.to(y.dtype), y[rows])
    with comm.meter() as bwd:
        loss.backward()
    with_grad = [p.grad is not None for p in model.parameters() if p.numel()]
    torch.optim.SGD(model.parameters(), lr=LR).step()
    return {"pred": pred.detach().to(y.dtype), "fwd": fwd.bytes["all_gather"],
            "bwd": bwd.bytes["all_gather"], "wire": fwd.wire_bytes["all_gather"],
            "grads": all(with_grad), "weights": full_state_dict(model)}


def _bf16_reference():
    """The dense model with the same quantised weights cast to bf16, on this rank's rows cast to bf16: the
    casts ``param_dtype=bf16`` makes, in the same places."""
    r, n = dist.get_rank(), dist.get_world_size()
    x, _ = _batch()
    rows = slice(r * B // n, (r + 1) * B // n)
    with torch.no_grad():
        return _quantised_by_shard(_mlp(), n).to(torch.bfloat16)(x[rows].to(torch.bfloat16)).float()


def _one_step_float64():
    with float64():
        return _one_step("fp8")


def _gpt_losses():
    """A GPT whose blocks and root gather fp8 weights, and the same in fp32: 4 AdamW steps' losses."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    torch.manual_seed(0)
    for mode in ("fp32", "fp8"):
        gpt = GPT(GPTConfig.tiny(block_size=16))
        for block in gpt.blocks:
            fully_shard(block, **MODES[mode])
        fully_shard(gpt, **MODES[mode])
        torch.manual_seed(0)
        out[mode] = train_steps(gpt, 4, 8, 16, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                                rank=r, world_size=n).losses
    return out


def _fsdp_rank():
    """Every case of one launch (each fails on its own: tests/_support.run_cases): the four modes in
    float32 (bytes; the bf16 comparison), fp8 in float64 (against one process), the GPT, the refusals."""
    cases = {mode: functools.partial(_one_step, mode) for mode in MODES}
    cases |= {"fp8_float64": _one_step_float64, "bf16_reference": _bf16_reference, "gpt": _gpt_losses,
              "errors": lambda: [refusal(lambda bad=bad: fully_shard(nn.Linear(2, 2), fp8_all_gather=bad))
                                 for bad in ("e3m4", 3)]}
    return run_cases(cases)


def _quantised_by_shard(model, n):
    """The dense model with each Linear's (weight | bias) flat buffer cut in n shards, each quantised to
    E4M3 with its own float32 scale 448 / amax and dequantised in float32: what every rank computes
    with (in the model's dtype)."""
    dense = _mlp()
    with torch.no_grad():
        for i in (0, 2, 4):
            params = list(dense[i].parameters())
            flat = FlatParams(params, n)
            buf = flat.flatten([p.detach() for p in params])
            for r in range(n):
                shard = flat.shard(buf, r)
                s = torch.tensor(448.0, dtype=torch.float32) / shard.abs().max().float()
                shard.copy_((shard.float() * s).clamp(-448, 448).to(torch.float8_e4m3fn).float() / s)
            for p, v in zip(params, flat.views(buf)):
                p.copy_(v)
    return dense


@pytest.fixture(scope="module", params=[2, 4])
def fsdp_run(request):
    return request.param, launch(_fsdp_rank, request.param, timeout_s=100)


#: the MLP's longest reduction (D = 64 features; a weight gradient sums <= B rows) and its chain:
#: 3 Linear layers forward, the loss, 3 backward
MLP_N, MLP_DEPTH = max(D, B), 7


def _case(results, name):
    return [case(res, name, r) for r, res in enumerate(results)]


def test_fsdp_fp8_all_gather_equals_one_process_with_the_same_quantised_weights(fsdp_run):
    n, results = fsdp_run
    with float64():
        dense = _quantised_by_shard(_mlp(), n)
        x, y = _batch()
        pred = dense(x)
        nn.functional.mse_loss(pred, y).backward()  # the global batch: the mean the ranks' average makes
        start = dict(_mlp().named_parameters())
    grads = {k: p.grad for k, p in dense.named_parameters()}
    grad_size = max(1.0, max(g.abs().max().item() for g in grads.values()))
    grad_err = model_bound(n=MLP_N, depth=MLP_DEPTH, scale=grad_size)
    for r, res in enumerate(_case(results, "fp8_float64")):
        rows = slice(r * B // n, (r + 1) * B // n)
        want = pred[rows].detach()
        bound = model_bound(n=MLP_N, depth=MLP_DEPTH, scale=max(1.0, want.abs().max().item()))
        close(res["pred"], want, bound, f"fp8 pred r={r}")
        assert res["grads"]
        # the fp32 masters moved by the gradient of the quantised weights (straight through the cast)
        for k, p in start.items():
            close(res["weights"][k], p.detach() - LR * grads[k], sgd_bound(steps=1, lr=LR, grad_err=grad_err),
                  f"weight {k} r={r}")
    modes = ("fp8", "fp32", "fp8+bf16", "bf16_reference")
    for fp8, fp32, both, ref in zip(*(_case(results, m) for m in modes)):
        assert fp8["grads"] and both["grads"]
        # the quantisation is visible: not the fp32 gather's result
        assert (fp8["pred"] - fp32["pred"]).abs().max() > 1e-4
        # with a bf16 param_dtype the same fp8 bytes are dequantised into bf16: the one process doing
        # the same casts in the same places, on the same rows and one thread like the rank: bitwise
        assert torch.equal(both["pred"], ref)
        assert not torch.equal(both["pred"], fp8["pred"])  # and bf16's rounding is visible


def test_fsdp_fp8_all_gather_halves_the_bytes_of_bf16(fsdp_run):
    n, results = fsdp_run
    numels = [sum(p.numel() for p in _mlp()[i].parameters()) for i in (0, 2, 4)]
    want = {"fp32": sum(all_gather_buffer_bytes(k, n, "fp32") for k in numels),
            "bf16": sum(all_gather_buffer_bytes(k, n, "bf16") for k in numels),
            "fp8": sum(all_gather_buffer_bytes(k, n, "fp8_e4m3", 4) for k in numels)}
    want["fp8+bf16"] = want["fp8"]
    for r in range(n):
        got = {mode: case(results[r], mode, r) for mode in MODES}
        for mode in MODES:
            assert got[mode]["fwd"] == got[mode]["bwd"] == want[mode], mode  # backward re-gathers in fp8 too
            assert got[mode]["wire"] == pytest.approx(want[mode] * (n - 1) / n, rel=1e-12)  # 2 float64 ops
        assert 0.5 <= got["fp8"]["fwd"] / got["bf16"]["fwd"] < 0.51
        assert 0.25 <= got["fp8"]["fwd"] / got["fp32"]["fwd"] < 0.255


def test_fsdp_fp8_all_gather_trains_a_gpt_and_rejects_bad_formats(fsdp_run):
    _, results = fsdp_run
    for gpt, errors in zip(_case(results, "gpt"), _case(results, "errors")):
        fp32, fp8 = gpt["fp32"], gpt["fp8"]
        assert fp8[-1] < fp8[0] - 0.1
        assert max(abs(a - b) / b for a, b in zip(fp8, fp32)) <= 2 ** -4  # E4M3's precision
        assert "unknown fp8 format 'e3m4': use 'e4m3' or 'e5m2'" in errors[0]
        assert "fp8_all_gather must be True, False, 'e4m3' or 'e5m2'" in errors[1]
