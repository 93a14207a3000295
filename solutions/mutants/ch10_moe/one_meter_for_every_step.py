"""Wrong: opens one meter around all the steps and reads it after each: running totals, not per step.

Reading the meter inside its ``with`` works and saves a context per batch; but its counts are
never reset between steps, so each value holds every earlier step's bytes too.
"""
def ep_step_traffic(layer, batches) -> dict:
    if not batches:
        raise ValueError("batches is empty: give at least one [T, h] batch to measure")
    T, h = batches[0].shape
    router = layer.router
    element = batches[0].element_size()
    predicted = ep_traffic_forecast(T, h, layer.n_experts, layer.n, router.capacity_factor, element)
    nbytes, dropped = [], []
    with comm.meter() as m:
        for x in batches:
            layer(x).sum().backward()
            nbytes.append(int(m.bytes["all_to_all"]))
            dropped.append(int(layer.last_routing.dropped))
    return {"bytes": nbytes, "dropped": dropped, "predicted": predicted}
