"""Wrong: combines the returned rows with the tokens and weights in the router's order, not in the order sent.

The rows were regrouped by owner rank before the dispatch; they come back in that order. Using the
Routing's own ``tokens`` and ``weights`` (sorted by expert) adds each output into the wrong token
as soon as two ranks own experts.
"""
import torch


def ep_moe_forward_strided(x: torch.Tensor, router, local_experts, group=None) -> torch.Tensor:
    n, r = size_and_rank(group, "expert parallelism")
    if x.dim() != 2 or x.size(1) != router.h:
        raise ValueError(f"x must be this rank's tokens [T, h={router.h}], got shape {tuple(x.shape)}")
    E, El = router.n_experts, len(local_experts)
    if El * n != E:
        raise ValueError(f"rank {r} holds {El} experts but the router scores E = {E} on {n} ranks: each "
                         f"rank must hold E/n experts (E divisible by n)")
    routing = router(x)
    owner = routing.experts % n
    by_owner = torch.sort(owner, stable=True).indices
    tokens, weights = routing.tokens[by_owner], routing.weights[by_owner]
    packed = x[tokens]
    to_rank = routing.counts.view(El, n).t().contiguous()
    recv = torch.empty_like(routing.counts)
    comm.all_to_all(recv, to_rank.reshape(-1), [El] * n, [El] * n, group=group)
    per_src = recv.view(n, El)
    send = to_rank.sum(1).tolist()
    got = per_src.sum(1).tolist()
    received = all_to_all(packed, got, send, group)
    expert_of_row = torch.arange(El, device=x.device).repeat(n).repeat_interleave(per_src.reshape(-1))
    by_expert = torch.sort(expert_of_row, stable=True).indices
    blocks = received[by_expert].split(per_src.sum(0).tolist())
    out = torch.cat([expert(b) for expert, b in zip(local_experts, blocks)])
    out = out[torch.argsort(by_expert)]
    back = all_to_all(out, send, got, group)
    weighted = back * routing.weights.to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, routing.tokens, weighted)
