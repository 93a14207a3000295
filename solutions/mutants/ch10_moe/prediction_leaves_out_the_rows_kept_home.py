"""Wrong: predicts only the bytes that leave the rank ((n-1)/n of each all-to-all), not what the meter counts.

That is the traffic on the wire, the cost model's default; but the meter counts a rank's whole
input to each call, its own rows included, so the forecast is short by the rows a rank keeps.
"""
def ep_step_traffic(layer, batches) -> dict:
    if not batches:
        raise ValueError("batches is empty: give at least one [T, h] batch to measure")
    T, h = batches[0].shape
    router = layer.router
    element = batches[0].element_size()
    E, n, cf = layer.n_experts, layer.n, router.capacity_factor
    kept = T - cm.expected_dropped_tokens(T, E, 1, cf)
    predicted = {"capacity": cm.moe_capacity(T, E, 1, cf), "dropped": T - kept,
                 "bytes": kept * cm.all_to_all_bytes_moe(1, h, n, bytes_per_element=element, backward=True)
                 + cm.moe_counts_exchange_bytes(E, n)}
    nbytes, dropped = [], []
    for x in batches:
        with comm.meter() as m:
            layer(x).sum().backward()
        nbytes.append(int(m.bytes["all_to_all"]))
        dropped.append(int(layer.last_routing.dropped))
    return {"bytes": nbytes, "dropped": dropped, "predicted": predicted}
