# generated from solutions/ch06_zero_fsdp.py by `make exercises`: fill in each NotImplementedError
# fingerprint 7f37ad2300ea07c1 of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 06 exercises: ZeRO — flat-buffer partitioning, the ZeRO-2 gradient hook, a ZeRO-3 unit,
predicting and metering a ZeRO step, Adafactor's factored moment.

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
3. :class:`Zero3Unit`: ZeRO stage 3 (P_os+g+p, ZeRO §5.3; FSDP's unit, Zhao et al. 2023, §3) for one
   module: its parameters live as one flat buffer of which this rank keeps 1/n; the buffer is
   all-gathered before the forward and freed after it, all-gathered again for the backward, and
   the gradients are reduce-scattered into the shard.
4. :func:`meter_zero_stage`: predict the per-rank model-state bytes (ZeRO §5, Figure 1) and the
   bytes on the wire of one step (§7) of a ZeRO stage, then measure both with ``MemoryMeter`` and
   ``comm.meter()``.
5. :func:`adafactor_update`: one step of Adafactor's factored second moment (Shazeer & Stern 2018,
   "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", §3, Algorithm 4): a
   ``rows x cols`` matrix of squared-gradient averages kept as ``rows + cols`` numbers.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from minitorch_dist import costmodel
from minitorch_dist.analysis.meters import MemoryMeter
from minitorch_dist.memory.zero import ZeroDataParallel, fully_shard
from minitorch_dist.runtime import comm


def _require_dist(name: str) -> None:
    if not dist.is_initialized():
        raise RuntimeError(f"{name} runs inside ranks: call it from a function started with "
                           "minitorch_dist.launch(fn, n)")


# --- 1. flatten and partition -------------------------------------------------------------------


def flatten_and_partition(tensors: list[torch.Tensor], n: int,
                          rank: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Size]]]:
    """Kind: build

    One padded flat buffer holding ``tensors`` end to end, and rank ``rank``'s shard of it.

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
    """Kind: build

    The shaped tensors of ``layout`` (from :func:`flatten_and_partition`) as views into ``flat``.

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
    """Kind: build

    Make every backward end with this rank's shard of the averaged gradient, and nothing else.

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


# --- 3. a ZeRO-3 unit ------------------------------------------------------------------------------------


class _UnitFunction(torch.autograd.Function):
    """The unit as one node of the outer autograd graph (scaffolding). Autograd calls ``backward``
    exactly when the gradient of the unit's output is ready: the moment to gather the weights again."""

    @staticmethod
    def forward(ctx, unit, shard, x):
        out, ctx.saved = unit.unit_forward(x)
        ctx.unit = unit
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_shard, grad_x = ctx.unit.unit_backward(ctx.saved, grad_out)
        ctx.saved = ctx.unit = None
        return None, grad_shard, grad_x


class Zero3Unit(nn.Module):
    """Kind: build

    ZeRO stage 3 (P_os+g+p, ZeRO §5.3) for one module — FSDP's *unit* (Zhao et al. 2023, §3): the
    module's parameters live as one flat buffer of ``padded = n * S`` elements (``S = ceil(Ψ / n)``,
    zero padding at the end) of which this rank keeps only its S elements, ``self.shard``. One step::

        forward:   all-gather shard -> full    run the module on views of full    free full
        backward:  all-gather shard -> full    backward through the saved graph
                   reduce-scatter(flat gradient / n) -> the shard's gradient       free full

    Chain units (``nn.Sequential(Zero3Unit(a), Zero3Unit(b))``) and only one unit's weights are ever
    whole at a time; train with any elementwise optimizer over ``model.parameters()`` — the shards.
    Every rank must build the same ``module`` (same seed) and feed its own rows of the global batch;
    the gradient reaching the shard is *averaged* over the ranks, so n ranks take the step of one
    process on the whole batch. ``module`` takes one tensor and returns one tensor.

    The scaffolding (keep it) lays out the module's trainable parameters, in ``named_parameters()``
    order, as :func:`flatten_and_partition` would: ``self.numels``, ``self.offsets``, ``self.shapes``
    (one per parameter), ``self.S``, ``self.padded``, ``self.n``, ``self.rank``, ``self.group``; makes
    ``self.shard`` (an ``nn.Parameter`` of S elements, the unit's only parameter) and removes the
    parameters from the module, so nothing but the shard stays allocated; ``self.full`` is the
    gathered buffer, a 1-D tensor of ``padded`` elements whose storage is resized to 0 bytes while
    the unit is sharded; ``self.gather_into`` is the same storage seen through another tensor (see
    :meth:`gather`); ``self._bind(leaves)`` puts one tensor per parameter on the module where its
    parameter was (``self._bind(None)`` takes them off again); and ``forward`` runs
    :class:`_UnitFunction`, which calls :meth:`unit_forward` and :meth:`unit_backward`.

    **Your task:** the four methods below.
    """

    def __init__(self, module: nn.Module, group=None):
        super().__init__()
        _require_dist("Zero3Unit")
        named = list(module.named_parameters(remove_duplicate=False))
        unique = list({id(p): p for _, p in named}.values())  # a tied parameter once
        if not unique:
            raise ValueError("Zero3Unit needs a module with parameters")
        if any(not p.requires_grad for p in unique) or len({(p.dtype, p.device) for p in unique}) != 1:
            raise ValueError("Zero3Unit shards trainable parameters of one dtype on one device")
        self.module, self.group = module, group
        self.n, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shapes = [p.shape for p in unique]
        self.numels = [p.numel() for p in unique]
        self.offsets = [sum(self.numels[:i]) for i in range(len(unique))]
        self.S = math.ceil(sum(self.numels) / self.n)
        self.padded = self.n * self.S
        with torch.no_grad():
            flat = torch.zeros(self.padded, dtype=unique[0].dtype, device=unique[0].device)
            for p, offset in zip(unique, self.offsets):
                flat[offset:offset + p.numel()].copy_(p.reshape(-1))
            self.shard = nn.Parameter(flat[self.rank * self.S:(self.rank + 1) * self.S].clone())
        index = {id(p): i for i, p in enumerate(unique)}
        self._slots = []  # (submodule, attribute, parameter index), tied parameters under each name
        for name, p in named:
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path)
            self._slots.append((owner, attr, index[id(p)]))
            owner._parameters.pop(attr, None)  # the dense parameter goes away ...
            setattr(owner, attr, None)  # ... and its name waits for _bind
        self.full = flat  # the gathered buffer: its storage exists only while gathered
        # The same storage through a second tensor, with a version counter of its own: gathering into
        # it does not mark the tensors autograd saved (views of `full`) as modified in place.
        self.gather_into = flat.new_empty(0).set_(flat.untyped_storage(), 0, flat.shape)
        self.full.untyped_storage().resize_(0)

    def _bind(self, leaves: list[torch.Tensor] | None) -> None:
        for owner, attr, i in self._slots:
            setattr(owner, attr, None if leaves is None else leaves[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UnitFunction.apply(self, self.shard, x)

    def gather(self) -> None:
        """Give ``self.full``'s storage its ``padded * element_size`` bytes back
        (``untyped_storage().resize_``) and all-gather every rank's shard into it with one
        ``comm.all_gather(self.gather_into, self.shard.detach(), group=self.group)``.

        Gather through ``self.gather_into``, not ``self.full``: an all-gather is an in-place write,
        and one into ``full`` would bump the version counter of every view of it that autograd
        saved in the forward, so the backward would refuse to run ("modified by an inplace
        operation"). The contents are the same weights, so nothing is lost by hiding the write.
        """
        raise NotImplementedError("exercise: Zero3Unit.gather — see chapters/06_zero_fsdp.md")

    def free(self) -> None:
        """Reshard: resize ``self.full``'s storage to 0 bytes (every view of it keeps its shape and
        sees the weights again after the next :meth:`gather`)."""
        raise NotImplementedError("exercise: Zero3Unit.free — see chapters/06_zero_fsdp.md")

    def unit_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """Gather; run the module on the whole weights; free; return ``(output, saved)``.

        - :meth:`gather`, then make one leaf per parameter: a shaped view of ``self.full``
          (``full[offset:offset + numel].view(shape)``), detached, requiring grad;
        - run the module under ``torch.enable_grad()`` (``_UnitFunction.forward`` runs under no-grad)
          on ``x.detach().requires_grad_(x.requires_grad)``, with the leaves bound (``_bind``) and
          unbound again after: a small graph of the unit's own, whose saved tensors include views
          of ``full``;
        - :meth:`free` — the weights exist in full only while the unit computes;
        - return the output *detached* and ``saved``, anything :meth:`unit_backward` will need (the
          leaves, the detached input, the inner output).
        """
        raise NotImplementedError("exercise: Zero3Unit.unit_forward — see chapters/06_zero_fsdp.md")

    def unit_backward(self, saved, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Gather again; backward through the saved graph; reduce-scatter; free.

        - :meth:`gather` (into the same storage the saved views see), then
          ``torch.autograd.backward(inner_output, grad_out)``: each leaf gets its ``.grad``;
        - copy the leaves' gradients into one flat buffer of ``padded`` elements (zero padding, zero
          for a leaf without a gradient), divide it by n, and ``comm.reduce_scatter`` it into a new
          tensor of S elements: this rank's shard of the gradient averaged over the ranks;
        - :meth:`free`, and return ``(grad_shard, grad_x)``: ``grad_x`` is the detached input's
          ``.grad`` (None when the input did not require grad), the gradient the previous unit needs.
        """
        raise NotImplementedError("exercise: Zero3Unit.unit_backward — see chapters/06_zero_fsdp.md")


# --- 4. predict, then meter, a ZeRO step ---------------------------------------------------------------


def _zero_model(model: nn.Module, stage: int, lr: float):
    """(model, optimizer, inner): the model at ZeRO ``stage`` with AdamW; ``inner`` holds the state."""
    adamw = lambda params: torch.optim.AdamW(params, lr=lr)
    if stage == 3:
        model = fully_shard(model)  # one unit: the whole model
        opt = adamw(model.parameters())
        return model, opt, opt
    zero = ZeroDataParallel(model, adamw, stage=stage)
    return zero, zero, zero.optimizer


def meter_zero_stage(make_model, stage: int, x: torch.Tensor, y: torch.Tensor, lr: float = 1e-3) -> dict:
    """Kind: measure

    Predict what one training step of ZeRO ``stage`` costs this rank — the bytes of model states it
    holds and the bytes it puts on the wire — then measure both.

    Runs inside ranks. ``make_model()`` builds the same fp32 model on every rank; ``x``, ``y`` are
    this rank's rows; the loss is ``F.mse_loss(model(x), y)``; the optimizer is AdamW. The
    scaffolding wraps the model: ``model, opt, inner = _zero_model(make_model(), stage, lr)``
    (stages 0-2: the library's ``ZeroDataParallel``; stage 3: ``fully_shard`` of the whole model,
    one unit; ``inner`` is the optimizer that holds the state). A step is ``opt.zero_grad()``,
    forward, ``loss.backward()``, ``opt.step()``.

    **Your task:** return ``{"predicted": {"model_states", "wire"}, "measured": {"parameters",
    "gradients", "optimizer_state", "model_states", "wire"}}``, in bytes:

    - *predict* from Ψ, the number of parameters of the model (count them before wrapping it), with
      the cost model: model states per rank in fp32 with AdamW (p = g = 4 bytes, K = 8: m and v;
      ``costmodel.zero_memory_bytes``) and wire bytes per step (4-byte elements;
      ``costmodel.zero_comm_bytes``);
    - *measure*: take one step first (AdamW creates its state in its first step), then a second one
      inside ``with comm.meter() as m:`` — ``m.total_wire_bytes`` is the measured wire — reading
      ``MemoryMeter(model, inner).current()`` right after its backward, before ``opt.step()``
      (gradients complete, state allocated: the moment ZeRO counts); ``model_states`` is the sum
      of its three categories.

    The tests hold each number to a stated tolerance: the predictions exactly (to 1e-9, relative);
    the measured wire to the byte against an independent count of that one step (the formula on the
    buffer padded to a multiple of n, plus the bookkeeping the meter also sees: stages 0-2 all-reduce
    one "has a gradient" byte per tensor, stage 3 carries one flag per tensor in each reduce-scatter
    chunk); the measured model states within 1% above the prediction and never below it (padding
    and AdamW's 4-byte step counter per tensor only add), each category within 1% of its term of
    the formula.
    """
    _require_dist("meter_zero_stage")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    raise NotImplementedError("exercise: meter_zero_stage — see chapters/06_zero_fsdp.md")


# --- 5. Adafactor's factored second moment ---------------------------------------------------------


def adafactor_update(grad: torch.Tensor, row_avg: torch.Tensor, col_avg: torch.Tensor, beta2: float,
                     eps: float = 1e-30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build

    One step of Adafactor's factored second moment for a 2-D gradient ``G`` (rows x cols).

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
