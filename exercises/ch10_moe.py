# generated from solutions/ch10_moe.py by `make exercises`: fill in each NotImplementedError
# fingerprint 28e70687576992cb of the text below (once you change it, `make exercises` leaves it alone)
"""Chapter 10 exercises: mixture of experts — top-2 gating with capacity, the load-balancing loss,
expert choice, auxiliary-loss-free balancing.

Your exercises. Each ``raise NotImplementedError`` marks a part for you to write; the rest
(imports, argument checks, helpers) is given. The first line of each exercise's docstring
says its kind: *build* a piece of the system, *derive* a formula, or *measure* (predict,
then run). Check your work: ``python -m minitorch_dist grade --chapter ch10``.

Nothing here needs ranks: a router is what every rank runs on its own tokens before the
all-to-all that sends them to their experts. Tokens are flattened: ``T`` tokens, ``E`` experts.

1. :func:`top2_gating_with_capacity`: GShard's top-2 gating (Lepikhin et al. 2021, "GShard:
   Scaling Giant Models with Conditional Computation and Automatic Sharding", Algorithm 1)
   with a fixed expert capacity ``C``: each token goes to its two highest-scoring experts, an
   expert takes at most ``C`` of them, first choices before second choices, and an assignment
   that finds its expert full is dropped. The result is GShard's pair of ``[T, E, C]`` tensors:
   *dispatch* (which token sits in which slot of which expert's buffer) and *combine* (with
   what weight the slot's output comes back).
2. :func:`load_balancing_loss`: the auxiliary loss of Switch Transformers (Fedus et al. 2021,
   "Switch Transformers: Scaling to Trillion Parameter Models with Simple and Efficient
   Sparsity", §2.2, eq. 4-6), ``α·N·Σ_i f_i·P_i``: the fraction of tokens routed to expert i
   times the router's mean probability for it, minimised (= α) by a uniform load.
3. :func:`expert_choice_routing`: Expert Choice (Zhou et al. 2022, "Mixture-of-Experts with
   Expert Choice Routing", §3.1, eq. 1): turn the choice around, each *expert* picks its top
   ``k = n·c/e`` tokens, so every expert is exactly full and nothing is dropped for capacity
   (a token may instead be picked by several experts, or by none).
4. :func:`aux_free_select` and :func:`aux_free_bias_step`: auxiliary-loss-free load balancing
   (Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts",
   Algorithm 1; DeepSeek-V3 Technical Report §2.1.2, eq. 16): a per-expert bias added to the
   scores *for choosing* the top-k experts only, the gates taken from the unbiased scores; after
   each step the bias of an overloaded expert falls by γ and an underloaded one's rises by γ.
"""
from __future__ import annotations

import torch

from minitorch_dist.analysis.costmodel import expert_choice_capacity, moe_capacity


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
    """``(combine_weights, dispatch_mask, dropped)`` of GShard top-2 gating (Lepikhin et al. 2021,
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
    raise NotImplementedError("exercise: top2_gating_with_capacity — see chapters/10_moe.md")


# --- 2. the load-balancing auxiliary loss ---------------------------------------------------------


def load_balancing_loss(router_probs: torch.Tensor, expert_index: torch.Tensor,
                        alpha: float = 0.01) -> torch.Tensor:
    """Switch Transformers' auxiliary loss (Fedus et al. 2021, §2.2, eq. 4-6), a 0-dim tensor::

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
    raise NotImplementedError("exercise: load_balancing_loss — see chapters/10_moe.md")


# --- 3. expert-choice routing ------------------------------------------------------------------------


def expert_choice_routing(logits: torch.Tensor, capacity_factor: float = 1.0
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(gates, token_index)``, each [E, k]: Expert Choice routing (Zhou et al. 2022, §3.1, eq. 1)::

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
    raise NotImplementedError("exercise: expert_choice_routing — see chapters/10_moe.md")


# --- 4. auxiliary-loss-free load balancing -----------------------------------------------------------


def _check_scores_and_bias(scores: torch.Tensor, bias: torch.Tensor) -> None:
    _check_logits(scores)
    if tuple(bias.shape) != (scores.shape[1],):
        raise ValueError(f"bias must hold one value per expert, shape ({scores.shape[1]},), got "
                         f"{tuple(bias.shape)}")


def aux_free_select(scores: torch.Tensor, bias: torch.Tensor, k: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(experts, gates)``, each [T, k]: top-k selection with a per-expert bias (DeepSeek-V3 eq. 16)::

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
    raise NotImplementedError("exercise: aux_free_select — see chapters/10_moe.md")


def aux_free_bias_step(bias: torch.Tensor, expert_index: torch.Tensor, rate: float = 0.001) -> torch.Tensor:
    """The bias after one training step (Wang et al. 2024, Algorithm 1), a new tensor::

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
    raise NotImplementedError("exercise: aux_free_bias_step — see chapters/10_moe.md")
