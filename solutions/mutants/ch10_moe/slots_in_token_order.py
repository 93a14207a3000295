"""Wrong: hands out the capacity slots in token order (GShard's plain Algorithm 1), not by priority.

The library's routers and GShard itself serve the earliest token first, so this is the natural first
version; under Batch Prioritized Routing a confident late token must win a full expert's last slot
over an unsure early one.
"""
import torch


def top2_gating_prioritized(logits: torch.Tensor, capacity_factor: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor, int]:
    _check_logits(logits, min_experts=2)
    T, E = logits.shape
    C = moe_capacity(T, E, k=2, capacity_factor=capacity_factor)
    gates = torch.softmax(logits, dim=-1)
    e1 = gates.argmax(dim=-1)
    mask1 = torch.nn.functional.one_hot(e1, E)
    e2 = gates.masked_fill(mask1.bool(), float("-inf")).argmax(dim=-1)
    mask2 = torch.nn.functional.one_hot(e2, E)
    p1, p2 = gates.gather(1, e1[:, None])[:, 0], gates.gather(1, e2[:, None])[:, 0]
    g1, g2 = p1 / (p1 + p2), p2 / (p1 + p2)
    order1 = torch.arange(T, device=logits.device)
    order2 = torch.arange(T, device=logits.device)
    m1, m2 = mask1[order1], mask2[order2]
    pos1 = (torch.cumsum(m1, dim=0) - 1) * m1
    m1 = m1 * (pos1 < C)
    pos2 = (torch.cumsum(m2, dim=0) - 1 + m1.sum(dim=0, keepdim=True)) * m2
    m2 = m2 * (pos2 < C)
    keep1, keep2 = m1.sum(-1).bool(), m2.sum(-1).bool()
    slot1, slot2 = pos1.sum(-1), pos2.sum(-1)
    w1, w2 = g1[order1], g2[order2]
    t1, t2, a1, a2 = order1, order2, e1[order1], e2[order2]
    combine = logits.new_zeros(T, E, C)
    dispatch = torch.zeros(T, E, C, dtype=torch.bool, device=logits.device)
    combine = combine.index_put((t1[keep1], a1[keep1], slot1[keep1]), w1[keep1])
    combine = combine.index_put((t2[keep2], a2[keep2], slot2[keep2]), w2[keep2])
    dispatch[t1[keep1], a1[keep1], slot1[keep1]] = True
    dispatch[t2[keep2], a2[keep2], slot2[keep2]] = True
    dropped = 2 * T - int(keep1.sum() + keep2.sum())
    return combine, dispatch, dropped
