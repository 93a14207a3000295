"""Chapter 08 — FP8 training: a Linear whose three GEMMs take fp8 inputs, and the model around it.

Micikevicius et al. 2022, "FP8 Formats for Deep Learning", §4: a Linear layer ``y = x W^T + b`` runs
three GEMMs, and each takes fp8 operands while accumulating and writing in higher precision::

    forward (fprop)   y  = q(x) q(W)^T          x, W in E4M3 (precision)
    backward (dgrad)  dx = q(dy) q(W)           dy in E5M2 (range: gradients span more binades)
    backward (wgrad)  dW = q(dy)^T q(x)         the same fp8 x as the forward (saved in 1 byte)

the *hybrid* format (``fp8_format="hybrid"``; ``"e4m3"`` uses E4M3 everywhere, as DeepSeek-V3 does
with its fine-grained scales). The bias, the bias gradient (a sum over tokens) and every other op of
the model (LayerNorm, attention's softmax, the embeddings, the loss) stay in higher precision, and
the optimizer keeps fp32 master weights: fp8 is only the *inputs* of the matmuls.

Two recipes, :class:`DelayedScaling` (Transformer Engine's per-tensor delayed scaling: one
:class:`.fp8.DelayedScaler` for x, one for W, one for dy per layer) and :class:`BlockwiseScaling`
(DeepSeek-AI 2024, "DeepSeek-V3 Technical Report", §3.3.2 and §3.3.4: 1×128 tiles for x and dy,
128×128 blocks for W, and for the wgrad GEMM, whose reduction runs over tokens, dy and the saved x
re-quantised in 128×1 tiles; every GEMM promoted to fp32 each 128 elements of K).

This is an emulation of the numerics: on a CPU (and on GPUs before Hopper) the GEMMs run in fp32 on
the dequantised values and are *slower* than bf16. The speed of fp8 needs Hopper-class tensor cores
(H100, H200, and later), where an fp8 GEMM runs at twice the bf16 rate (``costmodel.DEVICES``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models import GPT, GPTConfig, MarkovCorpus
from .fp8 import RECIPE_FORMATS, DelayedScaler, FP8Tensor, fp8_gemm, quantize_blockwise

__all__ = ["DelayedScaling", "BlockwiseScaling", "FP8Linear", "swap_to_fp8", "train_in_precision"]


def _check_format(fp8_format: str) -> None:
    if fp8_format not in RECIPE_FORMATS:
        raise ValueError(f"unknown fp8_format {fp8_format!r}: use 'hybrid' (E4M3 forward, E5M2 gradients) "
                         f"or 'e4m3' (E4M3 everywhere)")


@dataclass(frozen=True)
class DelayedScaling:
    """Transformer Engine's recipe: one scale per tensor, from the max of its last
    ``amax_history_len`` amaxes (TE's default window is 1024 steps; 16 suits short runs)."""

    margin: int = 0
    amax_history_len: int = 16
    amax_compute_algo: str = "max"
    fp8_format: str = "hybrid"

    def __post_init__(self):
        _check_format(self.fp8_format)
        DelayedScaler("e4m3", self.amax_history_len, self.margin, self.amax_compute_algo)  # checks the rest

    def quantizer(self) -> _PerTensorQuantizer:
        return _PerTensorQuantizer(self)


@dataclass(frozen=True)
class BlockwiseScaling:
    """DeepSeek-V3's recipe: a scale per 1×``block`` tile of x and dy and per ``block``×``block``
    block of W, computed from each tile's amax at the cast (the paper's N_C = 128)."""

    block: int = 128
    fp8_format: str = "hybrid"

    def __post_init__(self):
        _check_format(self.fp8_format)
        if isinstance(self.block, bool) or not isinstance(self.block, int) or self.block < 1:
            raise ValueError(f"block must be a positive int (DeepSeek-V3 uses 128), got {self.block!r}")

    def quantizer(self) -> _BlockwiseQuantizer:
        return _BlockwiseQuantizer(self)


class _PerTensorQuantizer:
    """The operands of the three GEMMs under delayed per-tensor scaling (a scaler per tensor)."""

    def __init__(self, recipe: DelayedScaling):
        fwd, bwd = RECIPE_FORMATS[recipe.fp8_format]
        args = (recipe.amax_history_len, recipe.margin, recipe.amax_compute_algo)
        self.scalers = {"input": DelayedScaler(fwd, *args), "weight": DelayedScaler(fwd, *args),
                        "grad_output": DelayedScaler(bwd, *args)}

    def forward(self, x, w):
        return self.scalers["input"].quantize(x), self.scalers["weight"].quantize(w)

    def dgrad(self, g, qw: FP8Tensor):
        qg = self.scalers["grad_output"].quantize(g)
        return qg, qw.t()  # a per-tensor scale survives the transpose

    def wgrad(self, g, qg: FP8Tensor, qx: FP8Tensor):
        return qg.t(), qx.t()


class _BlockwiseQuantizer:
    """The operands of the three GEMMs under DeepSeek-V3's tiles and blocks (no state)."""

    def __init__(self, recipe: BlockwiseScaling):
        self.block, (self.fwd, self.bwd) = recipe.block, RECIPE_FORMATS[recipe.fp8_format]

    def forward(self, x, w):
        b = self.block
        return quantize_blockwise(x, (1, b), self.fwd), quantize_blockwise(w, (b, b), self.fwd)

    def dgrad(self, g, qw: FP8Tensor):
        return quantize_blockwise(g, (1, self.block), self.bwd), qw.t()  # dx = dy W: K is W's rows

    def wgrad(self, g, qg: FP8Tensor, qx: FP8Tensor):
        """dW = dy^T x reduces over tokens: dy and x in 128×1 tiles, i.e. dy^T and x^T in 1×128 tiles.
        x is re-tiled from its saved fp8 values, as DeepSeek-V3 converts its stored activations."""
        b = self.block
        return (quantize_blockwise(g.t(), (1, b), self.bwd),
                quantize_blockwise(qx.dequantize().t(), (1, b), self.fwd))


class _FP8LinearFunction(torch.autograd.Function):
    """y = x W^T + b with the three GEMMs in fp8 (module docstring); autocast is off inside."""

    @staticmethod
    def forward(ctx, x, weight, bias, quantizer, out_dtype):
        with torch.autocast(x.device.type, enabled=False):
            x2 = x.detach().reshape(-1, x.shape[-1]).float()
            qx, qw = quantizer.forward(x2, weight.detach().float())
            y = fp8_gemm(qx, qw)
            if bias is not None:
                y = y + bias.detach().float()
        ctx.quantizer, ctx.qx, ctx.qw = quantizer, qx, qw  # fp8 bytes kept for backward, not x
        ctx.shapes = (x.shape, x.dtype, weight.dtype, None if bias is None else bias.dtype)
        return y.to(out_dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_y):
        x_shape, x_dtype, w_dtype, b_dtype = ctx.shapes
        gx = gw = gb = None
        with torch.autocast(grad_y.device.type, enabled=False):
            g = grad_y.reshape(-1, grad_y.shape[-1]).float()
            qg, qwt = ctx.quantizer.dgrad(g, ctx.qw)
            if ctx.needs_input_grad[0]:
                gx = fp8_gemm(qg, qwt).to(x_dtype).reshape(x_shape)
            if ctx.needs_input_grad[1]:
                gw = fp8_gemm(*ctx.quantizer.wgrad(g, qg, ctx.qx)).to(w_dtype)
            if b_dtype is not None and ctx.needs_input_grad[2]:
                gb = g.sum(0).to(b_dtype)  # a sum over tokens: from the high-precision dy
        ctx.qx = ctx.qw = None
        return gx, gw, gb, None, None


class FP8Linear(nn.Linear):
    """A drop-in ``nn.Linear`` whose forward and backward GEMMs take fp8 operands (``recipe``:
    :class:`DelayedScaling`, the default, or :class:`BlockwiseScaling`). Parameters stay in their
    dtype (fp32 masters); the output has the input's dtype, or autocast's when autocast is on."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 recipe: DelayedScaling | BlockwiseScaling | None = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self._set_recipe(recipe)

    def _set_recipe(self, recipe) -> None:
        recipe = DelayedScaling() if recipe is None else recipe
        if not isinstance(recipe, (DelayedScaling, BlockwiseScaling)):
            raise TypeError(f"recipe must be DelayedScaling() or BlockwiseScaling(), "
                            f"got {type(recipe).__name__}")
        self.recipe, self.quantizer = recipe, recipe.quantizer()

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe=None) -> FP8Linear:
        """An FP8Linear that holds ``linear``'s own weight and bias Parameters (shared, not copied)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.in_features, new.out_features = linear.in_features, linear.out_features
        new.weight, new.bias = linear.weight, linear.bias
        new._set_recipe(recipe)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        out_dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
        return _FP8LinearFunction.apply(x, self.weight, self.bias, self.quantizer, out_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, recipe={self.recipe}"


def swap_to_fp8(model: nn.Module, recipe=None, skip=("lm_head",)) -> list[str]:
    """Replace every ``nn.Linear`` under ``model`` (in place) by an :class:`FP8Linear` sharing its
    parameters, except those whose name ends with an entry of ``skip``; return the swapped names.

    The default keeps the output layer, ``lm_head``, in higher precision: its weight is the tied token
    embedding and its logits feed the softmax of the loss. DeepSeek-V3 (§3.3) likewise keeps the
    embedding, the output head, gating, normalisation and attention in bf16/fp32.
    """
    skip = (skip,) if isinstance(skip, str) else tuple(skip)
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for s in skip:
        if not any(n == s or n.endswith("." + s) for n in names):
            raise ValueError(f"skip entry {s!r} names no nn.Linear under the model; its Linears are {names}")
    swapped = []
    for name in names:
        if any(name == s or name.endswith("." + s) for s in skip):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, attr, FP8Linear.from_linear(getattr(parent, attr), recipe))
        swapped.append(name)
    return swapped


def train_in_precision(cfg: GPTConfig, precision: str, steps: int, batch: int, seq: int, *, seed: int = 0,
                       lr: float = 3e-3, recipe=None, data: MarkovCorpus | None = None) -> list[float]:
    """Losses of ``steps`` AdamW steps of the course GPT on the Markov corpus, from ``seed``.

    ``precision``: ``"fp32"``; ``"bf16"`` (``torch.autocast``: fp32 master weights, bf16 matmuls);
    ``"fp8"`` (bf16 autocast, and every Linear but ``lm_head`` an :class:`FP8Linear` with ``recipe``).
    Same weights, batches and optimizer for each, so the loss curves differ only by the arithmetic.
    """
    if precision not in ("fp32", "bf16", "fp8"):
        raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp8', got {precision!r}")
    data = data or MarkovCorpus(cfg.vocab_size, seed=0)
    torch.manual_seed(seed)
    model = GPT(cfg)
    if precision == "fp8":
        swap_to_fp8(model, recipe)
    dev = next(model.parameters()).device.type
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = data.batch(step, batch, seq)
        opt.zero_grad()
        with torch.autocast(dev, torch.bfloat16, enabled=precision != "fp32"):
            _, loss = model(x, y)
        loss.float().backward()
        opt.step()
        losses.append(loss.item())
    return losses
