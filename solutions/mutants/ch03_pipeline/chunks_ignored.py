"""Wrong: counts one chunk per rank whatever v.

The 1F1B count, right for v = 1; interleaving sends every chunk's boundary, v times as many messages
(Narayanan et al. 2021 §2.2.2).
"""


def predict_pipeline_sends(p: int, m: int, activation_bytes: int, v: int = 1) -> dict:
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if not activation_bytes >= 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    if p == 1:
        return {"messages": [0], "bytes": [0]}
    messages = [m * (2 - (r == p - 1) - (r == 0)) for r in range(p)]
    return {"messages": messages, "bytes": [k * activation_bytes for k in messages]}
