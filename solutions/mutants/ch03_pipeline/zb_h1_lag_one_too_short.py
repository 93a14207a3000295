"""Wrong: stage r defers its W's by r - 1 microbatches, not r (the off-by-one at the memory bound).

Stage r holds p - r microbatches at 1F1B's peak; counting the microbatch whose B has just run as one
already freed, a student leaves one W fewer pending than the memory allows. Stage 0 comes out
right; every later stage runs its W's a microbatch early, holds one microbatch fewer than 1F1B's
peak, and idles more than the paper says.
"""


def zb_h1_from_1f1b(stages: list[list[str]]) -> list[list[str]]:
    if not stages:
        raise ValueError("need at least one stage list")
    for r, acts in enumerate(stages):
        bad = [a for a in acts if not (isinstance(a, str) and a[:1] in ("F", "B") and a[1:].isdigit())]
        if bad:
            raise ValueError(f"stage {r}: expected 1F1B actions like 'F3' and 'B3' (no W yet), got {bad[:3]}")
    out = []
    for r, acts in enumerate(stages):
        zb, pending = [], []
        for a in acts:
            zb.append(a)
            if a[0] == "B":
                pending.append("W" + a[1:])
                if len(pending) >= r:
                    zb.append(pending.pop(0))
        out.append(zb + pending)
    return out
