"""Wrong: exchanges the counts as contiguous blocks of E/n experts while the rows go round-robin.

The rows are regrouped by owner, but the count all-to-all still sends counts[j·E/n:(j+1)·E/n] to
rank j, as in the block layout: the split sizes stay consistent (no hang), yet every receiver cuts
the rows it got into the wrong experts' blocks.
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
    to_rank = routing.counts.view(n, El)
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
    weighted = back * weights.to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, tokens, weighted)
