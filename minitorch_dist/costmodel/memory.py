"""Chapter 00 — memory: model states under mixed precision and ZeRO, and activation memory per layer.

Rajbhandari et al. 2020, ZeRO, §3 and §5; Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", §4.
"""
from __future__ import annotations

# --- memory: model states -------------------------------------------------------------------

#: Bytes of optimizer state per parameter, kept in fp32 (Transformer Math 101, EleutherAI 2023).
#: adafactor is approximate: its factored second moment (row + column sums, O(r+c) per r x c
#: matrix) is neglected and an fp32 first moment is kept (beta1 > 0, as commonly run); with
#: beta1 = 0 it is ~0, model that with "sgd_nomomentum". adamw_8bit: two 1-byte states (Dettmers 2022).
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "adamw_8bit": 2, "sgd": 4, "sgd_nomomentum": 0,
                         "adafactor": 4}

#: (weight bytes, gradient bytes, fp32 master-copy bytes) per parameter for each precision.
PRECISIONS = {"fp32": (4, 4, 0), "mixed": (2, 2, 4)}

#: Bytes per parameter of Megatron-LM's contiguous gradient buffer, ``main_grad``: with bf16 weights the
#: gradients are accumulated (over the microbatches) and reduced over the data-parallel ranks in fp32
#: (Megatron-LM's ``DistributedOptimizer``: "for bfloat16, we want to do gradient accumulation and
#: all-reduces in float32"; its distributed-optimizer notes count 18 bytes per parameter for 16-bit
#: parameters with fp32 gradients, 6 + 12/d with the optimizer sharded over d ranks).
MAIN_GRAD_BYTES = 4


def optimizer_bytes_per_param(precision="mixed", optimizer="adamw") -> int:
    """K of the ZeRO paper: bytes per parameter the optimizer owns (master copy + states).
    Mixed-precision AdamW: K = 4 + 4 + 4 = 12 (Rajbhandari et al. 2020 §3.1)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}")
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_STATE_BYTES)}")
    return PRECISIONS[precision][2] + OPTIMIZER_STATE_BYTES[optimizer]


def gradient_bytes_per_param(precision="mixed", main_grad=False) -> int:
    """Bytes per parameter of the gradients a step keeps: the weights' own precision (16-bit under
    ``"mixed"``, the ZeRO paper's count), or :data:`MAIN_GRAD_BYTES` with ``main_grad`` (Megatron-LM's
    fp32 buffer, which the backward accumulates into directly: the 16-bit gradients are not kept)."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; expected one of {sorted(PRECISIONS)}")
    return max(PRECISIONS[precision][1], MAIN_GRAD_BYTES) if main_grad else PRECISIONS[precision][1]


def model_state_bytes(num_params, precision="mixed", optimizer="adamw", main_grad=False) -> dict:
    """Bytes of model states (no activations, no buffers) for training ``num_params`` parameters.

    Transformer Math 101 (Anthony, Biderman & Schoelkopf, EleutherAI 2023); ZeRO §3.1.

    * ``"fp32"``:  weights 4 + gradients 4 + optimizer states (AdamW m, v: 8) = 16 B/param;
    * ``"mixed"`` (fp16 or bf16 compute): weights 2 + gradients 2 + optimizer (fp32 master 4
      + m 4 + v 4 = 12) = 16 B/param: mixed precision saves compute and activations, not states;
    * ``"mixed"`` with ``main_grad`` (Megatron-LM's recipe with bf16: the gradients live in an fp32
      buffer, :data:`MAIN_GRAD_BYTES`): weights 2 + gradients 4 + optimizer 12 = 18 B/param.

    Returns a dict of bytes: ``weights``, ``gradients``, ``optimizer`` (everything the optimizer
    owns: the ZeRO paper's K*Psi, master copy included), ``master_weights`` (the part of
    ``optimizer`` that is the fp32 copy), and ``total = weights + gradients + optimizer``.
    ``num_params`` may be a float (e.g. 7.5e9).
    """
    k = optimizer_bytes_per_param(precision, optimizer)
    w, _, master = PRECISIONS[precision]
    g = gradient_bytes_per_param(precision, main_grad)
    parts = {
        "weights": w * num_params,
        "gradients": g * num_params,
        "optimizer": k * num_params,
        "master_weights": master * num_params,
    }
    parts["total"] = parts["weights"] + parts["gradients"] + parts["optimizer"]
    return parts


def zero_memory_bytes(num_params, dp, stage, k=12, param_bytes=2, grad_bytes=2) -> float:
    """Model-state bytes per device under ZeRO-DP (Rajbhandari et al. 2020, §5.1 and Figure 1).

    Psi parameters of ``param_bytes`` each, gradients of ``grad_bytes`` each, K*Psi bytes of
    optimizer state (everything the optimizer owns, fp32 master copy included), N = dp ranks::

        stage 0 (plain DP)            (p + g + K) * Psi
        stage 1 (P_os)                (p + g) * Psi + K*Psi/N
        stage 2 (P_os+g)               p * Psi + (g + K)*Psi/N
        stage 3 (P_os+g+p)            (p + g + K) * Psi / N

    The defaults are the paper's: fp16 parameters and gradients (p = g = 2) and mixed-precision
    Adam, K = 12 (fp32 master 4 + momentum 4 + variance 4), so stage 1 is 4*Psi + K*Psi/N.
    fp32 AdamW with no master copy is ``zero_memory_bytes(P, N, stage, k=8, param_bytes=4,
    grad_bytes=4)``: 16*Psi at stage 0.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    if dp < 1:
        raise ValueError(f"data-parallel degree must be >= 1, got {dp}")
    P, N, p, g = num_params, dp, param_bytes, grad_bytes
    return {0: (p + g + k) * P, 1: (p + g) * P + k * P / N, 2: p * P + (g + k) * P / N,
            3: (p + g + k) * P / N}[stage]


# --- memory: optimizer states of Adam and Adafactor -----------------------------------------

def _shape_tuple(shape) -> tuple:
    shape = tuple(int(d) for d in shape)
    if any(d < 0 for d in shape):
        raise ValueError(f"a shape cannot have negative sizes, got {shape}")
    return shape


def adam_state_bytes(shapes, bytes_per_element=4, step_bytes=0) -> int:
    """Bytes of Adam's (and AdamW's) state for parameters of the given ``shapes``.

    Kingma & Ba 2015, Algorithm 1: a first moment m and a second moment v, each the size of
    the parameter, so 2 * numel * ``bytes_per_element`` per tensor -- 2*r*c for an r x c matrix.
    ``step_bytes`` adds a per-tensor step counter (``torch.optim.Adam`` keeps a 0-d fp32 tensor:
    4 bytes; the meter counts it).
    """
    total = 0
    for shape in shapes:
        numel = 1
        for d in _shape_tuple(shape):
            numel *= d
        total += 2 * numel * bytes_per_element + step_bytes
    return total


def adafactor_state_bytes(shapes, bytes_per_element=4, step_bytes=0) -> int:
    """Bytes of Adafactor's state (no first moment) for parameters of the given ``shapes``.

    Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", §3:
    for an r x c matrix the second moment V is replaced by its row sums R (r numbers) and
    column sums C (c numbers), V-hat = R C^T / (1^T R) -- O(r + c) memory instead of O(r c).
    A tensor of rank >= 2 is factored over its last two dims, one (R, C) pair per leading
    index: prod(leading) * (r + c); a vector (or scalar) keeps the full second moment, numel.
    §4 drops the first moment (beta1 = 0), so that is all. ``step_bytes`` as in
    :func:`adam_state_bytes`.
    """
    total = 0
    for shape in shapes:
        shape = _shape_tuple(shape)
        lead = 1
        for d in shape[:-2]:
            lead *= d
        n = lead * (shape[-2] + shape[-1]) if len(shape) >= 2 else (shape[0] if shape else 1)
        total += n * bytes_per_element + step_bytes
    return total


# --- memory: activations --------------------------------------------------------------------

RECOMPUTE = ("none", "selective", "full")


def activation_memory_bytes(seq, batch, hidden, heads, layers=1, tp=1,
                            sequence_parallel=False, recompute="none") -> float:
    """Activation bytes stored for backward by ``layers`` transformer layers, 16-bit activations
    (Korthikanti et al. 2022, §4, eq. 1 and Table 2). s = seq, b = batch, h = hidden, a = heads,
    t = tp. Per layer:

    ====================  ========================================  =====================
    recompute             tensor parallel only                      tensor + sequence par.
    ====================  ========================================  =====================
    "none"                s*b*h*(10 + 24/t + 5*a*s/(h*t))           s*b*h/t*(34 + 5*a*s/h)
    "selective"           s*b*h*(10 + 24/t)                         34*s*b*h/t
    "full"                2*s*b*h  (the layer input only)           2*s*b*h/t
    ====================  ========================================  =====================

    With t = 1 the first row is eq. 1, ``s*b*h*(34 + 5*a*s/h)``: 34sbh from the matmul inputs,
    norms, GeLU and dropout masks, 5as^2b from the attention scores, softmax and its dropout.
    The 10sbh that TP alone cannot shard are the LayerNorm and dropout activations, which SP
    splits along the sequence. Selective recompute drops the 5as/h attention term.
    Embeddings, the final norm and the output layer (Korthikanti §4.3) are not included.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; expected one of {RECOMPUTE}")
    for name, v in (("seq", seq), ("batch", batch), ("hidden", hidden), ("heads", heads),
                    ("layers", layers), ("tp", tp)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    s, b, h, a, t = seq, batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        per_layer = 2 * sbh / t if sequence_parallel else 2 * sbh
    elif sequence_parallel:
        per_layer = sbh / t * (34 + (5 * a * s / h if recompute == "none" else 0))
    else:
        per_layer = sbh * (10 + 24 / t + (5 * a * s / (h * t) if recompute == "none" else 0))
    return layers * per_layer

