"""Chapter 11 — where the kernels run: compiled for a CUDA GPU when there is one, else Triton's
interpreter on CPU.

Triton (Tillet, Kung & Cox 2019, "Triton: an intermediate language and compiler for tiled neural
network computations") compiles a ``@triton.jit`` function for the GPU. With ``TRITON_INTERPRET=1``
the same function instead runs as Python + NumPy on CPU tensors, one program instance after
another: slow, but every load, mask and reduction behaves as on the GPU, so each kernel in this
package is checked against its PyTorch reference on any machine.

The choice is made once, when ``@triton.jit`` decorates a kernel (it reads ``TRITON_INTERPRET``
then). So this module, which :mod:`minitorch_dist.kernels` imports before any kernel module, sets
``TRITON_INTERPRET=1`` when the machine has no CUDA GPU and the user has not set it. Code outside
the package that defines its own kernels (the exercises) imports this module first for the same
effect. Triton's own library functions are decorated when triton is first imported; if that
came earlier (``torch.compile`` imports triton), `_interpret_triton_library` rebuilds them.

Interpreter facts worth knowing (measured with triton 3.9): fp32 and fp16 are exact enough to
compare against PyTorch; arithmetic on bf16 values is wrong, so every kernel here loads, casts to
fp32, computes, and casts back only when it stores.
"""
from __future__ import annotations

import math
import os

import torch

from ..runtime.timing import cache_flusher, seconds

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first @triton.jit (see module docstring)

try:
    import triton
    import triton.language as tl
except ImportError as e:  # pragma: no cover - triton ships with the Linux x86-64 install
    raise ImportError(
        "minitorch_dist.kernels needs Triton: `pip install triton` (wheels exist for Linux x86-64; "
        "on other platforms chapter 11 can only be read, not run)") from e

#: True when kernels run in the Triton interpreter, False when they compile for CUDA. Fixed at
#: import: flipping TRITON_INTERPRET later does not re-decorate kernels already defined.
INTERPRET: bool = bool(triton.knobs.runtime.interpret)


def _interpret_triton_library() -> None:
    """Triton's own library (``tl.max``, ``tl.sum``, ``tl.cdiv``...) is ``@triton.jit`` code too,
    decorated when ``triton`` is first imported. If that happened before TRITON_INTERPRET=1 was
    set (``torch.compile`` imports triton, and so may a test run earlier), those functions were
    built for the GPU and an interpreted kernel calling them fails with "Cannot call @triton.jit'd
    outside of the scope of a kernel". Rebuild them as the interpreter would have."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    rebuilt = {}
    for module in (tl, tl.standard, tl.random):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                rebuilt.setdefault(id(value), InterpretedFunction(value.fn))
                setattr(module, name, rebuilt[id(value)])


if INTERPRET:
    _interpret_triton_library()

#: The Triton fused-softmax / LayerNorm tutorials keep one row of at most 64 KB in a block: past
#: that the row no longer fits in registers and shared memory, and the compiled kernel spills.
MAX_FUSED_BYTES = 65536

__all__ = ["INTERPRET", "MAX_FUSED_BYTES", "as_rows", "backend", "check_device", "default_device",
           "max_block", "num_warps", "row_block", "time_ms", "tl", "triton"]


def backend() -> str:
    """``"cuda"`` when the kernels are compiled for a GPU, ``"interpreter"`` when they run on CPU."""
    return "interpreter" if INTERPRET else "cuda"


def default_device() -> torch.device:
    """The device whose tensors the kernels take: CUDA when compiled, CPU in the interpreter."""
    return torch.device("cpu") if INTERPRET else torch.device("cuda")


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse tensors the compiled kernels cannot reach (CPU tensors when Triton targets CUDA)
    and tensors spread over several devices."""
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"tensors are on several devices {sorted(map(str, devices))}; move them to one")
    (dev,) = devices
    if not INTERPRET and dev.type != "cuda":
        raise ValueError(
            f"a tensor is on {dev} but the Triton kernels were compiled for CUDA: move it with .cuda(), or "
            f"set TRITON_INTERPRET=1 before importing minitorch_dist.kernels to run them on CPU")


def as_rows(x: torch.Tensor, what: str = "input") -> torch.Tensor:
    """``x`` as a 2-D ``(rows, cols)`` tensor over its last dimension, with unit column stride.

    A row stride other than ``cols`` is fine (the kernels take it as an argument), so a slice
    ``x[:, :n]`` is used in place; a tensor whose last dimension is strided (e.g. ``x.t()``) is
    copied once with ``.contiguous()``: a kernel that loads a row as one block needs it dense.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() == 0:
        raise ValueError(f"{what} is a 0-dim tensor; the kernels work along the last dimension, give it one")
    if not x.is_floating_point():
        raise TypeError(f"{what} must be a floating tensor (fp32, fp16 or bf16), got {x.dtype}")
    if x.dtype == torch.float64:
        raise TypeError(f"{what} is float64, which the kernels do not take: cast it with .float()")
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not -1: a last dimension of 0 is allowed
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2


def max_block(dtype: torch.dtype) -> int:
    """The widest row block (elements) of ``dtype`` that fits the 64 KB fused-row budget."""
    return MAX_FUSED_BYTES // torch.empty((), dtype=dtype).element_size()


def row_block(n: int, cap: int, block_size: int | None = None) -> int:
    """Columns a program loads at once for rows of ``n``: the next power of two (``tl.arange``
    needs one), at most ``cap``; or ``block_size``, which a caller may force (tests use a narrow
    block to make the kernels loop over column blocks)."""
    if block_size is not None:
        if block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {block_size}")
        return block_size
    return min(triton.next_power_of_2(n), cap)


def num_warps(block: int) -> int:
    """Warps per program for a row block of ``block`` elements (the fused-softmax tutorial's rule:
    more threads for wider rows so each thread holds a few elements)."""
    return 16 if block >= 4096 else 8 if block >= 2048 else 4


def time_ms(fn, warmup_ms: float = 25, budget_ms: float = 100) -> float:
    """Median milliseconds of ``fn()`` on the current GPU, timed as ``triton.testing.do_bench`` times a
    kernel, with the course's one clock (:mod:`..runtime.timing`): CUDA events around each run, the L2
    cache flushed before it (every run reads its inputs from memory, as in a real step), and as many
    runs as fill about ``warmup_ms`` untimed, then ``budget_ms`` timed, counted from 5 runs of a flush
    and ``fn`` together (so the count stays bounded however short ``fn`` is)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    flush = cache_flusher(dev)
    once_ms = 1e3 * seconds(lambda: (flush(), fn()), 5, warmup=1, device=dev, cuda_events=True)
    warmup, reps = (max(1, int(ms / max(once_ms, 1e-6))) for ms in (warmup_ms, budget_ms))
    return 1e3 * seconds(fn, reps, warmup, device=dev, before=flush, cuda_events=True)
