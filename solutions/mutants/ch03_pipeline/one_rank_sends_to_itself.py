"""Wrong: counts messages between the chunks of a single rank.

The general formula gives 0 for p = 1 and v = 1, so the special case looks unneeded; with v > 1 it
counts hand-overs in memory as messages.
"""


def predict_pipeline_sends(p: int, m: int, activation_bytes: int, v: int = 1) -> dict:
    for name, x in (("p", p), ("m", m), ("v", v)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    if not activation_bytes >= 0:
        raise ValueError(f"activation_bytes must be >= 0, got {activation_bytes!r}")
    messages = [m * (2 * v - (r == p - 1) - (r == 0)) for r in range(p)]
    return {"messages": messages, "bytes": [k * activation_bytes for k in messages]}
