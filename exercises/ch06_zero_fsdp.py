# generated from solutions/ch06_zero_fsdp.py by `make exercises`: fill in each NotImplementedError
# fingerprint 7a680a0519ff42bf of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 06 exercises: ZeRO — flat-buffer partitioning, the ZeRO-2 gradient hook,
Adafactor's factored moment.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch06``.

1. :func:`flatten_and_partition` / :func:`unflatten`: many tensors as one 1-D buffer, padded with
   zeros to a multiple of the world size n and cut into n equal shards — the layout every ZeRO stage
   partitions (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
   Parameter Models", §5) and FSDP's ``FlatParameter`` (Zhao et al. 2023, "PyTorch FSDP:
   Experiences on Scaling Fully Sharded Data Parallel", §3.2).
2. :func:`zero2_reduce_scatter_hook`: ZeRO stage 2 (P_os+g, ZeRO §5.2): as soon as backward has
   produced the gradients, one reduce-scatter averages them over the ranks and leaves each rank only
   its 1/n shard; the full gradients are freed. It runs inside ranks (start it with
   ``minitorch_dist.launch(fn, n)``) and talks through ``minitorch_dist.runtime.comm``, whose meter
   the tests read.
3. :func:`adafactor_update`: one step of Adafactor's factored second moment (Shazeer & Stern 2018,
   "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", §3, Algorithm 4): a
   ``rows x cols`` matrix of squared-gradient averages kept as ``rows + cols`` numbers.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from minitorch_dist.runtime import comm


def _require_dist(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{name} runs inside ranks: call it from a function started with "
                           "minitorch_dist.launch(fn, n)")


# --- 1. flatten and partition -------------------------------------------------------------------


def flatten_and_partition(tensors: list[torch.Tensor], n: int,
                          rank: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Size]]]:
    """One padded flat buffer holding ``tensors`` end to end, and rank ``rank``'s shard of it.

    ZeRO partitions parameters, gradients and optimizer state as flat 1-D buffers: one
    reduce-scatter or all-gather moves all of them at once, and an elementwise optimizer (SGD,
    Adam) can update a slice of the buffer without caring where one tensor ends and the next
    begins. With ``numel`` the total number of elements,

        S      = ceil(numel / n)            elements per shard, the same on every rank
        padded = n * S                      the buffer's length; elements numel..padded-1 are 0
        shard  = flat[rank*S : (rank+1)*S]  rank's part (it may end inside the padding)

    Tensor i starts at ``offset_i = numel_0 + ... + numel_{i-1}``. A tensor may straddle two
    shards; that is fine.

    **Your task:** return ``(flat, shard, layout)``:

    - ``flat``: a new 1-D tensor of ``padded`` elements, dtype and device of the inputs, holding
      ``tensors[0].flatten(), tensors[1].flatten(), ...`` and then zeros (the inputs are copied,
      not modified);
    - ``shard``: a *view* into ``flat`` (slicing, not a copy: writing into it writes into ``flat``)
      of rank's S elements;
    - ``layout``: a list with one ``(offset_i, tensors[i].shape)`` pair per tensor, in order — what
      :func:`unflatten` needs to cut ``flat`` back into shaped tensors.
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("flatten_and_partition needs at least one tensor")
    if n < 1:
        raise ValueError(f"the world size n must be >= 1, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a world of n={n} ranks (0 <= rank < n)")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one flat buffer holds one dtype, got {sorted(map(str, dtypes))}; "
                         "flatten each dtype separately")
    raise NotImplementedError("exercise: flatten_and_partition — see chapters/06_zero_fsdp.md")


def unflatten(flat: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    """The shaped tensors of ``layout`` (from :func:`flatten_and_partition`) as views into ``flat``.

    ``flat`` is a padded buffer with that layout (the one returned, or another of the same
    length, e.g. the all-gathered parameters or a gradient buffer). Tensor i is the ``numel_i``
    elements from ``offset_i`` on, in its shape; the padding belongs to no tensor.

    **Your task:** return the list of tensors, each a *view* into ``flat`` (``flat[a:b].view(shape)``),
    so that writing into ``flat`` (a whole-buffer all-gather, say) updates every tensor at once —
    the reason FSDP's parameters are views into its flat buffer.
    """
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D buffer, got shape {tuple(flat.shape)}")
    for offset, shape in layout:
        end = offset + math.prod(shape)
        if offset < 0 or end > flat.numel():
            raise ValueError(f"layout entry (offset {offset}, shape {tuple(shape)}) needs elements "
                             f"[{offset}, {end}) but flat has {flat.numel()}: flat and layout come from "
                             "different buffers")
    raise NotImplementedError("exercise: unflatten — see chapters/06_zero_fsdp.md")


# --- 2. the ZeRO-2 reduce-scatter hook ------------------------------------------------------------


def zero2_reduce_scatter_hook(params: list[torch.nn.Parameter], group=None) -> tuple[torch.Tensor, list]:
    """Make every backward end with this rank's shard of the averaged gradient, and nothing else.

    Plain data parallelism all-reduces the full gradient (2Ψ bytes per rank on the wire) and every
    rank keeps all Ψ gradients. ZeRO-2 (§5.2) notices that a rank only *updates* its own 1/n of
    the parameters (stage 1 already partitions the optimizer state), so it only needs that 1/n of
    the gradient: a reduce-scatter (Ψ on the wire, half an all-reduce) gives each rank the sum of
    its shard, and the full gradients can be freed as soon as it has run.

    ``params`` (all of one dtype and device, each trainable) are laid out end to end in a flat
    buffer padded to ``padded = n * S``, ``S = ceil(Ψ / n)``, ``n = dist.get_world_size(group)``,
    exactly as :func:`flatten_and_partition` does; this rank's shard is elements
    ``[rank*S, (rank+1)*S)``.

    The scaffolding computes the layout (``offsets``, ``S``, ``padded``) and allocates
    ``grad_shard``, a 1-D zero tensor of S elements (the params' dtype and device).
    **Your task:** with ``p.register_post_accumulate_grad_hook(hook)`` on every parameter
    (it runs once ``p.grad`` holds the parameter's gradient for this backward) arrange that
    during each backward:

    - each gradient is copied into its place in a full flat gradient buffer of ``padded``
      elements (zero padding) and ``p.grad`` is set to None (freed);
    - when the *last* parameter's gradient of this backward has arrived, exactly one
      ``comm.reduce_scatter(grad_shard, flat_grad / n, group=group)`` runs: ``grad_shard`` then
      holds this rank's S elements of the gradient *averaged* over the ranks (SUM of grad/n), and
      the flat buffer is dropped;
    - the next backward starts afresh (count the arrivals per backward; ``grad_shard`` is
      overwritten, not accumulated).

    Every parameter must receive a gradient in every backward (or the count never completes and
    the ranks wait for each other). Return ``(grad_shard, handles)``: the tensor each backward
    fills in place, and the list of hook handles (``handle.remove()`` undoes the hooks).
    """
    _require_dist("zero2_reduce_scatter_hook")
    params = list(params)
    if not params:
        raise ValueError("zero2_reduce_scatter_hook needs at least one parameter")
    if any(not p.requires_grad for p in params):
        raise ValueError("every parameter must require grad: a frozen one never fires its hook, and the "
                         "reduce-scatter would never run; leave frozen parameters out")
    if len({(p.dtype, p.device) for p in params}) != 1:
        raise ValueError("one flat gradient buffer holds one dtype on one device, got "
                         f"{sorted({(str(p.dtype), str(p.device)) for p in params})}")
    n = dist.get_world_size(group)
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(params))]
    s = math.ceil(sum(numels) / n)
    padded = n * s
    grad_shard = torch.zeros(s, dtype=params[0].dtype, device=params[0].device)
    raise NotImplementedError("exercise: zero2_reduce_scatter_hook — see chapters/06_zero_fsdp.md")


# --- 3. Adafactor's factored second moment ---------------------------------------------------------


def adafactor_update(grad: torch.Tensor, row_avg: torch.Tensor, col_avg: torch.Tensor, beta2: float,
                     eps: float = 1e-30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step of Adafactor's factored second moment for a 2-D gradient ``G`` (rows x cols).

    Adam keeps ``V``, an exponential moving average of ``G * G``: as many numbers as the
    parameter, a full copy of the model per moment. Adafactor (§3) keeps only its row and column
    averages, ``rows + cols`` numbers, and rebuilds a rank-1 estimate of V from them:

        R_t = beta2 R_{t-1} + (1 - beta2) mean_over_columns(G*G + eps)     shape (rows,)
        C_t = beta2 C_{t-1} + (1 - beta2) mean_over_rows(G*G + eps)        shape (cols,)
        V^_t[i, j] = R_t[i] C_t[j] / mean(R_t)
        update    = G / sqrt(V^_t)

    The paper (Algorithm 4) writes *sums* ``R = (G*G + eps) 1_m``, ``C = 1_n^T (G*G + eps)`` and
    ``V^ = R C / (1_n^T R)``; with means, as here and in ``torch.optim.Adafactor``, every factor is
    divided by a constant that cancels in the ratio, so V^ is the same. If V itself is rank-1
    (``V = a b^T``) the estimate is exact. The paper's ``eps`` (eps_1 = 1e-30) keeps the
    averages away from 0.

    ``row_avg`` (rows,) and ``col_avg`` (cols,) are R_{t-1} and C_{t-1} (zeros at the first step;
    with ``beta2 = 0`` they are ignored). Adafactor's schedule ``beta2_t = 1 - t^-0.8`` (so 0 at
    t = 1), its relative step size and its update clipping belong to the optimizer around this
    function, not to it.

    **Your task:** return ``(update, new_row_avg, new_col_avg)``: ``update`` shaped like ``grad``,
    the new averages shaped like the old ones; the inputs are not modified.
    """
    if grad.dim() != 2:
        raise ValueError("adafactor_update factors a 2-D gradient (rows x cols), got shape "
                         f"{tuple(grad.shape)}; vectors keep an unfactored second moment")
    rows, cols = grad.shape
    if tuple(row_avg.shape) != (rows,):
        raise ValueError(f"row_avg must have shape ({rows},), one average per row of grad "
                         f"{tuple(grad.shape)}, got {tuple(row_avg.shape)}")
    if tuple(col_avg.shape) != (cols,):
        raise ValueError(f"col_avg must have shape ({cols},), one average per column of grad "
                         f"{tuple(grad.shape)}, got {tuple(col_avg.shape)}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must lie in [0, 1), got {beta2}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    raise NotImplementedError("exercise: adafactor_update — see chapters/06_zero_fsdp.md")
