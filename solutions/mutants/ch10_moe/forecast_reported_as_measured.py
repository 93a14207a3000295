"""Wrong: reports the forecast as every step's measurement instead of running the steps.

The forecast is the expected value of exactly these quantities, so a list of it looks like a
measurement with no noise; nothing was run, and a layer that moved other bytes would go unseen.
"""
def ep_step_traffic(layer, batches) -> dict:
    if not batches:
        raise ValueError("batches is empty: give at least one [T, h] batch to measure")
    T, h = batches[0].shape
    router = layer.router
    element = batches[0].element_size()
    predicted = ep_traffic_forecast(T, h, layer.n_experts, layer.n, router.capacity_factor, element)
    nbytes, dropped = [], []
    for _ in batches:
        nbytes.append(int(round(predicted["bytes"])))
        dropped.append(int(round(predicted["dropped"])))
    return {"bytes": nbytes, "dropped": dropped, "predicted": predicted}
