"""Wrong: dispatches the rows with the plain ``comm.all_to_all``, as the counts, so no gradient flows back.

The forward is right and the experts' gradients are too (their inputs are what arrived); but the
dispatch's backward never runs, so the input gradient misses everything that went through an
expert.
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
    received = packed.new_empty(sum(got), packed.size(1))
    comm.all_to_all(received, packed.detach().contiguous(), got, send, group=group)
    expert_of_row = torch.arange(El, device=x.device).repeat(n).repeat_interleave(per_src.reshape(-1))
    by_expert = torch.sort(expert_of_row, stable=True).indices
    blocks = received[by_expert].split(per_src.sum(0).tolist())
    out = torch.cat([expert(b) for expert, b in zip(local_experts, blocks)])
    out = out[torch.argsort(by_expert)]
    back = all_to_all(out, send, got, group)
    weighted = back * weights.to(back.dtype)[:, None]
    return x.new_zeros(x.shape).index_add(0, tokens, weighted)
