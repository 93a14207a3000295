"""Wrong: counts the forward's all-reduces with a meter that also saw the backward.

One meter around the whole step is simpler; its count of all-reduces is then the forward's plus the
backward's, reported as the forward's.
"""


def tp_layer_traffic(block: nn.Module, x: torch.Tensor, group=None) -> dict:
    _require_dist("tp_layer_traffic")
    if x.dim() != 3:
        raise ValueError(f"x must be the layer's (batch, seq, hidden) input, got shape {tuple(x.shape)}")
    b, s, h = x.shape
    t = dist.get_world_size(group)
    counts = costmodel.tensor_parallel_allreduces_per_layer()
    predicted = {"forward": counts["forward"], "backward": counts["backward"],
                 "wire_bytes": costmodel.tensor_parallel_bytes_per_layer(b, s, h, t, x.element_size())}
    x = x.detach().clone().requires_grad_(True)
    with comm.meter() as fwd:
        y = block(x)
        with comm.meter() as bwd:
            y.sum().backward()
    measured = {"forward": fwd.calls["all_reduce"], "backward": bwd.calls["all_reduce"],
                "wire_bytes": fwd.total_wire_bytes + bwd.total_wire_bytes}
    return {"predicted": predicted, "measured": measured}
