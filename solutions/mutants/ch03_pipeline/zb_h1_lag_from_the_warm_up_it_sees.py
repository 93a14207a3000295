"""Wrong: reads a stage's lag off its list, p minus the forwards before its first backward.

With m >= p a stage's list opens with p - r forwards, so the lag is r and every size the library's
zb_h1 accepts comes out right. With fewer microbatches than stages the list opens with all m, and the
lag grows with the shortage: a stage's lag then depends on m, which the memory does not ask for.
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
    for acts in stages:
        lag = p - next((i for i, a in enumerate(acts) if a[0] == "B"), len(acts))
        zb, pending = [], []
        for a in acts:
            zb.append(a)
            if a[0] == "B":
                pending.append("W" + a[1:])
                if len(pending) > lag:
                    zb.append(pending.pop(0))
        out.append(zb + pending)
    return out
