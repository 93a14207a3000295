"""Chapter 11 — fused kernels: bytes moved eager vs fused, arithmetic intensity, and the roofline of a
device.

Williams, Waterman & Patterson 2009, "Roofline: An Insightful Visual Performance Model for
Multicore Architectures", §2: a kernel that does ``F`` FLOPs and moves ``B`` bytes to and from
DRAM takes at least

    t >= max( F / peak_flops,  B / memory_bandwidth )

Its *arithmetic intensity* is ``I = F / B`` (FLOP/byte); the *ridge point* ``peak / bandwidth``
is the intensity at which the two bounds meet. Below it the kernel is memory-bound, and the only
way to make it faster is to move fewer bytes, which is what fusion does: one kernel reads each
input once, keeps intermediates in registers / shared memory, and writes each output once.
Softmax, LayerNorm, the optimizer step and the loss all sit at about 1 FLOP/byte, two orders of
magnitude below an H100's ridge (~295 FLOP/byte in bf16).

The eager counts model PyTorch running one kernel per op (the "naive" versions of the Triton
tutorials, Tillet et al. 2019, "Triton: An Intermediate Language and Compiler for Tiled Neural
Network Computations", and its fused-softmax tutorial): every op reads each tensor operand from
DRAM and writes its result to DRAM; views are free; 0-dim scalars are not counted. Caches are
ignored (a result re-read right away may still sit in L2: eager is then a little faster than
its count says). ``tests/test_costmodel_kernels.py`` checks each count by running the op sequence
under a dispatch mode that adds up the bytes of every op's tensor arguments and results.

Every function returns bytes; ``dtype_bytes`` is the element size (4 fp32, 2 bf16 / fp16) or a
torch dtype. Device specifications are the vendor's datasheet numbers (:data:`DEVICES`).
"""
from __future__ import annotations

from typing import NamedTuple

from ..runtime.dtypes import short_name


class DeviceSpec(NamedTuple):
    """Datasheet peaks of one accelerator. ``peak_flops`` maps a dtype name ("fp32" = non-tensor
    FP32 FMA units, "tf32" / "bf16" / "fp16" / "fp8" = tensor cores, dense) to FLOP/s."""

    name: str
    memory_bandwidth: float  #: DRAM (HBM) bytes / s
    memory_bytes: float  #: DRAM capacity, bytes
    peak_flops: dict  #: dtype name -> FLOP/s, dense (no 2:4 sparsity)
    source: str


_T = 1e12
#: Datasheet peaks. NVIDIA prints tensor-core FLOP/s "with sparsity" (2:4 structured); dense is half
#: of that, and dense is what a training matmul gets, so the dense numbers are stored.
DEVICES: dict[str, DeviceSpec] = {
    # NVIDIA A100 Tensor Core GPU datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf),
    # "A100 80GB SXM" column: 2,039 GB/s HBM2e; FP32 19.5 TFLOPS; TF32 156 (312 sparse);
    # BF16 / FP16 312 (624 sparse).
    "a100-sxm-80gb": DeviceSpec(
        "NVIDIA A100 SXM 80GB", 2.039e12, 80e9,
        {"fp32": 19.5 * _T, "tf32": 156 * _T, "bf16": 312 * _T, "fp16": 312 * _T},
        "NVIDIA A100 datasheet, A100 80GB SXM column"),
    # NVIDIA H100 Tensor Core GPU datasheet, "H100 SXM" column: 3.35 TB/s HBM3; FP32 67 TFLOPS;
    # TF32 989 / BF16 1,979 / FP8 3,958 TFLOPS, all "with sparsity" -> 494.5 / 989.5 / 1979 dense.
    "h100-sxm": DeviceSpec(
        "NVIDIA H100 SXM", 3.35e12, 80e9,
        {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T, "fp8": 1979 * _T},
        "NVIDIA H100 datasheet, H100 SXM column"),
    # NVIDIA H200 Tensor Core GPU datasheet, "H200 SXM" column: 141 GB HBM3e at 4.8 TB/s; the same
    # GH100 compute as H100 SXM (FP32 67, TF32 989*, BF16 1,979*, FP8 3,958* TFLOPS, * = sparse).
    "h200-sxm": DeviceSpec(
        "NVIDIA H200 SXM", 4.8e12, 141e9,
        {"fp32": 67 * _T, "tf32": 494.5 * _T, "bf16": 989.5 * _T, "fp16": 989.5 * _T, "fp8": 1979 * _T},
        "NVIDIA H200 datasheet, H200 SXM column"),
}
_DEVICE_ALIASES = {"a100": "a100-sxm-80gb", "h100": "h100-sxm", "h200": "h200-sxm"}


def device_spec(device) -> DeviceSpec:
    """A :class:`DeviceSpec` from itself or a key of :data:`DEVICES` ("h100-sxm", or "h100" for short).
    To use a measured bandwidth instead of the datasheet's:
    ``device_spec("h100")._replace(memory_bandwidth=bw)``."""
    if isinstance(device, DeviceSpec):
        return device
    key = _DEVICE_ALIASES.get(str(device).lower(), str(device).lower())
    if key not in DEVICES:
        raise ValueError(f"unknown device {device!r}; use one of {sorted(DEVICES)} "
                         f"(or {sorted(_DEVICE_ALIASES)}) or a DeviceSpec")
    return DEVICES[key]


def _peak(spec: DeviceSpec, dtype) -> float:
    """``spec``'s peak for ``dtype``: a torch dtype or any name of one (short names via
    :func:`~minitorch_dist.runtime.dtypes.short_name`), or a key of ``peak_flops`` ("tf32", "fp8")."""
    key = short_name(dtype, default=str(dtype).removeprefix("torch.").lower())
    if key not in spec.peak_flops:
        raise ValueError(f"{spec.name} has no peak for dtype {dtype!r}; it lists {sorted(spec.peak_flops)}")
    return spec.peak_flops[key]


def element_size(dtype_bytes) -> int:
    """Element size from an int or a torch dtype."""
    itemsize = getattr(dtype_bytes, "itemsize", dtype_bytes)
    if isinstance(itemsize, bool) or not isinstance(itemsize, int) or itemsize < 1:
        raise ValueError(f"dtype_bytes must be an element size in bytes (4 for fp32) or a torch dtype, "
                         f"got {dtype_bytes!r}")
    return itemsize


def check_dims(**dims) -> None:
    for name, n in dims.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{name} must be an int >= 1, got {n!r}")


def read_written(read: float, written: float) -> dict:
    return {"read": read, "written": written}


# --- bytes moved --------------------------------------------------------------------------------


def softmax_bytes(M: int, N: int, dtype_bytes=4, fused: bool = False) -> dict:
    """Bytes ``{"read", "written"}`` of a row softmax of an ``M x N`` matrix (along N).

    Eager, the sequence of the Triton fused-softmax tutorial, one kernel per line::

        x_max = x.amax(dim=1)           read MN        write M
        z     = x - x_max[:, None]      read MN + M    write MN
        num   = torch.exp(z)            read MN        write MN
        den   = num.sum(dim=1)          read MN        write M
        y     = num / den[:, None]      read MN + M    write MN
                                        ----------     ----------
                                        5MN + 2M       3MN + 2M   elements

    (The tutorial writes ``x.max(dim=1)[0]``; that op also writes M int64 argmax indices, which its
    count leaves out: ``amax`` is the op that moves exactly what it counts.)

    Fused (one program per row, the row held on chip): read x once, write y once, ``MN`` and ``MN``.
    So eager moves (8MN + 4M) / 2MN, about 4x, the bytes; a memory-bound kernel runs that much slower.
    ``torch.softmax`` is itself one fused kernel: its bytes are ``fused=True``'s.
    """
    check_dims(M=M, N=N)
    e = element_size(dtype_bytes)
    if fused:
        return read_written(M * N * e, M * N * e)
    return read_written((5 * M * N + 2 * M) * e, (3 * M * N + 2 * M) * e)


def layernorm_bytes(M: int, N: int, dtype_bytes=4, fused: bool = False, backward: bool = False,
                    stats_bytes: int = 4) -> dict:
    """Bytes ``{"read", "written"}`` of LayerNorm (Ba et al. 2016, eq. 4) over the last dim of
    ``M x N`` with weight and bias (N each): ``y = (x - mu) * rstd * w + b``,
    ``rstd = 1 / sqrt(var + eps)``. Eager keeps every tensor, per-row ones included, in the input
    dtype; ``stats_bytes`` is the size of the per-row mean and rstd a fused kernel saves for
    backward (fp32 in every fused kernel, whatever the input dtype).

    Forward, eager (one kernel per op)::

        mu   = x.mean(-1, keepdim=True)           read MN       write M
        xc   = x - mu                             read MN + M   write MN
        sq   = xc ** 2                            read MN       write MN
        var  = sq.mean(-1, keepdim=True)          read MN       write M
        rstd = torch.rsqrt(var + eps)             read 2M       write 2M     (add, rsqrt)
        xhat = xc * rstd                          read MN + M   write MN
        y    = xhat * w + b                       read 2MN + 2N write 2MN    (mul, add)
                                                  7MN + 4M + 2N   5MN + 4M

    Forward, fused (Triton tutorial "Layer Normalization"): read x, w, b; write y and the saved
    mean and rstd: ``MN + 2N`` read, ``MN`` + 2M stats written.

    Backward, with ``g = dy * w`` the gradient flowing into ``xhat``::

        dw = sum_rows(dy * xhat)      db = sum_rows(dy)
        dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (means along the row)

    eager, from the saved ``xhat`` (MN) and ``rstd`` (M)::

        dw   = (dy * xhat).sum(0)                 read 3MN      write MN + N
        db   = dy.sum(0)                          read MN       write N
        g    = dy * w                             read MN + N   write MN
        c1   = (g * xhat).mean(-1, keepdim=True)  read 3MN      write MN + M
        c2   = g.mean(-1, keepdim=True)           read MN       write M
        dx   = (g - c2 - xhat * c1) * rstd        read 5MN + 3M write 4MN      (mul, sub, sub, mul)
                                                  14MN + N + 3M   7MN + 2N + 2M

    fused (the tutorial's two kernels): one pass over rows reads x, dy, w and the stats, writes dx
    and per-group partial sums of dw, db; a second kernel sums the partials (G x N each, G << M,
    left out): read ``2MN + N`` + 2M stats, write ``MN + 2N``.
    """
    check_dims(M=M, N=N)
    e, s = element_size(dtype_bytes), element_size(stats_bytes)
    MN = M * N
    if not backward:
        if fused:
            return read_written((MN + 2 * N) * e, MN * e + 2 * M * s)
        return read_written((7 * MN + 2 * N + 4 * M) * e, (5 * MN + 4 * M) * e)
    if fused:
        return read_written((2 * MN + N) * e + 2 * M * s, (MN + 2 * N) * e)
    return read_written((14 * MN + N + 3 * M) * e, (7 * MN + 2 * N + 2 * M) * e)


def adamw_bytes(n_params: int, fused: bool = False, dtype_bytes=4, weight_decay: bool = True) -> dict:
    """Bytes ``{"read", "written"}`` of one AdamW step (Loshchilov & Hutter 2019, Algorithm 2) over
    ``n_params`` parameters with gradients and both moments in ``dtype_bytes`` (fp32: 4).

    Eager is ``torch.optim.AdamW(foreach=True)`` (``_multi_tensor_adam`` in torch/optim/adam.py),
    each ``_foreach_*`` op one pass over all parameters::

        _foreach_mul_(p, 1 - lr*wd)          read p          write p     (decoupled weight decay)
        _foreach_lerp_(m, g, 1 - b1)         read m, g       write m
        _foreach_mul_(v, b2)                 read v          write v
        _foreach_addcmul_(v, g, g, 1 - b2)   read v, g, g    write v
        s = _foreach_sqrt(v)                 read v          write s
        _foreach_div_(s, sqrt(bc2))          read s          write s
        _foreach_add_(s, eps)                read s          write s
        _foreach_addcdiv_(p, m, s, -lr/bc1)  read p, m, s    write p
                                             13 psi           8 psi

    (``g`` is an operand of addcmul twice and counted twice; without weight decay the first line
    goes: 12 and 7.) Fused, one pass: read p, g, m, v and write p, m, v: 4 psi and 3 psi; about 3x
    fewer bytes. The per-tensor step counters and bias corrections are scalars and not counted.
    """
    check_dims(n_params=n_params)
    e = element_size(dtype_bytes)
    if fused:
        return read_written(4 * n_params * e, 3 * n_params * e)
    wd = 1 if weight_decay else 0
    return read_written((12 + wd) * n_params * e, (7 + wd) * n_params * e)


def cross_entropy_bytes(M: int, V: int, dtype_bytes=4, fused: bool = False, target_bytes: int = 8,
                        fused_passes: int = 1) -> dict:
    """Bytes ``{"read", "written"}`` of softmax cross-entropy, forward *and* backward, over
    ``M`` rows of ``V`` logits with integer targets (``target_bytes``: 8 for int64), mean reduction.

    Eager, ``F.cross_entropy(logits, y).backward()`` as PyTorch runs it::

        logp = _log_softmax(logits)              read MV                write MV
        loss = nll_loss_forward(logp, y)         read M (gathered) + M targets   write scalar
        g    = nll_loss_backward(...)            read M targets         write MV  (-1/M at y, 0 elsewhere)
        dlog = _log_softmax_backward(g, logp)    read 2MV               write MV
                                                 3MV + M, 2M targets    3MV

    Fused, one program per row: load the row, compute ``lse = max + log sum exp(x - max)``, the
    row's loss ``lse - x[y]`` and the gradient ``(softmax(x) - onehot(y)) / M`` in the same pass:
    read MV + M targets, write MV (the gradient, often over the logits in place) + M row losses.
    A vocabulary too large to hold on chip is streamed twice (online max / normaliser, then the
    gradient): ``fused_passes=2`` reads the logits twice.
    """
    check_dims(M=M, V=V)
    if fused_passes not in (1, 2):
        raise ValueError("fused_passes must be 1 (row held on chip) or 2 (streamed twice), got "
                         f"{fused_passes!r}")
    e, t = element_size(dtype_bytes), element_size(target_bytes)
    MV = M * V
    if fused:
        return read_written(fused_passes * MV * e + M * t, MV * e + M * e)
    return read_written((3 * MV + M) * e + 2 * M * t, 3 * MV * e)


# --- FLOPs, intensity, roofline ---------------------------------------------------------------------


def softmax_flops(M: int, N: int) -> int:
    """FLOPs of a row softmax counting one per element for each of max, subtract, exp, sum and
    divide: ``5MN`` (exp is several instructions on the special-function unit; counted as one)."""
    check_dims(M=M, N=N)
    return 5 * M * N


def layernorm_flops(M: int, N: int) -> int:
    """FLOPs of a LayerNorm forward, one per element for each of: sum for the mean, subtract,
    square, sum for the variance, scale by rstd, multiply by w, add b: ``7MN`` (the per-row
    ``rsqrt`` is left out)."""
    check_dims(M=M, N=N)
    return 7 * M * N


def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """``flops / nbytes``, FLOP per byte of DRAM traffic (Williams et al. 2009, §2).
    ``nbytes`` may be the dict a ``*_bytes`` function returns (read + written)."""
    if isinstance(nbytes, dict):
        nbytes = nbytes["read"] + nbytes["written"]
    if not nbytes > 0:
        raise ValueError(f"bytes must be > 0 to define an intensity, got {nbytes!r}")
    if flops < 0:
        raise ValueError(f"flops must be >= 0, got {flops!r}")
    return flops / nbytes


def ridge_point(device, dtype="bf16") -> float:
    """``peak_flops[dtype] / memory_bandwidth``: the intensity (FLOP/byte) above which a kernel on
    ``device`` is compute-bound. H100 SXM: 989.5e12 / 3.35e12 = 295 in bf16, 20 in fp32."""
    spec = device_spec(device)
    return _peak(spec, dtype) / spec.memory_bandwidth


def roofline_time(flops: float, nbytes: float, device, dtype="bf16") -> float:
    """The roofline lower bound on run time, seconds: ``max(flops / peak, bytes / bandwidth)``
    (Williams et al. 2009, §2) on ``device`` (a key of :data:`DEVICES` or a :class:`DeviceSpec`)
    with the ``dtype`` peak. ``dtype`` names the units doing the arithmetic: a matmul's input
    dtype for tensor cores, but ``"fp32"`` for elementwise and reduction kernels (softmax, norms,
    optimizer steps), which run on the fp32 units whatever dtype they store. ``nbytes`` may be a
    ``*_bytes`` dict. Real kernels reach ~80-90% of the copy bandwidth at best; this is the bound,
    not a prediction of it."""
    if isinstance(nbytes, dict):
        nbytes = nbytes["read"] + nbytes["written"]
    if flops < 0 or nbytes < 0:
        raise ValueError(f"flops and bytes must be >= 0, got {flops!r}, {nbytes!r}")
    spec = device_spec(device)
    return max(flops / _peak(spec, dtype), nbytes / spec.memory_bandwidth)
