"""Chapter 10 exercises: mixture of experts — top-2 gating with batch-prioritised capacity, the
load-balancing loss, expert choice, auxiliary-loss-free balancing, expert-parallel dispatch and combine
with the experts dealt round-robin, the traffic and drops of an expert-parallel step predicted and
measured.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch10_moe.py`` is generated from this file with each such region
replaced by ``raise NotImplementedError``. Everything else (imports, argument checks, helpers)
is scaffolding the student keeps. Tests: ``pytest -m ch10 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Exercises 1-4 need no ranks: a router is what every rank runs on its own tokens before the
all-to-all that sends them to their experts. Exercise 5 is that all-to-all, on ranks; exercise 6
predicts what it moves and drops, exercise 7 measures it. Tokens are flattened: ``T`` tokens,
``E`` experts.

1. :func:`top2_gating_prioritized`: GShard's top-2 gating (Lepikhin et al. 2021, Algorithm 1) with
   a fixed expert capacity, its slots handed out by Batch Prioritized Routing (Riquelme et al.
   2021, "Scaling Vision with Sparse Mixture of Experts", §4.1): the most confident tokens first,
   not the earliest. The result is GShard's pair of ``[T, E, C]`` tensors.
2. :func:`switch_aux_loss`: the auxiliary loss of Switch Transformers (Fedus et al. 2021, §2.2).
3. :func:`experts_choose_tokens`: Expert Choice (Zhou et al. 2022, §3.1): each expert picks its
   tokens.
4. :func:`aux_free_select` and :func:`aux_free_bias_step`: auxiliary-loss-free load balancing
   (Wang et al. 2024, Algorithm 1; DeepSeek-V3 §2.1.2).
5. :func:`ep_moe_forward_strided`: expert parallelism (GShard §2.2; Switch Transformers §5) with
   the experts dealt to the ranks round-robin; equal to the single-process layer, gradients included.
6. :func:`ep_traffic_forecast`: the bytes and drops of an expert-parallel step under random routing.
7. :func:`ep_step_traffic`: run the library's expert-parallel layer, meter it, and set the
   forecast beside what the ranks measured.
"""
from __future__ import annotations

import torch

from minitorch_dist import costmodel as cm
from minitorch_dist.costmodel import expert_choice_capacity, moe_capacity
from minitorch_dist.parallelism.mappings import all_to_all, size_and_rank
from minitorch_dist.runtime import comm


def _check_logits(logits: torch.Tensor, min_experts: int = 1) -> None:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E] (tokens x experts), got shape {tuple(logits.shape)}; "
                         "flatten the batch and sequence dimensions first")
    if not logits.is_floating_point():
        raise TypeError(f"router logits must be floating point, got {logits.dtype}")
    if logits.shape[1] < min_experts:
        raise ValueError(f"need at least {min_experts} experts, got E = {logits.shape[1]}")


# --- 1. top-2 gating with batch-prioritised capacity -----------------------------------------------


def top2_gating_prioritized(logits: torch.Tensor, capacity_factor: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Kind: build · about 60 minutes

    ``(combine_weights, dispatch_mask, dropped)``: GShard's top-2 gating (Lepikhin et al. 2021,
    Algorithm 1, without its random dispatch of small second gates) for router ``logits`` [T, E],
    with the capacity slots handed out by Batch Prioritized Routing (Riquelme et al. 2021, §4.1)
    instead of in token order.

    What it must do:

    * Each token's two choices are its two most probable experts under ``softmax(logits)`` (the
      lower index wins a tie); their gates are the two probabilities renormalised to sum to 1.
    * Every expert has ``C = moe_capacity(T, E, k=2, capacity_factor)`` slots. A token's priority
      is its largest router probability; the higher, the earlier (equal priorities: the earlier
      token first). All first choices are served before any second choice, each round in priority
      order. An assignment that finds its expert full is dropped; its gate is *not* given to the
      token's other expert (the residual carries the token). Slots fill from 0 in the order the
      assignments are accepted.
    * Return ``dispatch_mask`` [T, E, C] bool, True where token t sits in slot c of expert e;
      ``combine_weights`` [T, E, C] in ``logits``' dtype, the token's gate in that slot and 0
      elsewhere, differentiable with respect to ``logits``; ``dropped``, the assignments lost.

    Expert e's input buffer is then ``einsum("tec,th->ech", dispatch, x)`` and the layer's output
    ``einsum("tec,ech->th", combine, expert_outputs)``.

    The tests check the kept set, every slot and every gate against routing written token by token,
    on batches whose priority order differs from token order (and from the order of the normalised
    gates, and of the second gates); the drops the loads imply; the MoE layer computed through the
    two tensors; bad input refused.

    Reference: ``minitorch_dist/sparsity/routers.py`` (``assign_by_priority`` serves choices in token
    order and returns index lists; here the order is by confidence and the result GShard's tensors).
    """
    _check_logits(logits, min_experts=2)
    T, E = logits.shape
    C = moe_capacity(T, E, k=2, capacity_factor=capacity_factor)
    # BEGIN SOLUTION
    gates = torch.softmax(logits, dim=-1)
    e1 = gates.argmax(dim=-1)
    mask1 = torch.nn.functional.one_hot(e1, E)                             # [T, E]
    e2 = gates.masked_fill(mask1.bool(), float("-inf")).argmax(dim=-1)
    mask2 = torch.nn.functional.one_hot(e2, E)
    p1, p2 = gates.gather(1, e1[:, None])[:, 0], gates.gather(1, e2[:, None])[:, 0]
    g1, g2 = p1 / (p1 + p2), p2 / (p1 + p2)

    order = torch.sort(p1.detach(), descending=True, stable=True).indices  # priority: most confident first
    m1, m2 = mask1[order], mask2[order]                                    # rows in priority order
    pos1 = (torch.cumsum(m1, dim=0) - 1) * m1                              # slot among first choices
    m1 = m1 * (pos1 < C)
    pos2 = (torch.cumsum(m2, dim=0) - 1 + m1.sum(dim=0, keepdim=True)) * m2  # after the kept firsts
    m2 = m2 * (pos2 < C)
    keep1, keep2 = m1.sum(-1).bool(), m2.sum(-1).bool()
    slot1, slot2 = pos1.sum(-1), pos2.sum(-1)
    t = order                                                              # the token at each priority
    a1, a2 = e1[order], e2[order]
    combine = logits.new_zeros(T, E, C)
    dispatch = torch.zeros(T, E, C, dtype=torch.bool, device=logits.device)
    combine = combine.index_put((t[keep1], a1[keep1], slot1[keep1]), g1[order][keep1])
    combine = combine.index_put((t[keep2], a2[keep2], slot2[keep2]), g2[order][keep2])
    dispatch[t[keep1], a1[keep1], slot1[keep1]] = True
    dispatch[t[keep2], a2[keep2], slot2[keep2]] = True
    dropped = 2 * T - int(keep1.sum() + keep2.sum())
    return combine, dispatch, dropped
    # END SOLUTION


# --- 2. the load-balancing auxiliary loss ---------------------------------------------------------


def switch_aux_loss(router_probs: torch.Tensor, expert_index: torch.Tensor,
                    alpha: float = 0.01) -> torch.Tensor:
    """Kind: derive · about 20 minutes

    The load-balancing auxiliary loss of Switch Transformers (Fedus et al. 2021, §2.2, eq. 4-6), a
    0-dim tensor, for a batch of ``T`` tokens routed over ``N`` experts with weight ``alpha``.

    ``router_probs`` [T, N] are the router's softmax outputs; ``expert_index`` [T] the expert each
    token was dispatched to (top-1), or [T, k] its k experts. Assumptions to build it from: the
    loss multiplies, expert by expert, the share of the batch's assignments the expert received by
    the router probability it was given on average; with k experts per token the share is of the
    ``T·k`` assignments, so the shares still sum to 1. The shares are counts and carry no gradient:
    the gradient must reach ``router_probs`` only through the probabilities. Scale it so that a
    uniform router with a uniform dispatch gives exactly ``alpha`` (the paper's "minimized under a
    uniform distribution").

    The tests check hand-made routers (uniform; collapsed onto one expert; a half-skewed one), the
    library's ``load_balancing_loss`` on seeded random routers (top-1 and top-k), and the gradient.
    """
    if router_probs.dim() != 2:
        raise ValueError("router_probs must be [T, N] (tokens x experts), got shape "
                         f"{tuple(router_probs.shape)}")
    idx = expert_index if expert_index.dim() == 2 else expert_index.unsqueeze(-1)
    if expert_index.dim() not in (1, 2) or idx.shape[0] != router_probs.shape[0]:
        raise ValueError(f"expert_index must be [T] or [T, k] with T = {router_probs.shape[0]}, "
                         f"got shape {tuple(expert_index.shape)}")
    if expert_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_index must be an integer tensor of expert ids, got {expert_index.dtype}")
    N = router_probs.shape[1]
    if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= N):
        raise ValueError(f"expert_index has ids outside [0, {N}): one id per expert of router_probs")
    if not alpha >= 0:
        raise ValueError(f"alpha must be >= 0 (the paper uses 1e-2), got {alpha!r}")
    # BEGIN SOLUTION
    counts = torch.bincount(idx.reshape(-1).long(), minlength=N)
    f = counts.to(router_probs.dtype) / idx.numel()      # fraction of assignments per expert
    P = router_probs.mean(dim=0)                          # mean router probability per expert
    return alpha * N * torch.sum(f * P)
    # END SOLUTION


# --- 3. expert-choice routing ------------------------------------------------------------------------


def experts_choose_tokens(logits: torch.Tensor, capacity_factor: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: derive · about 20 minutes

    ``(gates, token_index)``, each [E, k]: Expert Choice routing (Zhou et al. 2022, §3.1, eq. 1)
    for router ``logits`` [T, E] (the ``X · W_g`` of the paper).

    Turn the choice around: every *expert* ranks the tokens by their affinity to it and takes its
    ``k`` best, ``k = expert_choice_capacity(T, E, capacity_factor)`` (the paper's ``n·c/e``,
    rounded up, at most T). Work out from the paper which normalisation the affinity uses (over
    experts or over tokens: it matters). Row e of ``token_index`` lists expert e's tokens best
    first (int64), and ``gates[e, j]`` is the affinity of that token to expert e: the weight of the
    expert's output in that token's combined output. Every expert is exactly full; a token may be
    chosen by several experts or by none. ``gates`` is differentiable.

    The tests check each expert's tokens and gates against a sort on seeded random logits, a
    hand-made batch with tokens picked twice and never, and the combined outputs and gradient.
    """
    _check_logits(logits)
    T, E = logits.shape
    k = expert_choice_capacity(T, E, capacity_factor)
    # BEGIN SOLUTION
    S = torch.softmax(logits, dim=-1)                 # [T, E]: each token's affinity over experts
    gates, token_index = torch.topk(S.t(), k, dim=-1)  # each expert ranks the tokens
    return gates, token_index
    # END SOLUTION


# --- 4. auxiliary-loss-free load balancing -----------------------------------------------------------


def _check_scores_and_bias(scores: torch.Tensor, bias: torch.Tensor) -> None:
    _check_logits(scores)
    if tuple(bias.shape) != (scores.shape[1],):
        raise ValueError(f"bias must hold one value per expert, shape ({scores.shape[1]},), got "
                         f"{tuple(bias.shape)}")


def aux_free_select(scores: torch.Tensor, bias: torch.Tensor, k: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Kind: derive · about 20 minutes

    ``(experts, gates)``, each [T, k]: DeepSeek-V3's top-k expert selection with a per-expert bias
    (§2.1.2, eq. 16; Wang et al. 2024, Algorithm 1), for affinities ``scores`` [T, E] (a softmax or
    a sigmoid of the router's logits) and ``bias`` [E].

    The bias exists to move load between experts: it decides *which* k experts a token uses (best
    first), and must never change *how much* they weigh nor receive a gradient. Derive from that
    where the bias enters and where it must not. For k > 1 the k gates are renormalised to sum to 1;
    for k = 1 the single gate is the raw score (so the router keeps its gradient, as in Switch).

    The tests check the choices and gates against sorting by hand and against the library's
    ``biased_choice`` on seeded random scores and biases, that a large bias changes choices but no
    weight and gets no gradient, and (with the next exercise) that the bias alone balances a
    collapsed router.
    """
    _check_scores_and_bias(scores, bias)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= scores.shape[1]:
        raise ValueError(f"k must be an int in [1, E = {scores.shape[1]}], got {k!r}")
    # BEGIN SOLUTION
    experts = (scores.detach() + bias.to(scores.dtype)).topk(k, dim=-1).indices   # choose: biased
    gates = scores.gather(1, experts)                                             # weigh: unbiased
    if k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    return experts, gates
    # END SOLUTION


def aux_free_bias_step(bias: torch.Tensor, expert_index: torch.Tensor, rate: float = 0.001) -> torch.Tensor:
    """Kind: derive · about 15 minutes

    The per-expert bias after one training step of auxiliary-loss-free balancing (Wang et al. 2024,
    Algorithm 1; DeepSeek-V3 §2.1.2), a new tensor, from this step's assignments ``expert_index``
    ([T] or [T, k] expert ids) and the update speed ``rate`` (γ; DeepSeek-V3 uses 0.001).

    The update looks only at each expert's load against the mean load, and moves every bias by
    the same fixed amount γ in the direction that evens the loads out (an expert exactly at the
    mean keeps its bias). Which direction is that for an overloaded expert, given how the previous
    exercise uses the bias?

    The tests check hand-made loads (over, under, at the mean; top-1 and top-k), the library's
    ``bias_update`` on seeded random loads, and that the input is not changed in place.
    """
    if bias.dim() != 1:
        raise ValueError(f"bias must be [E] (one value per expert), got shape {tuple(bias.shape)}")
    if expert_index.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"expert_index must be an integer tensor of expert ids, got {expert_index.dtype}")
    E = bias.shape[0]
    if expert_index.numel() and (int(expert_index.min()) < 0 or int(expert_index.max()) >= E):
        raise ValueError(f"expert_index has ids outside [0, {E}): one id per expert of bias")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate > 0:
        raise ValueError(f"rate must be > 0 (DeepSeek-V3 uses 0.001), got {rate!r}")
    # BEGIN SOLUTION
    load = torch.bincount(expert_index.reshape(-1).long(), minlength=E).to(torch.float64)
    return bias + rate * torch.sign(load.mean() - load).to(bias.dtype)
    # END SOLUTION


# --- 5. expert-parallel dispatch and combine, experts dealt round-robin ------------------------------------


def ep_moe_forward_strided(x: torch.Tensor, router, local_experts, group=None) -> torch.Tensor:
    """Kind: build · about 75 minutes

    One MoE layer with its experts dealt to the ``n`` ranks of ``group`` round-robin (GShard §2.2;
    Switch Transformers §5): this rank's outputs ``y`` [T, h] for its own tokens ``x`` [T, h].

    Every rank holds the same ``router`` (a :class:`~minitorch_dist.sparsity.routers.Router`) and
    only its own experts: rank r holds experts ``r, r + n, r + 2n, ...`` of the layer's E, in that
    order, as ``local_experts`` (``layer.experts[r::n]``). ``router(x)`` returns a ``Routing``
    whose kept assignments ``tokens``, ``experts``, ``weights`` [A] are sorted by expert, and
    ``counts`` [E] (int64) the kept assignments per expert.

    What it must do: send every kept row of ``x`` to the rank that owns its expert, run it there
    through that expert, bring the output home and add it into its token's output with its
    assignment's weight (0 for a token with no kept assignment). A rank cannot know in advance how
    many rows it will receive: it must learn the counts first. Use only all-to-alls
    (``comm.all_to_all(out, inp, out_splits, in_splits, group=group)`` for integer counts, the
    differentiable ``all_to_all(rows, out_splits, in_splits, group)`` imported above for rows: its
    backward is the all-to-all of the gradients with the splits swapped), and move the kept rows
    out and back once each, nothing more than E counts besides.

    The result, outputs and gradients (of ``x``, of the router through the weights, and of every
    local expert, which sees every rank's rows), must equal the single-process layer
    (``sparsity.moe.MoELayer``: the same router and all E experts) run on this rank's ``x`` alone.
    Give every local expert its rows even when there are none (an expert run on an empty block gets
    a zero gradient rather than ``None``). Refuse ``x`` of the wrong width and a number of local
    experts other than E/n (``ValueError``).

    The tests run it on 2 and 4 ranks for four routings (Switch and top-2 with drops, expert choice,
    a skewed one that leaves whole blocks empty) against the single-process layer, in float64, and
    read the comm meter: all-to-alls only, the kept rows out and back plus at most E counts.

    Reference: ``minitorch_dist/sparsity/expert_parallel.py`` (``ExpertParallelMoE`` holds contiguous
    blocks of experts, so its rows are already grouped by owner; dealt round-robin, they are not).
    """
    n, r = size_and_rank(group, "expert parallelism")
    if x.dim() != 2 or x.size(1) != router.h:
        raise ValueError(f"x must be this rank's tokens [T, h={router.h}], got shape {tuple(x.shape)}")
    E, El = router.n_experts, len(local_experts)
    if El * n != E:
        raise ValueError(f"rank {r} holds {El} experts but the router scores E = {E} on {n} ranks: each "
                         f"rank must hold E/n experts (E divisible by n)")
    # BEGIN SOLUTION
    routing = router(x)
    owner = routing.experts % n                                  # expert e lives on rank e mod n
    by_owner = torch.sort(owner, stable=True).indices            # rank-major, expert order inside
    tokens, weights = routing.tokens[by_owner], routing.weights[by_owner]
    packed = x[tokens]
    to_rank = routing.counts.view(El, n).t().contiguous()        # [n, El]: rows for rank j's i-th expert
    recv = torch.empty_like(routing.counts)
    comm.all_to_all(recv, to_rank.reshape(-1), [El] * n, [El] * n, group=group)
    per_src = recv.view(n, El)                                   # rows rank i sends to my i-th expert
    send = to_rank.sum(1).tolist()                               # rows I send to each rank
    got = per_src.sum(1).tolist()                                # rows I receive from each rank
    received = all_to_all(packed, got, send, group)              # source-major
    expert_of_row = torch.arange(El, device=x.device).repeat(n).repeat_interleave(per_src.reshape(-1))
    by_expert = torch.sort(expert_of_row, stable=True).indices   # regroup: expert-major
    blocks = received[by_expert].split(per_src.sum(0).tolist())
    out = torch.cat([expert(b) for expert, b in zip(local_experts, blocks)])
    out = out[torch.argsort(by_expert)]                          # back to the order the rows arrived
    back = all_to_all(out, send, got, group)                     # every row home, in the order sent
    weighted = back * weights.to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, tokens, weighted)
    # END SOLUTION


# --- 6. the traffic and drops of an expert-parallel step, predicted ----------------------------------


def ep_traffic_forecast(tokens: int, hidden: int, n_experts: int, n_ranks: int, capacity_factor: float = 1.0,
                        bytes_per_element: int = 4) -> dict:
    """Kind: derive · about 30 minutes

    Predict what one training step (forward and backward) of an expert-parallel Switch layer
    (top-1, experts in contiguous blocks: the library's ``ExpertParallelMoE``) costs one rank, when
    every rank routes ``tokens`` tokens and the router sends each token to one of the
    ``n_experts`` experts uniformly at random, independently of the others. Return a dict:

    * ``"capacity"``: C, the assignments one expert takes from one rank's batch (capacity is per
      rank: every rank routes its own tokens);
    * ``"dropped"``: the expected number of assignments one rank drops (an expert asked for more
      than C keeps the first C);
    * ``"bytes"``: the expected bytes one rank's comm meter counts in ``all_to_all`` over the step.

    Assumptions: the forward exchanges the counts (E int64s), dispatches every kept row (``hidden``
    elements of ``bytes_per_element`` bytes) and sends back every row it received; the backward runs
    the row exchanges again, splits swapped (the counts need no backward). The meter counts a rank's
    whole input to each call, the rows it keeps for itself included. On average a rank receives as
    many rows as it keeps. Expected drops need the distribution of one expert's load; expectation
    is linear.

    The tests compare your numbers with ``minitorch_dist.costmodel`` on seeded random
    configurations, with sums written term by term, with hand-worked cases, and with the mean the
    library's layer measures on 2 and 4 ranks (within 5 standard errors).
    """
    for name, v in (("tokens", tokens), ("hidden", hidden), ("n_experts", n_experts), ("n_ranks", n_ranks),
                    ("bytes_per_element", bytes_per_element)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if n_experts % n_ranks:
        raise ValueError(f"n_experts {n_experts} is not divisible by n_ranks {n_ranks}: each rank holds "
                         f"E/n experts")
    if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, (int, float)) \
            or not 0 < capacity_factor < float("inf"):
        raise ValueError(f"capacity_factor must be a number > 0 (1.0 = an even share), "
                         f"got {capacity_factor!r}")
    # BEGIN SOLUTION
    C = cm.moe_capacity(tokens, n_experts, 1, capacity_factor)
    dropped = cm.expected_dropped_tokens(tokens, n_experts, 1, capacity_factor)
    kept = tokens - dropped  # rows dispatched, and (on average) rows received
    # one kept row's bytes: dispatch + combine, forward + backward, as the meter counts them
    per_row = cm.all_to_all_bytes_moe(1, hidden, n_ranks, bytes_per_element=bytes_per_element,
                                      include_self=True, backward=True)
    nbytes = kept * per_row + cm.moe_counts_exchange_bytes(n_experts, n_ranks, include_self=True)
    return {"capacity": C, "dropped": dropped, "bytes": nbytes}
    # END SOLUTION


# --- 7. the traffic and drops of an expert-parallel step, measured -----------------------------------------


def ep_step_traffic(layer, batches) -> dict:
    """Kind: measure · about 30 minutes

    Measure what training steps of an expert-parallel Switch layer cost this rank, and set your
    forecast (exercise 6) beside it. Runs inside ranks.

    ``layer`` is this rank's :class:`~minitorch_dist.sparsity.expert_parallel.ExpertParallelMoE`
    (a Switch router, top-1, with a finite capacity factor); ``batches`` a list of this rank's
    token batches, each [T, h] (the same T), leaf tensors that require grad. For each batch run
    one step, forward then backward of ``layer(x).sum()``, and record the bytes this rank's comm
    meter counts in ``all_to_all`` over that step and the assignments the layer dropped on this
    rank. Return a dict:

    * ``"bytes"``, ``"dropped"``: lists, one measured value per batch, in order (ints);
    * ``"predicted"``: ``ep_traffic_forecast`` for this layer and these batches (every argument
      read from the layer, the group and the batches: none is given to you).

    The tests compare your measurements, batch by batch and exactly, with the same steps metered
    by the tests on 2 and 4 ranks; your prediction with the costmodel; and the prediction with the
    mean of your measurements (within 5 standard errors).

    Reference: ``minitorch_dist/sparsity/expert_parallel.py`` (the layer and what it records after a
    forward); ``minitorch_dist.runtime.comm.meter`` counts the bytes.
    """
    if not batches:
        raise ValueError("batches is empty: give at least one [T, h] batch to measure")
    if len({tuple(b.shape) for b in batches}) != 1 or batches[0].dim() != 2:
        raise ValueError("every batch must be [T, h] with the same T: the forecast is for one batch size")
    # BEGIN SOLUTION
    T, h = batches[0].shape
    router = layer.router
    element = batches[0].element_size()
    predicted = ep_traffic_forecast(T, h, layer.n_experts, layer.n, router.capacity_factor, element)
    nbytes, dropped = [], []
    for x in batches:
        with comm.meter() as m:
            layer(x).sum().backward()
        nbytes.append(int(m.bytes["all_to_all"]))
        dropped.append(int(layer.last_routing.dropped))
    return {"bytes": nbytes, "dropped": dropped, "predicted": predicted}
    # END SOLUTION
