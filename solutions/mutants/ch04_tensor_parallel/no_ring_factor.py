"""Wrong: predicts the bytes of the all-reduced buffers, not the ring's wire bytes.

Four all-reduces of b·s·h elements is the count the chapter stresses; but a ring all-reduce puts
2(t-1)/t of its buffer on the wire per rank (Narayanan et al. 2021 §3.2).
"""


def tp_layer_traffic(block: nn.Module, x: torch.Tensor, group=None) -> dict:
    _require_dist("tp_layer_traffic")
    if x.dim() != 3:
        raise ValueError(f"x must be the layer's (batch, seq, hidden) input, got shape {tuple(x.shape)}")
    b, s, h = x.shape
    t = dist.get_world_size(group)
    counts = costmodel.tensor_parallel_allreduces_per_layer()
    predicted = {"forward": counts["forward"], "backward": counts["backward"],
                 "wire_bytes": (counts["forward"] + counts["backward"]) * b * s * h * x.element_size()}
    x = x.detach().clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = block(x)
    with comm.meter() as bwd:
        y.sum().backward()
    measured = {"forward": fwd.calls["all_reduce"], "backward": bwd.calls["all_reduce"],
                "wire_bytes": fwd.total_wire_bytes + bwd.total_wire_bytes}
    return {"predicted": predicted, "measured": measured}
