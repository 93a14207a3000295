"""Wrong: meters the forward pass only; the backward's all-to-alls are left out of the step.

The forward is where the layer calls its all-to-alls, so wrapping ``layer(x)`` in the meter looks
like enough; the backward of the dispatch and of the combine moves as many bytes again.
"""
def ep_step_traffic(layer, batches) -> dict:
    if not batches:
        raise ValueError("batches is empty: give at least one [T, h] batch to measure")
    T, h = batches[0].shape
    router = layer.router
    element = batches[0].element_size()
    predicted = ep_traffic_forecast(T, h, layer.n_experts, layer.n, router.capacity_factor, element)
    nbytes, dropped = [], []
    for x in batches:
        with comm.meter() as m:
            y = layer(x)
        y.sum().backward()
        nbytes.append(int(m.bytes["all_to_all"]))
        dropped.append(int(layer.last_routing.dropped))
    return {"bytes": nbytes, "dropped": dropped, "predicted": predicted}
