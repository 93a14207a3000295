"""Chapter 10 exercises: mixture of experts — top-2 gating with capacity, the load-balancing loss,
expert choice, auxiliary-loss-free balancing, expert-parallel dispatch and combine, the traffic and
drops of an expert-parallel step predicted.

Worked solutions. The part a student writes sits between ``# BEGIN SOLUTION`` and
``# END SOLUTION``; ``exercises/ch10_moe.py`` is generated from this file with each such region
replaced by ``raise NotImplementedError``. Everything else (imports, argument checks, helpers)
is scaffolding the student keeps. Tests: ``pytest -m ch10 tests/exercises``
(``MTD_IMPL=exercises`` runs them against the stubs).

Exercises 1-4 need no ranks: a router is what every rank runs on its own tokens before the
all-to-all that sends them to their experts. Exercise 5 is that all-to-all, on ranks; exercise 6
predicts what it moves and drops. Tokens are flattened: ``T`` tokens, ``E`` experts.

1. :func:`top2_gating_with_capacity`: GShard's top-2 gating (Lepikhin et al. 2021, "GShard:
   Scaling Giant Models with Conditional Computation and Automatic Sharding", Algorithm 1)
   with a fixed expert capacity ``C``: each token goes to its two highest-scoring experts, an
   expert takes at most ``C`` of them, first choices before second choices, and an assignment
   that finds its expert full is dropped. The result is GShard's pair of ``[T, E, C]`` tensors:
   *dispatch* (which token sits in which slot of which expert's buffer) and *combine* (with
   what weight the slot's output comes back).
2. :func:`switch_aux_loss`: the auxiliary loss of Switch Transformers (Fedus et al. 2021,
   "Switch Transformers: Scaling to Trillion Parameter Models with Simple and Efficient
   Sparsity", §2.2, eq. 4-6), ``α·N·Σ_i f_i·P_i``: the fraction of tokens routed to expert i
   times the router's mean probability for it, minimised (= α) by a uniform load.
3. :func:`experts_choose_tokens`: Expert Choice (Zhou et al. 2022, "Mixture-of-Experts with
   Expert Choice Routing", §3.1, eq. 1): turn the choice around, each *expert* picks its top
   ``k = n·c/e`` tokens, so every expert is exactly full and nothing is dropped for capacity
   (a token may instead be picked by several experts, or by none).
4. :func:`aux_free_select` and :func:`aux_free_bias_step`: auxiliary-loss-free load balancing
   (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
   Algorithm 1; DeepSeek-V3 Technical Report §2.1.2, eq. 16): a per-expert bias added to the
   scores *for choosing* the top-k experts only, the gates taken from the unbiased scores; after
   each step the bias of an overloaded expert falls by γ and an underloaded one's rises by γ.
5. :func:`ep_moe_forward`: expert parallelism (GShard §2.2; Switch Transformers §5): each rank
   holds E/n of the experts and routes its own tokens; the kept rows travel to their experts'
   ranks by an all-to-all and come back by another, and the result equals the single-process
   layer, gradients included.
6. :func:`ep_traffic_forecast`: before running it, predict the bytes one rank's all-to-alls move
   in a training step of that layer and the assignments its capacity drops, for a router that
   spreads tokens at random; the tests measure both on 2 and 4 ranks.
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


# --- 1. GShard top-2 gating with expert capacity ---------------------------------------------------


def top2_gating_with_capacity(logits: torch.Tensor, capacity_factor: float = 1.0
                              ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Kind: build

    ``(combine_weights, dispatch_mask, dropped)`` of GShard top-2 gating (Lepikhin et al. 2021,
    Algorithm 1, without its random dispatch of small second gates) for router ``logits`` [T, E].

    ``C = moe_capacity(T, E, k=2, capacity_factor)`` = ceil(cf · 2T / E) slots per expert.

    1. ``gates = softmax(logits)`` over experts. First choice ``e1 = argmax gates``, second
       ``e2`` = argmax with ``e1`` excluded (``torch.argmax``: the lowest index wins a tie).
       Normalise the pair: ``g1, g2 = g1 / (g1 + g2), g2 / (g1 + g2)``.
    2. First choices, in token order: the token's slot in ``e1``'s buffer is the number of earlier
       tokens whose first choice is ``e1``; it is kept if that slot is ``< C``.
    3. Second choices, in token order, fill the slots *after* the kept first choices of their
       expert: slot = (first choices kept at ``e2``) + (earlier tokens whose second choice is
       ``e2``); kept if ``< C``. So first choices always have priority over second choices.
    4. ``dispatch_mask[t, e, c]`` is True where token t sits in slot c of expert e;
       ``combine_weights[t, e, c]`` is its normalised gate there, 0 elsewhere (a dropped
       assignment's gate is *not* given to the other expert: the token's residual carries it).
       ``dropped`` = 2T minus the kept assignments.

    Shapes: both ``[T, E, C]`` (combine in ``logits``' dtype, differentiable; dispatch bool).
    Expert e's input buffer is ``einsum("tec,th->ech", dispatch, x)`` and the layer's output
    ``einsum("tec,ech->th", combine, expert_outputs)``.
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
    g1, g2 = gates.gather(1, e1[:, None])[:, 0], gates.gather(1, e2[:, None])[:, 0]
    denom = g1 + g2
    g1, g2 = g1 / denom, g2 / denom

    pos1 = (torch.cumsum(mask1, dim=0) - 1) * mask1                      # slot among first choices
    mask1 = mask1 * (pos1 < C)
    pos2 = (torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)) * mask2  # after kept firsts
    mask2 = mask2 * (pos2 < C)
    keep1, keep2 = mask1.sum(-1).bool(), mask2.sum(-1).bool()
    slot1, slot2 = pos1.sum(-1), pos2.sum(-1)

    t = torch.arange(T, device=logits.device)
    combine = logits.new_zeros(T, E, C)
    dispatch = torch.zeros(T, E, C, dtype=torch.bool, device=logits.device)
    combine = combine.index_put((t[keep1], e1[keep1], slot1[keep1]), g1[keep1])
    combine = combine.index_put((t[keep2], e2[keep2], slot2[keep2]), g2[keep2])
    dispatch[t[keep1], e1[keep1], slot1[keep1]] = True
    dispatch[t[keep2], e2[keep2], slot2[keep2]] = True
    dropped = 2 * T - int(keep1.sum() + keep2.sum())
    return combine, dispatch, dropped
    # END SOLUTION


# --- 2. the load-balancing auxiliary loss ---------------------------------------------------------


def switch_aux_loss(router_probs: torch.Tensor, expert_index: torch.Tensor,
                    alpha: float = 0.01) -> torch.Tensor:
    """Kind: derive

    Switch Transformers' auxiliary loss (Fedus et al. 2021, §2.2, eq. 4-6), a 0-dim tensor::

        loss = α · N · Σ_i f_i · P_i
        f_i  = (1/T) Σ_x 1{argmax p(x) = i}       fraction of tokens dispatched to expert i
        P_i  = (1/T) Σ_x p_i(x)                    router probability mass given to expert i

    ``router_probs`` [T, N] are the router's softmax outputs ``p(x)``; ``expert_index`` [T] the
    expert each token was dispatched to (top-1), or [T, k] its k experts, in which case ``f_i``
    is the fraction of the ``T·k`` assignments that went to expert i (so Σ f_i = 1 either way).
    ``f`` is a count, not differentiable; the gradient flows through ``P``, pushing probability
    away from overloaded experts. With uniform ``f`` and ``P`` the loss is ``α`` (its minimum
    under uniform routing: "the auxiliary loss ... is minimized under a uniform distribution");
    all tokens on one expert that the router is sure of gives ``α·N``.
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
    """Kind: derive

    ``(gates, token_index)``, each [E, k]: Expert Choice routing (Zhou et al. 2022, §3.1, eq. 1)::

        S    = softmax(X · W_g)        [n, e]   token-to-expert affinity, softmax over experts
        G, I = TopK(Sᵀ, k)             [e, k]   each expert's k best tokens and their scores
        k    = n · c / e                         c = capacity_factor (experts per token on average)

    ``logits`` [T, E] are ``X · W_g``; ``k = expert_choice_capacity(T, E, capacity_factor)``
    (rounded up, at most T). Row e of ``token_index`` lists the tokens expert e takes, best first
    (int64), and ``gates[e, j] = S[token_index[e, j], e]`` is the weight of that expert's output
    in token ``token_index[e, j]``'s combined output: ``y_t = Σ_{(e,j): I[e,j]=t} G[e,j]·FFN_e(x_t)``.
    Every expert gets exactly k tokens; a token may be chosen by several experts or by none (its
    residual then carries it, as for a dropped token). ``gates`` is differentiable.
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
    """Kind: derive

    ``(experts, gates)``, each [T, k]: top-k selection with a per-expert bias (DeepSeek-V3 eq. 16)::

        experts[t] = the k experts with the largest  scores[t, i] + bias[i]     (best first)
        gates[t]   = scores[t, experts[t]] / Σ_j scores[t, experts[t, j]]       (k > 1)
        gates[t]   = scores[t, experts[t]]                                      (k = 1: kept raw)

    ``scores`` [T, E] are the router's affinities (a softmax or a sigmoid of its logits). The bias
    changes *which* experts are chosen, never *how much* they weigh: the gates use the unbiased
    scores and carry the gradient; the selection carries none (``experts`` is an index tensor).
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
    """Kind: derive

    The bias after one training step (Wang et al. 2024, Algorithm 1), a new tensor::

        c_i  = number of assignments to expert i in ``expert_index`` ([T] or [T, k] expert ids)
        b_i ← b_i + rate · sign(mean_j c_j − c_i)

    An overloaded expert (c_i above the mean) loses ``rate``, an underloaded one gains it, one at
    the mean keeps its bias. ``rate`` is γ, the bias update speed (DeepSeek-V3: 0.001).
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


# --- 5. expert-parallel dispatch and combine -----------------------------------------------------------


def ep_moe_forward(x: torch.Tensor, router, local_experts, group=None) -> torch.Tensor:
    """Kind: build

    One MoE layer with its experts spread over the ``n`` ranks of ``group`` (GShard §2.2; Switch
    Transformers §5): this rank's outputs ``y`` [T, h] for its own tokens ``x`` [T, h].

    Every rank holds the same ``router`` (a :class:`~minitorch_dist.sparsity.routers.Router`) and only
    its own experts, ``local_experts`` = experts ``[r·E/n, (r+1)·E/n)`` of the layer (rank r, E
    experts). ``router(x)`` returns a ``Routing`` whose kept assignments ``tokens``, ``experts``,
    ``weights`` [A] are sorted by expert, and ``counts`` [E] (int64) the kept assignments per expert.
    The steps:

        1. route x; the kept rows ``x[routing.tokens]`` are already grouped by expert, hence by the
           rank that owns the expert (rank j owns experts j·E/n ... (j+1)·E/n - 1)
        2. counts: an all-to-all of the E counts tells each rank how many rows every rank will send
           to each of its experts (``comm.all_to_all(out, inp, out_splits, in_splits, group=group)``,
           splits of E/n counts)
        3. dispatch: an all-to-all of the rows, uneven splits (rows this rank sends to each rank, rows
           it receives from each)
        4. the received rows arrive source-major (all of rank 0's rows, by expert, then rank 1's ...):
           regroup them by local expert, run each expert on its rows, put the outputs back in the
           order they arrived
        5. combine: the reverse all-to-all (the splits swapped) brings every output home;
           ``y[t] = Σ weights[a] · out[a]`` over token t's kept assignments, 0 for a token with none

    ``all_to_all(rows, out_splits, in_splits, group)`` (imported above) is differentiable: its backward
    is the all-to-all of the gradients with the splits swapped. Use it for steps 3 and 5, so that the
    gradients of ``x``, of the router (through ``weights``) and of the local experts (which saw every
    rank's rows) all come out right. The result, outputs and gradients, must equal the single-process
    layer (``sparsity.moe.MoELayer``: the same router and all E experts) run on this rank's ``x``
    alone. Give every local expert its rows even when there are none (an expert run on an empty block
    gets a zero gradient rather than ``None``).
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
    packed = x[routing.tokens]                                   # [A, h], grouped by expert = by owner rank
    recv = torch.empty_like(routing.counts)
    comm.all_to_all(recv, routing.counts.contiguous(), [El] * n, [El] * n, group=group)
    per_src = recv.view(n, El)                                   # rows rank i sends to my expert e
    send = routing.counts.view(n, El).sum(1).tolist()            # rows I send to each rank
    got = per_src.sum(1).tolist()                                # rows I receive from each rank
    received = all_to_all(packed, got, send, group)              # source-major
    expert_of_row = torch.arange(El, device=x.device).repeat(n).repeat_interleave(per_src.reshape(-1))
    by_expert = torch.sort(expert_of_row, stable=True).indices   # regroup: expert-major
    blocks = received[by_expert].split(per_src.sum(0).tolist())
    out = torch.cat([expert(b) for expert, b in zip(local_experts, blocks)])
    out = out[torch.argsort(by_expert)]                          # back to the order the rows arrived
    back = all_to_all(out, send, got, group)                     # every row home, in dispatch order
    weighted = back * routing.weights.to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, routing.tokens, weighted)
    # END SOLUTION


# --- 6. the traffic and drops of an expert-parallel step, predicted ----------------------------------


def ep_traffic_forecast(tokens: int, hidden: int, n_experts: int, n_ranks: int, capacity_factor: float = 1.0,
                        bytes_per_element: int = 4) -> dict:
    """Kind: measure

    Predict, before running it, what one training step (forward and backward) of an expert-parallel
    Switch layer (top-1, the layer of exercise 5) costs one rank, when every rank routes ``tokens``
    tokens and the router sends each token to one of the ``n_experts`` experts uniformly at random,
    independently of the others. Return a dict:

    * ``"capacity"``: C, the assignments one expert takes from one rank's batch (capacity is per rank:
      every rank routes its own tokens);
    * ``"dropped"``: the expected number of assignments one rank drops (an expert asked for more than
      C keeps the first C);
    * ``"bytes"``: the expected bytes one rank's comm meter counts in ``all_to_all`` over the step.

    The step runs five all-to-alls: forward, the counts (E int64s), the dispatch (every kept row,
    ``hidden`` elements of ``bytes_per_element`` bytes) and the combine (every row this rank received,
    sent back); backward, the combine's and the dispatch's again, splits swapped. The meter counts a
    rank's whole input to each call, the rows it keeps for itself included. On average a rank receives
    as many rows as it keeps (every rank routes the same way).

    ``costmodel`` has every formula you need (capacity, expected drops under random routing, the
    all-to-all bytes of an MoE layer and of the counts exchange). The tests compare your numbers with
    values computed independently (relative 1e-9), and with the mean over many batches measured on 2
    and 4 ranks (within 5 standard errors of that mean).
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
