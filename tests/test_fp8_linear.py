"""Chapter 08, FP8 training: ``FP8Linear``'s three GEMMs on fp8 operands under both recipes, the swap of a
model's Linears, and the tiny GPT trained in fp8 against bf16.

Expected values: float64 GEMMs of operands quantised here by each recipe's rules (the quantisers
themselves are checked against hand computations in ``tests/test_fp8.py``); bf16 autocast's losses on
the same weights, batches and optimizer.

Tolerances (derived in tests/_support.py). Each GEMM is emulated in fp32 on the fp8 operands
(K-block products, the division by the scales, the promotions, the bias: at most K + 5 operations
counting the reference's dequantising divisions) against float64 on the same dequantised values:
``reorder_bound(K + 5, |A| @ |B|^T + |b|)``, K = 40 (y), 24 (dX), 15 (dW, db: the rows). fp8 against
the exact fp32 Linear: at least far above float32's rounding (1e-4 >> γ_40 ~ 2.4e-6), at most what
the operands' own quantisation errors allow, ``(‖Δx‖·‖W_q‖ + ‖x‖·‖ΔW‖) / ‖y‖`` (Frobenius norms,
computed here). fp8 training against bf16 over 15 steps of the tiny GPT (the chapter's claim, after
DeepSeek-V3): the curves differ by less than what one optimizer step makes, at every step by less
than bf16's mean progress per step, and over the last five by less than half of it; a recipe that
stops learning or falls behind by a step fails.
"""
import pytest
import torch
from torch import nn

from minitorch_dist.memory import (
    BlockwiseScaling,
    DelayedScaling,
    FP8Linear,
    quantize_blockwise,
    quantize_per_tensor,
    swap_to_fp8,
    train_in_precision,
)
from minitorch_dist.models import GPT, GPTConfig

from _support import close, reorder_bound

pytestmark = [pytest.mark.ch08, pytest.mark.timeout(120)]


# --- the fp8 Linear -------------------------------------------------------------------------------

def _forward_operands(x, w, recipe):
    """x (as rows) and W quantised by the recipe's forward rules, dequantised (fp32)."""
    x2 = x.reshape(-1, x.shape[-1])
    if isinstance(recipe, DelayedScaling):
        return quantize_per_tensor(x2, "e4m3").dequantize(), quantize_per_tensor(w, "e4m3").dequantize()
    k = recipe.block
    return (quantize_blockwise(x2, (1, k), "e4m3").dequantize(),
            quantize_blockwise(w, (k, k), "e4m3").dequantize())


def _reference_linear(x, w, b, gy, recipe):
    """y, dx, dW, db computed in float64 from fp8 operands quantised here, by the recipe's rules; each
    with the size of its terms, ``|A| @ |B|^T`` (+ |b|), that bounds its rounding."""
    x2, g2 = x.reshape(-1, x.shape[-1]), gy.reshape(-1, gy.shape[-1])
    fwd, bwd = ("e4m3", "e5m2") if recipe.fp8_format == "hybrid" else ("e4m3", "e4m3")
    if isinstance(recipe, DelayedScaling):  # first call of each scaler: calibrated on the tensor
        qx, qw, qg = quantize_per_tensor(x2, fwd), quantize_per_tensor(w, fwd), quantize_per_tensor(g2, bwd)
        dx, dwx, dwg = qx.dequantize(), qw.dequantize(), qg.dequantize()
        gx_g, gw_g, gw_x = dwg, dwg, dx
    else:
        k = recipe.block
        qx, qw = quantize_blockwise(x2, (1, k), fwd), quantize_blockwise(w, (k, k), fwd)
        dx, dwx = qx.dequantize(), qw.dequantize()
        gx_g = quantize_blockwise(g2, (1, k), bwd).dequantize()
        gw_g = quantize_blockwise(g2.t(), (1, k), bwd).dequantize().t()
        gw_x = quantize_blockwise(dx.t(), (1, k), fwd).dequantize().t()
    d = torch.float64
    y = dx.to(d) @ dwx.to(d).t() + b.to(d)
    return ((y, dx.to(d).abs() @ dwx.to(d).abs().t() + b.to(d).abs()),
            (gx_g.to(d) @ dwx.to(d), gx_g.to(d).abs() @ dwx.to(d).abs()),
            (gw_g.to(d).t() @ gw_x.to(d), gw_g.to(d).abs().t() @ gw_x.to(d).abs()),
            (g2.to(d).sum(0), g2.to(d).abs().sum(0)))


@pytest.mark.parametrize("recipe", [DelayedScaling(), DelayedScaling(fp8_format="e4m3"),
                                    BlockwiseScaling(block=16)], ids=["delayed", "delayed-e4m3", "blockwise"])
def test_fp8_linear_runs_its_three_gemms_on_fp8_operands(recipe):
    torch.manual_seed(0)
    lin = nn.Linear(40, 24)
    fp8 = FP8Linear.from_linear(lin, recipe)
    assert fp8.weight is lin.weight and fp8.bias is lin.bias
    x = torch.randn(3, 5, 40, requires_grad=True)
    gy = torch.randn(3, 5, 24) * 1e-3
    y = fp8(x)
    y.backward(gy)
    (ry, sy), (rgx, sgx), (rgw, sgw), (rgb, sgb) = _reference_linear(
        x.detach(), lin.weight.detach(), lin.bias.detach(), gy, recipe)
    for name, got, want, size, k in (("y", y.reshape(-1, 24), ry, sy, 40),
                                     ("dX", x.grad.reshape(-1, 40), rgx, sgx, 24),
                                     ("dW", lin.weight.grad, rgw, sgw, 15),
                                     ("db", lin.bias.grad, rgb, sgb, 15)):
        close(got.double(), want, reorder_bound(k + 5, size, torch.float32), name)
    exact = nn.functional.linear(x.detach(), lin.weight.detach(), lin.bias.detach())
    rel = ((y.detach() - exact).norm() / exact.norm()).item()
    # fp8 is not fp32 (far above float32's rounding), and not farther from it than its operands allow
    xq, wq = _forward_operands(x.detach(), lin.weight.detach(), recipe)
    x2 = x.detach().reshape(-1, 40)
    most = ((xq - x2).norm() * wq.norm() + x2.norm() * (wq - lin.weight.detach()).norm()) / exact.norm()
    assert 1e-4 < rel <= most.item(), (rel, most.item())


def test_hybrid_gradients_are_e5m2_and_differ_from_e4m3():
    torch.manual_seed(0)
    x, gy = torch.randn(8, 32, requires_grad=True), torch.randn(8, 16)
    grads = {}
    for f in ("hybrid", "e4m3"):
        torch.manual_seed(1)
        lin = FP8Linear(32, 16, recipe=DelayedScaling(fp8_format=f))
        x.grad = None
        lin(x).backward(gy)
        grads[f] = x.grad.clone()
        assert lin.quantizer.scalers["grad_output"].fmt == ("e5m2" if f == "hybrid" else "e4m3")
    # E5M2 rounds the output gradient to 2 mantissa bits, E4M3 to 3: apart by ~2^-4 of it, >> 1e-3
    assert not torch.allclose(grads["hybrid"], grads["e4m3"], rtol=1e-3, atol=0)


def test_fp8_linear_output_dtype_follows_autocast():
    lin, x = FP8Linear(16, 8), torch.randn(4, 16)
    assert lin(x).dtype == torch.float32
    with torch.autocast("cpu", torch.bfloat16):
        y = lin(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert lin.weight.grad.dtype == torch.float32


def test_swap_keeps_the_output_layer_and_shares_every_parameter():
    torch.manual_seed(0)
    model = GPT(GPTConfig.tiny())
    before = [id(p) for p in model.parameters()]
    swapped = swap_to_fp8(model, BlockwiseScaling(block=32))
    assert swapped == [f"blocks.{i}.{n}" for i in range(2) for n in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                      "mlp.c_proj")]
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight is model.wte.weight
    assert isinstance(model.blocks[0].mlp.c_fc, FP8Linear)
    assert [id(p) for p in model.parameters()] == before
    assert swap_to_fp8(model) == []  # already swapped: nothing left but lm_head
    with pytest.raises(ValueError, match="'lm_haed' names no nn.Linear"):
        swap_to_fp8(GPT(GPTConfig.tiny()), skip=("lm_haed",))
    with pytest.raises(TypeError, match="recipe must be"):
        FP8Linear(4, 4, recipe="delayed")
    with pytest.raises(ValueError, match="block must be a positive int"):
        BlockwiseScaling(block=0)
    with pytest.raises(ValueError, match="unknown fp8_format 'e5m2'"):
        DelayedScaling(fp8_format="e5m2")


def test_fp8_training_follows_bf16_with_both_recipes():
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=64)
    run = dict(steps=15, batch=16, seq=32, seed=0)
    bf16 = train_in_precision(cfg, "bf16", **run)
    progress = (bf16[0] - bf16[-1]) / (len(bf16) - 1)  # bf16's mean loss drop per step
    for recipe in (DelayedScaling(), BlockwiseScaling(block=32)):
        fp8 = train_in_precision(cfg, "fp8", recipe=recipe, **run)
        assert fp8 != bf16  # the fp8 path ran
        step_gap = max(abs(a - b) for a, b in zip(fp8, bf16))
        end_gap = abs(sum(fp8[-5:]) - sum(bf16[-5:])) / 5
        assert step_gap < progress and end_gap < progress / 2, (recipe, step_gap, end_gap, progress)
        assert fp8[0] - fp8[-1] > 0.5  # and it learns, as bf16
