"""Wrong: stage r defers its W's by p - 1 - r microbatches (its warm-up's length), not r.

The first stage has the longest warm-up, so it looks like the one with slack to spare; but it is
already at the memory bound, and the last stage, which idles longest in the drain, defers nothing.
"""


def zb_h1_from_1f1b(stages: list[list[str]]) -> list[list[str]]:
    if not stages:
        raise ValueError("need at least one stage list")
    for r, acts in enumerate(stages):
        bad = [a for a in acts if not (isinstance(a, str) and a[:1] in ("F", "B") and a[1:].isdigit())]
        if bad:
            raise ValueError(f"stage {r}: expected 1F1B actions like 'F3' and 'B3' (no W yet), got {bad[:3]}")
    p = len(stages)
    out = []
    for r, acts in enumerate(stages):
        zb, pending = [], []
        for a in acts:
            zb.append(a)
            if a[0] == "B":
                pending.append("W" + a[1:])
                if len(pending) > p - 1 - r:
                    zb.append(pending.pop(0))
        out.append(zb + pending)
    return out
