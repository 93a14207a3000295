"""Wrong: has every rank send an activation and a gradient per chunk and microbatch.

Right for the middle ranks; the first rank sends no gradient of its first chunk and the last no
activation of its last, so the total exceeds the cost model's by 2m.
"""


def predict_pipeline_sends(p: int, m: int, activation_bytes: int, v: int = 1) -> dict:
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if not activation_bytes >= 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    if p == 1:
        return {"messages": [0], "bytes": [0]}
    messages = [2 * m * v for r in range(p)]
    return {"messages": messages, "bytes": [k * activation_bytes for k in messages]}
