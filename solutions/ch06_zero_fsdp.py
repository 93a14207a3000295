"""Chapter 06 exercises: ZeRO — flat-buffer partitioning, the ZeRO-2 gradient hook, a ZeRO-3 unit,
predicting and metering a ZeRO step, Adafactor's factored moment.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch06_zero_fsdp.py`` is generated from this file with each
such region replaced by ``raise NotImplementedError``. Everything else (imports, argument checks,
helpers) is scaffolding the student keeps. Tests: ``pytest -m ch06 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

1. :func:`flatten_and_partition` / :func:`unflatten`: many tensors as one zero-padded 1-D buffer cut
   into n equal shards, every tensor and every shard aligned — the layout every ZeRO stage
   partitions (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
   Parameter Models", §5) and FSDP's ``FlatParameter`` (Zhao et al. 2023, "PyTorch FSDP:
   Experiences on Scaling Fully Sharded Data Parallel", §3.2).
2. :func:`zero2_reduce_scatter_hook`: ZeRO stage 2 (P_os+g, ZeRO §5.2) with FSDP2's per-parameter
   shards: when backward has produced the gradients, one reduce-scatter leaves each rank its piece
   of every parameter's averaged gradient; the full gradients are freed. It runs inside ranks (start
   it with ``minitorch_dist.launch(fn, n)``) and talks through ``minitorch_dist.runtime.comm``,
   whose meter the tests read.
3. :class:`Zero3Unit`: ZeRO stage 3 (P_os+g+p, ZeRO §5.3; FSDP's unit, Zhao et al. 2023, §3) for one
   module, with per-parameter shards: this rank keeps its piece of every parameter; the weights are
   gathered for the forward and for the backward and freed after each, and the gradients are
   reduce-scattered into the shard.
4. :func:`meter_zero_stage`: predict the per-rank model-state bytes (ZeRO §5, Figure 1) and the
   bytes on the wire of one step (§7) of a ZeRO stage, then measure both with ``MemoryMeter`` and
   ``comm.meter()``.
5. :func:`adafactor_update`: one step of Adafactor's factored second moment (Shazeer & Stern 2018,
   "Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", §3, Algorithm 4), factored over
   a gradient's two largest dimensions.
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


def flatten_and_partition(tensors: list[torch.Tensor], n: int, rank: int,
                          align: int = 1) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, torch.Size]]]:
    """Kind: build · about 30 minutes

    One zero-padded flat buffer holding ``tensors``, cut into n equal shards, in which every tensor
    and every shard starts at a multiple of ``align`` elements, and rank ``rank``'s shard of it.

    ZeRO partitions parameters, gradients and optimizer state as flat 1-D buffers (Rajbhandari et
    al. 2020, §5; FSDP's ``FlatParameter``, Zhao et al. 2023, §3.2): one collective moves every
    tensor at once, and an elementwise optimizer updates a slice without caring where one tensor
    ends. Real implementations also *align*: a tensor that starts on an aligned address can be
    read with wide vector loads, and so can a shard. Here every tensor starts at an offset that is
    a multiple of ``align`` (zeros fill the gaps), the shards are equal, each a multiple of
    ``align`` elements long, and the buffer is as short as those rules allow.

    Interface:

    - ``tensors``: one or more tensors of one dtype (the scaffolding checks); ``n >= 1`` shards;
      ``0 <= rank < n``; ``align >= 1`` elements. ``align = 1`` is the plain end-to-end layout.
    - returns ``(flat, shard, layout)``: ``flat`` a new 1-D buffer (inputs' dtype and device)
      holding each tensor flattened at its offset and zeros everywhere else (the inputs are
      copied, never modified); ``shard`` rank's elements of ``flat``, a *view* (writing into it
      writes into ``flat``); ``layout`` one ``(offset, shape)`` pair per tensor, in order.

    The tests check, for n = 1..5, several alignments and ragged sizes (a prime number of
    elements, a 0-dim tensor): the buffer against one built element by element, equal shards that
    tile it, the shortest such buffer, zero gaps and padding, the shard being a view, untouched
    inputs, the layout, and refusals of bad input.

    Reference: ``minitorch_dist/memory/zero/flat.py`` (``FlatParams``: the unaligned layout, align = 1;
    the exercise adds alignment of tensors and shards).
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("flatten_and_partition needs at least one tensor")
    if n < 1:
        raise ValueError(f"the world size n must be >= 1, got {n}")
    if not 0 <= rank < n:
        raise ValueError(f"rank {rank} is outside a world of n={n} ranks (0 <= rank < n)")
    if align < 1:
        raise ValueError(f"align must be >= 1 element, got {align}")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(f"one flat buffer holds one dtype, got {sorted(map(str, dtypes))}; "
                         "flatten each dtype separately")
    # BEGIN SOLUTION
    layout, offset = [], 0
    for t in tensors:
        offset = math.ceil(offset / align) * align  # each tensor starts aligned
        layout.append((offset, t.shape))
        offset += t.numel()
    s = math.ceil(offset / (n * align)) * align  # equal shards, each a multiple of align
    flat = torch.zeros(n * s, dtype=tensors[0].dtype, device=tensors[0].device)  # gaps and tail stay 0
    for t, (o, _) in zip(tensors, layout):
        flat[o:o + t.numel()].copy_(t.reshape(-1))
    return flat, flat[rank * s:(rank + 1) * s], layout
    # END SOLUTION


def unflatten(flat: torch.Tensor, layout: list[tuple[int, torch.Size]]) -> list[torch.Tensor]:
    """Kind: build · about 10 minutes

    The shaped tensors of ``layout`` as views into ``flat``: the inverse of
    :func:`flatten_and_partition`, for that buffer or any other of the same layout (the
    all-gathered parameters, a gradient buffer).

    Interface: ``flat`` a 1-D buffer, ``layout`` a list of ``(offset, shape)`` pairs (the offsets
    may leave gaps: alignment). Returns one tensor per pair, of that shape, holding the elements
    from its offset on. Each must be a *view* into ``flat``, so that a whole-buffer write (an
    all-gather) updates every tensor at once, and so that autograd carries each tensor's gradient
    back into ``flat`` — the reason FSDP's parameters are views of its flat buffer (Zhao et al.
    2023, §3.2).

    The tests check the round trip with aligned and unaligned layouts, views that see writes into
    another buffer, gradients flowing into ``flat``, and the refusal of a layout from another
    buffer.

    Reference: ``minitorch_dist/memory/zero/flat.py`` (``FlatParams.views``: offsets computed from the
    parameters; here they come from the layout, gaps and all).
    """
    if flat.dim() != 1:
        raise ValueError(f"flat must be a 1-D buffer, got shape {tuple(flat.shape)}")
    for offset, shape in layout:
        end = offset + math.prod(shape)
        if offset < 0 or end > flat.numel():
            raise ValueError(f"layout entry (offset {offset}, shape {tuple(shape)}) needs elements "
                             f"[{offset}, {end}) but flat has {flat.numel()}: flat and layout come from "
                             "different buffers")
    # BEGIN SOLUTION
    return [flat[offset:offset + math.prod(shape)].view(shape) for offset, shape in layout]
    # END SOLUTION


# --- 2. the ZeRO-2 reduce-scatter hook ------------------------------------------------------------


def zero2_reduce_scatter_hook(params: list[torch.nn.Parameter], group=None) -> tuple[torch.Tensor, list]:
    """Kind: build · about 60 minutes

    ZeRO stage 2 (P_os+g, Rajbhandari et al. 2020, §5.2) with *per-parameter* shards: make every
    backward end with this rank's shard of the gradient averaged over the ranks, and no full
    gradient left behind.

    A rank only updates its own 1/n of the parameters, so it only needs that 1/n of the gradient:
    one reduce-scatter (Ψ on the wire, half an all-reduce) gives it, and the full gradients can go.
    Which 1/n? ZeRO-1/2 and FSDP1 cut one flat buffer end to end, so a rank's shard may hold half
    of one tensor and none of the next. FSDP2 (PyTorch's ``fully_shard``) cuts *each parameter*
    instead: parameter i, flattened and zero-padded to ``n * c_i`` elements, ``c_i = ceil(numel_i /
    n)``, gives rank r its elements ``[r*c_i, (r+1)*c_i)``. Rank r's shard is those pieces
    concatenated in parameter order: ``S = c_0 + c_1 + ...`` elements, every rank holding a piece of
    every parameter. Build the gradient path for that layout.

    Interface: ``params`` trainable, of one dtype and device (the scaffolding checks and computes
    ``c`` as ``chunks``, ``S`` and the zero ``grad_shard``). Returns ``(grad_shard, handles)``:
    ``grad_shard`` the 1-D tensor of S elements that every backward overwrites, in place, with
    this rank's pieces of the gradient *averaged* over the ranks (padding positions 0); ``handles``
    one hook handle per parameter (``handle.remove()`` undoes it). Every parameter receives a
    gradient in every backward. Use ``p.register_post_accumulate_grad_hook``.

    The tests check, on 2 and 4 ranks, over two backwards (the second must start afresh): the shard
    against the single-process gradient of the whole global batch cut per parameter; exactly one
    ``comm.reduce_scatter`` per backward, of n·S elements over n ranks, issued after the *last*
    gradient of the backward, also in a model whose first-registered parameter is used last;
    ``p.grad`` freed; the handles.

    Reference: ``minitorch_dist/memory/zero/zero12.py`` (stage 2 on one flat buffer cut end to end;
    the exercise cuts every parameter separately, as FSDP2 does).
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
    chunks = [math.ceil(p.numel() / n) for p in params]  # c_i: parameter i's piece on every rank
    s = sum(chunks)
    grad_shard = torch.zeros(s, dtype=params[0].dtype, device=params[0].device)
    # BEGIN SOLUTION
    starts = [sum(chunks[:i]) for i in range(len(params))]  # where piece i sits inside a shard
    index = {id(p): i for i, p in enumerate(params)}
    state = {"send": None, "arrived": 0}

    def hook(p: torch.nn.Parameter) -> None:
        if state["send"] is None:  # the first gradient of this backward
            state["send"] = torch.zeros(n, s, dtype=grad_shard.dtype, device=grad_shard.device)
        i = index[id(p)]
        c, numel = chunks[i], p.numel()
        padded = torch.zeros(n * c, dtype=p.grad.dtype, device=p.grad.device)
        padded[:numel].copy_(p.grad.reshape(-1))
        # row j of the send buffer is what rank j keeps: piece j of every parameter, in order
        state["send"][:, starts[i]:starts[i] + c].copy_(padded.view(n, c))
        p.grad = None  # ZeRO-2: the full gradient is not kept
        state["arrived"] += 1
        if state["arrived"] == len(params):  # every gradient is in: one reduce-scatter
            comm.reduce_scatter(grad_shard, state["send"].view(-1).div_(n), group=group)
            state["send"], state["arrived"] = None, 0

    handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
    return grad_shard, handles
    # END SOLUTION


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
    """Kind: build · about 90 minutes

    ZeRO stage 3 (P_os+g+p, Rajbhandari et al. 2020, §5.3) for one module — FSDP's *unit* (Zhao et
    al. 2023, §3) — with FSDP2's *per-parameter* shards: every parameter, flattened and zero-padded
    to ``n * c_i`` elements (``c_i = ceil(numel_i / n)``), gives rank r its elements ``[r*c_i,
    (r+1)*c_i)``, and this rank keeps only those pieces, concatenated in parameter order:
    ``self.shard``, S elements, the unit's only parameter (the layout of the ZeRO-2 exercise above).
    The whole weights may exist only while the unit computes: gathered for its forward, freed after
    it, gathered again for its backward, freed after it; the backward ends with this rank's shard
    of the gradient averaged over the ranks. Chain units (``nn.Sequential(Zero3Unit(a),
    Zero3Unit(b))``) and train them with any elementwise optimizer over the shards: n ranks, each on
    its own rows of the global batch, then take the step of one process on the whole batch.

    Interface: ``Zero3Unit(module, group=None)``; ``module`` takes one tensor and returns one; every
    rank builds the same module. The scaffolding (keep it) computes the layout (``self.shapes``,
    ``self.numels``, ``self.chunks`` (the c_i), ``self.starts`` (where each piece sits in a shard),
    ``self.S``, ``self.padded = n * S``, ``self.n``, ``self.rank``, ``self.group``), makes
    ``self.shard``, removes the dense parameters, keeps ``self.full`` (the whole weights, parameter
    after parameter at ``self.offsets``, ``self.total`` elements, its storage resized to 0 bytes
    while sharded) and ``self.gather_into`` (the same storage through a second tensor),
    ``self._bind(leaves)`` (puts one tensor per parameter on the module where its parameter was;
    ``None`` takes them off), and ``forward``, which runs :class:`_UnitFunction`:
    autograd calls :meth:`unit_forward` for the forward and :meth:`unit_backward` exactly when the
    gradient of the unit's output is ready. **You write** :meth:`gather`, :meth:`free`,
    :meth:`unit_forward` and :meth:`unit_backward`.

    The tests check, on 2 and 4 ranks with a chain of two units (one padded) over three steps of SGD
    with momentum: the shards' gradients, the input's gradient and the weights against one process
    on the global batch cut per parameter, and against torch's FSDP2 ``fully_shard``; the
    collectives in order with their bytes (an all-gather of n·S elements per unit forward; all-gather
    then reduce-scatter per unit backward, last unit first: 3Ψ on the wire, padding included); both
    units' whole weights freed after the forward and after the backward, only the computing unit
    gathered, and the forward never recomputed.

    Reference: ``minitorch_dist/memory/zero/fsdp_unit.py`` (``UnitFunction``: the same life cycle on one
    flat buffer cut end to end; per-parameter shards need the gathered pieces copied out and the
    gradient laid out rank by rank).
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
        self.offsets = [sum(self.numels[:i]) for i in range(len(unique))]  # in the whole weights, `full`
        self.total = sum(self.numels)
        self.chunks = [math.ceil(k / self.n) for k in self.numels]  # c_i: parameter i's piece per rank
        self.starts = [sum(self.chunks[:i]) for i in range(len(unique))]  # where piece i sits in a shard
        self.S = sum(self.chunks)
        self.padded = self.n * self.S  # what an all-gather or a reduce-scatter moves
        with torch.no_grad():
            pieces = []
            for p, c in zip(unique, self.chunks):
                padded = torch.zeros(self.n * c, dtype=p.dtype, device=p.device)
                padded[:p.numel()].copy_(p.reshape(-1))
                pieces.append(padded[self.rank * c:(self.rank + 1) * c])
            self.shard = nn.Parameter(torch.cat(pieces))
            full = torch.zeros(self.total, dtype=unique[0].dtype, device=unique[0].device)
        index = {id(p): i for i, p in enumerate(unique)}
        self._slots = []  # (submodule, attribute, parameter index), tied parameters under each name
        for name, p in named:
            path, _, attr = name.rpartition(".")
            owner = module.get_submodule(path)
            self._slots.append((owner, attr, index[id(p)]))
            owner._parameters.pop(attr, None)  # the dense parameter goes away ...
            setattr(owner, attr, None)  # ... and its name waits for _bind
        self.full = full  # the whole weights, parameter after parameter: storage only while gathered
        # The same storage through a second tensor, with a version counter of its own: writing the
        # gathered weights through it does not mark the tensors autograd saved (views of `full`) as
        # modified in place.
        self.gather_into = full.new_empty(0).set_(full.untyped_storage(), 0, full.shape)
        self.full.untyped_storage().resize_(0)

    def _bind(self, leaves: list[torch.Tensor] | None) -> None:
        for owner, attr, i in self._slots:
            setattr(owner, attr, None if leaves is None else leaves[i])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _UnitFunction.apply(self, self.shard, x)

    def gather(self) -> None:
        """Give ``self.full``'s storage its bytes back and fill it with the whole weights, parameter
        after parameter at ``self.offsets``, from every rank's shard: one ``comm.all_gather`` of
        ``self.shard`` (detached) moving ``self.padded`` elements, then whatever copying your layout
        needs.

        Write into ``full``'s storage through ``self.gather_into``, not ``self.full``: it sees the
        same storage with a version counter of its own, so the write does not mark the views of
        ``full`` that autograd saved in the forward as modified in place (the backward would refuse
        to run).
        """
        # BEGIN SOLUTION
        self.full.untyped_storage().resize_(self.total * self.full.element_size())
        received = torch.empty(self.padded, dtype=self.shard.dtype, device=self.shard.device)
        comm.all_gather(received, self.shard.detach(), group=self.group)
        by_rank = received.view(self.n, self.S)  # row j: rank j's shard, a piece of every parameter
        for o, k, c, st in zip(self.offsets, self.numels, self.chunks, self.starts):
            # parameter i: the column block of its pieces, rank after rank, without the padding
            self.gather_into[o:o + k].copy_(by_rank[:, st:st + c].reshape(-1)[:k])
        # END SOLUTION

    def free(self) -> None:
        """Reshard: give back the bytes of ``self.full``'s storage (every view of it keeps its
        shape and sees the weights again after the next :meth:`gather`)."""
        # BEGIN SOLUTION
        self.full.untyped_storage().resize_(0)
        # END SOLUTION

    def unit_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, object]:
        """The unit's forward on the whole weights; returns ``(output, saved)``.

        ``output`` is the module's output on ``x``, detached (``_UnitFunction`` makes it part of the
        outer graph); ``saved`` is whatever :meth:`unit_backward` needs to run the backward without
        running the module again. The whole weights exist only while this runs. It is called under
        no-grad.
        """
        # BEGIN SOLUTION
        self.gather()
        leaves = [self.full[o:o + k].view(shape).detach().requires_grad_()
                  for o, k, shape in zip(self.offsets, self.numels, self.shapes)]
        inp = x.detach().requires_grad_(x.requires_grad)
        with torch.enable_grad():
            self._bind(leaves)
            try:
                out = self.module(inp)
            finally:
                self._bind(None)
        self.free()
        return out.detach(), (leaves, inp, out)
        # END SOLUTION

    def unit_backward(self, saved, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unit's backward; returns ``(grad_shard, grad_x)``.

        ``grad_shard``: a new tensor of S elements, this rank's shard of the weights' gradient
        averaged over the ranks, in the shard's layout (zero in the padding); ``grad_x``: the
        gradient of the unit's input (None when the input did not require grad), the gradient the
        previous unit needs. The whole weights exist only while this runs; one
        ``comm.reduce_scatter`` of ``self.padded`` elements.
        """
        # BEGIN SOLUTION
        leaves, inp, out = saved
        self.gather()
        torch.autograd.backward(out, grad_out)
        send = torch.zeros(self.n, self.S, dtype=self.shard.dtype, device=self.shard.device)
        for leaf, k, c, st in zip(leaves, self.numels, self.chunks, self.starts):
            if leaf.grad is not None:  # row j gets piece j of this parameter's gradient
                padded = torch.zeros(self.n * c, dtype=send.dtype, device=send.device)
                padded[:k].copy_(leaf.grad.reshape(-1))
                send[:, st:st + c].copy_(padded.view(self.n, c))
        grad_shard = torch.empty_like(self.shard)
        comm.reduce_scatter(grad_shard, send.view(-1).div_(self.n), group=self.group)
        self.free()
        return grad_shard, inp.grad
        # END SOLUTION


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
    """Kind: measure · about 40 minutes

    Predict what one training step of ZeRO ``stage`` costs this rank — the bytes of model states it
    holds and the bytes it puts on the wire — then run the step and measure both.

    Runs inside ranks. ``make_model()`` builds the same fp32 model on every rank; ``x``, ``y`` are
    this rank's rows; the loss is ``F.mse_loss(model(x), y)``; the optimizer is AdamW. The
    scaffolding wraps the model: ``model, opt, inner = _zero_model(make_model(), stage, lr)``
    (stages 0-2: the library's ``ZeroDataParallel``; stage 3: ``fully_shard`` of the whole model,
    one unit; ``inner`` is the optimizer that holds the state). A step is ``opt.zero_grad()``,
    forward, ``loss.backward()``, ``opt.step()``.

    Return ``{"predicted": {"model_states", "wire"}, "measured": {"parameters", "gradients",
    "optimizer_state", "model_states", "wire"}}``, in bytes:

    - *predicted*, before anything runs, from the model's parameter count with the cost model
      (``minitorch_dist.costmodel``, its ZeRO formulas: fp32 parameters and gradients, AdamW's two
      moments), Rajbhandari et al. 2020, §5 and §7;
    - *measured* on a real step in the steady state (AdamW creates its state in its first step):
      the wire bytes that ``comm.meter()`` counts for exactly one step, and the model states that
      ``MemoryMeter(model, inner).current()`` reports at the moment ZeRO counts them — gradients
      complete, optimizer state allocated; ``model_states`` the sum of the three categories.

    The tests hold the predictions exactly (to 1e-9, relative) to ZeRO's formulas; the measured wire
    to the byte against an independent count of one step (padding and the "has a gradient"
    bookkeeping included); parameters and gradients to the byte; the optimizer state and the total
    within 1% above the formula (AdamW's step counters and the padding only add).

    Reference: ``minitorch_dist/analysis/meters.py`` (``MemoryMeter``: what it counts in each category;
    the exercise predicts and meters a step across the four stages).
    """
    _require_dist("meter_zero_stage")
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage!r}")
    # BEGIN SOLUTION
    n = dist.get_world_size()
    model = make_model()
    psi = sum(p.numel() for p in model.parameters())
    predicted = {"model_states": costmodel.zero_memory_bytes(psi, n, stage, k=8, param_bytes=4, grad_bytes=4),
                 "wire": costmodel.zero_comm_bytes(psi, n, stage, bytes_per_element=4)}
    model, opt, inner = _zero_model(model, stage, lr)

    def step(meter=None):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        states = MemoryMeter(model, inner).current() if meter else None
        opt.step()
        return states

    step()  # AdamW allocates its state in its first step
    with comm.meter() as m:
        states = step(meter=True)
    measured = {k: states[k] for k in ("parameters", "gradients", "optimizer_state")}
    measured["model_states"] = sum(measured.values())
    measured["wire"] = m.total_wire_bytes
    return {"predicted": predicted, "measured": measured}
    # END SOLUTION


# --- 5. Adafactor's factored second moment ---------------------------------------------------------


def adafactor_update(grad: torch.Tensor, row_avg: torch.Tensor, col_avg: torch.Tensor, beta2: float,
                     eps: float = 1e-30) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Kind: build · about 40 minutes

    One step of Adafactor's factored second moment (Shazeer & Stern 2018, §3, Algorithm 4) for a
    gradient ``G`` of two or more dimensions, factored over its *two largest* dimensions.

    Adam keeps ``V``, an exponential moving average of ``G * G``: as many numbers as the
    parameter. Adafactor keeps moving averages of its row means and of its column means (each of
    ``G * G + eps``, the paper's eps_1) and rebuilds a rank-1 estimate ``V^`` of V from them; the
    update is ``G / sqrt(V^)``. Derive ``V^`` from the paper (it writes sums; means give the same
    estimate). A tensor of more dimensions (a convolution's kernel, a stack of heads) is factored
    over the two dimensions that save the most, its two largest, as optax and T5X do: with sizes
    ``grad.shape``, pick the largest dimension and then the largest of the others (ties go to the
    later dimension); call the one with the smaller index ``r`` and the other ``c``. Every slice
    ``grad[..., :, ..., :, ...]`` over (r, c), one for each index of the other dimensions, is then a
    matrix factored on its own, with rows along r and columns along c.

    Interface: ``grad`` with ``grad.dim() >= 2``; ``row_avg`` shaped like ``grad`` without dimension
    c (the row means, one per index of every other dimension); ``col_avg`` shaped like ``grad``
    without dimension r; ``0 <= beta2 < 1`` (the old averages are ignored when it is 0); ``eps >= 0``.
    Returns ``(update, new_row_avg, new_col_avg)`` shaped like ``grad``, ``row_avg``, ``col_avg``;
    the inputs are not modified. The step size, the beta2 schedule and update clipping belong to
    the optimizer around this function. The scaffolding finds r and c and checks the shapes.

    The tests check exactness when each slice's V is rank 1; the averages against their
    definition; three steps against ``torch.optim.Adafactor`` on a matrix; 3-D and 4-D gradients
    whose largest dimensions are not the last two, slice by slice; untouched inputs; refusals.

    Reference: ``minitorch_dist/memory/adafactor.py`` (the optimizer, factoring the last two dimensions
    of a matrix; the exercise factors the two largest of any number).
    """
    if grad.dim() < 2:
        raise ValueError("adafactor_update factors a gradient of 2 or more dimensions, got shape "
                         f"{tuple(grad.shape)}; vectors keep an unfactored second moment")
    by_size = sorted(range(grad.dim()), key=lambda d: (grad.shape[d], d))  # ties: the later dim is larger
    r, c = sorted(by_size[-2:])
    row_shape = tuple(grad.shape[:c]) + tuple(grad.shape[c + 1:])
    col_shape = tuple(grad.shape[:r]) + tuple(grad.shape[r + 1:])
    if tuple(row_avg.shape) != row_shape:
        raise ValueError(f"row_avg must have shape {row_shape}: grad {tuple(grad.shape)} without its "
                         f"dimension {c} (the columns), got {tuple(row_avg.shape)}")
    if tuple(col_avg.shape) != col_shape:
        raise ValueError(f"col_avg must have shape {col_shape}: grad {tuple(grad.shape)} without its "
                         f"dimension {r} (the rows), got {tuple(col_avg.shape)}")
    if not 0.0 <= beta2 < 1.0:
        raise ValueError(f"beta2 must lie in [0, 1), got {beta2}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    # BEGIN SOLUTION
    sq = grad * grad + eps
    new_row = beta2 * row_avg + (1 - beta2) * sq.mean(dim=c)
    new_col = beta2 * col_avg + (1 - beta2) * sq.mean(dim=r)
    # the rank-1 estimate of every (r, c) slice: R_i C_j / mean(R), mean over that slice's rows
    v_hat = new_row.unsqueeze(c) * new_col.unsqueeze(r) / new_row.mean(dim=r, keepdim=True).unsqueeze(c)
    return grad / v_hat.sqrt(), new_row, new_col
    # END SOLUTION
